"""Mixed precision (``torch.autocast`` fp16 / bf16 on CPU) with torch.amp loss scaling, on real gloo ranks: DDP with
``GradScaler``, FSDP2 with ``ShardedGradScaler``, a plain module. What must hold (issue "The stacks users run"):

* a clean run applies exactly the steps the scaler applies, bitwise as without arc_engine, its statistics unscaled;
* the scaler's own skips (its routine search of the scale) are reported as the scaler's and never escalate, however
  many in a row, up to ``policy.max_consecutive_overflow_skips``;
* a NaN on one rank is skipped on every rank, named (rank, group), and training continues."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from arc_engine.integrations.pytorch.amp import ScalerWatch
from tests.amp_training import train_amp
from tests.dist_harness import run_ranks
from tests.training import make_config, tiny_model_and_data

pytestmark = pytest.mark.timeout(300)

STEPS = 14
SCALE = 2.0**24  # the tiny GPT's fp16 backward overflows at this scale: the scaler skips its first steps


def _run(rank: int, world: int, steps: int, config, kwargs: dict) -> dict:
    return train_amp(rank, steps, config, **kwargs)


def _overflow_steps(result: dict) -> list[int]:
    return [step for step, action, overflow, _ in result["decisions"] if overflow]


@pytest.mark.parametrize("order", ["step", "clip"])
def test_fp16_grad_scaler_under_ddp_trains_exactly_as_without_arc_engine(tmp_path: Path, order: str) -> None:
    kwargs = {"wrap": "ddp", "order": order, "init_scale": SCALE}
    plain = run_ranks(_run, 2, STEPS, None, kwargs)
    config = make_config(tmp_path, "stats.interval=1")
    watched = run_ranks(_run, 2, STEPS, config, kwargs)
    skipped = [step for step, changed in enumerate(plain[0]["changed"]) if not changed]
    assert len(skipped) > config.policy.max_consecutive_skips, "the scaler must search its scale for a while"
    assert skipped == list(range(len(skipped))) and len(skipped) < STEPS - 3
    for rank in range(2):
        assert torch.equal(watched[rank]["params"], plain[rank]["params"]), "arc_engine changed the training"
        assert watched[rank]["changed"] == plain[rank]["changed"]
        assert watched[rank]["decisions"] == watched[0]["decisions"], "ranks disagree"
        summary = watched[rank]["summary"]
        assert summary["skipped_by_policy"] == 0 and summary["skipped_by_framework"] == len(skipped)
    assert _overflow_steps(watched[0]) == skipped
    for step, action, overflow, findings in watched[0]["decisions"]:
        detectors = {detector for detector, _, _ in findings}
        if overflow:
            assert "grad_scaler_overflow" in detectors and action == "SKIP"
            assert all(severity == "WARNING" for _, _, severity in findings), findings
        else:
            assert action == "NONE" and not findings, (step, findings)
    if order == "clip":  # the agreed norm is the unscaled one torch measures after unscale_
        norms = dict(watched[0]["grad_norms"])
        for step in range(len(skipped), STEPS):
            assert math.isclose(norms[step], plain[0]["clip_norms"][step], rel_tol=1e-5), step


def test_a_nan_on_one_rank_under_fp16_is_named_skipped_everywhere_and_training_goes_on(tmp_path: Path) -> None:
    nan_step = 11
    config = make_config(tmp_path, "stats.interval=1", "faults.injections=[{kind: nan_grad, rank: 1, step: "
                                   f"{nan_step}, param: blocks.0.ln1.weight}}]")
    results = run_ranks(_run, 2, STEPS + 2, config, {"wrap": "ddp", "init_scale": SCALE})
    assert results[0]["decisions"] == results[1]["decisions"], "ranks disagree"
    by_step = {step: (action, overflow, findings) for step, action, overflow, findings in results[0]["decisions"]}
    action, overflow, findings = by_step[nan_step]
    assert action == "SKIP" and overflow
    assert ("non_finite", [1], "WARNING") in findings and any(f[0] == "grad_scaler_overflow" for f in findings)
    for result in results:
        assert not result["changed"][nan_step]
        assert all(result["changed"][nan_step + 1:]), "training did not continue"
        assert torch.isfinite(result["params"]).all()


def test_the_scalers_routine_skips_never_escalate_but_a_persistent_overflow_does(tmp_path: Path) -> None:
    routine = run_ranks(_run, 2, STEPS, make_config(tmp_path / "a", "policy.max_consecutive_skips=2"),
                        {"wrap": "ddp", "init_scale": SCALE})
    assert "aborted_at" not in routine[0] and len(_overflow_steps(routine[0])) > 2
    # NaN gradients on every step from 4 on (a scale the model fits: no search): the scaler halves its scale
    # forever; arc_engine stops the job once more than policy.max_consecutive_overflow_skips steps in a row skipped
    persistent = make_config(tmp_path / "b", "policy.max_consecutive_overflow_skips=3",
                             "faults.injections=[{kind: nan_grad, rank: 0, step: 4, steps: 50, "
                             "param: blocks.0.ln1.weight}]")
    results = run_ranks(_run, 2, 12, persistent, {"wrap": "ddp", "init_scale": 1024.0})
    for result in results:
        assert result["changed"][:4] == [True] * 4
        assert result["aborted_at"] == 7 and result["exit_code"] == 3
        assert "max_consecutive_overflow_skips" in result["message"]


def test_a_nan_loss_under_fp16_is_no_routine_overflow_and_escalates_like_any_skip(tmp_path: Path) -> None:
    config = make_config(tmp_path, "policy.max_consecutive_skips=1",
                         "faults.injections=[{kind: nan_loss, rank: 1, step: 10, steps: 5}]")
    results = run_ranks(_run, 2, STEPS + 4, config, {"wrap": "ddp", "init_scale": SCALE})
    for result in results:
        assert result["aborted_at"] == 11, result.get("decisions")
    step, action, overflow, findings = results[0]["decisions"][-2]
    assert (step, action, overflow) == (10, "SKIP", False)
    assert ("non_finite", [1], "ERROR") in findings


def test_bf16_autocast_under_ddp_is_bitwise_unchanged_and_a_nan_is_skipped(tmp_path: Path) -> None:
    kwargs = {"wrap": "ddp", "dtype": "bfloat16", "scaler": False}
    plain = run_ranks(_run, 2, 8, None, kwargs)
    watched = run_ranks(_run, 2, 8, make_config(tmp_path / "a"), kwargs)
    for rank in range(2):
        assert torch.equal(watched[rank]["params"], plain[rank]["params"])
        assert all(watched[rank]["changed"])
    config = make_config(tmp_path / "b", "faults.injections=[{kind: nan_grad, rank: 0, step: 3, "
                                         "param: blocks.0.ln1.weight}]")
    faulted = run_ranks(_run, 2, 8, config, kwargs)
    assert faulted[0]["decisions"] == faulted[1]["decisions"]
    by_step = {step: (action, findings) for step, action, _, findings in faulted[0]["decisions"]}
    assert by_step[3][0] == "SKIP" and ("non_finite", [0], "ERROR") in by_step[3][1]
    assert faulted[0]["changed"] == [True, True, True, False, True, True, True, True]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fsdp2_with_sharded_grad_scaler_is_bitwise_unchanged_and_names_a_nan(tmp_path: Path, dtype: str) -> None:
    kwargs = {"wrap": "fsdp", "dtype": dtype, "init_scale": SCALE}
    plain = run_ranks(_run, 2, 12, None, kwargs)
    watched = run_ranks(_run, 2, 12, make_config(tmp_path / "a", "stats.interval=1"), kwargs)
    skipped = [step for step, changed in enumerate(plain[0]["changed"]) if not changed]
    assert bool(skipped) == (dtype == "float16"), "an fp16 scaler searches its scale; bf16 never overflows"
    for rank in range(2):
        assert torch.equal(watched[rank]["params"], plain[rank]["params"])
        assert _overflow_steps(watched[rank]) == skipped
        assert watched[rank]["summary"]["skipped_by_policy"] == 0
    # a NaN loss on rank 1 (FSDP2 refuses gradient faults: its sharded parameters run no tensor hooks)
    nan_step = len(skipped) + 2
    config = make_config(tmp_path / "b", f"faults.injections=[{{kind: nan_loss, rank: 1, step: {nan_step}}}]")
    faulted = run_ranks(_run, 2, 12, config, kwargs)
    assert faulted[0]["decisions"] == faulted[1]["decisions"]
    by_step = {step: (action, findings) for step, action, _, findings in faulted[0]["decisions"]}
    action, findings = by_step[nan_step]
    assert action == "SKIP" and any(f[0] == "non_finite" and f[1] == [1] for f in findings)
    assert all(faulted[0]["changed"][nan_step + 1:])


# ----------------------------------------------------------------- a plain module, in this process

def test_a_plain_module_with_grad_scaler_applies_what_the_scaler_applies(tmp_path: Path) -> None:
    plain = train_amp(0, 12, None, wrap="plain", init_scale=SCALE)
    watched = train_amp(0, 12, make_config(tmp_path, "stats.interval=1"), wrap="plain", init_scale=SCALE)
    skipped = [step for step, changed in enumerate(plain["changed"]) if not changed]
    assert skipped and torch.equal(watched["params"], plain["params"])
    assert _overflow_steps(watched) == skipped
    assert watched["summary"]["skipped_by_framework"] == len(skipped)


def test_a_fused_adamw_under_grad_scaler_unscales_statistics_and_reports_its_own_skips(tmp_path: Path) -> None:
    if not getattr(torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True),
                   "_step_supports_amp_scaling", False):
        pytest.skip("this torch's fused AdamW does not unscale in its kernel")
    kwargs = {"wrap": "plain", "init_scale": SCALE, "fused": True, "order": "step"}
    plain = train_amp(0, 12, None, **kwargs)
    watched = train_amp(0, 12, make_config(tmp_path, "stats.interval=1"), **kwargs)
    skipped = [step for step, changed in enumerate(plain["changed"]) if not changed]
    assert skipped and torch.equal(watched["params"], plain["params"])
    assert _overflow_steps(watched) == skipped
    norms = dict(watched["grad_norms"])
    reference = train_amp(0, 12, None, **{**kwargs, "order": "clip"})
    for step in range(len(skipped), 12):
        assert math.isclose(norms[step], reference["clip_norms"][step], rel_tol=1e-5), step


def test_a_rollback_restores_the_grad_scalers_scale() -> None:
    from arc_engine.recovery.state import TorchTrainState

    model, _ = tiny_model_and_data()
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # the scale tensor exists from the first scale() on
    state = TorchTrainState(model, optimizer, grad_scaler=scaler)
    saved = state.extra_state()
    scaler.update(2.0)  # e.g. a fault made the scaler back off many times
    assert scaler.get_scale() == 2.0
    state.load_extra_state(saved)
    assert scaler.get_scale() == 1024.0 and scaler.state_dict() == saved["grad_scaler"]


def _rollback_under_scaler(rank: int, world: int, config: Any) -> dict[str, Any]:
    return train_amp(rank, 16, config, end_step=True, init_scale=1024.0)


def test_after_a_rollback_step_the_scaler_holds_the_snapshots_state_not_one_update_later(tmp_path: Path) -> None:
    """DDP, fp16 with a GradScaler, a loss spike rolled back: when ``arc.end_step()`` returns after the
    rollback's ``scaler.update()``, every rank's scaler holds exactly the state it had when the restored step
    first started (that update, which ran after the restore inside the same step, would have moved the growth
    tracker on)."""
    config = make_config(tmp_path, "recovery.enabled=true", "recovery.checkpoint_freq=1",
                         "recovery.checkpoint.every_steps=0", "detectors.loss_spike.warmup_steps=4",
                         "detectors.loss_spike.action=rollback", "stats.optimizer_stats_every=0",
                         "faults.injections=[{kind: loss_scale, rank: -1, step: 8, scale: 30.0}]")
    for result in run_ranks(_rollback_under_scaler, 2, config):
        assert "aborted_at" not in result, result
        assert result["after_rollbacks"], result["decisions"]
        for step, state in result["after_rollbacks"]:
            assert state == result["scaler_at"][step], (step, state, result["scaler_at"][step])


def test_attach_refuses_a_scaler_it_cannot_read_and_sdc_recomputation_with_a_scaler(tmp_path: Path) -> None:
    import arc_engine

    model, _ = tiny_model_and_data()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"grad_scaler must be a torch\.amp\.GradScaler"):
        arc_engine.attach(model, optimizer, make_config(tmp_path), grad_scaler=object())
    with pytest.raises(ValueError, match="grad_scaler must be"):
        ScalerWatch(object(), optimizer)
    recompute = make_config(tmp_path, "detectors.sdc.recompute.enabled=true")
    with pytest.raises(ValueError, match=r"sdc\.recompute is not supported with a loss scaler"):
        arc_engine.attach(model, optimizer, recompute, grad_scaler=torch.amp.GradScaler("cpu"))


def test_a_torch_outside_the_tested_range_is_warned_about_not_refused() -> None:
    from arc_engine.attach import warn_if_untested_torch

    assert not warn_if_untested_torch("2.9.1") and not warn_if_untested_torch("2.15.0+cu132")
    with pytest.warns(UserWarning, match=r"torch 2\.8\.0 is outside the range .* \(2\.9 \.\. 2\.15\.x\)"):
        assert warn_if_untested_torch("2.8.0")
    with pytest.warns(UserWarning, match=r"torch 2\.16\.0 is outside"):
        assert warn_if_untested_torch("2.16.0")


# ----------------------------------------------------------------- a GradScaler not passed to attach (grad_scaler=)

FORGOTTEN_SCALE = 2.0**19  # the tiny GPT's fp16 backward overflows at this scale twice before the scaler steps


def _grad_scaler_events(run_dir: Path) -> list[dict]:
    from arc_engine.sinks import read_jsonl

    return [e for e in read_jsonl(run_dir / "test" / "events.jsonl") if e.get("detector") == "grad_scaler"]


def _forgotten_scaler(rank: int, world: int, run_dir: Path) -> dict:
    """The same DDP fp16 run with its GradScaler passed to attach, not passed, and not passed under a fused AdamW."""
    cases = {"passed": {}, "forgotten": {"pass_scaler": False}, "fused": {"pass_scaler": False, "fused": True}}
    return {label: train_amp(rank, 6, make_config(run_dir / label, "stats.interval=1"), wrap="ddp",
                             init_scale=FORGOTTEN_SCALE, **kwargs) for label, kwargs in cases.items()}


def test_a_grad_scaler_not_passed_is_found_at_the_first_step_and_used_as_if_passed(tmp_path: Path) -> None:
    """Issue 47: without grad_scaler= the comm hook's statistics carried the loss scale, a clean run was stopped
    for a gradient explosion. Now the scaler is found at the first optimizer.step() on every rank, with one
    warning: every step the scaler applies is applied, bitwise as with the scaler passed, the agreed norms unscaled."""
    results = run_ranks(_forgotten_scaler, 2, tmp_path)
    skipped = [step for step, changed in enumerate(results[0]["passed"]["changed"]) if not changed]
    assert skipped == [0, 1], "the scaler must search its scale before arc_engine finds it"
    for result in results:
        passed, forgotten = result["passed"], result["forgotten"]
        assert "aborted_at" not in forgotten, forgotten.get("message")
        assert torch.equal(forgotten["params"], passed["params"]) and forgotten["changed"] == passed["changed"]
        assert forgotten["decisions"] == results[0]["forgotten"]["decisions"], "ranks disagree"
        # its first skips merged into step 0 (the step stayed open: no hook saw them); from there on, as if passed
        assert all(action == "NONE" and not findings for _, action, _, findings in forgotten["decisions"])
        assert len(forgotten["decisions"]) == 6 - len(skipped) and forgotten["summary"]["skipped_by_policy"] == 0
        applied_norms = [norm for step, norm in passed["grad_norms"] if step >= len(skipped)]
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in
                   zip([norm for _, norm in forgotten["grad_norms"]], applied_norms, strict=True))
    (warning,) = _grad_scaler_events(tmp_path / "forgotten")
    assert (warning["severity"], warning["action"], warning["step"]) == ("warning", "found", 0)
    assert "grad_scaler=" in warning["message"]
    assert _grad_scaler_events(tmp_path / "passed") == []
    # a fused AdamW unscales inside its kernel: refused at the first step on every rank, before any update
    if getattr(torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True), "_step_supports_amp_scaling",
               False):
        for result in results:
            fused = result["fused"]
            assert (fused["aborted_at"], fused["exit_code"], fused["changed"]) == (0, 2, [])
            assert "grad_scaler=" in fused["message"] and "fused" in fused["message"]
        (refusal,) = _grad_scaler_events(tmp_path / "fused")
        assert refusal["severity"] == "error"


def test_a_plain_module_with_a_grad_scaler_not_passed_trains_as_with_it_passed(tmp_path: Path) -> None:
    """Without DDP the statistics come from .grad at the step, already unscaled: only the scaler's own skips were
    unseen (merged into the next step). Found at the first step, a later skip is closed as the scaler's."""
    faults = "faults.injections=[{kind: nan_grad, rank: 0, step: 3, param: blocks.0.ln1.weight}]"
    kwargs = {"wrap": "plain", "init_scale": 1024.0}
    passed = train_amp(0, 8, make_config(tmp_path / "a", "stats.interval=1", faults), **kwargs)
    forgotten = train_amp(0, 8, make_config(tmp_path / "b", "stats.interval=1", faults), pass_scaler=False, **kwargs)
    assert torch.equal(forgotten["params"], passed["params"]) and forgotten["changed"] == passed["changed"]
    assert forgotten["decisions"] == passed["decisions"] and _overflow_steps(forgotten) == [3]
    assert forgotten["summary"]["skipped_by_framework"] == 1 and forgotten["summary"]["skipped_by_policy"] == 0
    (warning,) = _grad_scaler_events(tmp_path / "b")
    assert warning["severity"] == "warning" and "grad_scaler=" in warning["message"]

"""DeepSpeed fp16 (dynamic loss scaling) and bf16 under ZeRO-2, on real gloo ranks: DeepSpeed's own overflow skips
are the scaler's (never escalated while it searches its scale), every step it applies is applied bitwise as without
arc_engine, statistics are judged unscaled, a NaN is named and skipped on every rank.

DeepSpeed's CPU accelerator answers ``is_fp16_supported()`` from oneDNN's fp16 support, which CPUs without
AVX512-FP16 lack; the ranks here override that answer (test-side only) and then run DeepSpeed's real fp16 path:
an fp16 model, its loss scaler, its overflow check, torch's fp16 arithmetic on the CPU."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from arc_engine import ArcAbort
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config, tiny_model_and_data

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.timeout(300)

STEPS = 10
SCALE_POWER = 18  # the tiny GPT's fp16 backward overflows above 2^14: DeepSpeed skips its first 4 steps


def _train(rank: int, world: int, precision: str, config: Any, steps: int) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True  # see the module docstring
    from arc_engine.integrations.deepspeed import attach_deepspeed

    model, data = tiny_model_and_data()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ds_config = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": 2},
                 "gradient_clipping": 1.0, "steps_per_print": 10_000,
                 "fp16": {"enabled": precision == "fp16", "initial_scale_power": SCALE_POWER},
                 "bf16": {"enabled": precision == "bf16"}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    arc = attach_deepspeed(engine, config) if config is not None else None
    decisions: list[tuple] = []
    if arc is not None:  # every decision the policy commits (DeepSpeed's skips are closed at the next record_loss)
        commit = arc.engine.policy.commit

        def record(decision: Any) -> None:
            decisions.append((decision.step, decision.action.name, decision.overflow,
                              sorted({(f.detector, tuple(f.ranks), f.severity.name) for f in decision.findings})))
            commit(decision)

        arc.engine.policy.commit = record
    applied, norms, stopped = [], {}, None
    for step in range(steps):
        if stopped is not None:
            break
        inputs, targets = data.batch(step, rank, BATCH)
        loss = engine(inputs, targets)
        if arc is not None:
            loss = arc.faults.on_loss(loss)
            arc.record_loss(loss)
        engine.backward(loss)
        before = [p.detach().clone() for p in engine.module.parameters()]
        try:
            engine.step()
        except ArcAbort as abort:  # (raised where DeepSpeed's step returns, once it closed the skipped step)
            stopped = (abort.step, abort.exit_code, str(abort))
        # applied: the parameters moved. DeepSpeed's own was_step_applied() is not the measure: from 0.19 it skips a
        # non-finite gradient norm itself, while 0.18 under bf16 runs a step whose gradients arc_engine dropped
        applied.append(any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters(), strict=True)))
        if arc is not None and applied[-1]:
            stats = arc.engine.last_stats
            norms[step] = (float(engine.get_global_grad_norm()), math.sqrt(float(stats.total("grad_sq").sum())),
                           float(stats.per_rank("grad_sq_local").sum()))
    summary = arc.summary() if arc is not None else {}
    if arc is not None:
        arc.close()
        summary = arc.summary()
    params = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])
    return {"params": params, "applied": applied, "decisions": decisions, "norms": norms, "summary": summary,
            "stopped": stopped}


def _rank(rank: int, world: int, precision: str, config: Any, faulted: Any,
          persistent: Any = None) -> dict[str, Any]:
    runs = {"plain": _train(rank, world, precision, None, STEPS), "arc": _train(rank, world, precision, config, STEPS),
            "faulted": _train(rank, world, precision, faulted, STEPS)}
    if persistent is not None:
        runs["persistent"] = _train(rank, world, precision, persistent, STEPS + 4)
    return runs


def test_deepspeed_fp16_overflow_skips_are_the_scalers_and_clean_training_is_bitwise(tmp_path: Path) -> None:
    config = make_config(tmp_path / "a", "stats.interval=1", "policy.max_consecutive_skips=2")
    nan_step = 7
    faulted = make_config(tmp_path / "b", "stats.interval=1", "faults.injections=[{kind: nan_grad, rank: 1, step: "
                                          f"{nan_step}, param: blocks.0.ln1.weight}}]")
    # a NaN gradient on rank 1 at every step from 6: not the scaler's routine, a fault stopped after 2 skips
    persistent = make_config(tmp_path / "c", "stats.interval=1", "policy.max_consecutive_skips=2",
                             "faults.injections=[{kind: nan_grad, rank: 1, step: 6, steps: 100, "
                             "param: blocks.0.ln1.weight}]")
    results = run_ranks(_rank, 2, "fp16", config, faulted, persistent, timeout_s=280)
    for rank, result in enumerate(results):
        plain, watched = result["plain"], result["arc"]
        skipped = [step for step, ok in enumerate(plain["applied"]) if not ok]
        assert len(skipped) > 2 and skipped == list(range(len(skipped))), (rank, skipped)
        assert watched["applied"] == plain["applied"] and torch.equal(watched["params"], plain["params"]), rank
        assert [step for step, _, overflow, _ in watched["decisions"] if overflow] == skipped, rank
        for step, action, overflow, findings in watched["decisions"]:
            if overflow:
                assert action == "SKIP" and any(f[0] == "deepspeed_overflow" for f in findings), findings
                assert all(f[2] == "WARNING" for f in findings), findings
            else:
                assert action == "NONE", (step, findings)
        assert watched["summary"]["skipped_by_policy"] == 0
        assert watched["summary"]["skipped_by_framework"] == len(skipped)
        for step, (ds_norm, agreed, local_sq) in watched["norms"].items():
            # DeepSpeed's norm is unscaled; so are the agreed and the local statistics (scaled ones: x 2^28)
            assert agreed == pytest.approx(ds_norm, rel=1e-3), (rank, step)
            assert local_sq < 100 * ds_norm**2 + 1.0, (rank, step, local_sq)
        # a NaN gradient on rank 1 after the search: DeepSpeed skips it; named as rank 1's, on both ranks
        faulty = result["faulted"]
        assert not faulty["applied"][nan_step] and all(faulty["applied"][nan_step + 1:]), rank
        step, action, overflow, findings = next(d for d in faulty["decisions"] if d[0] == nan_step)
        assert action == "SKIP" and overflow and ("non_finite", (1,), "WARNING") in findings, findings
        assert faulty["decisions"] == results[0]["faulted"]["decisions"], "ranks disagree"
        stopped = result["persistent"]
        assert stopped["stopped"] is not None and stopped["stopped"][:2] == (8, 3), stopped["stopped"]
        assert "rank 1 only" in stopped["stopped"][2], stopped["stopped"]
        assert stopped["summary"]["skipped_by_framework"] == len(skipped) + 2, stopped["summary"]


def test_deepspeed_bf16_is_bitwise_unchanged_and_a_nan_loss_is_skipped_on_every_rank(tmp_path: Path) -> None:
    config = make_config(tmp_path / "a", "stats.interval=1")
    faulted = make_config(tmp_path / "b", "stats.interval=1", "faults.injections=[{kind: nan_loss, rank: 0, step: 4}]")
    results = run_ranks(_rank, 2, "bf16", config, faulted, timeout_s=280)
    for rank, result in enumerate(results):
        assert all(result["plain"]["applied"]) and result["arc"]["applied"] == result["plain"]["applied"], rank
        assert torch.equal(result["arc"]["params"], result["plain"]["params"]), rank
        for ds_norm, agreed, _ in result["arc"]["norms"].values():
            assert agreed == pytest.approx(ds_norm, rel=1e-3), rank
        faulty = result["faulted"]
        assert not faulty["applied"][4] and all(faulty["applied"][5:]), rank
        _, action, overflow, findings = next(d for d in faulty["decisions"] if d[0] == 4)
        assert action == "SKIP" and not overflow and ("non_finite", (0,), "ERROR") in findings, findings
        assert faulty["decisions"] == results[0]["faulted"]["decisions"], "ranks disagree"
        assert torch.isfinite(faulty["params"]).all()


def _bf16_zero1_rank(rank: int, world: int, run_dir: Path) -> str:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    import deepspeed

    from arc_engine.integrations.deepspeed import attach_deepspeed

    model, _ = tiny_model_and_data()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
        "steps_per_print": 10_000})
    try:
        attach_deepspeed(engine, make_config(run_dir)).close()
    except ValueError as refused:
        return f"{type(engine.optimizer).__name__}: {refused}"
    return f"{type(engine.optimizer).__name__}: attached"


def test_bf16_under_zero1_attaches_or_is_refused_naming_deepspeeds_optimizer(tmp_path: Path) -> None:
    """bf16 under ZeRO-1: where DeepSpeed steps its ZeRO-1/2 optimizer (0.18.0 and 0.19.8 on these CPU ranks)
    arc_engine attaches; where it routes to another (its BF16_Optimizer), attach refuses naming that optimizer and
    what to use instead, not calling the engine ZeRO-0 as it used to."""
    (message,) = run_ranks(_bf16_zero1_rank, 1, tmp_path, timeout_s=200)
    optimizer, outcome = message.split(": ", 1)
    if optimizer == "DeepSpeedZeroOptimizer":
        assert outcome == "attached", message
    else:
        assert f"ZeRO-1 engine steps a {optimizer}" in outcome and "use ZeRO-2 for bf16" in outcome, message
        assert "ZeRO-0" not in outcome, message

"""Fisher-aware recovery (ARC paper §3.3, §3.6): the effective rank and the EWC schedule against their closed forms,
the diagonal Fisher of a linear model with known noise, and real gloo ranks: the agreed Fisher-Rao distance equals
the full model's, a drift past its threshold takes a preventive disk checkpoint, the importance-weighted rollback
equals θ = β θ_ckpt + (1 − β) θ_cur on DDP, FSDP2 and ZeRO-2 with every replica identical, and EWC-regularised
recovery against a plain rollback on the same fault."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import arc_engine
from arc_engine.config import ConfigError, load_config
from arc_engine.monitors.family import section_of
from arc_engine.monitors.fisher import (
    FisherFamily,
    FisherMonitor,
    effective_rank,
    ewc_penalty_gradient,
    ewc_strength,
    importance_blend,
    importance_weights,
)
from tests.dist_harness import run_ranks
from tests.test_recovery_dist import events, lr_spike, make_job, recovery_config, train
from tests.training import make_config

pytestmark = pytest.mark.timeout(300)
ON = ("detectors.fisher.enabled=true", "detectors.fisher.every=1", "detectors.fisher.warmup_measurements=1",
      "detectors.fisher.min_rank_fraction=0")


def fisher_monitor(arc: Any) -> FisherMonitor:
    return next(m for m in arc.engine.gathering.assembly.monitors if isinstance(m, FisherMonitor))


# ------------------------------------------------------------------ closed forms

def test_the_effective_rank_is_the_exponential_of_the_fisher_entropy() -> None:
    fisher = torch.tensor([4.0, 1.0, 1.0, 2.0, 0.0], dtype=torch.float64)
    p = fisher[fisher > 0] / fisher.sum()
    direct = math.exp(float(-(p * p.log()).sum()))
    total, total_log = float(fisher.sum()), float(torch.special.xlogy(fisher, fisher).sum())
    assert effective_rank(total, total_log) == pytest.approx(direct)
    assert effective_rank(8.0, 8.0 * math.log(2.0)) == pytest.approx(4.0)  # four equal entries
    assert math.isnan(effective_rank(0.0, 0.0))


def test_the_importance_blend_and_the_ewc_penalty_follow_their_formulas() -> None:
    fisher = torch.tensor([0.0, 1.0, 2.0, 8.0])
    restored, current = torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([3.0, 3.0, float("nan"), 3.0])
    beta = torch.sigmoid(5.0 * (fisher / 2.75 - 1))
    assert torch.allclose(importance_weights(fisher, 2.75, 5.0), beta)
    blended = restored.clone()
    importance_blend(blended, current, fisher, 2.75, 5.0)
    expected = beta * restored + (1 - beta) * current
    assert torch.allclose(blended[[0, 1, 3]], expected[[0, 1, 3]])
    assert blended[2] == 1.0  # a non-finite current value takes the checkpoint's
    assert blended[0] > 2.9 and blended[3] < 1.01  # unimportant kept, important restored

    grad, value, anchor = torch.ones(4), torch.tensor([2.0, 2.0, 2.0, 2.0]), torch.zeros(4)
    ewc_penalty_gradient(grad, value, anchor, fisher, 0.5)
    assert torch.equal(grad, 1 + 0.5 * fisher * 2.0)
    loaded = load_config(None, ["detectors.fisher.ewc_strength=2.0", "detectors.fisher.ewc_decay_steps=10",
                                "detectors.fisher.ewc_steps=30"])
    config = section_of(loaded, FisherFamily())
    assert [ewc_strength(config, t) for t in (0, 10, 29, 30, -1)] == \
        pytest.approx([2.0, 2.0 * math.exp(-1), 2.0 * math.exp(-2.9), 0.0, 0.0])


def test_the_config_refuses_bad_values_and_shaping_without_recovery(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="decay"):
        load_config(None, ["detectors.fisher.decay=0"])
    with pytest.raises(ConfigError, match="drift_factor"):
        load_config(None, ["detectors.fisher.drift_factor=0.5"])
    model = torch.nn.Linear(4, 1)
    config = make_config(tmp_path, *ON, "detectors.fisher.importance_rollback=true")
    with pytest.raises(ValueError, match=r"recovery\.enabled"):
        arc_engine.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


def test_the_diagonal_fisher_of_a_linear_model_with_known_noise(tmp_path: Path) -> None:
    """y = w·x + σ ε, x_i ~ N(0, s_i²), loss ½ mean over a batch of B of (w·x − y)², at w = w_true (learning
    rate 0): g_i = −(σ / B) Σ_b ε_b x_bi, so F_i = E[g_i²] = σ² s_i² / B."""
    torch.manual_seed(0)
    scales = torch.tensor([0.5, 1.0, 2.0, 4.0]).repeat_interleave(64)
    sigma, batch, steps = 0.5, 16, 1200
    model = torch.nn.Linear(scales.numel(), 1, bias=False)
    w_true = model.weight.detach().clone()
    config = make_config(tmp_path, *ON, "detectors.fisher.decay=0.01", "detectors.loss_spike.enabled=false")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    arc = arc_engine.attach(model, optimizer, config)
    try:
        for _ in range(steps):
            x = torch.randn(batch, scales.numel()) * scales
            y = x @ w_true.T + sigma * torch.randn(batch, 1)
            loss = 0.5 * (model(x) - y).square().mean()
            arc.record_loss(loss)
            loss.backward()
            optimizer.step()
            model.zero_grad()
        fisher = fisher_monitor(arc).state.fisher[0].flatten()
    finally:
        arc.close()
    expected = sigma**2 * scales**2 / batch
    per_scale = (fisher / expected).reshape(4, 64).mean(dim=1)
    assert torch.allclose(per_scale, torch.ones(4), rtol=0.1), per_scale


# ------------------------------------------------------------------ real ranks

def _drift(rank: int, world: int, config: Any, steps: int) -> dict[str, Any]:
    """Train DDP; at each step start compute the Fisher-Rao distance of the full model from this rank's F and θ*
    (every rank holds them whole) to compare with the agreed one (each element counted once over the ranks)."""
    job, data = make_job("ddp", config, rank, world)
    direct: dict[int, float] = {}

    def at_step_start(arc: Any) -> None:
        state = fisher_monitor(arc).state
        if state.anchor is not None:
            direct[arc.progress.step] = math.sqrt(sum(float((f.double() * (t.double() - a.double()).square()).sum())
                                             for f, t, a in zip(state.fisher, state.tensors, state.anchor,
                                                                strict=True)))

    agreed: dict[int, float] = {}
    arc = job.arc
    original = arc.engine.finish_step

    def finish_step(*args: Any, **kwargs: Any) -> None:
        value = fisher_monitor(arc).metrics().get("rao_distance", math.nan)
        if arc.engine.last_decision is not None and arc.engine.last_decision.step == arc.progress.step:
            agreed[arc.progress.step] = value
        original(*args, **kwargs)

    arc.engine.finish_step = finish_step
    out = train(job, data, rank, steps, at_step_start=at_step_start)
    return {"direct": direct, "agreed": agreed, "summary": out["summary"]}


def test_the_agreed_fisher_rao_distance_is_the_full_models_and_a_drift_takes_a_preventive_checkpoint(
        tmp_path: Path) -> None:
    config = recovery_config(tmp_path, *ON, "detectors.fisher.drift_factor=0", "detectors.fisher.drift_threshold=1e-4",
                             "recovery.checkpoint.enabled=true", "recovery.checkpoint.every_steps=0",
                             "detectors.loss_spike.enabled=false")
    out = run_ranks(_drift, 2, config, 16)
    for rank in range(2):
        compared = [s for s in out[rank]["agreed"] if s in out[rank]["direct"] and
                    math.isfinite(out[rank]["agreed"][s])]
        assert len(compared) >= 8
        for step in compared:
            assert out[rank]["agreed"][step] == pytest.approx(out[rank]["direct"][step], rel=1e-5)
    assert repr(out[0]["agreed"]) == repr(out[1]["agreed"])  # every rank agreed on the same (NaN before any θ*)
    found = events(tmp_path)
    drifts = [e for e in found if e.get("detector") == "fisher" and e["kind"] == "detection"]
    assert drifts and all(e["action"] == "checkpoint" for e in drifts)
    # the preventive checkpoint: saved to disk although every_steps is 0
    assert out[0]["summary"]["recovery"]["disk_saves"] >= 1


def _blend(rank: int, world: int, backend: str, config: Any, steps: int) -> dict[str, Any]:
    """Train with a learning-rate spike that a loss spike rolls back; record, independently of the blend, the
    stepped tensors at the first attempt of each step (θ_ckpt) and at the step start before the restore (θ_cur,
    and F), the tensors the blend left, and the model's parameters once the backend refreshed them."""
    job, data = make_job(backend, config, rank, world)
    arc = job.arc
    monitor = fisher_monitor(arc)
    first_seen: dict[int, list[torch.Tensor]] = {}
    latest: dict[str, Any] = {}
    blends: list[dict[str, Any]] = []

    def at_step_start(arc: Any) -> None:
        tensors = [t.detach().clone() for t in monitor.state.tensors]
        first_seen.setdefault(arc.progress.step, tensors)
        latest.update(tensors=tensors, fisher=[f.clone() for f in monitor.state.fisher])

    original = monitor.after_restore

    def after_restore(step: int) -> bool:
        edited = original(step)
        blends.append({"step": step, "edited": edited, "checkpoint": first_seen[step], "current": latest["tensors"],
                       "fisher": latest["fisher"], "blended": [t.detach().clone() for t in monitor.state.tensors]})
        return edited

    state = arc.engine.recovery.state
    refresh = state.masters_changed

    def masters_changed() -> None:
        refresh()
        blends[-1]["model"] = [p.detach().clone() for p in job.params()]

    monitor.after_restore, state.masters_changed = after_restore, masters_changed
    out = train(job, data, rank, steps, at_step_start=at_step_start)
    for blend in blends:  # F̄ as the agreement counts it: every element once over the ranks
        fisher = blend["fisher"]
        sums = torch.tensor([sum(float(f.double().sum()) for f in fisher), float(sum(f.numel() for f in fisher))],
                            dtype=torch.float64)
        if backend != "ddp":  # partitions and shards: add the ranks' parts
            dist.all_reduce(sums)
        blend["mean"] = float(sums[0] / sums[1])
    return {"blends": blends, "out": out}


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "zero2", "zero3-fp32"])
def test_the_importance_weighted_rollback_equals_the_formula(tmp_path: Path, backend: str) -> None:
    """A learning-rate spike at step 12 is rolled back at 13 to the step-10 snapshot: the stepped tensors (DDP's
    parameters, FSDP2's shards, ZeRO-2's fp32 partitions) become β θ_ckpt + (1 − β) θ_cur with β =
    sigmoid(5 (F / F̄ − 1)), F̄ over the whole model; replicated parameters identical on every rank."""
    config = recovery_config(tmp_path, *ON, "detectors.fisher.importance_rollback=true", lr_spike(12))
    out = run_ranks(_blend, 2, backend, config, 16)
    for rank in range(2):
        blend = out[rank]["blends"][0]
        assert blend["edited"] and blend["step"] == 10
        for restored, current, fisher, blended in zip(blend["checkpoint"], blend["current"], blend["fisher"],
                                                       blend["blended"], strict=True):
            beta = torch.sigmoid(5.0 * (fisher.double() / blend["mean"] - 1))
            expected = beta * restored.double() + (1 - beta) * current.double()
            # (F̄ comes from the agreement's float32 sums: β to ~1e-6)
            assert torch.allclose(blended.double(), expected, rtol=0, atol=1e-5)
        moved = torch.cat([(b - c).abs().flatten() for b, c in zip(blend["blended"], blend["checkpoint"],
                                                                     strict=True)])
        assert float(moved.max()) > 1e-4  # the blend kept some of the current values: not a plain restore
    first, second = out[0]["blends"][0]["model"], out[1]["blends"][0]["model"]
    if backend in ("ddp", "zero2"):  # replicated parameters (ZeRO-2: gathered again from the blended partitions)
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    if backend == "zero3-fp32":  # [fp32 partitions, bit16 partitions (the same), the persistent gathered params]
        groups = len(out[0]["blends"][0]["blended"])
        for rank in range(2):
            model = out[rank]["blends"][0]["model"]
            assert all(torch.equal(a, b) for a, b in zip(model[:groups], out[rank]["blends"][0]["blended"],
                                                         strict=True))
        assert len(first) > 2 * groups
        assert all(torch.equal(a, b) for a, b in zip(first[2 * groups:], second[2 * groups:], strict=True))
    if backend == "zero2":  # the gathered parameters hold the blended partitions
        flat = torch.cat([p.flatten() for p in out[0]["blends"][0]["model"]])
        for rank in range(2):
            for part in out[rank]["blends"][0]["blended"]:
                assert any(torch.equal(part[: min(part.numel(), 8)], flat[i: i + min(part.numel(), 8)])
                           for i in range(flat.numel() - 7))


def _recover(rank: int, world: int, config: Any, steps: int) -> dict[str, Any]:
    """Train DDP; record per attempt the agreed Fisher-Rao distance from θ* and the EWC strength."""
    job, data = make_job("ddp", config, rank, world)
    arc, trace = job.arc, []
    original = arc.engine.finish_step

    def finish_step(*args: Any, **kwargs: Any) -> None:
        values = fisher_monitor(arc).metrics()
        trace.append((arc.progress.step, values.get("rao_distance", math.nan), values.get("ewc_lambda", math.nan)))
        original(*args, **kwargs)

    arc.engine.finish_step = finish_step
    out = train(job, data, rank, steps)
    return {**out, "trace": trace}


def test_ewc_regularised_recovery_holds_the_important_parameters_after_a_rollback(tmp_path: Path) -> None:
    """The same learning-rate spike (step 12, rolled back at 13 to the step-10 snapshot) with and without EWC
    (λ₀ = 3·10⁴): the runs are identical to the bit until the rollback (the penalty is off before one), then the
    penalty λ_t F (θ − θ*) decays as λ₀ e^{−t/50} and keeps the Fisher-Rao distance from θ* below the plain run's
    until the next verified snapshot moves θ*; replicas stay identical. Whether that lowers the loss depends on the
    fault: ``scripts/bench_fisher.py recovery`` measures it, and docs/detectors.md reports it (on a plain
    learning-rate spike it does not help)."""
    faults = (*ON, lr_spike(12))
    plain = run_ranks(_recover, 2, recovery_config(tmp_path / "plain", *faults), 24)
    ewc = run_ranks(_recover, 2, recovery_config(tmp_path / "ewc", *faults, "detectors.fisher.ewc_strength=3e4"), 24)
    for run in (plain, ewc):
        assert run[0]["summary"]["recovery"]["rollbacks"] == 1
        assert all(torch.equal(a, b) for a, b in zip(run[0]["params"], run[1]["params"], strict=True))
    rollback = 14  # attempts 0-13 (13 rolled back), then the replay from step 10
    assert plain[0]["losses"][:rollback] == ewc[0]["losses"][:rollback]
    assert plain[0]["losses"][rollback + 1:] != ewc[0]["losses"][rollback + 1:]
    steps = [step for step, _, _ in ewc[0]["trace"]]
    assert steps[rollback - 1: rollback + 2] == [13, 10, 11]
    lambdas = [value for _, _, value in ewc[0]["trace"][rollback:rollback + 4]]
    assert lambdas == pytest.approx([3e4 * math.exp(-t / 50) for t in range(4)])
    assert not any(value > 0 for _, _, value in ewc[0]["trace"][:rollback])
    # the distance from θ* (the restored state) on the replayed steps before the next snapshot (step 15)
    held = [ewc[0]["trace"][k][1] for k in range(rollback + 2, rollback + 5)]
    free = [plain[0]["trace"][k][1] for k in range(rollback + 2, rollback + 5)]
    assert all(h < 0.8 * f for h, f in zip(held, free, strict=True)), (held, free)




def _clean(rank: int, world: int, config: Any) -> dict[str, Any]:
    from tests.training import train_ddp

    return train_ddp(rank, 12, config)


def test_without_a_fault_the_parameters_are_bitwise_those_of_a_run_without_arc_engine(tmp_path: Path) -> None:
    """The Fisher estimate only reads the gradients; the blend and the penalty wait for a rollback."""
    config = recovery_config(tmp_path, *ON, "detectors.fisher.importance_rollback=true",
                             "detectors.fisher.ewc_strength=3e4")
    with_arc = run_ranks(_clean, 2, config)
    without = run_ranks(_clean, 2, None)
    for rank in range(2):
        assert all(torch.equal(with_arc[rank]["params"][name], without[rank]["params"][name])
                   for name in without[rank]["params"])
        assert with_arc[rank]["summary"]["recovery"]["rollbacks"] == 0

"""Training dynamics (ARC paper §3.4): the Lyapunov estimate on contracting and expanding maps, the phases, the FFT
oscillation check against a sinusoid and white noise, the monitor on simulated agreed velocities, and real gloo
ranks (DDP, FSDP2) where the agreed velocity equals the full model's and a growing learning rate is called
divergent on every rank while a clean run is not."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine.config import ConfigError, load_config
from arc_engine.monitors.dynamics import (
    CONVERGENT,
    DIVERGENT,
    HEALTHY,
    MARGINAL,
    SKETCH,
    VELOCITY,
    WARNING,
    DynamicsFamily,
    attractor_radius,
    lyapunov,
    oscillation_ratio,
    phase,
    sketch_into,
    stabilisation,
)
from arc_engine.monitors.family import FamilyContext, section_of
from arc_engine.stats import AgreedStats, Reduce, StatLayout
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data

pytestmark = pytest.mark.timeout(300)
ON = ("detectors.dynamics.enabled=true",)


def test_the_lyapunov_estimate_is_the_mean_log_ratio_per_step() -> None:
    assert lyapunov([0.9**k for k in range(10)]) == pytest.approx(math.log(0.9))  # contracting: negative
    assert lyapunov([1.3**k for k in range(10)]) == pytest.approx(math.log(1.3))  # expanding: positive
    # velocities 5 steps apart of a trajectory growing as e^{0.05 t}: 0.05 per step again
    assert lyapunov([math.exp(0.05 * 5 * k) for k in range(6)], every=5) == pytest.approx(0.05)
    assert lyapunov([1.0, 0.0, 2.0, 4.0]) == pytest.approx(math.log(2.0))  # ratios at a zero velocity are skipped
    assert lyapunov([1.0]) is None and lyapunov([0.0, 0.0]) is None


def test_the_phases_follow_the_papers_thresholds() -> None:
    config = section_of(load_config(None, list(ON)), DynamicsFamily())
    assert [phase(x, config) for x in (0.3, 0.15, 0.07, 0.01, -0.01, -0.07, -0.2)] == \
        [DIVERGENT, WARNING, HEALTHY, MARGINAL, MARGINAL, HEALTHY, CONVERGENT]


def test_the_oscillation_check_finds_a_period_and_not_white_noise() -> None:
    t = np.arange(32)
    rng = np.random.default_rng(1)
    ratio, period = oscillation_ratio(list(1 + 0.3 * np.sin(2 * np.pi * t / 8) + 0.05 * rng.normal(size=32)))
    assert ratio > 8 and period == 8
    # the default factor 8 on 32 white-noise velocities: 1 window in 2,000 above it (the paper's 2: 98.7%)
    rng = np.random.default_rng(0)
    ratios = np.array([oscillation_ratio(list(1 + 0.1 * rng.normal(size=32)))[0] for _ in range(2000)])
    assert (ratios > 8).mean() < 0.002 and (ratios > 2).mean() > 0.95
    assert math.isnan(oscillation_ratio([1.0] * 32)[0]) and math.isnan(oscillation_ratio([1.0, 2.0])[0])


def _monitor(*overrides: str) -> tuple[StatLayout, Any]:
    config = load_config(None, [*ON, "detectors.dynamics.every=1", *overrides])
    ctx = FamilyContext(config, section_of(config, DynamicsFamily()), ["g"], Reduce.SUM)
    layout = StatLayout()
    for decl in DynamicsFamily().statistics(ctx):
        layout.add(decl.name, decl.size, decl.reduce)
    layout.freeze()
    (monitor,) = DynamicsFamily().monitors(ctx)
    return layout, monitor


def _drive(velocities: list[float], *overrides: str) -> dict[int, list[str]]:
    layout, monitor = _monitor("detectors.dynamics.attractor_sketch=0", *overrides)
    found = {}
    for step, velocity in enumerate(velocities):
        rows = np.zeros((2, layout.size))
        rows[:, layout[VELOCITY].span] = [[velocity**2 / 2, 1.0], [velocity**2 / 2, 1.0]]  # two ranks' halves
        findings = monitor.evaluate(step, AgreedStats.from_rows(layout, rows, ranks=(0, 1)))
        monitor.commit(step, True)
        if findings:
            found[step] = [f.message.split(":")[0] for f in findings]
    return found


def test_the_monitor_reports_each_phase_when_it_begins() -> None:
    rng = np.random.default_rng(3)
    clean = list(1.0 + 0.05 * rng.normal(size=200))  # a steady velocity: λ about 0, no period
    assert _drive(clean) == {}
    growing = clean[:60] + [clean[59] * 1.5**k for k in range(1, 8)]  # accelerating from step 60
    found = _drive(growing)
    assert found and min(found) >= 60 and "training dynamics divergent" in found[max(found)]
    t = np.arange(200)
    periodic = list(1 + 0.3 * np.sin(2 * np.pi * t / 8) + 0.02 * rng.normal(size=200))
    found = _drive(periodic)  # (an 8-velocity Lyapunov window over a period-8 wave swings: "unstable" at times)
    oscillating = [step for step, labels in found.items() if labels == ["training dynamics oscillating"]]
    assert oscillating and min(oscillating) >= 31  # once the FFT window is full
    assert all(labels != ["training dynamics divergent"] for labels in found.values())


def _trajectory(positions: np.ndarray, *overrides: str) -> tuple[dict[int, list[str]], list[float]]:
    """Feed the monitor a trajectory: each measurement's displacement as two ranks' halves of its sketch (fixed
    random signs per element) and of its squared norm. Returns the findings and the ratio metric per step."""
    layout, monitor = _monitor(*overrides)
    k = layout[SKETCH].size
    generator = torch.Generator().manual_seed(5)
    signs = torch.randint(0, 2, (positions.shape[1],), generator=generator).to(torch.int8) * 2 - 1
    half = positions.shape[1] // 2
    found, ratios = {}, []
    for step in range(1, len(positions)):
        move = torch.as_tensor(positions[step] - positions[step - 1])
        rows = np.zeros((2, layout.size))
        for rank, part in enumerate((slice(0, half), slice(half, None))):
            sketch = torch.zeros(k, dtype=torch.float64)
            sketch_into(sketch, move[part], signs[part])
            rows[rank, layout[VELOCITY].span] = [float(move[part].square().sum()), 1.0]
            rows[rank, layout[SKETCH].span] = sketch.numpy()
        findings = monitor.evaluate(step, AgreedStats.from_rows(layout, rows, ranks=(0, 1)))
        monitor.commit(step, True)
        ratios.append(monitor.metrics()["attractor_ratio"])
        labels = [f.message.split(":")[0] for f in findings if "attractor" in f.message]
        if labels:
            found[step] = labels
    return found, ratios


def test_the_sketch_keeps_norms_and_the_attractor_is_a_settled_trajectory() -> None:
    rng = np.random.default_rng(0)
    x = torch.as_tensor(rng.normal(size=3000))
    estimates = []
    for seed in range(200):
        signs = torch.randint(0, 2, (3000,), generator=torch.Generator().manual_seed(seed)).to(torch.int8) * 2 - 1
        sketch, halves = torch.zeros(128, dtype=torch.float64), torch.zeros(128, dtype=torch.float64)
        sketch_into(sketch, x, signs)
        sketch_into(halves, x / 4, signs)  # linear: two displacements add up to the sketch of their sum
        sketch_into(halves, 3 * x / 4, signs)
        assert torch.allclose(sketch, halves)
        estimates.append(float(sketch.square().sum() / x.square().sum()))
    assert np.mean(estimates) == pytest.approx(1.0, abs=0.03)  # unbiased
    assert np.std(estimates) == pytest.approx(math.sqrt(2 / 128), rel=0.25)  # spread √(2/k)
    positions = [np.zeros(4), np.array([1.0, 3.0, 0.0, 0.0]), np.array([-1.0, 3.0, 0.0, 0.0])]
    assert attractor_radius(positions) == pytest.approx(2.0)  # the origin, farthest from the centroid (0, 2)

    dims, steps = 4000, 80
    drift = np.outer(np.arange(steps), rng.normal(size=dims)) * 0.1 + 0.05 * rng.normal(size=(steps, dims))
    settled = 0.05 * rng.normal(size=(steps, dims))  # independent draws around a point: a noise ball
    settled[:40] += drift[:40]  # drifting, then settled from measurement 40
    found, ratios = _trajectory(drift)
    assert found == {} and min(ratios[31:]) > 0.3  # a straight drift: R about half the path
    found, ratios = _trajectory(settled)
    # reported once: the window of 32 positions lies in the ball from position 71, and 5 measurements in a row
    assert found == {71 + 4: ["training settled into an attractor"]}, found
    assert ratios[-1] < 0.05 < min(ratios[31:70])


def test_the_family_is_off_by_default_and_validates_its_section() -> None:
    default = load_config(None, [])
    section = section_of(default, DynamicsFamily())
    assert not DynamicsFamily().enabled(FamilyContext(default, section, ["g"], Reduce.SUM))
    for bad in ("window=2", "ema=0", "divergent=0.05", "marginal=0.5", "oscillation_factor=1", "every=0"):
        with pytest.raises(ConfigError):
            load_config(None, [*ON, f"detectors.dynamics.{bad}"])
    odd = load_config(None, [*ON, "stats.interval=3", "detectors.dynamics.every=10"])
    with pytest.raises(ValueError, match=r"multiple of stats\.interval"):
        DynamicsFamily().enabled(FamilyContext(odd, section_of(odd, DynamicsFamily()), ["g"], Reduce.SUM))


# ------------------------------------------------------------------ real ranks


def _train(rank: int, world: int, run_dir: Path, backend: str, grow: bool, stabilize: bool = False) -> dict[str, Any]:
    """The tiny GPT, velocity every 2 steps; with ``grow`` the learning rate is multiplied by 1.6^k on step 30 + k,
    k = 1..8 (an accelerating trajectory). Returns the agreed velocities, the full model's own, and the findings."""
    model, data = tiny_model_and_data(seed=2)
    faults = [f"{{kind: lr_scale, rank: -1, step: {30 + k}, scale: {1.6**k}}}" for k in range(1, 9)] if grow else []
    config = make_config(run_dir, *ON, "detectors.dynamics.every=2", "detectors.dynamics.window=8",
                         "detectors.dynamics.lyapunov_window=4", "detectors.dynamics.ema=0.6",
                         f"detectors.dynamics.stabilize={str(stabilize).lower()}",
                         f"faults.injections=[{', '.join(faults)}]")
    if backend == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = make_optimizer(model)
        arc = arc_engine.attach(model, optimizer, config)
        wrapped = model

        def full() -> torch.Tensor:
            return torch.cat([p.full_tensor().double().flatten() for p in model.parameters()])
    else:
        optimizer = make_optimizer(model)
        wrapped = DistributedDataParallel(model)
        arc = arc_engine.attach(wrapped, optimizer, config)

        def full() -> torch.Tensor:
            return torch.cat([p.detach().double().flatten() for p in model.parameters()])
    monitor = next(m for m in arc.engine.gathering.assembly.monitors if m.name == "dynamics")
    agreed, exact, findings, states, coefficients, params = [], [], {}, [], [], []
    from arc_engine.recovery import heal

    applied = heal.gradient_coefficient  # what the optimizer hook applies to each step's gradients

    def recorded(engine: object) -> float:
        value = applied(engine)
        coefficients.append(value)
        return value

    heal.gradient_coefficient = recorded  # (this rank's process only)
    for step in range(42):
        if step % 2 == 0:
            states.append(full())
        loss = wrapped(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        decision = arc.engine.last_decision
        params.append(full())
        if step % 2 == 0 and step > 0:
            agreed.append(monitor.metrics()["velocity"])
            exact.append(float((states[-1] - states[-2]).norm()))
        for finding in decision.findings if decision.step == step else ():
            if finding.detector == "dynamics":
                findings[step] = finding.message.split(":")[0]
    arc.close()
    window = torch.stack(states[-8:])  # the positions of the last `window` (8) measurements
    exact_radius = float((window - window.mean(dim=0)).norm(dim=1).max())
    return {"agreed": agreed, "exact": exact, "findings": findings, "lyapunov": monitor.metrics()["lyapunov"],
            "coefficients": coefficients, "params": params, "exact_radius": exact_radius,
            "radius": monitor.metrics()["attractor_radius"]}


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_the_agreed_velocity_is_the_full_models_and_a_growing_step_is_divergent(tmp_path: Path,
                                                                                  backend: str) -> None:
    """2 ranks. Clean: the agreed velocity (each rank's part, each element once) equals ‖θ_t − θ_{t−2}‖ of the full
    model, every rank agrees, and the phase is never divergent. With the learning rate growing 1.6x per step from
    step 31 to 38: divergent while it grows (a 4-velocity Lyapunov window, EMA 0.6), on every rank at the same
    step."""
    clean = run_ranks(_train, 2, tmp_path / "clean", backend, False)
    for result in clean:
        assert result["agreed"] == clean[0]["agreed"]
        np.testing.assert_allclose(result["agreed"], result["exact"], rtol=1e-5)
        # the attractor radius from the 128-number sketch: the full model's within the sketch's spread
        assert result["radius"] == pytest.approx(result["exact_radius"], rel=0.35)
        assert result["radius"] == clean[0]["radius"]
        assert all(label != "training dynamics divergent" for label in result["findings"].values())
    grown = run_ranks(_train, 2, tmp_path / "grown", backend, True)
    assert grown[0]["findings"] == grown[1]["findings"]
    divergent = [step for step, label in grown[0]["findings"].items() if label == "training dynamics divergent"]
    assert divergent and 30 < divergent[0] <= 38, grown[0]["findings"]
    assert grown[0]["lyapunov"] > 0.2 > clean[0]["lyapunov"]
    assert set(clean[0]["coefficients"]) == set(grown[0]["coefficients"]) == {1.0}  # stabilisation is opt-in


def test_opt_in_stabilisation_scales_the_gradients_only_while_lambda_is_positive(tmp_path: Path) -> None:
    """DDP, 2 ranks, the growing learning rate with ``stabilize: true``: the gradient factor is 1 (and the
    parameters bitwise those of the run without it) until λ̄ leaves the marginal band after the growth starts (a clean
    stretch's λ̄ wanders around 0 untouched); then it is below 1 on every rank alike, and the parameters part from
    the unstabilised run's."""
    plain = run_ranks(_train, 2, tmp_path / "plain", "ddp", True)
    steady = run_ranks(_train, 2, tmp_path / "steady", "ddp", True, True)
    assert steady[0]["coefficients"] == steady[1]["coefficients"]
    scaled = [step for step, c in enumerate(steady[0]["coefficients"]) if c != 1.0]
    assert scaled and scaled[0] > 30 and all(0 < steady[0]["coefficients"][s] < 1 for s in scaled)
    first = scaled[0]
    for step in range(first):  # nothing touched before the first scaled step
        assert torch.equal(plain[0]["params"][step], steady[0]["params"][step]), step
    assert not torch.equal(plain[0]["params"][first], steady[0]["params"][first])


def test_the_stabilisation_factor_is_the_papers_formula() -> None:
    value, norm, strength = 0.2, 10.0, 0.5
    stability, limit = math.exp(-value), 0.5 + 0.5 * math.exp(-value)
    assert stabilisation(value, norm, strength) == pytest.approx(stability + (1 - stability) * limit / norm)
    assert stabilisation(value, 0.5, strength) == 1.0  # the norm is under the clip: S + (1 - S) = 1
    assert stabilisation(-0.1, norm, strength) == stabilisation(value, math.inf, strength) == 1.0


def _deepspeed(rank: int, world: int, run_dir: Path, stage: int) -> dict[str, Any]:
    """DeepSpeed ZeRO-``stage``: the velocity from each rank's partition of the fp32 masters."""
    from arc_engine.integrations.deepspeed import attach_deepspeed
    from tests.test_deepspeed_dist import ds_engine

    engine, data = ds_engine(rank, world, stage, clip=1.0)
    arc = attach_deepspeed(engine, make_config(run_dir, *ON, "detectors.dynamics.every=2"))
    monitor = next(m for m in arc.engine.gathering.assembly.monitors if m.name == "dynamics")
    agreed, exact, states = [], [], []
    for step in range(9):
        if step % 2 == 0:
            states.append(torch.cat([p.detach().double().flatten() for p in engine.module.parameters()]))
            if step > 0:
                exact.append(float((states[-1] - states[-2]).norm()))
        inputs, targets = data.batch(step, rank, BATCH)
        loss = engine(inputs, targets)
        arc.record_loss(loss)
        engine.backward(loss)
        engine.step()
        if step % 2 == 0 and step > 0:
            agreed.append(monitor.metrics()["velocity"])
    arc.close()
    return {"agreed": agreed, "exact": exact}


def test_deepspeed_zero2_velocity_from_the_partitions_is_the_full_models(tmp_path: Path) -> None:
    """2 ranks under ZeRO-2 (each holds half of the fp32 masters): the agreed velocity equals ‖θ_t − θ_{t−2}‖ of
    the module's full parameters."""
    pytest.importorskip("deepspeed")
    results = run_ranks(_deepspeed, 2, tmp_path, 2)
    for result in results:
        assert result["agreed"] == results[0]["agreed"] and len(result["agreed"]) == 4
        np.testing.assert_allclose(result["agreed"], result["exact"], rtol=1e-5)

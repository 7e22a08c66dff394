"""Cross-worker consistency (silent-inconsistency paper): the pure estimators, the monitor on simulated ranks'
buffers against the definitions, and 4 real gloo ranks under DDP -- the paper's S1-1 / S1-2 / S1-3 experiment in
miniature, the exact values against a single-process computation, one rank's contribution scaled (an "NCCL bug"),
and clean runs that raise nothing."""

from __future__ import annotations

import math
from copy import deepcopy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine.config import load_config
from arc_engine.monitors.consistency import (
    DIRECTION_SUM,
    EXTREMES,
    POSITION,
    ConsistencyFamily,
    ConsistencyMonitor,
    ExtremesProducer,
    direction_consistency,
    exact_direction_consistency,
    extremes_detail,
    farthest_rank,
    farthest_rank_within,
    position_sketch_size,
)
from arc_engine.monitors.family import FamilyContext, ModelParts, StepView, section_of
from arc_engine.monitors.sdc_local import BUCKET_SKETCH_INDEX, add_gradient_sketch
from arc_engine.monitors.worker_spread import GRAD_NORM_MOMENTS, LOSS_MOMENTS, WorkerMoments, dispersion
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, StatLayout, names
from tests.dist_harness import run_ranks
from tests.training import BATCH, family_stats_layout, make_config, make_optimizer, tiny_model_and_data

pytestmark = pytest.mark.timeout(300)

#: The documented bound on |sketch C_dir - exact C_dir| with a 1,024-number sketch (docs/detectors.md: measured
#: largest error 0.071 by scripts/bench_direction_sketch.py).
DIRECTION_ERROR_BOUND = 0.1


# ------------------------------------------------------------------ pure estimators

def test_dispersion_is_the_population_std_from_shifted_moments() -> None:
    values = np.array([2.5, 2.7, 2.4, 3.1])
    for shift in (0.0, 2.6, -10.0):
        mean, std = dispersion(float((values - shift).sum()), float(((values - shift) ** 2).sum()), 4, shift)
        assert mean == pytest.approx(values.mean()) and std == pytest.approx(values.std(), rel=1e-9)
    assert math.isnan(dispersion(0.0, 0.0, 0, 0.0)[0])
    assert dispersion(0.0, 0.0, 3, 5.0) == (5.0, 0.0)  # identical values: exactly 0, not a rounding residue


def test_direction_consistency_from_the_sum_of_unit_vectors_is_the_mean_pairwise_cosine() -> None:
    rng = np.random.default_rng(0)
    for ranks in (2, 3, 8):
        vectors = rng.normal(size=(ranks, 50)) + rng.normal(size=50)  # a shared part: positive cosines
        unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        assert direction_consistency(unit.sum(axis=0), ranks) == pytest.approx(exact_direction_consistency(vectors))
    assert math.isnan(direction_consistency(np.ones(3), 1))
    same = np.tile(rng.normal(size=20), (4, 1))
    assert exact_direction_consistency(same) == pytest.approx(1.0)


def test_the_farthest_rank_is_the_one_away_from_the_peers_median() -> None:
    assert farthest_rank(np.array([1.0, 1.1, 3.0, 0.9])) == (2, pytest.approx(2.0))
    assert farthest_rank(np.array([1.0, math.nan, 1.0, 0.2]))[0] == 3
    # model-parallel positions: compared within a position only (shards of different sizes never compete)
    norms, groups = np.array([1.0, 10.0, 1.1, 10.5, 0.9, 30.0]), np.array([0, 1, 0, 1, 0, 1])
    assert farthest_rank(norms)[0] == 5 and farthest_rank_within(norms, groups) == (5, pytest.approx(30 / 10.25 - 1))
    assert farthest_rank_within(np.array([1.0, 5.0, 1.0, 1.0]), np.array([0, 0, 1, 1]))[0] in (0, 1)
    assert position_sketch_size(256, 1) == 256 and position_sketch_size(256, 4) == 64
    assert position_sketch_size(256, 32) == 16


def test_worker_moments_keep_one_row_per_position() -> None:
    """Two positions (e.g. two tensor-parallel shards) of two replicas each: each position's spread is over its
    own replicas; the CV the alarm reads is the larger one, sigma is the root mean of the variances."""
    layout = StatLayout()
    for name, size, reduce in names.adapter_statistics(1, Reduce.SUM):
        layout.add(name, size, reduce)
    for decl in WorkerMoments(2, 0).statistics():
        layout.add(decl.name, decl.size, decl.reduce)
    layout.freeze()
    norms = {0: [1.0, 1.2], 1: [10.0, 14.0]}  # position -> its replicas' local norms
    rows = []
    for position, values in norms.items():
        for norm in values:
            buffer = StatBuffer(layout, torch.device("cpu"))
            buffer.put(names.GRAD_SQ_LOCAL, norm * norm)
            moments = WorkerMoments(2, position)
            moments.norm_shift = np.array([1.0, 11.0])  # shifts as a previous step left them
            moments.write(buffer)
            rows.append(buffer.values.numpy().copy())
    spread = WorkerMoments.read(AgreedStats.from_rows(layout, np.stack(rows)))
    assert spread.norm_means.tolist() == pytest.approx([1.1, 12.0])
    assert spread.norm_stds.tolist() == pytest.approx([0.1, 2.0])
    assert spread.norm_cv == pytest.approx(2.0 / 12.0) and spread.norm_std == pytest.approx(math.sqrt((0.01 + 4) / 2))


# ------------------------------------------------------------------ the monitor on simulated ranks

def family_layout(config: Any) -> tuple[StatLayout, ConsistencyMonitor]:
    ctx = FamilyContext(config, section_of(config, ConsistencyFamily()), ["g0", "g1"], Reduce.SUM)
    layout = family_stats_layout(ConsistencyFamily().statistics(ctx), 2)
    (monitor,) = ConsistencyFamily().monitors(ctx)
    return layout, monitor


def rank_buffers(layout: StatLayout, monitor: ConsistencyMonitor, losses: list[float],
                 grads: list[list[torch.Tensor]], step: int = 0) -> np.ndarray:
    """What each rank's buffer holds before the all-reduce: its loss, its local norms per group, its sketch, the
    extremes on detail steps (the family's producer, rank i on row i) and the monitor's own slots
    (``before_agreement``)."""
    rows = []
    for rank, (loss, rank_grads) in enumerate(zip(losses, grads, strict=True)):
        buffer = StatBuffer(layout, torch.device("cpu"))
        buffer.reset()
        buffer.put(names.LOSS, loss)
        buffer.put(names.LOSS_COUNT, 1.0)
        buffer.put(names.LOSS_RANKS, 1.0)
        buffer.view(names.GRAD_SQ_LOCAL).copy_(torch.stack([g.double().square().sum() for g in rank_grads]))
        if names.GRAD_SKETCH_LOCAL in layout:
            add_gradient_sketch(buffer.view(names.GRAD_SKETCH_LOCAL), rank_grads,
                                [BUCKET_SKETCH_INDEX + i for i in range(len(rank_grads))])
        if EXTREMES in layout:
            ExtremesProducer(1, monitor.config.detail_every, 0, rank).write(buffer, StepView(step))
        monitor.before_agreement(buffer)
        rows.append(buffer.values.numpy().copy())
    return np.stack(rows)


def test_the_monitor_gives_the_definitions_on_every_rank_buffer() -> None:
    """D_loss, D_grad and the ranges equal numpy's over the ranks' values, C_dir the exact mean pairwise cosine
    within the sketch's bound; a second step with the shift (the previous means) gives the same."""
    config = load_config(None, ["detectors.consistency.sketch_size=1024", "detectors.consistency.detail_every=1"])
    layout, monitor = family_layout(config)
    rng = torch.Generator().manual_seed(3)
    shared = [torch.randn(3000, generator=rng), torch.randn(1500, generator=rng)]
    for step in (1, 2):  # detail_every=1: every monitored step but the first
        grads = [[s + 0.8 * torch.randn(s.shape, generator=rng) for s in shared] for _ in range(4)]
        losses = [2.0 + 0.1 * float(torch.randn((), generator=rng)) for _ in range(4)]
        stats = AgreedStats.from_rows(layout, rank_buffers(layout, monitor, losses, grads, step))
        assert monitor.evaluate(step, stats) == []
        values = monitor.metrics()
        norms = np.array([math.sqrt(sum(float(g.double().square().sum()) for g in rank)) for rank in grads])
        assert values["loss_std"] == pytest.approx(np.std(losses), rel=1e-9)
        # the ranges come through rank keys: the extreme values rounded to float32
        assert values["loss_range"] == pytest.approx(max(losses) - min(losses), rel=1e-5)
        assert values["grad_norm_std"] == pytest.approx(np.std(norms), rel=1e-9)
        assert values["grad_norm_mean"] == pytest.approx(norms.mean(), rel=1e-12)
        assert values["grad_norm_range"] == pytest.approx(np.ptp(norms), rel=1e-5)
        farthest = max((abs(norms[r] - np.delete(norms, r).mean()) / np.delete(norms, r).mean(), r)
                       for r in (int(norms.argmax()), int(norms.argmin())))[1]
        assert values["farthest_rank"] == farthest
        per_rank = monitor.rank_metrics()  # the extreme ranks' values, for ranks.jsonl
        assert per_rank["grad_norm"] == {int(norms.argmin()): pytest.approx(norms.min(), rel=1e-6),
                                         int(norms.argmax()): pytest.approx(norms.max(), rel=1e-6)}
        assert set(per_rank["loss"]) == {int(np.argmin(losses)), int(np.argmax(losses))}
        exact = exact_direction_consistency(np.stack([torch.cat(rank).double().numpy() for rank in grads]))
        assert abs(values["direction"] - exact) <= DIRECTION_ERROR_BOUND
        monitor.commit(step, True)
    assert monitor.loss_shift == pytest.approx(np.mean(losses))


def test_a_lasting_jump_of_the_norm_spread_alarms_once_and_names_the_rank() -> None:
    """Rank 2's norm 4x its peers' from step 9: the alarm needs 3 consecutive steps past the limit (steps 9-11), comes
    once, and the steps past the limit stay out of the baseline; a single outlier step never alarms."""
    config = load_config(None, ["detectors.consistency.warmup_steps=5", "detectors.consistency.direction=false"])
    layout, monitor = family_layout(config)
    rng = torch.Generator().manual_seed(5)
    alarms = {}
    for step in range(16):
        scale = [1.0, 1.0, 4.0 if step >= 9 or step == 6 else 1.0, 1.0]  # step 6: a one-step outlier
        grads = [[s * (1.0 + 0.05 * float(torch.randn((), generator=rng))) * torch.ones(100)] for s in scale]
        stats = AgreedStats.from_rows(layout, rank_buffers(layout, monitor, [1.0, 1.1, 1.0, 0.9], grads, step))
        findings = monitor.evaluate(step, stats)
        if findings:
            alarms[step] = findings
        monitor.commit(step, True)
    assert list(alarms) == [11]
    (finding,) = alarms[11]
    assert finding.detector == "consistency" and finding.ranks == (2,)
    assert "rank 2 farthest" in finding.message and "for 3 steps" in finding.message
    assert monitor.alarms == 1 and len(monitor.cv_history) == 8  # steps 0-8 but the outlier at 6
    state = monitor.state_dict()
    other = ConsistencyMonitor(section_of(config, ConsistencyFamily()), 0)
    other.load_state_dict(state)
    assert list(other.cv_history) == list(monitor.cv_history) and other.alarms == 1 and other._runs == (7, 0)


def test_the_family_stays_off_under_model_parallelism_and_checks_its_schedule() -> None:
    config = load_config(None, [])
    family = ConsistencyFamily()
    plain = FamilyContext(config, section_of(config, ConsistencyFamily()), ["g"], Reduce.SUM)
    assert family.enabled(plain)
    sharded = FamilyContext(config, section_of(config, ConsistencyFamily()), ["g"], Reduce.SUM,
                            ModelParts(model_parallel_size=2))
    assert not family.enabled(sharded)  # shards the adapter cannot place (e.g. expert parallelism)
    placed = FamilyContext(config, section_of(config, ConsistencyFamily()), ["g"], Reduce.SUM,
                           ModelParts(model_parallel_size=4, shard_positions=2, shard_position=1))
    assert family.enabled(placed)  # tensor x pipeline positions: compared within each
    sizes = {d.name: d.size for d in family.statistics(placed)}
    assert sizes[DIRECTION_SUM] == 2 * (128 + 1) and sizes[GRAD_NORM_MOMENTS] == 8 and sizes[POSITION] == 1
    (monitor,) = family.monitors(placed)
    assert (monitor.positions, monitor.position, monitor.folded) == (2, 1, 128)
    assert family.sketch_due(plain, 20) and not family.sketch_due(plain, 21)
    odd = load_config(None, ["stats.interval=3"])  # every 10th monitored step: optimizer steps 0, 30, 60
    sparse = FamilyContext(odd, section_of(odd, ConsistencyFamily()), ["g"], Reduce.SUM)
    assert family.enabled(sparse) and [s for s in range(0, 61, 3) if family.sketch_due(sparse, s)] == [0, 30, 60]
    with_sdc = load_config(None, ["detectors.sdc.sketch_size=64"])
    decls = family.statistics(FamilyContext(with_sdc, section_of(with_sdc, ConsistencyFamily()), ["g"], Reduce.SUM))
    assert {d.name: d.size for d in decls}[names.GRAD_SKETCH_LOCAL] == 64  # the SDC sketch's size wins
    assert {d.name: d.size for d in decls}[DIRECTION_SUM] == 65
    assert {LOSS_MOMENTS, GRAD_NORM_MOMENTS} <= {d.name for d in decls}


# ------------------------------------------------------------------ 4 real ranks under DDP

#: Which data stream each rank trains on, per setting of the paper's S1 experiment (4 ranks): S1-1 every rank the
#: same; S1-2 rank 0 reseeded; S1-3 every rank its own.
STREAMS = {"S1-1": [0, 0, 0, 0], "S1-2": [7, 0, 0, 0], "S1-3": [0, 1, 2, 3]}


def _local_reference(model: torch.nn.Module, batch: tuple) -> tuple[float, torch.Tensor]:
    """This rank's loss and local gradient on ``batch``, computed on a plain copy of the model (no DDP)."""
    copy = deepcopy(model)
    loss = copy(*batch)
    loss.backward()
    return float(loss), torch.cat([p.grad.flatten() for p in copy.parameters()])


def _run(rank: int, world: int, run_dir: Path, setting: str, steps: int, scale_from: int = -1,
         scaled_rank: int = -1, reference: bool = False, exact: bool = False) -> dict[str, Any]:
    model, data = tiny_model_and_data(seed=1)
    optimizer = make_optimizer(model)
    ddp = DistributedDataParallel(model)
    config = make_config(run_dir, "detectors.consistency.direction_every=1", "detectors.consistency.detail_every=0",
                         "detectors.consistency.sketch_size=1024",
                         f"detectors.consistency.exact_max_params={10**6 if exact else 0}")
    arc = arc_engine.attach(ddp, optimizer, config)
    if rank == scaled_rank:  # "an NCCL bug": this rank's contribution to the reduction scaled by 5
        for param in model.parameters():
            param.register_hook(lambda grad: grad * 5.0 if arc.engine.progress.step >= scale_from else grad)
    monitor = next(m for m in arc.engine.gathering.assembly.monitors if m.name == "consistency")
    metrics, findings, exact = [], {}, []
    for step in range(steps):
        batch = data.batch(step, STREAMS[setting][rank], BATCH)
        if reference:
            loss_value, grad = _local_reference(model, batch)
            everyone = [torch.zeros_like(grad) for _ in range(world)]
            dist.all_gather(everyone, grad)
            losses = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(losses, torch.tensor([loss_value]))
            stacked = torch.stack(everyone).double().numpy()
            exact.append({"loss_std": float(np.std([float(x) for x in losses])),
                          "grad_norm_std": float(np.std(np.linalg.norm(stacked, axis=1))),
                          "direction": exact_direction_consistency(stacked)})
        loss = ddp(*batch)
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        metrics.append(dict(monitor.metrics()))
        decision = arc.engine.last_decision
        found = [f for f in decision.findings if f.detector == "consistency"] if decision.step == step else []
        if found:
            findings[step] = list(found[0].ranks)
    summary = arc.summary()
    arc.close()
    return {"metrics": metrics, "findings": findings, "exact": exact, "detections": summary["detections"]}


def test_s1_settings_give_rising_dispersion_and_falling_direction_consistency(tmp_path: Path) -> None:
    """The paper's S1 experiment in miniature: identical data on every rank, rank 0 on its own, every rank on its
    own. Loss and gradient-norm dispersion rise and C_dir falls, as the paper reports; none of the three is an
    alarm (each run's own level is its baseline)."""
    means = {}
    for setting in STREAMS:
        results = run_ranks(_run, 4, tmp_path / setting, setting, 30)
        assert all(r["metrics"] == results[0]["metrics"] for r in results)  # every rank agrees on every value
        assert all(r["detections"] == {} for r in results)
        rows = results[0]["metrics"]
        means[setting] = {key: float(np.mean([row[key] for row in rows]))
                          for key in ("loss_std", "grad_norm_std", "direction")}
    assert means["S1-1"]["loss_std"] < 1e-6 and means["S1-1"]["grad_norm_std"] < 1e-6
    assert means["S1-1"]["direction"] == pytest.approx(1.0, abs=1e-9)  # identical sketches
    for key in ("loss_std", "grad_norm_std"):
        assert means["S1-1"][key] < means["S1-2"][key] < means["S1-3"][key], (key, means)
    assert means["S1-1"]["direction"] > means["S1-2"]["direction"] > means["S1-3"]["direction"], means


def test_dispersion_and_direction_equal_a_single_process_computation(tmp_path: Path) -> None:
    """Every rank's loss and local gradient recomputed on a plain copy of the model and gathered: D_loss and D_grad
    equal numpy's to float32 precision, the sketch's C_dir is within its documented bound of the exact value."""
    results = run_ranks(_run, 4, tmp_path, "S1-3", 12, -1, -1, True)
    rows, exact = results[0]["metrics"], results[0]["exact"]
    errors = []
    for row, truth in zip(rows, exact, strict=True):
        assert row["loss_std"] == pytest.approx(truth["loss_std"], rel=1e-5, abs=1e-7)
        assert row["grad_norm_std"] == pytest.approx(truth["grad_norm_std"], rel=1e-3, abs=1e-6)
        errors.append(abs(row["direction"] - truth["direction"]))
    assert max(errors) <= DIRECTION_ERROR_BOUND, errors
    assert 0.0 < np.mean([t["direction"] for t in exact]) < 0.95  # ranks on their own data: not aligned


def test_exact_mode_gives_the_mean_pairwise_cosine_itself(tmp_path: Path) -> None:
    """With ``exact_max_params`` above the model's size, the DDP hook writes each rank's whole local gradient (every
    element at its parameter's offset) in place of the sketch: C_dir equals the single-process definition to
    rounding, not within the sketch's bound."""
    results = run_ranks(_run, 4, tmp_path, "S1-3", 6, -1, -1, True, True)
    rows, exact = results[0]["metrics"], results[0]["exact"]
    for row, truth in zip(rows, exact, strict=True):
        assert row["direction"] == pytest.approx(truth["direction"], abs=1e-6)
        assert row["grad_norm_std"] == pytest.approx(truth["grad_norm_std"], rel=1e-3, abs=1e-6)
    assert len({round(r["direction"], 4) for r in rows}) > 1  # measured every step, not a constant


def test_one_ranks_scaled_contribution_is_flagged_and_the_rank_named(tmp_path: Path) -> None:
    """From step 30 rank 2's gradient enters the reduction 5x too large. The norm spread jumps and stays; every rank
    raises the same single finding at step 32 (3 consecutive steps) naming rank 2; the 30 steps before it (past the
    20-step warm-up) raised nothing."""
    results = run_ranks(_run, 4, tmp_path, "S1-3", 36, 30, 2)
    for result in results:
        assert result["findings"] == {32: [2]}
    assert all(r["findings"] == results[0]["findings"] for r in results)


# ------------------------------------------------------------------ FSDP2: C_dir from the unsharded local gradients

def _run_fsdp(rank: int, world: int, run_dir: Path, exact: bool) -> dict[str, Any]:
    """The tiny GPT under FSDP2 on S1-3 streams; each step, every rank's local gradient recomputed on a plain copy
    holding the full weights (gathered for the test) and gathered, for the exact C_dir."""
    from torch.distributed.fsdp import fully_shard

    from arc_engine.integrations.pytorch.fsdp import attach_fsdp

    model, data = tiny_model_and_data(seed=1)
    plain = deepcopy(model)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = make_optimizer(model)
    config = make_config(run_dir, "detectors.consistency.direction_every=1", "detectors.consistency.detail_every=0",
                         "detectors.consistency.sketch_size=1024",
                         f"detectors.consistency.exact_max_params={10**6 if exact else 0}")
    arc = attach_fsdp(model, optimizer, config)
    monitor = next(m for m in arc.engine.gathering.assembly.monitors if m.name == "consistency")
    directions, truth = [], []
    for step in range(6):
        batch = data.batch(step, STREAMS["S1-3"][rank], BATCH)
        plain.load_state_dict({name: p.full_tensor() for name, p in model.state_dict().items()})
        _, grad = _local_reference(plain, batch)
        everyone = [torch.zeros_like(grad) for _ in range(world)]
        dist.all_gather(everyone, grad)
        truth.append(exact_direction_consistency(torch.stack(everyone).double().numpy()))
        loss = model(*batch)
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        directions.append(monitor.metrics()["direction"])
    arc.close()
    return {"directions": directions, "truth": truth}


@pytest.mark.parametrize("exact", [False, True], ids=["sketch", "exact"])
def test_fsdp2_direction_consistency_from_the_unsharded_local_gradients(tmp_path: Path, exact: bool) -> None:
    """Under FSDP2 each rank sketches its unsharded gradient before the reduce-scatter: C_dir is within the sketch's
    bound of the single-process value, and with ``exact_max_params`` above the model's size equal to it."""
    results = run_ranks(_run_fsdp, 4, tmp_path, exact)
    directions, truth = results[0]["directions"], results[0]["truth"]
    assert all(r["directions"] == directions for r in results)
    assert 0.0 < np.mean(truth) < 0.95  # ranks on their own data
    for got, want in zip(directions, truth, strict=True):
        assert got == pytest.approx(want, abs=1e-6 if exact else DIRECTION_ERROR_BOUND)


def test_the_extremes_name_the_rank_farthest_from_the_others_mean_per_position() -> None:
    """Two positions of three replicas each (global ranks 0-2 and 3-5); position 1's rank 4 holds 3x its peers'
    norm; the loss extremes are over the ranks that recorded one (rank 5 did not). Pure: keys as the MAX reduction
    leaves them."""
    from arc_engine.stats.rank_keys import rank_key

    norms = {0: 1.0, 1: 1.1, 2: 0.9, 3: 2.0, 4: 6.0, 5: 2.1}
    losses = {0: 1.5, 1: 1.4, 2: 1.6, 3: 1.5, 4: 1.45}
    keys = np.full(6, -math.inf)
    keys[0], keys[1] = max(rank_key(v, r) for r, v in losses.items()), max(rank_key(-v, r) for r, v in losses.items())
    moments = np.zeros((2, 4))
    for position, members in enumerate(((0, 1, 2), (3, 4, 5))):
        keys[2 + 2 * position] = max(rank_key(norms[r], r) for r in members)
        keys[3 + 2 * position] = max(rank_key(-norms[r], r) for r in members)
        moments[position] = [sum(norms[r] for r in members), 0.0, len(members), 0.0]  # shift 0
    values, per_rank = extremes_detail(keys, moments)
    assert values["farthest_rank"] == 4.0 and values["farthest_distance"] == pytest.approx(6.0 / 2.05 - 1, rel=1e-6)
    assert values["loss_range"] == pytest.approx(0.2, rel=1e-5)
    assert values["grad_norm_range"] == pytest.approx(6.0 - 0.9, rel=1e-6)
    assert set(per_rank["loss"]) == {1, 2} and set(per_rank["grad_norm"]) == {1, 2, 3, 4}
    empty, nobody = extremes_detail(np.full(6, -math.inf), np.zeros((2, 4)))
    assert empty["farthest_rank"] == -1.0 and math.isnan(empty["loss_range"]) and nobody == {"loss": {},
                                                                                             "grad_norm": {}}

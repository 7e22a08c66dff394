"""Weight health (ARC paper §3.2.3, §3.2.1): the math against numpy and hand values, the monitor on simulated ranks'
buffers, and real gloo ranks -- DDP with one weight matrix zeroed and another scaled by 1e3 (the findings) after a
clean stretch (none), the agreed sums equal to each rank's full tensors; FSDP2, whose agreed sums over the shards
equal the full model's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine.config import ConfigError, load_config
from arc_engine.events import Action
from arc_engine.integrations.pytorch.fsdp import attach_fsdp
from arc_engine.monitors.family import FamilyContext, ModelParts, section_of
from arc_engine.monitors.weight_health import GRAD, GRAD_HIST, RANK, WEIGHT, WeightHealthFamily, WeightHealthMonitor
from arc_engine.monitors.weight_stats import (
    effective_rank,
    effective_rank_reference,
    gradient_cv,
    health_score,
    log_magnitude_histogram,
    normalized_entropy,
    rank_sample,
    tracked_indices,
)
from arc_engine.stats import AgreedStats, Reduce, StatLayout
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config, make_optimizer, mean_rank_gradients, tiny_model_and_data

pytestmark = pytest.mark.timeout(300)

ON = ("detectors.weight_health.enabled=true",)


# ------------------------------------------------------------------ the math

def test_effective_rank_is_the_exponential_of_the_singular_value_entropy() -> None:
    rng = np.random.default_rng(0)
    matrix = rng.normal(size=(12, 7))
    assert float(effective_rank(torch.from_numpy(matrix))) == pytest.approx(effective_rank_reference(matrix), rel=1e-5)
    assert float(effective_rank(torch.eye(6))) == pytest.approx(6.0, rel=1e-6)  # equal σ: the full rank
    outer = torch.outer(torch.arange(1.0, 5.0), torch.arange(1.0, 4.0))
    assert float(effective_rank(outer)) == pytest.approx(1.0, abs=1e-5)  # rank one
    assert float(effective_rank(torch.zeros(4, 3))) == 0.0
    spread = torch.diag(torch.tensor([3.0, 1.0]))  # p = (3/4, 1/4): exp(-(3/4 log 3/4 + 1/4 log 1/4))
    assert float(effective_rank(spread)) == pytest.approx(math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))))
    conv = torch.from_numpy(rng.normal(size=(4, 2, 3, 3)))  # more than 2 dimensions: [rows, -1]
    assert float(effective_rank(conv)) == pytest.approx(effective_rank_reference(conv.numpy()), rel=1e-5)
    poisoned = torch.eye(3)
    poisoned[0, 1] = float("nan")  # read as 0
    assert float(effective_rank(poisoned)) == pytest.approx(3.0, rel=1e-6)


def test_the_log_magnitude_histogram_has_fixed_edges_so_shards_add_up() -> None:
    values = torch.tensor([0.0, 2.0**-50, 2.0**-40, 2.0**-38.5, -1.0, 2.0**7.9, 2.0**8, float("inf"), float("nan")])
    counts = log_magnitude_histogram(values, 48, -40, 8)  # one-octave bins over [2^-40, 2^8)
    expected = np.zeros(48, dtype=np.int64)
    for bin_index in (0, 0, 0, 1, 40, 47, 47, 47, 0):
        expected[bin_index] += 1
    assert counts.dtype == torch.long and counts.tolist() == expected.tolist()
    grad = torch.randn(300, 17, generator=torch.Generator().manual_seed(1)) * 10.0 ** torch.linspace(-9, 2, 17)
    whole = log_magnitude_histogram(grad, 24, -36, 12)
    shards = sum(log_magnitude_histogram(shard, 24, -36, 12) for shard in grad.split([101, 0, 199]))
    assert torch.equal(whole, shards) and int(whole.sum()) == grad.numel()


def test_normalized_entropy_and_gradient_cv_by_hand_and_by_numpy() -> None:
    assert normalized_entropy([5, 5, 5, 5]) == pytest.approx(1.0)
    assert normalized_entropy([0, 9, 0, 0]) == 0.0
    assert normalized_entropy([1, 1, 0, 0]) == pytest.approx(math.log(2) / math.log(4))
    assert math.isnan(normalized_entropy([0, 0, 0]))
    rng = np.random.default_rng(2)
    layers = [rng.normal(0.3, 2.0, size=500), rng.normal(-1e-3, 1.0, size=80), np.full(10, 2.5)]
    cv = gradient_cv([x.sum() for x in layers], [(x * x).sum() for x in layers], [x.size for x in layers])
    assert cv[0] == pytest.approx(layers[0].std() / abs(layers[0].mean()), rel=1e-9)
    assert cv[1] == pytest.approx(layers[1].std() / abs(layers[1].mean()), rel=1e-6)
    assert cv[2] == 0.0  # constant: σ = 0
    empty, centred = gradient_cv([0.0, 0.0], [1.0, 4.0], [0, 4])
    assert math.isnan(empty) and centred == math.inf


def test_the_tracked_set_the_rank_rotation_and_the_score() -> None:
    assert tracked_indices(5, 8) == [0, 1, 2, 3, 4]
    assert tracked_indices(10, 4) == [0, 3, 6, 9] and tracked_indices(10, 1) == [0]
    assert [rank_sample(5, m, 2) for m in range(3)] == [[0, 1], [2, 3], [0, 4]]
    assert sorted({s for m in range(5) for s in rank_sample(5, m, 2)}) == [0, 1, 2, 3, 4]
    assert rank_sample(0, 3, 2) == [] and rank_sample(3, 1, 5) == [0, 1, 2]
    weights = {"a": 0.4, "b": 0.3, "c": 0.3}
    assert health_score({"a": 1.0, "b": 0.5, "c": 0.0}, weights) == pytest.approx(0.55)
    assert health_score({"a": 1.0, "b": math.nan, "c": 0.0}, weights) == pytest.approx(0.4 / 0.7)  # renormalized
    assert math.isnan(health_score({"a": math.nan}, weights))


# ------------------------------------------------------------------ the monitor on simulated ranks

def _setup(*overrides: str) -> tuple[StatLayout, WeightHealthMonitor, Any]:
    config = load_config(None, [*ON, "detectors.weight_health.max_tensors=4", "detectors.weight_health.every=1",
                                *overrides])
    ctx = FamilyContext(config, section_of(config, WeightHealthFamily()), ["g0"], Reduce.SUM)
    family = WeightHealthFamily()
    layout = StatLayout()
    for decl in family.statistics(ctx):
        layout.add(decl.name, decl.size, decl.reduce)
    layout.freeze()
    (monitor,) = family.monitors(ctx)
    return layout, monitor, config


def _rows(layout: StatLayout, per_rank: list[dict[str, dict[int, list[float]]]]) -> AgreedStats:
    """Each rank's buffer: ``{slot name: {matrix slot: its numbers}}`` (what its producer wrote)."""
    matrix = np.zeros((len(per_rank), layout.size))
    for row, written in enumerate(per_rank):
        for name, entries in written.items():
            span = layout[name].span
            width = {WEIGHT: 3, RANK: 2, GRAD: 3}.get(name, layout[name].size)
            for slot, numbers in entries.items():
                matrix[row, span.start + slot * width: span.start + slot * width + len(numbers)] = numbers
    return AgreedStats.from_rows(layout, matrix)


def test_the_monitor_reads_norms_sparsity_and_ranks_and_alarms_on_each_condition() -> None:
    """Rank 0 owns matrices 0 and 1, rank 1 matrix 2 (slot 3 is unused). Step 0 sets the baselines; at step 1
    matrix 1 is zeroed (collapse, sparsity), matrix 2 explodes, matrix 0's effective rank falls by 3/4, and the
    score falls below 0.5."""
    layout, monitor, _ = _setup()
    hist = {0: [3, 5, 0, 2]}
    step0 = _rows(layout, [{WEIGHT: {0: [4.0, 100, 0], 1: [9.0, 50, 1]}, RANK: {0: [4.0, 1]}, GRAD_HIST: hist},
                           {WEIGHT: {2: [16.0, 20, 0]}, GRAD: {2: [0.5, 2.0, 20]}}])
    assert monitor.evaluate(0, step0) == []
    values = monitor.metrics()
    assert values["weight_norm_max"] == 4.0 and values["tensors"] == 3.0 and values["score"] == 1.0
    counts = np.zeros(layout[GRAD_HIST].size)
    counts[:4] = [3, 5, 0, 2]
    assert values["grad_entropy"] == pytest.approx(normalized_entropy(counts))
    monitor.commit(0, True)
    assert monitor.norm0 == {0: 2.0, 1: 3.0, 2: 4.0} and monitor.sparsity0[1] == pytest.approx(0.02)
    step1 = _rows(layout, [{WEIGHT: {0: [4.0, 100, 0], 1: [0.0, 50, 50]}, RANK: {0: [1.0, 1]}},
                           {WEIGHT: {2: [1e10, 20, 0]}}])
    findings = monitor.evaluate(1, step1)
    kinds = {f.values["kind"] for f in findings if "kind" in f.values}
    assert kinds == {"explosion", "collapse", "sparsity", "rank_drop"}
    by_kind = {f.values["kind"]: f for f in findings if "kind" in f.values}
    assert [m["slot"] for m in by_kind["explosion"].values["matrices"]] == [2]
    assert [m["slot"] for m in by_kind["collapse"].values["matrices"]] == [1]
    assert [m["slot"] for m in by_kind["rank_drop"].values["matrices"]] == [0]
    scores = monitor.metrics()
    # NormScore 1/3 (only matrix 0 healthy), SparsityScore (1 + 0 + 1)/3, RankScore 1/4
    assert scores["score"] == pytest.approx((0.4 / 3 + 0.3 * 0.25 + 0.3 * 2 / 3) / 1.0)
    assert any("score" in f.message for f in findings) and all(f.action == Action.WARN for f in findings)
    state = monitor.state_dict()
    monitor.commit(1, True)
    assert monitor.alarms == 1 and monitor.rank_latest[0] == 1.0 and monitor.rank0[0] == 4.0
    assert monitor.evaluate(2, _rows(layout, [{}, {}])) == []  # off the schedule: nothing measured
    restored = _setup()[1]
    restored.load_state_dict(state)
    assert {f.message for f in restored.evaluate(1, step1)} == {f.message for f in findings}


def _rank_drops(monitor: WeightHealthMonitor, layout: StatLayout, ranks: list[float]) -> list[int]:
    """Feed matrix 0's effective rank through ``ranks`` (one measurement each); the steps with a rank_drop."""
    drops = []
    for step, value in enumerate(ranks):
        findings = monitor.evaluate(step, _rows(layout, [{WEIGHT: {0: [4.0, 100, 0]}, RANK: {0: [value, 1]}}]))
        if any(f.values.get("kind") == "rank_drop" for f in findings):
            drops.append(step)
        monitor.commit(step, True)
    return drops


def test_the_rank_drop_follows_a_moving_reference_so_slow_compression_is_not_a_collapse() -> None:
    """Learning compresses a matrix slowly (here 40 -> 16 over 30 measurements, 3% each: what the campaign's
    position embedding does over 2,000 clean steps); a collapse halves it between two measurements. The default
    reference (the largest of the last 5) flags only the collapse, for as long as it is within the window; the
    paper's first-value reference (``rank_window=0``) flags the slow compression too, from where it passes half."""
    slow = [40.0 * 0.97 ** k for k in range(30)]
    collapse = [*slow[:10], slow[9] * 0.4, slow[9] * 0.4, *[slow[9] * 0.4] * 6]
    layout, monitor, _ = _setup()
    assert _rank_drops(monitor, layout, slow) == []
    layout, monitor, _ = _setup()
    assert _rank_drops(monitor, layout, collapse) == [10, 11, 12, 13, 14]  # then the collapsed rank is the reference
    assert monitor.metrics()["rank_ratio_min"] == pytest.approx(slow[9] * 0.4 / 40.0)  # the score still sees it
    state = monitor.state_dict()
    restored = _setup()[1]
    restored.load_state_dict(state)
    assert restored.rank_recent == monitor.rank_recent and restored.rank_recent[0].maxlen == 5
    layout, paper, _ = _setup("detectors.weight_health.rank_window=0")
    first_below_half = next(k for k, value in enumerate(slow) if value < 20.0)
    assert _rank_drops(paper, layout, slow) == list(range(first_below_half, len(slow)))


def test_the_gradient_cv_alarm_is_off_by_default_and_fires_above_cv_max() -> None:
    noisy = {WEIGHT: {0: [1.0, 100, 0]}, GRAD: {0: [0.1, 100.0, 100]}}  # μ = 1e-3, σ ≈ 1: CV ≈ 1000
    layout, monitor, _ = _setup()
    assert monitor.evaluate(0, _rows(layout, [noisy])) == []
    assert monitor.metrics()["grad_cv_max"] == pytest.approx(1000.0, rel=1e-3)
    layout, monitor, _ = _setup("detectors.weight_health.cv_max=10", "detectors.weight_health.grad_action=skip")
    (finding,) = monitor.evaluate(0, _rows(layout, [noisy]))
    assert finding.values["kind"] == "grad_cv" and finding.action == Action.SKIP


def test_the_family_is_off_by_default_off_without_the_adapters_matrix_list_and_validates_its_section() -> None:
    family = WeightHealthFamily()
    default = load_config(None, [])
    assert not family.enabled(FamilyContext(default, section_of(default, WeightHealthFamily()), ["g"], Reduce.SUM))
    on = load_config(None, list(ON))
    assert family.enabled(FamilyContext(on, section_of(on, WeightHealthFamily()), ["g"], Reduce.SUM))
    # an adapter that describes the model (Megatron) must list its matrices, or the family stays off
    assert not family.enabled(FamilyContext(on, section_of(on, WeightHealthFamily()), ["g"], Reduce.SUM, ModelParts()))
    listed = ModelParts(matrices=[("layers.0.w", torch.zeros(2, 2), True)])
    assert family.enabled(FamilyContext(on, section_of(on, WeightHealthFamily()), ["g"], Reduce.SUM, listed))
    sizes = {d.name: d.size for d in family.statistics(FamilyContext(on, section_of(on, WeightHealthFamily()), ["g"],
                                                                     Reduce.SUM))}
    assert sizes == {WEIGHT: 3 * 64, RANK: 2 * 64, GRAD: 3 * 64, GRAD_HIST: 48}  # independent of the ranks
    odd = load_config(None, [*ON, "stats.interval=3", "detectors.weight_health.every=10"])
    with pytest.raises(ValueError, match=r"multiple of stats\.interval"):
        family.enabled(FamilyContext(odd, section_of(odd, WeightHealthFamily()), ["g"], Reduce.SUM))
    for bad in ("rank_samples=65", "collapse_ratio=1.0", "hist_max_log2=-50", "score_min=2", "rank_window=-1"):
        with pytest.raises(ConfigError):
            load_config(None, [*ON, f"detectors.weight_health.{bad}"])


# ------------------------------------------------------------------ real ranks

EVERY = 2
ZERO_AT, SCALE_AT, STEPS = 10, 14, 15


def _relative(agreed: float, expected: float, scale: float) -> float:
    """|agreed − expected| / scale (the absolute difference where the scale is 0: a zeroed matrix has no
    gradient flowing into the layer before it); NaN raises."""
    error = abs(float(agreed) - expected) / scale if scale > 0 else abs(float(agreed) - expected)
    assert math.isfinite(error), (agreed, expected)
    return error


def _matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]


def _ddp(rank: int, world: int, run_dir: Path) -> dict[str, Any]:
    """The tiny GPT under DDP, weight health every 2 steps: clean until step 10, where every rank zeroes the
    attention projection; at step 14 the first MLP matrix is scaled by 1e3. Returns the findings per step and the
    largest relative error of the agreed sums against this rank's own full tensors."""
    model, data = tiny_model_and_data(seed=1)
    optimizer = make_optimizer(model)
    ddp = DistributedDataParallel(model)
    config = make_config(run_dir, *ON, f"detectors.weight_health.every={EVERY}",
                         "detectors.weight_health.max_norm=1000", "detectors.weight_health.rank_samples=3")
    arc = arc_engine.attach(ddp, optimizer, config)
    matrices = _matrices(model)
    findings: dict[int, list[str]] = {}
    errors: list[float] = []
    for step in range(STEPS):
        with torch.no_grad():
            if step == ZERO_AT:
                model.blocks[0].attn.proj.weight.zero_()
            if step == SCALE_AT:
                model.blocks[0].mlp[0].weight.mul_(1e3)
        loss = ddp(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        loss.backward()
        expected = [(float(w.square().sum()), float(g.sum()), float(g.abs().sum()), float(g.square().sum()),
                     effective_rank_reference(w.numpy()))
                    for w, g in ((p.detach().double(), p.grad.double()) for p in matrices)]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        decision = arc.engine.last_decision
        found = [f.values.get("kind", "score") for f in decision.findings if f.detector == "weight_health"]
        if found:
            findings[step] = found
        if step % EVERY == 0:
            stats = arc.engine.last_stats
            weight = stats.total(WEIGHT).reshape(-1, 3)
            grad = stats.total(GRAD).reshape(-1, 3)
            rank_slots = stats.total(RANK).reshape(-1, 2)
            for slot, (sq, grad_sum, grad_abs, grad_sq, erank) in enumerate(expected):
                errors += [_relative(weight[slot, 0], sq, sq), _relative(grad[slot, 1], grad_sq, grad_sq),
                           _relative(grad[slot, 0], grad_sum, grad_abs)]
                assert weight[slot, 1] == matrices[slot].numel() and grad[slot, 2] == matrices[slot].numel()
                if rank_slots[slot, 1]:
                    assert rank_slots[slot, 1] == 1.0  # one owner wrote it
                    errors.append(_relative(rank_slots[slot, 0], erank, erank))
            assert stats.total(GRAD_HIST).sum() == sum(p.numel() for p in matrices)
        else:
            assert not arc.engine.last_stats.total(WEIGHT).any()  # off the schedule: zero
    arc.close()
    return {"findings": findings, "max_error": max(errors)}


def test_ddp_zeroed_and_scaled_matrices_are_found_after_a_clean_stretch(tmp_path: Path) -> None:
    results = run_ranks(_ddp, 2, tmp_path)
    assert results[0]["findings"] == results[1]["findings"]  # every rank, the same verdicts
    findings = results[0]["findings"]
    assert not [s for s in findings if s < ZERO_AT], findings  # the clean stretch raises nothing
    assert {"collapse", "sparsity"} <= set(findings[ZERO_AT])
    assert "explosion" in findings[SCALE_AT]
    assert max(r["max_error"] for r in results) < 1e-6  # each element once: the owners' sums are the full ones


def _fsdp(rank: int, world: int, run_dir: Path) -> dict[str, Any]:
    """The tiny GPT sharded by FSDP2 (vocab 29: uneven shards); per measured step the agreed Σw², Σg, Σg² and the
    gradient histogram against the full tensors (gathered for the test)."""
    model, data = tiny_model_and_data()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = make_optimizer(model)
    config = make_config(run_dir, *ON, "detectors.weight_health.every=2")
    arc = attach_fsdp(model, optimizer, config)
    matrices = _matrices(model)
    errors, histograms_equal, ranked = [], [], 0.0
    for step in range(5):
        loss = model(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        loss.backward()
        full = [(p.full_tensor().double(), p.grad.full_tensor().double()) for p in matrices]
        optimizer.step()
        optimizer.zero_grad()
        if step % 2:
            continue
        stats = arc.engine.last_stats
        weight, grad = stats.total(WEIGHT).reshape(-1, 3), stats.total(GRAD).reshape(-1, 3)
        for slot, (w, g) in enumerate(full):
            errors += [_relative(weight[slot, 0], float(w.square().sum()), float(w.square().sum())),
                       _relative(grad[slot, 1], float(g.square().sum()), float(g.square().sum())),
                       _relative(grad[slot, 0], float(g.sum()), float(g.abs().sum()))]
            assert weight[slot, 1] == w.numel() and grad[slot, 2] == g.numel()
        expected = sum(log_magnitude_histogram(g, 48, -40, 8) for _, g in full)
        histograms_equal.append(bool(np.array_equal(stats.total(GRAD_HIST), expected.double().numpy())))
        ranked += float(stats.total(RANK).sum())
    arc.close()
    return {"max_error": max(errors), "histograms_equal": histograms_equal, "ranked": ranked}


def test_fsdp2_agreed_sums_over_shards_equal_the_full_model(tmp_path: Path) -> None:
    results = run_ranks(_fsdp, 2, tmp_path)
    for result in results:
        assert result["max_error"] < 1e-9
        assert result["histograms_equal"] == [True, True, True]  # fixed edges: the shards' counts add up exactly
        assert result["ranked"] == 0.0  # sharded matrices are not rank-measured


# ------------------------------------------------------------------ DeepSpeed ZeRO-1/2/3: partitioned parameters

DS_CLIP = 0.05  # clipping active on every step: the gradient measured is the one DeepSpeed applies


def _deepspeed(rank: int, world: int, stage: int, run_dir: Path) -> list[list[float]]:
    """The tiny GPT under DeepSpeed ZeRO-``stage`` on 2 ranks, weight health every step; per step the agreed sums
    (every rank's parts of every tracked matrix, from the optimizer's partitions) and the rank measurements."""
    from arc_engine.integrations.deepspeed import attach_deepspeed
    from tests.test_deepspeed_dist import ds_engine

    engine, data = ds_engine(rank, world, stage, clip=DS_CLIP)
    arc = attach_deepspeed(engine, make_config(run_dir, *ON, "detectors.weight_health.every=1"))
    rows = []
    for step in range(3):
        inputs, targets = data.batch(step, rank, BATCH)
        loss = engine(inputs, targets)
        arc.record_loss(loss)
        engine.backward(loss)
        engine.step()
        stats = arc.engine.last_stats
        rows.append([*stats.total(WEIGHT), *stats.total(GRAD), *stats.total(GRAD_HIST), *stats.total(RANK)])
    arc.close()
    return rows


def _reference(world: int, steps: int) -> list[dict[str, np.ndarray]]:
    """One process, full tensors: per step, per matrix, the weights before the update and the gradient DeepSpeed
    applies (the ranks' mean, clipped to DS_CLIP)."""
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    matrices = _matrices(model)
    out = []
    for step in range(steps):
        mean_rank_gradients(model, data, step, world)
        weights = [p.detach().double().clone() for p in matrices]
        torch.nn.utils.clip_grad_norm_(model.parameters(), DS_CLIP)
        applied = [p.grad.double().clone() for p in matrices]
        out.append({"weight": np.array([[float(w.square().sum()), w.numel()] for w in weights]),
                    "grad": np.array([[float(g.sum()), float(g.square().sum()), g.numel()] for g in applied]),
                    "grad_abs": np.array([float(g.abs().sum()) for g in applied]),
                    "hist": sum(log_magnitude_histogram(g, 48, -40, 8) for g in applied).double().numpy()})
        optimizer.step()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_agreed_sums_over_partitions_equal_the_full_model(tmp_path: Path, stage: int) -> None:
    """Under ZeRO-1/2 the module holds whole weights but the gradient lives in the ranks' partitions; under ZeRO-3
    both do. The agreed Σw², element counts, Σg and Σg² of every matrix equal the full model's (applied, clipped
    gradient), the gradient histogram counts every element once, every rank agrees, and ZeRO-1/2 measure effective
    ranks from their whole module weights."""
    pytest.importorskip("deepspeed")
    results = run_ranks(_deepspeed, 2, stage, tmp_path)
    assert results[0] == results[1]  # one agreed value on every rank
    expected = _reference(2, 3)
    matrices = len(expected[0]["weight"])
    for step, (row, want) in enumerate(zip(results[0], expected, strict=True)):
        row = np.asarray(row)
        weight = row[:64 * 3].reshape(64, 3)[:matrices]
        grad = row[64 * 3:64 * 6].reshape(64, 3)[:matrices]
        hist, ranked = row[64 * 6:64 * 6 + 48], row[64 * 6 + 48:].reshape(64, 2)
        np.testing.assert_allclose(weight[:, 0], want["weight"][:, 0], rtol=1e-5, err_msg=f"step {step}")
        np.testing.assert_array_equal(weight[:, 1], want["weight"][:, 1])  # every element once
        np.testing.assert_allclose(grad[:, 1], want["grad"][:, 1], rtol=1e-4, err_msg=f"step {step}")
        # Σg is a small difference of large sums (float32 gradients reduced in another order): against Σ|g|
        assert (np.abs(grad[:, 0] - want["grad"][:, 0]) <= 1e-5 * want["grad_abs"]).all(), step
        np.testing.assert_array_equal(grad[:, 2], want["grad"][:, 2])
        assert hist.sum() == want["hist"].sum()  # every gradient element once
        assert np.abs(hist - want["hist"]).sum() <= 1e-3 * hist.sum()  # a bin edge may split float rounding
        # ZeRO-1/2: rank_samples matrices measured by their owners from the whole module weights; ZeRO-3 holds
        # no whole matrix
        assert ranked[:, 1].sum() == (0 if stage == 3 else 2), step

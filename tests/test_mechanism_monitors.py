"""The mechanism monitors' decisions on synthetic agreed statistics (no model, no processes): the robust trend,
the QK-spectra alarm (a CUSUM of the layers' drops below their own trajectories, naming layer / head / TP
rank), the attention-logit growth alarm per head, and the router alarms (entropy, similarity, dead expert)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arc_engine.events import Action
from arc_engine.monitors.family import ModelParts
from arc_engine.monitors.qk_spectra import (
    HEAD_ENTROPY,
    LAYER_FIELDS,
    LAYER_SUMS,
    LOGIT_BOUND,
    MAX_LOGIT,
    MEASURED,
    QKLogitMonitor,
    QKSpectraConfig,
    QKSpectraMonitor,
)
from arc_engine.monitors.router import (
    pack_router_partials,
    per_token_entropy,
    router_partials_size,
    topk_routing_map,
)
from arc_engine.monitors.router_health import RANK_ENTROPY, ROUTER_SUMS, RouterConfig, RouterMonitor
from arc_engine.monitors.trajectory import robust_trend
from arc_engine.stats import AgreedStats, Reduce, StatLayout
from arc_engine.stats.rank_keys import rank_key

LAYERS, HEADS = 2, 4


def test_robust_trend_follows_a_drift_and_ignores_one_outlier() -> None:
    steps = np.arange(10, dtype=np.float64)
    series = np.stack([2.0 - 0.1 * steps, np.full(10, 1.0)], axis=1)  # a healthy decline, a flat series
    series[4, 0] = 9.0  # one wild measurement
    prediction, spread = robust_trend(series)
    assert np.allclose(prediction, [1.0, 1.0])  # the next point on the line, not the median of the past
    assert np.allclose(spread, [0.0, 0.0])
    with_nan = series.copy()
    with_nan[2:5, 1] = np.nan  # a series not measured every time
    assert robust_trend(with_nan)[0][1] == 1.0


def _qk_stats(entropy_lh: np.ndarray) -> AgreedStats:
    layout = StatLayout()
    layout.add(HEAD_ENTROPY, LAYERS * HEADS, Reduce.SUM)
    layout.add(LAYER_SUMS, LAYERS * len(LAYER_FIELDS), Reduce.SUM)
    layout.add(MEASURED, LAYERS, Reduce.SUM)
    row = np.concatenate([entropy_lh.reshape(-1), np.ones(LAYERS * len(LAYER_FIELDS)), np.full(LAYERS, HEADS)])
    return AgreedStats.from_rows(layout, row[None, :])


def _qk_monitor(**overrides: object) -> QKSpectraMonitor:
    config = QKSpectraConfig(**{"warmup_measurements": 5, **overrides})
    return QKSpectraMonitor(config, ModelParts(num_layers=LAYERS, num_heads=HEADS), heads_per_tp_rank=2)


def _healthy(step: int, rng: np.random.Generator) -> np.ndarray:
    """Drifting down by 0.1 a measurement until step 10, then by 0.005, with 2 % noise per head."""
    level = 2.0 - 0.1 * min(step, 10) - 0.005 * max(step - 10, 0)
    return level * (1 + 0.02 * rng.standard_normal((LAYERS, HEADS)))


def _feed(monitor: QKSpectraMonitor, step: int, entropy: np.ndarray) -> list:
    findings = monitor.evaluate(step, _qk_stats(entropy))
    monitor.commit(step, True)
    return findings


def test_qk_monitor_follows_a_drifting_healthy_run_and_alarms_on_a_sustained_drop() -> None:
    rng = np.random.default_rng(0)
    monitor = _qk_monitor()
    for step in range(40):  # a healthy decline: never an alarm
        assert _feed(monitor, step, _healthy(step, rng)) == []
    assert monitor.cusum == 0.0 and len(monitor.history) == 16
    # every head 25 % below its trend, head 3 of layer 1 (TP rank 1) most: 0.20, 0.40, then 0.60 > 0.5
    for step in (40, 41):
        dropped = _healthy(step, rng) * 0.75
        dropped[1, 3] *= 0.5
        assert _feed(monitor, step, dropped) == []
        assert len(monitor.history) == 16 and monitor.history[-1][1, 3] > 1.5 * dropped[1, 3]  # kept out
    assert 0.3 < monitor.cusum < 0.5
    dropped = _healthy(42, rng) * 0.75
    dropped[1, 3] *= 0.5
    findings = monitor.evaluate(42, _qk_stats(dropped))
    assert len(findings) == 1 and findings[0].action is Action.WARN
    values = findings[0].values
    assert 0.2 < values["drop"] < 0.3 and values["accumulated_drop"] > 0.5
    assert [layer["layer"] for layer in values["layers"]] == [0, 1]
    assert (values["heads"][0]["layer"], values["heads"][0]["head"], values["heads"][0]["tp_rank"]) == (1, 3, 1)
    assert values["heads"][0]["baseline"] > 1.5 * dropped[1, 3]
    assert "layer 1 head 3 (TP rank 1)" in findings[0].message
    monitor.commit(42, True)
    assert monitor.alarms == 1 and monitor.cusum == 0.0  # one alarm per episode: the new level joins the trajectory
    assert np.isclose(monitor.history[-1][1, 3], dropped[1, 3])


def test_qk_monitor_ignores_one_dip_and_one_collapsed_head() -> None:
    rng = np.random.default_rng(1)
    monitor = _qk_monitor()
    for step in range(20):
        assert _feed(monitor, step, _healthy(step, rng)) == []
    dip = _healthy(20, rng) * 0.6  # one measurement 40 % down (about 35 % below the trend): below the alarm
    assert _feed(monitor, 20, dip) == []
    assert 0.2 < monitor.cusum < 0.5
    for step in range(21, 30):  # back on the trend: the sum drains (the trend held meanwhile), the trajectory resumes
        assert _feed(monitor, step, _healthy(step, rng)) == []
    assert monitor.cusum == 0.0
    for step in range(30, 40):  # one head of four collapsed: the layer's median head barely moves
        one_head = _healthy(step, rng)
        one_head[0, 0] = 0.05
        assert _feed(monitor, step, one_head) == []
    assert monitor.alarms == 0


def test_qk_monitor_is_quiet_during_warmup_and_between_measurements() -> None:
    monitor = _qk_monitor()
    for step in range(5):
        assert _feed(monitor, step, np.full((LAYERS, HEADS), 2.0 if step < 4 else 0.1)) == []
    layout_empty = _qk_stats(np.zeros((LAYERS, HEADS)))
    layout_empty._totals[:] = 0.0  # no head measured on this step
    assert monitor.evaluate(5, layout_empty) == []
    monitor.commit(5, True)
    assert monitor.measurements == 5 and monitor.cusum == 0.0
    monitor.cusum = 0.3
    state = monitor.state_dict()
    restored = _qk_monitor()
    restored.load_state_dict(state)
    assert len(restored.history) == len(monitor.history) and restored.cusum == 0.3


def test_qk_monitor_skipped_steps_do_not_move_the_sum() -> None:
    rng = np.random.default_rng(2)
    monitor = _qk_monitor()
    for step in range(10):
        assert _feed(monitor, step, _healthy(step, rng)) == []
    before = (len(monitor.history), monitor.cusum)
    monitor.evaluate(10, _qk_stats(_healthy(10, rng) * 0.5))
    monitor.commit(10, False)  # the step was vetoed (skipped or rolled back)
    assert (len(monitor.history), monitor.cusum) == before


def _router_stats(logits_tn: torch.Tensor, weight_nd: torch.Tensor, layers: int = 1, ranks: int = 1) -> AgreedStats:
    """The agreed router statistics of ``ranks`` ranks that each routed a consecutive share of the tokens: the
    SUM of their partials, and the MAX of their rank keys of negated mean entropy."""
    size = router_partials_size(logits_tn.shape[1])
    layout = StatLayout()
    layout.add(ROUTER_SUMS, layers * size, Reduce.SUM)
    layout.add(RANK_ENTROPY, layers, Reduce.MAX)
    partial = pack_router_partials(logits_tn, topk_routing_map(logits_tn, 2), weight_nd).numpy()
    key = max(rank_key(-float(per_token_entropy(share).mean()), rank)
              for rank, share in enumerate(logits_tn.chunk(ranks)))
    row = np.concatenate([partial, np.zeros((layers - 1) * size), [key], np.full(layers - 1, -np.inf)])
    return AgreedStats.from_rows(layout, row[None, :])


def _healthy_router_monitor(generator: torch.Generator, weight: torch.Tensor, ranks: int = 1) -> RouterMonitor:
    """A router monitor after 8 healthy measurements (random logits, a fixed weight): no alarm on any of them."""
    ep_groups = {rank: (rank - rank % 2, rank - rank % 2 + 1) for rank in range(ranks)} if ranks > 1 else {}
    monitor = RouterMonitor(RouterConfig(warmup_measurements=5), ModelParts(num_layers=1, num_experts=4,
                                                                            experts_per_rank=2, ep_groups=ep_groups))
    for step in range(8):
        logits = torch.randn(256, 4, generator=generator, dtype=torch.float64)
        assert monitor.evaluate(step, _router_stats(logits, weight, ranks=ranks)) == []
        monitor.commit(step, True)
    return monitor


def test_router_monitor_names_a_collapse_confined_to_one_ranks_tokens() -> None:
    """4 ranks (EP=2 x DP=2), a quarter of the tokens each: rank 2's tokens lean hard on one expert. The union's
    mean entropy falls by less than ``min_relative_change`` (nothing fires on it), the lowest rank's entropy falls by
    far more: one finding, naming rank 2 and its expert-parallel group (2, 3)."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(4, 16, generator=generator, dtype=torch.float64)
    monitor = _healthy_router_monitor(generator, weight, ranks=4)
    logits = torch.randn(256, 4, generator=generator, dtype=torch.float64)
    logits[128:192, 0] += 2.5  # rank 2's tokens
    findings = monitor.evaluate(8, _router_stats(logits, weight, ranks=4))
    union_before, union_now = monitor.history[-1][0]["entropy_mean"], monitor._current[0]["entropy_mean"]
    assert 0 < 1 - union_now / union_before < RouterConfig().min_relative_change
    assert len(findings) == 1
    finding = findings[0]
    assert [p["statistic"] for p in finding.values["problems"]] == ["rank_min_entropy"]
    assert finding.ranks == (2,) and finding.values["rank"] == 2 and finding.values["ep_group"] == [2, 3]
    assert "on the tokens of rank 2 (expert-parallel group [2, 3])" in finding.message
    monitor.commit(8, True)
    assert monitor.alarms == 1


def test_router_monitor_alarms_on_collapsing_entropy_and_on_a_dead_expert() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 16, generator=generator, dtype=torch.float64)
    monitor = _healthy_router_monitor(generator, weight)
    collapsed = torch.randn(256, 4, generator=generator, dtype=torch.float64)
    collapsed[:, 0] += 8.0  # every token prefers expert 0: entropy falls
    findings = monitor.evaluate(8, _router_stats(collapsed, weight))
    assert [f.values["problems"][0]["statistic"] for f in findings if "problems" in f.values] == ["entropy_mean"]
    monitor.commit(8, True)
    dead = torch.randn(256, 4, generator=generator, dtype=torch.float64)
    dead[:, 3] = -1e9  # expert 3 (EP rank 1) never chosen
    findings = monitor.evaluate(9, _router_stats(dead, weight))
    dead_findings = [f for f in findings if "dead_expert_ids" in f.values]
    assert len(dead_findings) == 1
    assert dead_findings[0].values["dead_expert_ids"] == [3] and dead_findings[0].values["ep_ranks"] == [1]


def test_router_monitor_alarms_when_the_router_columns_collapse_onto_their_common_mode() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(4, 16, generator=generator, dtype=torch.float64)
    monitor = _healthy_router_monitor(generator, weight)
    common = weight.mean(dim=0, keepdim=True)
    collapsed = 0.1 * weight + 0.9 * (common + torch.randn(1, 16, generator=generator, dtype=torch.float64))
    findings = monitor.evaluate(8, _router_stats(torch.randn(256, 4, generator=generator, dtype=torch.float64),
                                                 collapsed))
    statistics = {p["statistic"] for f in findings for p in f.values.get("problems", [])}
    assert "similarity" in statistics


def test_router_monitor_ignores_a_small_similarity_move_near_zero() -> None:
    """Healthy router columns are nearly orthogonal (similarity ~0): a move of a few thousandths is far more than
    ``min_relative_change`` of the prediction but not a collapse; ``min_similarity_change`` is the floor."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(4, 16, generator=generator, dtype=torch.float64)
    monitor = _healthy_router_monitor(generator, weight)
    nudged = weight + 0.08 * weight.mean(dim=0, keepdim=True)
    stats = _router_stats(torch.randn(256, 4, generator=generator, dtype=torch.float64), nudged)
    findings = monitor.evaluate(8, stats)
    before = monitor.history[-1][0]["similarity"]
    after = monitor._current[0]["similarity"]
    assert 0.15 * abs(before) < after - before < RouterConfig().min_similarity_change
    assert not [p for f in findings for p in f.values.get("problems", []) if p["statistic"] == "similarity"]


def test_qk_spectra_skip_diverged_weights_without_raising() -> None:
    """A diverged run (non-finite QKV weights, e.g. an unprotected 100,000x learning rate in the campaign) must not
    crash the measurement (an SVD of NaN raises): the layer is skipped, and measured again one interval after its
    weights are finite again."""
    from types import SimpleNamespace

    from arc_engine.monitors.family import AttentionShard, ModelParts
    from arc_engine.monitors.qk_spectra import QKSpectraProducer

    weight = torch.randn(2 * 3 * 4, 8, generator=torch.Generator().manual_seed(0))  # 2 groups x (1 q + k + v) x 4
    parts = ModelParts(num_layers=1, num_heads=2, attention=[AttentionShard(
        layer=0, weight=weight, num_query_groups=2, heads_per_group=1, head_dim=4, first_head=0, tp_rank=0,
        owner=True)])
    producer = QKSpectraProducer(parts, every=1)
    slots = {HEAD_ENTROPY: torch.zeros(2), LAYER_SUMS: torch.zeros(len(LAYER_FIELDS)), MEASURED: torch.zeros(1),
             LOGIT_BOUND: torch.zeros(2)}
    buffer = SimpleNamespace(device=torch.device("cpu"), view=lambda name: slots[name])

    def measured_at(step: int) -> float:
        slots[MEASURED].zero_()
        producer.write(buffer, SimpleNamespace(step=step))
        weight.add_(0.01 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(step)))
        return float(slots[MEASURED][0])

    assert [measured_at(0), measured_at(1)] == [0.0, 2.0]  # a baseline, then both heads
    weight[0, 0] = float("nan")
    assert measured_at(2) == 0.0  # skipped, no exception
    weight[0, 0] = 0.0
    assert [measured_at(3), measured_at(4)] == [0.0, 2.0]  # a new baseline first


def test_qk_spectra_make_the_same_few_svd_calls_per_measurement_for_any_number_of_layers_and_heads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The SVDs of a measurement are batched over the heads of every layer: 2 layers of 2 heads and 6 layers of 8
    heads make the same number of ``svdvals`` calls (one per spectrum kind), and each head's values are those of
    its layer measured alone."""
    from types import SimpleNamespace

    from arc_engine.monitors.family import AttentionShard, ModelParts
    from arc_engine.monitors.qk_spectra import QKSpectraProducer

    calls = []
    svdvals = torch.linalg.svdvals
    monkeypatch.setattr(torch.linalg, "svdvals", lambda *a, **k: calls.append(1) or svdvals(*a, **k))

    def measure(layers: int, heads: int, only: int | None = None) -> tuple[int, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(heads * 3 * 4, 16, generator=gen) for _ in range(layers)]
        shards = [AttentionShard(layer=i, weight=w, num_query_groups=heads, heads_per_group=1, head_dim=4,
                                 first_head=0, tp_rank=0, owner=True)
                  for i, w in enumerate(weights) if only is None or i == only]
        producer = QKSpectraProducer(ModelParts(num_layers=layers, num_heads=heads, attention=shards), every=1)
        slots = {HEAD_ENTROPY: torch.zeros(layers * heads), LAYER_SUMS: torch.zeros(layers * len(LAYER_FIELDS)),
                 MEASURED: torch.zeros(layers), LOGIT_BOUND: torch.zeros(layers * heads)}
        buffer = SimpleNamespace(device=torch.device("cpu"), view=lambda name: slots[name])
        producer.write(buffer, SimpleNamespace(step=0))
        for w in weights:
            w.add_(0.01 * torch.randn(w.shape, generator=gen))
        calls.clear()
        producer.write(buffer, SimpleNamespace(step=1))
        return len(calls), slots[HEAD_ENTROPY].view(layers, heads)

    small, _ = measure(2, 2)
    large, entropy = measure(6, 8)
    assert small == large <= 6, (small, large)
    _, alone = measure(6, 8, only=3)
    assert torch.equal(entropy[3], alone[3]) and bool((entropy > 0).all())
    # batches bounded in bytes (whole layers): 2 layers of 8 heads per call, 3 calls of each kind, the same values
    one_layer = 8 * 4 * 8 * 16 * 4  # float64 bytes of a layer's q, k and their previous values: [8 heads, 16, 4]
    monkeypatch.setattr("arc_engine.monitors.qk_spectra.BATCH_BYTES", 2 * one_layer)
    bounded, bounded_entropy = measure(6, 8)
    assert bounded == 3 * large and torch.equal(bounded_entropy, entropy), (bounded, large)


def _logit_stats(bound_lh: np.ndarray, max_logit_lh: np.ndarray | None = None) -> AgreedStats:
    layout = StatLayout()
    layout.add(LOGIT_BOUND, LAYERS * HEADS, Reduce.SUM)
    row = [bound_lh.reshape(-1)]
    if max_logit_lh is not None:
        layout.add(MAX_LOGIT, LAYERS * HEADS, Reduce.MAX)
        row.append(max_logit_lh.reshape(-1))
    return AgreedStats.from_rows(layout, np.concatenate(row)[None, :])


def test_qk_logit_monitor_follows_healthy_growth_and_names_a_head_that_grows_off_its_trend() -> None:
    """Every head's bound grows 4 % a measurement (weights growing early in training) with 2 % noise: never an
    alarm. Then layer 1 head 2 jumps 3x: one alarm naming it (TP rank 1 of 2 heads per rank) and its growth; at its
    new level the next measurements are quiet (one alarm per episode), and so is a vetoed measurement's history."""
    rng = np.random.default_rng(3)
    config = QKSpectraConfig(warmup_measurements=5, logit_warmup_measurements=5)
    monitor = QKLogitMonitor(config, ModelParts(num_layers=LAYERS, num_heads=HEADS), heads_per_tp_rank=2)

    def bound(step: int) -> np.ndarray:
        return 3.0 * 1.04**step * (1 + 0.02 * rng.standard_normal((LAYERS, HEADS)))

    for step in range(30):
        assert monitor.evaluate(step, _logit_stats(bound(step))) == []
        monitor.commit(step, True)
    jumped = bound(30)
    jumped[1, 2] *= 3.0
    findings = monitor.evaluate(30, _logit_stats(jumped))
    assert len(findings) == 1 and findings[0].action is Action.WARN and findings[0].detector == "qk_logit"
    heads = findings[0].values["heads"]
    assert [(h["layer"], h["head"], h["tp_rank"]) for h in heads] == [(1, 2, 1)]
    assert 2.7 < heads[0]["growth"] < 3.3
    assert "layer 1 head 2 (TP rank 1)" in findings[0].message
    monitor.commit(30, True)
    assert monitor.alarms == 1
    for step in range(31, 36):  # the head stays at its new level, growing as before
        later = bound(step)
        later[1, 2] *= 3.0
        assert monitor.evaluate(step, _logit_stats(later)) == [], step
        monitor.commit(step, True)
    before = len(monitor.history)
    spike = bound(36) * 10.0
    assert monitor.evaluate(36, _logit_stats(spike))  # the whole model x 10: every head
    monitor.commit(36, False)  # vetoed: nothing joins the trend
    assert len(monitor.history) == before and monitor.alarms == 2
    restored = QKLogitMonitor(config, ModelParts(num_layers=LAYERS, num_heads=HEADS), heads_per_tp_rank=2)
    restored.load_state_dict(monitor.state_dict())
    assert restored.alarms == 2 and len(restored.history) == before


def test_qk_logit_monitor_reports_measured_max_logits_and_skips_steps_without_a_measurement() -> None:
    monitor = QKLogitMonitor(QKSpectraConfig(warmup_measurements=3, logit_warmup_measurements=3),
                             ModelParts(num_layers=LAYERS, num_heads=HEADS), heads_per_tp_rank=4, max_logits=True)
    assert monitor.required_stats() == (LOGIT_BOUND, MAX_LOGIT)
    for step in range(4):
        monitor.evaluate(step, _logit_stats(np.full((LAYERS, HEADS), 2.0), np.full((LAYERS, HEADS), 7.0 + step)))
        monitor.commit(step, True)
    # between measurements: no bound, and the MAX slot not reduced (NaN)
    assert monitor.evaluate(4, _logit_stats(np.zeros((LAYERS, HEADS)), np.full((LAYERS, HEADS), np.nan))) == []
    monitor.commit(4, True)
    assert len(monitor.history) == 4  # a step between measurements adds nothing
    metrics = monitor.metrics()
    assert metrics["layer0/logit_bound_max"] == 2.0 and metrics["layer1/max_logit"] == 10.0
    grown = np.full((LAYERS, HEADS), 2.0)
    grown[0, 1] = 5.0
    findings = monitor.evaluate(5, _logit_stats(grown, np.full((LAYERS, HEADS), 30.0)))
    assert findings[0].values["heads"][0]["measured_max_logit"] == 30.0


def test_the_producer_writes_each_heads_bound_and_the_attentions_recorded_max_logits() -> None:
    """The bound is σ_max of the head's dense W_q W_kᵀ over √d_k; the max logits come from the core attention's
    ``current_max_attn_logits`` (Transformer Engine's name) at the shard's global head offset, as a running max."""
    from types import SimpleNamespace

    from arc_engine.monitors.family import AttentionShard
    from arc_engine.monitors.qk_spectra import QKSpectraProducer, records_max_logits

    weight = torch.randn(2 * 3 * 4, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    core = SimpleNamespace(current_max_attn_logits=torch.tensor([3.0, 9.0]))
    shard = AttentionShard(layer=1, weight=weight, num_query_groups=2, heads_per_group=1, head_dim=4, first_head=2,
                           tp_rank=1, owner=True, core_attention=core)
    parts = ModelParts(num_layers=2, num_heads=4, attention=[shard])
    assert records_max_logits(parts)
    assert not records_max_logits(ModelParts(num_layers=2, num_heads=4, attention=[AttentionShard(
        layer=1, weight=weight, num_query_groups=2, heads_per_group=1, head_dim=4, first_head=2, tp_rank=1,
        owner=True)]))
    slots = {HEAD_ENTROPY: torch.zeros(8), LAYER_SUMS: torch.zeros(2 * len(LAYER_FIELDS)), MEASURED: torch.zeros(2),
             LOGIT_BOUND: torch.zeros(8, dtype=torch.float64), MAX_LOGIT: torch.zeros(8, dtype=torch.float64)}
    buffer = SimpleNamespace(device=torch.device("cpu"), view=lambda name: slots[name])
    QKSpectraProducer(parts, every=1, max_logits=True).write(buffer, SimpleNamespace(step=0))
    grouped = weight.view(2, 3, 4, 8)
    expected = [float(torch.linalg.svdvals(grouped[g, 0].T @ grouped[g, 1])[0]) / 2.0 for g in range(2)]
    bounds = slots[LOGIT_BOUND].view(2, 4)
    assert torch.allclose(bounds[1, 2:], torch.tensor(expected, dtype=torch.float64))
    assert bounds[0].eq(0).all() and bounds[1, :2].eq(0).all()
    assert slots[MAX_LOGIT].view(2, 4)[1].tolist() == [0.0, 0.0, 3.0, 9.0]

"""The mechanism monitors' decisions on synthetic agreed statistics (no model, no processes): the robust trend,
the QK-spectra alarm against each head's own trajectory (with patience, naming layer / head / TP rank), and the
router alarms (entropy, similarity, dead expert)."""

from __future__ import annotations

import numpy as np
import torch

from arc_engine.config.schema import QKSpectraConfig, RouterConfig
from arc_engine.events import Action
from arc_engine.monitors.family import ModelParts
from arc_engine.monitors.qk_spectra import HEAD_ENTROPY, LAYER_FIELDS, LAYER_SUMS, MEASURED, QKSpectraMonitor
from arc_engine.monitors.router import pack_router_partials, router_partials_size, topk_routing_map
from arc_engine.monitors.router_health import ROUTER_SUMS, RouterMonitor
from arc_engine.monitors.trajectory import robust_trend
from arc_engine.stats import AgreedStats, Reduce, StatLayout

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
    config = QKSpectraConfig(**{"warmup_measurements": 5, "patience": 2, **overrides})
    return QKSpectraMonitor(config, ModelParts(num_layers=LAYERS, num_heads=HEADS), heads_per_tp_rank=2)


def _healthy(step: int, rng: np.random.Generator) -> np.ndarray:
    return 2.0 - 0.02 * step + 0.01 * rng.standard_normal((LAYERS, HEADS))  # drifting down, a little noise


def test_qk_monitor_follows_a_drifting_healthy_run_and_alarms_on_one_collapsing_head() -> None:
    rng = np.random.default_rng(0)
    monitor = _qk_monitor()
    for step in range(30):  # a slow healthy decline: never an alarm
        assert monitor.evaluate(step, _qk_stats(_healthy(step, rng))) == []
        monitor.commit(step, True)
    collapsed = _healthy(30, rng)
    collapsed[1, 3] = 0.3  # layer 1, head 3 (TP rank 1 with 2 heads per rank)
    assert monitor.evaluate(30, _qk_stats(collapsed)) == []  # patience: one measurement is not enough
    monitor.commit(30, True)
    collapsed = _healthy(31, rng)
    collapsed[1, 3] = 0.25
    findings = monitor.evaluate(31, _qk_stats(collapsed))
    assert len(findings) == 1 and findings[0].action is Action.WARN
    heads = findings[0].values["heads"]
    assert [(h["layer"], h["head"], h["tp_rank"]) for h in heads] == [(1, 3, 1)]
    assert heads[0]["baseline"] > 1.0
    assert "layer 1 head 3 (TP rank 1)" in findings[0].message
    monitor.commit(31, True)
    assert monitor.alarms == 1


def test_qk_monitor_is_quiet_during_warmup_and_between_measurements() -> None:
    monitor = _qk_monitor()
    for step in range(5):
        assert monitor.evaluate(step, _qk_stats(np.full((LAYERS, HEADS), 2.0 if step < 4 else 0.1))) == []
        monitor.commit(step, True)
    layout_empty = _qk_stats(np.zeros((LAYERS, HEADS)))
    layout_empty._totals[:] = 0.0  # no head measured on this step
    assert monitor.evaluate(5, layout_empty) == []
    state = monitor.state_dict()
    restored = _qk_monitor()
    restored.load_state_dict(state)
    assert len(restored.history) == len(monitor.history)


def _router_stats(logits_tn: torch.Tensor, weight_nd: torch.Tensor, layers: int = 1) -> AgreedStats:
    size = router_partials_size(logits_tn.shape[1])
    layout = StatLayout()
    layout.add(ROUTER_SUMS, layers * size, Reduce.SUM)
    partial = pack_router_partials(logits_tn, topk_routing_map(logits_tn, 2), weight_nd).numpy()
    return AgreedStats.from_rows(layout, np.concatenate([partial, np.zeros((layers - 1) * size)])[None, :])


def _healthy_router_monitor(generator: torch.Generator, weight: torch.Tensor) -> RouterMonitor:
    """A router monitor after 8 healthy measurements (random logits, a fixed weight): no alarm on any of them."""
    monitor = RouterMonitor(RouterConfig(warmup_measurements=5), ModelParts(num_layers=1, num_experts=4,
                                                                            experts_per_rank=2))
    for step in range(8):
        logits = torch.randn(256, 4, generator=generator, dtype=torch.float64)
        assert monitor.evaluate(step, _router_stats(logits, weight)) == []
        monitor.commit(step, True)
    return monitor


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

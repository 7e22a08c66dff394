"""Conformal loss intervals (ARC paper §3.5): the split-conformal quantile and the state by hand, the empirical
coverage on a stationary stream, a spike as a failure that stays out of the calibration, recalibration after a
regime change, and the warning ahead of an explosion."""

from __future__ import annotations

import math

import numpy as np
import pytest

from arc_engine.config import ConfigError, load_config
from arc_engine.monitors.conformal import (
    FAILURE,
    HEALTHY,
    WARNING,
    ConformalMonitor,
    conformal_quantile,
    stability_state,
)
from arc_engine.stats import AgreedStats, Reduce, StatLayout, names

ON = ("detectors.conformal.enabled=true",)


def test_the_quantile_is_the_finite_sample_rank_and_the_state_its_sets() -> None:
    scores = [float(s) for s in range(10, 0, -1)]
    assert conformal_quantile(scores, 0.1) == 10.0  # ⌈11 x 0.9⌉ = 10th smallest
    assert conformal_quantile(scores, 0.5) == 6.0  # ⌈5.5⌉ = 6th
    assert conformal_quantile(scores, 0.05) == math.inf  # ⌈10.45⌉ = 11 > 10 scores
    assert conformal_quantile([], 0.5) == math.inf
    assert [stability_state(s, 1.0, 2.0) for s in (0.5, 1.0, 1.5, 2.5)] == [HEALTHY, HEALTHY, WARNING, FAILURE]


def _layout() -> StatLayout:
    layout = StatLayout()
    layout.add(names.LOSS, 1, Reduce.SUM)
    layout.add(names.LOSS_RANKS, 1, Reduce.SUM)
    layout.freeze()
    return layout


def _drive(losses: list[float], *overrides: str) -> tuple[ConformalMonitor, dict[int, list[str]], list[float]]:
    config = load_config(None, [*ON, *overrides]).detectors.conformal
    monitor, layout = ConformalMonitor(config), _layout()
    found, coverage = {}, []
    for step, loss in enumerate(losses):
        rows = np.zeros((2, layout.size))
        rows[:, layout[names.LOSS].span] = [[loss], [loss]]
        rows[:, layout[names.LOSS_RANKS].span] = [[1.0], [1.0]]
        findings = monitor.evaluate(step, AgreedStats.from_rows(layout, rows, ranks=(0, 1)))
        monitor.commit(step, True)
        coverage.append(monitor.metrics().get("coverage", math.nan))
        if findings:
            found[step] = [f.message for f in findings]
    return monitor, found, coverage


def test_coverage_on_a_stationary_stream_meets_one_minus_alpha() -> None:
    """6,000 steps of loss 3 + N(0, 0.1²): the 90% interval holds 90% of the losses (within 1.5 points), and the
    99.5% failure bound is crossed at about its one-sided rate (a quarter-percent: the price of any calibrated
    threshold)."""
    rng = np.random.default_rng(0)
    monitor, found, _ = _drive(list(3 + 0.1 * rng.normal(size=6000)))
    inside = [c for c in monitor.covered]
    assert len(inside) == 500
    # the whole run's coverage, from the scores the monitor judged (its window only keeps the last 200)
    config = load_config(None, list(ON)).detectors.conformal
    losses = 3 + 0.1 * np.random.default_rng(0).normal(size=6000)
    replay = ConformalMonitor(config)
    layout, judged = _layout(), []
    for step, loss in enumerate(losses):
        rows = np.zeros((1, layout.size))
        rows[0, layout[names.LOSS].span] = [loss]
        rows[0, layout[names.LOSS_RANKS].span] = [1.0]
        replay.evaluate(step, AgreedStats.from_rows(layout, rows, ranks=(0,)))
        if replay._pending is not None and replay._pending[2] is not None:
            judged.append(replay._pending[2])
        replay.commit(step, True)
    coverage = float(np.mean(judged))
    assert abs(coverage - 0.9) < 0.015, coverage
    failures = sum(1 for messages in found.values() for m in messages if "outside its" in m)
    assert failures / len(judged) < 0.006 and monitor.failures == failures
    assert monitor.recalibrations == 0


def test_a_spike_is_a_failure_and_stays_out_of_the_calibration() -> None:
    rng = np.random.default_rng(1)
    losses = list(3 + 0.1 * rng.normal(size=400))
    losses[300] = 4.5
    monitor, found, _ = _drive(losses)
    assert any("loss 4.5 outside its 99.5% conformal interval" in m for m in found[300])
    assert max(monitor.scores) < 1.0  # the spike's score (about 1.5) was not calibrated on


def test_a_regime_change_recalibrates_once_and_coverage_recovers() -> None:
    rng = np.random.default_rng(2)
    losses = list(3 + 0.1 * rng.normal(size=600)) + list(3 + 0.3 * rng.normal(size=1400))
    monitor, found, coverage = _drive(losses, "detectors.conformal.action=warn")
    recalibrated = [s for s, messages in found.items() if any("recalibrating" in m for m in messages)]
    assert recalibrated and all(s > 600 for s in recalibrated) and monitor.recalibrations >= 1
    assert coverage[-1] > 0.85  # calibrated on the new regime


def test_a_rising_loss_warns_ahead_of_the_explosion_level() -> None:
    rng = np.random.default_rng(3)
    losses = list(3 + 0.05 * rng.normal(size=300)) + [3 + 0.05 * k for k in range(1, 60)]
    _, found, _ = _drive(losses, "detectors.conformal.explosion_loss=4.5")
    ahead = [s for s, messages in found.items() if any("(preventive checkpoint)" in m for m in messages)]
    assert ahead and ahead[0] > 300 and losses[ahead[0]] < 4.5  # before the loss itself got there
    assert len(ahead) == 1  # once per episode


def test_the_section_is_validated() -> None:
    for bad in ("failure_alpha=0.2", "min_calibration=50", "window=100", "alpha=1.5", "coverage_window=3"):
        with pytest.raises(ConfigError):
            load_config(None, [*ON, f"detectors.conformal.{bad}"])
    assert not load_config(None, []).detectors.conformal.enabled


def test_autocorrelated_noise_keeps_coverage_near_its_level_with_more_failures() -> None:
    """AR(1), φ = 0.9, the same variance (docs/detectors.md's second figure): exchangeability fails, coverage stays
    near 90% (89.4%), failures rise to about 1.3% of steps and it recalibrates (twice)."""
    rng = np.random.default_rng(5)
    noise = np.zeros(6000)
    for i in range(1, 6000):
        noise[i] = 0.9 * noise[i - 1] + 0.1 * math.sqrt(1 - 0.81) * rng.normal()
    monitor, _, coverage = _drive(list(3 + noise))
    assert 0.85 < float(np.nanmean(coverage)) < 0.95
    assert 0.005 < monitor.failures / 5800 < 0.02 and monitor.recalibrations >= 1

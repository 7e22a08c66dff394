"""The campaign's baselines (arc_engine/campaign/baselines.py) on hand-made series, each against the rule as its
source states it."""

from __future__ import annotations

import math

from arc_engine.campaign.baselines import (
    ConsecutiveIncreases,
    GradNormThreshold,
    LightningSpikeDetection,
    LossZScore,
    MegatronSpikyLoss,
    NoMonitoring,
    all_baselines,
    first_alarm,
)

NAN = float("nan")


def alarms(rule, losses, norms=None) -> list[int]:
    norms = norms if norms is not None else [1.0] * len(losses)
    return [step for step, (loss, norm) in enumerate(zip(losses, norms, strict=True)) if rule.observe(loss, norm)]


def test_consecutive_increases_need_three_rises_in_a_row() -> None:
    assert alarms(ConsecutiveIncreases(), [5, 4, 4.5, 4.6, 4.4, 4.5, 4.6, 4.7, 4.8]) == [7, 8]
    assert alarms(ConsecutiveIncreases(), [5, 5, 5, 5]) == []  # equal is not a rise
    assert alarms(ConsecutiveIncreases(), [5, 6, NAN, 7, 8, 9]) == [5]  # a NaN breaks the run: 7, 8, 9 restart it


def test_the_loss_z_score_uses_the_trailing_window_and_flags_non_finite() -> None:
    calm = [3.0 + 0.1 * ((-1) ** k) for k in range(20)]  # mean 3, std 0.1
    assert alarms(LossZScore(), [*calm, 3.25, 3.35]) == [21]  # z = 2.5 then z above 3 (3.25 joined the window)
    assert alarms(LossZScore(), [3.0] * 5 + [100.0]) == []  # fewer than 10 values: no verdict
    assert alarms(LossZScore(), [3.0, NAN]) == [1]


def test_the_gradient_norm_threshold() -> None:
    assert alarms(GradNormThreshold(), [1.0] * 4, [50, 100, 100.5, math.inf]) == [2, 3]


def test_megatron_takes_ten_times_the_largest_of_the_first_hundred_losses() -> None:
    early = [2.0] * 99 + [3.0]
    assert alarms(MegatronSpikyLoss(), [*early, 29.9, 30.0, -31.0, NAN, math.inf]) == [101, 102]
    assert alarms(MegatronSpikyLoss(), [1000.0] * 50) == []  # still sampling


def test_lightning_compares_a_rise_with_the_running_mean_of_accepted_losses() -> None:
    """rtol 2: a rise to at least 3x the mean of the last 10 accepted losses; a fall never; NaN always."""
    losses = [1 / i for i in range(1, 10)]  # Lightning's own test series: 1, 1/2, ..., 1/9
    spiked = [*losses[:4], 3.0, *losses[5:]]
    assert alarms(LightningSpikeDetection(), spiked) == [4]  # 3 >= 3 x mean(1, 1/2, 1/3, 1/4) = 1.5625
    assert alarms(LightningSpikeDetection(), losses) == []
    assert alarms(LightningSpikeDetection(), [2.0, 2.0, 2.0, 6.0]) == [3]  # |6 − 2| >= 2 x 2
    assert alarms(LightningSpikeDetection(), [2.0, 2.0, 2.0, 5.9, 6.0]) == []  # 5.9 accepted; then 6 vs mean 2.975
    assert alarms(LightningSpikeDetection(), [1.0, NAN, 1.0]) == [1]
    assert alarms(LightningSpikeDetection(), [NAN, 1.0]) == []  # the warm-up step is never judged


def test_every_rule_is_fresh_and_first_alarm_finds_the_first_step() -> None:
    rules = all_baselines()
    assert len({rule.name for rule in rules}) == len(rules) == 6
    assert first_alarm(GradNormThreshold(), [1.0] * 3, [1.0, 200.0, 300.0]) == 1
    assert first_alarm(NoMonitoring(), [NAN] * 3, [math.inf] * 3) is None

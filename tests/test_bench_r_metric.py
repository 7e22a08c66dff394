"""scripts/bench_r_metric.py: its persistence rule is the monitor's, and its tables are formed."""

from __future__ import annotations

import numpy as np
import pytest

from tests.scripts_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_r_metric")


def test_the_rule_replayed_on_the_scores_gives_the_monitors_own_alerts(bench) -> None:
    """The false-alarm table replays each rule on one run's above/below sequence: for the rules the monitor runs
    with, the replay must find exactly the monitor's alerts (a diverging replay would misreport the rates)."""
    inputs = bench.stream(np.random.default_rng(4), 3000, 0.9, 0.0)
    for persist, fraction in ((40, 0.8), (20, 1.0), (10, 0.5)):
        alerts, above = bench.run(inputs, "normalized", persist, fraction)
        assert bench.episodes(above, persist, fraction) == alerts
    assert bench.run(inputs, "normalized", 5, 0.6)[0], "a lenient rule on a wandering run must alert"


def test_the_tables_have_a_row_per_case(bench) -> None:
    lines = bench.false_alarms(400, 1)
    assert len(lines) == 2 + 8 and all(line.count("|") == 5 + len(bench.RULES) for line in lines)
    delays = bench.delays(1)
    assert len(delays) == 2 + 4 and "1/1" in delays[2]  # the loss drift is caught


def test_the_healthy_trend_table_compares_both_readings(bench) -> None:
    lines = bench.trends(2, steps=200)
    assert len(lines) == 2 + 2 * len(bench.READINGS) and all(line.count("|") == 5 for line in lines)
    assert any("relative" in line for line in lines[2:])

"""The pure parts of scripts/bench_overhead.py: how its figures are formed from step times."""

from __future__ import annotations

import pytest

from tests.scripts_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_overhead")


def test_pair_median_is_robust_to_a_slow_phase(bench) -> None:
    plain = [1.0, 1.0, 2.0, 1.0, 1.0]  # a slow phase of the machine in block 2 hits both variants
    arc = [1.01, 1.01, 2.02, 1.01, 3.0]  # and a one-off stall in the last arc block
    figures = bench.overhead_figures(plain, arc)
    assert figures["pair_median"] == pytest.approx(0.01)
    assert figures["mean_ratio"] > 0.3  # the mean sees the stall


def test_neighbour_ratios_take_monitored_steps_between_unmonitored_ones(bench) -> None:
    steps = [(True, 9.0), (False, 1.0), (True, 1.1), (False, 1.2), (True, 1.32), (False, 1.0), (True, 5.0)]
    ratios = bench.neighbour_ratios(steps)
    # the first and last monitored steps lack a neighbour on one side and are left out
    assert ratios == pytest.approx([1.1 / 1.1, 1.32 / 1.1])


def test_neighbour_ratios_skip_runs_of_monitored_steps(bench) -> None:
    steps = [(False, 1.0), (True, 2.0), (True, 2.0), (False, 1.0), (True, 1.5), (False, 1.0)]
    assert bench.neighbour_ratios(steps) == pytest.approx([1.5])

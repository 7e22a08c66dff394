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


def test_trimmed_mean_cuts_both_tails(bench) -> None:
    plain = [1.0] * 10
    arc = [1.01] * 8 + [0.5, 3.0]  # one block pair each way far off
    figures = bench.overhead_figures(plain, arc)
    assert figures["trimmed_mean"] == pytest.approx(0.01)
    assert figures["pair_median"] == pytest.approx(0.01) and figures["mean_ratio"] > 0.1


def test_a_block_spans_every_periodic_schedule(bench) -> None:
    from arc_engine.config import load_config

    assert bench.periodic_block(load_config(None, [])) == 20  # the straggler report every 20th step
    quiet = ["detectors.straggler.enabled=false", "detectors.consistency.enabled=false"]
    assert bench.periodic_block(load_config(None, quiet)) == 10  # optimizer statistics every 10th step
    assert bench.periodic_block(load_config(None, [*quiet, "stats.optimizer_stats_every=0"])) == 1
    config = load_config(None, ["recovery.enabled=true", "recovery.checkpoint_freq=4",
                                "recovery.checkpoint.every_steps=0", "stats.interval=3", *quiet])
    assert bench.periodic_block(config) == 60  # lcm(3, 30, 4)
    assert bench.periodic_block(load_config(None, quiet), mechanisms=True) == 50  # QK spectra every 50 steps


def test_the_variants_rotate_so_each_follows_each_other_equally_often(bench) -> None:
    orders = [bench.block_order(block) for block in range(6)]
    assert len({tuple(order) for order in orders}) == 6 and bench.block_order(6) == orders[0]
    followers = [(order[i], order[i + 1]) for order in orders for i in range(2)]
    assert sorted(followers) == sorted([(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)] * 2)


def test_own_work_is_reported_for_the_slowest_rank(bench) -> None:
    reports = [{"host_ms": 1.0, "fraction": 0.001}, {"host_ms": 2.5, "fraction": 0.003}]
    assert bench.slowest_rank(reports)["fraction"] == 0.003


def test_the_timers_cost_comes_out_of_the_own_work_figure_and_picks_the_slowest_rank(bench) -> None:
    slowest_rank, without_timers = bench.slowest_rank, bench.without_timers
    assert without_timers(4.0, 60.0, 0.004) == pytest.approx(3.76)
    assert without_timers(0.1, 60.0, 0.004) == 0.0  # never negative
    reports = [{"host_ms": 5.0, "untimed_ms": 3.0}, {"host_ms": 4.0, "untimed_ms": 3.5}]
    assert slowest_rank(reports) is reports[1]  # ranked by the figure the bar is compared with

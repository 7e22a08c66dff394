"""scripts/bench_compute_probe.py runs end to end on a tiny model and reports both arms and the probe's own cost."""

from __future__ import annotations

import math

import pytest

from tests.scripts_loader import load_script


def test_the_bench_reports_both_arms_and_the_cost_per_timed_module() -> None:
    bench = load_script("bench_compute_probe")
    result = bench.main(["--layers", "2", "--d-model", "32", "--batch", "1", "--seq", "8", "--repeats", "3",
                         "--modules", "6"])
    assert result["modules"] == 6.0  # capped: the 2-layer GPT has 14 leaf modules with parameters
    assert all(math.isfinite(value) for value in result.values())
    assert result["sampled_cost_ms"] == pytest.approx(result["per_module_us"] * 6 / 1e3)
    assert result["spread_ms"] == pytest.approx(result["sampled_cost_ms"] / 5)

"""scripts/bench_curvature.py runs on a tiny model and reports a measurement's cost in training steps."""

from __future__ import annotations

import pytest

from tests.scripts_loader import load_script


def test_the_bench_reports_the_measurement_against_a_training_step() -> None:
    result = load_script("bench_curvature").main(["--layers", "1", "--d-model", "32", "--batch", "1", "--seq", "8",
                                                  "--repeats", "1"])
    assert result["ratio"] == pytest.approx(result["measurement_ms"] / result["step_ms"])
    assert result["measurement_ms"] > 0 and result["step_ms"] > 0

"""scripts/bench_dynamics.py runs on a tiny model and reports each rank count's share and its copy's size."""

from __future__ import annotations

import pytest

from tests.scripts_loader import load_script


def test_the_bench_reports_the_owned_share_and_the_copy() -> None:
    bench = load_script("bench_dynamics")
    results = bench.main(["--layers", "1", "--d-model", "32", "--ranks", "1", "2", "--repeats", "3"])
    assert results[1]["owned"] == 1.0 and 0.3 < results[2]["owned"] < 0.7  # owner dealing: about half each
    assert results[1]["copy_mb"] == pytest.approx(results[2]["copy_mb"] / results[2]["owned"], rel=1e-6)
    # the attractor sketch keeps one int8 sign per element of the part beside the fp32 copy
    assert results[1]["mb_sketch128"] == pytest.approx(1.25 * results[1]["mb_sketch0"], rel=1e-6)
    assert results[1]["ms_sketch128"] > 0

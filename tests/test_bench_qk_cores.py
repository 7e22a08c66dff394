"""The pure parts of scripts/bench_qk_cores.py: its dense baseline, its accuracy figure and its table row."""

from __future__ import annotations

import pytest
import torch

from tests.scripts_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_qk_cores")


def test_the_dense_baseline_is_the_products_singular_spectrum(bench) -> None:
    a, b = bench.factors(40, 4)
    expected = torch.linalg.svdvals(a @ b.T)
    dense = bench.dense_spectrum(a, b)
    torch.testing.assert_close(dense[:8], expected[:8], atol=1e-9, rtol=1e-9)  # rank 2 d_k = 8
    assert float(dense[8:].max()) < 1e-6 * float(dense[0])  # the rest is numerical zero


def test_relative_difference_is_against_the_largest_value(bench) -> None:
    dense = torch.tensor([10.0, 5.0, 0.0, 0.0])
    assert bench.relative_difference(torch.tensor([10.0, 4.0]), dense) == pytest.approx(0.1)
    assert bench.relative_difference(torch.tensor([10.0, 5.0]), dense) == 0.0


def test_a_measured_row_is_accurate_and_formatted(bench) -> None:
    row = bench.measure(96, 8, repeats=1)
    assert row["rel_diff"] <= 1e-5 and row["dense_ms"] > 0 and row["core_ms"] > 0
    assert bench.table_row(row).startswith("| 96 | ") and bench.table_row(row).endswith(" |")


def test_the_logit_bound_is_timed_beside_the_heads_spectra(bench) -> None:
    row = bench.measure_head(96, 8, repeats=1)
    assert row["spectra_ms"] > 0 and row["bound_ms"] > 0 and row["share"] == row["bound_ms"] / row["spectra_ms"]

"""The pure parts of scripts/bench_agreement.py: the byte volumes, the summary line, and the simulated pipeline
that stands in for thousands of ranks (its agreed values must be what N real ranks would agree on)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arc_engine.stats import Reduce, StatLayout, names
from tests.scripts_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_agreement")


def test_byte_volumes_follow_the_collectives(bench) -> None:
    assert bench.gather_bytes_per_rank(1, 100) == 0
    assert bench.gather_bytes_per_rank(4, 100) == 3 * 100 * 8          # three peers' buffers arrive
    assert bench.allreduce_bytes_per_rank(2, 10) == pytest.approx(80.0)  # ring: 2 (N-1)/N x size
    assert bench.allreduce_bytes_per_rank(16384, 10) < 2 * 10 * 8       # bounded by twice the vector


def test_scaling_line_reports_the_new_schemes_ratios(bench) -> None:
    rows = {8: {"new_bytes": 100.0, "new_host_us": 50.0}, 16384: {"new_bytes": 114.0, "new_host_us": 45.0}}
    assert bench.scaling_line(rows) == "agreement scaling 8 -> 16384 ranks: bytes x1.14, host time x0.90"


def test_simulated_pipeline_agrees_like_n_equal_ranks(bench) -> None:
    layout = StatLayout()
    layout.add("sum", 2, Reduce.SUM)
    layout.add("detail", 3, Reduce.DETAIL)
    pipeline = bench.SimulatedPipeline(layout, 4096)
    buffer = pipeline.start()
    buffer.put("sum", torch.tensor([1.0, 0.5]))
    buffer.put("detail", torch.tensor([1.0, 2.0, 3.0]))
    stats = pipeline.agree(buffer)
    np.testing.assert_array_equal(stats.total("sum"), [4096.0, 2048.0])
    assert pipeline.collectives == 1 and not stats.detail_fetched
    assert stats.per_rank("detail").shape == (4096, 3) and pipeline.detail_fetches == 1
    assert bench.reduced_size(layout) == 2  # the detail never travels on a healthy step


def test_the_engines_layout_reduces_a_fixed_block(bench) -> None:
    engine = bench.make_engine()
    engine.gathering.layout.freeze()
    layout = engine.gathering.layout
    travelling = sum(spec.size for spec in layout.specs() if spec.reduce in (Reduce.SUM, Reduce.REPLICATED))
    assert bench.reduced_size(layout) == travelling  # the detail (the sketch itself) never travels
    assert layout[names.GRAD_SKETCH_LOCAL].reduce is Reduce.DETAIL
    assert bench.reduced_size(layout) < layout.size
    assert bench.simulate(16384, repeats=2)["collectives_per_step"] == 1
    # a straggler report step: the agreement (SUM, then the MAX block due), then one fixed-size follow-up; the
    # same sizes whatever the number of ranks
    small, sizes = bench.report_step_bytes(8)
    large, same = bench.report_step_bytes(16384)
    assert len(sizes) == 3 and sizes == same and sizes[-1] == 2 * 64 + 3
    assert large / small < 2.0

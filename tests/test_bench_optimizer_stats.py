"""scripts/bench_optimizer_stats.py: its model, its rank share and its table row (the timings are asserted nowhere)."""

from __future__ import annotations

import pytest
import torch

from tests.scripts_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_optimizer_stats")


def test_the_model_has_twelve_tensors_per_layer_and_adam_state(bench) -> None:
    params, optimizer, owned = bench.build(3)
    assert len(params) == 36 and len(owned) == 18
    assert all("exp_avg" in optimizer.state[p] for p in params)


def test_a_measured_row_records_the_update_and_is_formatted(bench) -> None:
    row = bench.measure(2, steps=3, repeats=1)
    assert row["tensors"] == 12 and row["fresh"] > 0 and row["persistent"] > 0 and row["optimizer"] > 0
    line = bench.table_row(row)
    assert line.startswith("| 12 | ") and line.count("|") == 7


def test_the_statistics_it_times_are_the_production_sums(bench) -> None:
    """What the benchmark times writes the sampled Σ U² and its element count (a broken path would write 0)."""
    params, optimizer, owned = bench.build(2)
    buffer = bench.stats_buffer()
    from arc_engine.stats import names
    from arc_engine.stats.optim_stats import adam_views
    from arc_engine.stats.producers import record_group_optimizer_stats
    views = adam_views(optimizer, optimizer.param_groups[0], owned=owned, memo={})
    record_group_optimizer_stats(buffer, 0, [p for p in params if id(p) in owned], views, 1 / 32, with_weights=False)
    assert float(buffer.view(names.UPDATE_SQ)[0]) > 0
    assert 0 < float(buffer.view(names.UPDATE_COUNT)[0]) < sum(p.numel() for p in params) / 2
    assert torch.isfinite(buffer.view(names.UPDATE_SQ)).all()

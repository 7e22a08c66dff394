"""The statistics pipeline on real gloo ranks: exact agreed values in one fixed-size all-reduce, per-rank detail only
on demand, an agreed layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arc_engine.stats import Reduce, StatLayout, StatsPipeline
from tests.dist_harness import run_ranks

pytestmark = pytest.mark.timeout(240)

NUM_ELEMENTS = 31  # not divisible by the world size: uneven shards, like ZeRO partitions with padding


def reference_vector() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(-50, 50, (NUM_ELEMENTS,), generator=gen).double()


def shard(vector: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return vector.tensor_split(world)[rank]


def _agree_rank(rank: int, world: int) -> dict:
    layout = StatLayout()
    layout.add("detail", 2, Reduce.DETAIL)
    layout.add("sharded", 3, Reduce.SUM)
    layout.add("largest", 2, Reduce.MAX)
    layout.add("replicated", 1, Reduce.REPLICATED)
    pipeline = StatsPipeline(layout)
    buffer = pipeline.start()
    part = shard(reference_vector(), rank, world)
    buffer.put("detail", torch.tensor([rank, 10.0 * rank]))
    buffer.put("sharded", torch.stack([part.square().sum(), part.sum(), torch.tensor(float(part.numel()))]))
    buffer.put("largest", torch.tensor([float(rank), -float(rank)]))  # max, and min encoded as a negated max
    buffer.put("replicated", 42.0 if rank == 0 else 41.0)  # only the group's first rank counts
    stats = pipeline.agree(buffer)
    before_detail = {"collectives": pipeline.collectives, "fetched": stats.detail_fetched,
                     "host_copies": pipeline.host_copies}
    # follow-ups: each rank's contribution, made from its own buffer, reduced at a fixed size
    total = stats.follow_up(lambda row: row[layout["detail"].span] + 1.0, Reduce.SUM)
    largest = stats.follow_up(lambda row: np.array([row[layout["detail"].span][0], -row[layout["detail"].span][0]]),
                              Reduce.MAX)
    follow_ups = pipeline.follow_ups
    detail = stats.per_rank("detail")
    sharded_rows = stats.per_rank("sharded")
    return {"sharded": stats.total("sharded"), "largest": stats.total("largest"),
            "replicated": stats.total("replicated"), "local": stats.local("detail"), "detail": detail,
            "sharded_rows": sharded_rows, "before_detail": before_detail, "detail_fetches": pipeline.detail_fetches,
            "ranks": stats.ranks, "my_row": stats.my_row, "total": total, "largest_rank": largest,
            "follow_ups": follow_ups}


def test_agreement_gives_exact_global_values_and_fetches_per_rank_detail_only_on_demand() -> None:
    world = 3
    results = run_ranks(_agree_rank, world)
    full = reference_vector()
    expected = np.array([float(full.square().sum()), float(full.sum()), float(NUM_ELEMENTS)])
    for rank, result in enumerate(results):
        np.testing.assert_array_equal(result["sharded"], expected)  # integer-valued: exact
        np.testing.assert_array_equal(result["largest"], [world - 1, 0.0])
        np.testing.assert_array_equal(result["replicated"], [42.0])
        # one SUM and one MAX all-reduce (the layout has MAX slots), one host copy, no detail yet
        assert result["before_detail"] == {"collectives": 2, "fetched": False, "host_copies": 1}
        np.testing.assert_array_equal(result["local"], [rank, 10.0 * rank])
        np.testing.assert_array_equal(result["detail"], [[r, 10.0 * r] for r in range(world)])
        np.testing.assert_array_equal(result["sharded_rows"].sum(axis=0), expected)  # rows: before the reduction
        assert result["detail_fetches"] == 1  # two per_rank() calls, one all-gather
        np.testing.assert_array_equal(result["total"], [3.0 + world, 30.0 + world])  # Σ (r + 1), Σ (10 r + 1)
        np.testing.assert_array_equal(result["largest_rank"], [world - 1, 0.0])
        assert result["follow_ups"] == 2
        assert result["ranks"] == (0, 1, 2) and result["my_row"] == rank


def _sum_only_rank(rank: int, world: int) -> dict:
    layout = StatLayout()
    layout.add("count", 4, Reduce.SUM)
    layout.add("sketch", 16, Reduce.DETAIL)
    pipeline = StatsPipeline(layout)
    buffer = pipeline.start()
    buffer.put("count", 1.0)
    stats = pipeline.agree(buffer)
    return {"count": stats.total("count"), "collectives": pipeline.collectives,
            "fetches": pipeline.detail_fetches, "reduced": layout.block(Reduce.SUM, Reduce.REPLICATED, Reduce.MAX)}


def test_a_sum_only_layout_agrees_in_one_all_reduce_that_skips_the_detail() -> None:
    for result in run_ranks(_sum_only_rank, 2):
        np.testing.assert_array_equal(result["count"], [2.0] * 4)
        assert result["collectives"] == 1 and result["fetches"] == 0
        assert result["reduced"] == slice(0, 4)  # the 16 detail entries never travel on a healthy step


def _group_scoped_rank(rank: int, world: int) -> dict:
    layout = StatLayout()
    layout.add("whole_job", 1, Reduce.SUM)
    layout.add("per_pair", 2, Reduce.SUM, group_size=2)  # summed over a pair of ranks, each pair a copy
    pipeline = StatsPipeline(layout)
    buffer = pipeline.start()
    buffer.put("whole_job", 1.0)
    shard = torch.tensor([1.0, 10.0]) if rank % 2 == 0 else torch.tensor([2.0, 20.0])  # the pair's two shards
    buffer.put("per_pair", shard)
    stats = pipeline.agree(buffer)
    return {"whole_job": stats.total("whole_job"), "per_pair": stats.total("per_pair"),
            "collectives": pipeline.collectives}


def test_a_sum_over_a_smaller_group_counts_one_copy_of_it() -> None:
    """4 ranks as 2 copies of a 2-rank group (e.g. tensor-parallel pairs in 2 data-parallel replicas): a statistic
    summed over the pair's shards agrees on one pair's sum, in the same single all-reduce as the job-wide sums."""
    for result in run_ranks(_group_scoped_rank, 4):
        np.testing.assert_array_equal(result["whole_job"], [4.0])
        np.testing.assert_array_equal(result["per_pair"], [3.0, 30.0])
        assert result["collectives"] == 1


def _bad_tiling_rank(rank: int, world: int) -> str:
    layout = StatLayout()
    layout.add("per_pair", 1, Reduce.SUM, group_size=2)
    try:
        StatsPipeline(layout).start()
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_group_that_does_not_tile_the_decision_group_is_refused() -> None:
    assert all("does not tile" in message for message in run_ranks(_bad_tiling_rank, 3))


def _float_shards_rank(rank: int, world: int) -> list[float]:
    layout = StatLayout()
    layout.add("sq", 1, Reduce.SUM)
    pipeline = StatsPipeline(layout)
    buffer = pipeline.start()
    gen = torch.Generator().manual_seed(3)
    weights = torch.randn(1000, generator=gen, dtype=torch.float32)
    buffer.put("sq", shard(weights, rank, world).double().square().sum())
    return pipeline.agree(buffer).total("sq").tolist()


def test_sharded_float_sum_matches_single_process_reference() -> None:
    results = run_ranks(_float_shards_rank, 2)
    gen = torch.Generator().manual_seed(3)
    reference = float(torch.randn(1000, generator=gen, dtype=torch.float32).double().square().sum())
    for result in results:
        assert result[0] == pytest.approx(reference, rel=1e-12)


def _mismatched_layout_rank(rank: int, world: int) -> str:
    layout = StatLayout()
    layout.add("loss", 1, Reduce.SUM)
    if rank == 1:
        layout.add("extra", 1, Reduce.DETAIL)
    try:
        StatsPipeline(layout).start()
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_layout_mismatch_is_an_error_on_every_rank() -> None:
    messages = run_ranks(_mismatched_layout_rank, 2)
    for message in messages:
        assert "ranks registered different statistics" in message


def test_single_process_pipeline_needs_no_collective() -> None:
    layout = StatLayout()
    layout.add("x", 2, Reduce.SUM)
    pipeline = StatsPipeline(layout)
    buffer = pipeline.start()
    buffer.add("x", torch.tensor([1.0, 2.0]))
    buffer.add("x", torch.tensor([0.5, 0.5]))
    stats = pipeline.agree(buffer)
    np.testing.assert_array_equal(stats.total("x"), [1.5, 2.5])
    np.testing.assert_array_equal(stats.per_rank("x"), [[1.5, 2.5]])
    assert pipeline.collectives == 0 and pipeline.host_copies == 1
    with pytest.raises(RuntimeError, match="frozen"):
        layout.add("late", 1, Reduce.SUM)

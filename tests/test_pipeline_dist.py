"""The statistics pipeline on real gloo ranks: exact global values, one collective, agreed layout."""

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


def _gather_rank(rank: int, world: int) -> dict:
    layout = StatLayout()
    layout.add("per_rank", 2, Reduce.PER_RANK)
    layout.add("sharded", 3, Reduce.SUM)
    layout.add("replicated", 1, Reduce.REPLICATED)
    pipeline = StatsPipeline(layout)
    buffer = pipeline.start()
    part = shard(reference_vector(), rank, world)
    buffer.put("per_rank", torch.tensor([rank, 10.0 * rank]))
    buffer.put("sharded", torch.stack([part.square().sum(), part.sum(), torch.tensor(float(part.numel()))]))
    buffer.put("replicated", 42.0)
    stats = pipeline.gather(buffer)
    return {"matrix": stats.matrix_rn.copy(), "sharded": stats.total("sharded"),
            "replicated": stats.total("replicated"), "per_rank": stats.per_rank("per_rank"),
            "collectives": pipeline.collectives, "host_copies": pipeline.host_copies, "ranks": stats.ranks}


def test_gather_gives_exact_global_values_on_every_rank() -> None:
    world = 3
    results = run_ranks(_gather_rank, world)
    full = reference_vector()
    expected = np.array([float(full.square().sum()), float(full.sum()), float(NUM_ELEMENTS)])
    for result in results:
        np.testing.assert_array_equal(result["sharded"], expected)  # integer-valued: exact
        np.testing.assert_array_equal(result["replicated"], [42.0])
        np.testing.assert_array_equal(result["per_rank"], [[r, 10.0 * r] for r in range(world)])
        assert result["collectives"] == 1 and result["host_copies"] == 1
        assert result["ranks"] == (0, 1, 2)
        np.testing.assert_array_equal(result["matrix"], results[0]["matrix"])


def _float_shards_rank(rank: int, world: int) -> list[float]:
    layout = StatLayout()
    layout.add("sq", 1, Reduce.SUM)
    pipeline = StatsPipeline(layout)
    buffer = pipeline.start()
    gen = torch.Generator().manual_seed(3)
    weights = torch.randn(1000, generator=gen, dtype=torch.float32)
    buffer.put("sq", shard(weights, rank, world).double().square().sum())
    return pipeline.gather(buffer).total("sq").tolist()


def test_sharded_float_sum_matches_single_process_reference() -> None:
    results = run_ranks(_float_shards_rank, 2)
    gen = torch.Generator().manual_seed(3)
    reference = float(torch.randn(1000, generator=gen, dtype=torch.float32).double().square().sum())
    for result in results:
        assert result[0] == pytest.approx(reference, rel=1e-12)


def _mismatched_layout_rank(rank: int, world: int) -> str:
    layout = StatLayout()
    layout.add("loss", 1, Reduce.PER_RANK)
    if rank == 1:
        layout.add("extra", 1, Reduce.PER_RANK)
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
    stats = pipeline.gather(buffer)
    np.testing.assert_array_equal(stats.total("x"), [1.5, 2.5])
    assert pipeline.collectives == 0 and pipeline.host_copies == 1
    with pytest.raises(RuntimeError, match="frozen"):
        layout.add("late", 1, Reduce.SUM)

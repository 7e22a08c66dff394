"""The ownership map that splits replicated statistics work across ranks (arc_engine.stats.partition)."""

from __future__ import annotations

import pytest
import torch

from arc_engine.stats.partition import PER_TENSOR_COST, balanced_owners, owned_ids


@pytest.mark.parametrize("num_owners", [1, 2, 3, 4, 8])
def test_every_item_has_one_owner_and_loads_are_balanced(num_owners: int) -> None:
    sizes = [65536] * 12 + [262144] * 4 + [256] * 30 + [16384, 7, 1]
    owners = balanced_owners(sizes, num_owners)
    assert len(owners) == len(sizes) and set(owners) <= set(range(num_owners))
    loads = [sum(s for s, o in zip(sizes, owners, strict=True) if o == owner) for owner in range(num_owners)]
    assert sum(loads) == sum(sizes)
    assert max(loads) - min(loads) <= max(sizes)  # greedy, largest first: within one item
    assert owners == balanced_owners(list(sizes), num_owners)  # deterministic


def test_owned_sets_partition_the_parameters() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 300, 7, 7, 64, 1)]
    sets = [owned_ids(params, rank, 3) for rank in range(3)]
    assert set().union(*sets) == {id(p) for p in params}
    assert sum(len(s) for s in sets) == len(params)
    assert all(sets)


def test_rejects_zero_owners() -> None:
    with pytest.raises(ValueError, match="num_owners"):
        balanced_owners([1, 2], 0)


def test_owned_sets_balance_tensor_counts_too() -> None:
    """A few large tensors and many small ones (a transformer's matrices, biases and norms): by element count alone
    one rank would get the large ones and the other every small one, and with them most of the per-tensor work."""
    layer = [256, 256, 196608, 768, 65536, 256, 256, 256, 262144, 1024, 262144, 256]
    sizes = [7424, 65536] + layer * 4 + [256, 256]  # the demo GPT of the overhead benchmark, in module order
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    assert balanced_owners(sizes, 2).count(0) <= 12  # by elements alone: 9 of 52 (the per-tensor cost's reason)
    sets = [owned_ids(params, rank, 2) for rank in range(2)]
    counts = [len(s) for s in sets]
    loads = [sum(p.numel() for p in params if id(p) in s) for s in sets]
    assert min(counts) >= 0.4 * len(params)
    assert abs(loads[0] - loads[1]) <= max(sizes) + PER_TENSOR_COST

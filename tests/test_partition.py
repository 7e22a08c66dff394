"""The ownership map that splits replicated statistics work across ranks (arc_engine.stats.partition)."""

from __future__ import annotations

import pytest
import torch

from arc_engine.stats.partition import balanced_owners, owned_ids


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

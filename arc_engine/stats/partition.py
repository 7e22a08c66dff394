"""Splitting replicated statistics work across the ranks that hold the same tensors.

Under DDP every rank holds the same reduced gradient, parameters and optimizer state, so a statistic of them (a
squared norm, the update's Σ U²) computed on every rank is the same work done N times. Instead each parameter gets
one owner rank; only the owner computes that parameter's contribution, the slots are ``Reduce.SUM``, and the
step's single gather adds the partial sums into the exact totals. Per rank that is 1/N of the work.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch


def balanced_owners(sizes: Sequence[int], num_owners: int) -> list[int]:
    """Owner (``0..num_owners-1``) of each item of ``sizes``: largest first, each to the least-loaded owner (ties to
    the lower owner, then to the earlier item), so every owner's total is within one item of the mean. Depends only
    on its arguments, so every rank computes the same assignment. Pure."""
    if num_owners < 1:
        raise ValueError(f"num_owners must be >= 1, got {num_owners}")
    owners = [0] * len(sizes)
    loads = [(0, owner) for owner in range(num_owners)]
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, owner = heapq.heappop(loads)
        owners[item] = owner
        heapq.heappush(loads, (load + sizes[item], owner))
    return owners


#: The fixed cost of one tensor in the statistics paths (Python and kernel launches per tensor), in elements: about
#: what a rank streams through memory in the few microseconds each tensor costs whatever its size. Without it a rank
#: given the few largest tensors would own 9 of 52 and its peer 43, and the peer, slower by the difference in
#: per-tensor work, would keep the step's gather waiting.
PER_TENSOR_COST = 1 << 14


def owned_ids(params: Sequence[torch.Tensor], rank: int, num_ranks: int) -> set[int]:
    """``id()`` of the parameters of ``params`` (the same list, in the same order, on every rank) that ``rank``
    owns among ``num_ranks`` (:func:`balanced_owners` by element count plus :data:`PER_TENSOR_COST` each)."""
    owners = balanced_owners([p.numel() + PER_TENSOR_COST for p in params], num_ranks)
    return {id(p) for p, owner in zip(params, owners, strict=True) if owner == rank}

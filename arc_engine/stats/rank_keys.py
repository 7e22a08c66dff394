"""Which rank holds the largest value, through a MAX all-reduce of one number: a rank key.

A rank key packs a value (rounded to float32) and a global rank into one float64 whose order is the value's order
(ties: the higher rank): the 32 bits of the float32 mapped to an unsigned integer of the same order, times 2^21, plus
the rank. Every key is an integer below 2^53, so float64 holds it exactly and a MAX reduction (on any backend) returns
the largest value together with the rank that holds it: an argmax whose size does not grow with the number of ranks.
The smallest value is the largest key of the negated values. -inf is "no value" (the identity of MAX).

Ranks up to 2^21 - 1 (2,097,151) fit.
"""

from __future__ import annotations

import math

import numpy as np
import torch

RANK_BITS = 21
MAX_RANK = (1 << RANK_BITS) - 1
_SCALE = float(1 << RANK_BITS)


def check_rank(rank: int) -> None:
    """ValueError when ``rank`` does not fit a key."""
    if not 0 <= rank <= MAX_RANK:
        raise ValueError(f"rank {rank} does not fit a rank key (0 to {MAX_RANK})")


def _ordered(bits: int) -> int:
    """The float32 bit pattern ``bits`` (unsigned) as an unsigned integer ordered like the float."""
    return bits ^ 0xFFFFFFFF if bits & 0x80000000 else bits | 0x80000000


def rank_key(value: float, rank: int) -> float:
    """The key of ``value`` held by ``rank`` (-inf when the value is NaN). Pure."""
    if math.isnan(value):
        return -math.inf
    bits = int(np.array(value, dtype=np.float32).view(np.uint32))
    return float(_ordered(bits) * (1 << RANK_BITS) + rank)


def split_key(key: float) -> tuple[float, int]:
    """(value as float32 rounded it, rank) of a key; (NaN, -1) for "no value" (-inf, NaN). Pure."""
    if not math.isfinite(key):
        return math.nan, -1
    whole = int(key)
    ordered, rank = whole >> RANK_BITS, whole & MAX_RANK
    bits = ordered & 0x7FFFFFFF if ordered & 0x80000000 else ordered ^ 0xFFFFFFFF
    return float(np.array(bits, dtype=np.uint32).view(np.float32)), rank


@torch.no_grad()
def rank_key_t(value: torch.Tensor, rank: int) -> torch.Tensor:
    """:func:`rank_key` of a tensor of values, on its device (no host sync): float64 keys, -inf where NaN."""
    bits = value.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    ordered = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    keys = (ordered * (1 << RANK_BITS) + rank).double()
    return torch.where(torch.isnan(value), torch.full_like(keys, -math.inf), keys)


__all__ = ["MAX_RANK", "RANK_BITS", "check_rank", "rank_key", "rank_key_t", "split_key"]

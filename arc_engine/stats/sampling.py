"""Sampled windows for the update RMS (``detectors.sdc.update_sample``): which elements of each tensor R_t is
computed on at a given step.

Each tensor (a full parameter under DDP, a DTensor's local shard under FSDP2, a parameter's piece of a ZeRO-3
sub-group partition, a segment of a ZeRO-1/2 flat partition) contributes one contiguous window of
``L = max(⌈f·n⌉, MIN_WINDOW_ELEMENTS)`` of its ``n`` elements (``f = update_sample``; smaller tensors are taken
whole). The window *moves*: a tensor has ``K = ⌈1/f⌉`` window positions, evenly spaced from offset 0 to ``n − L``
(neighbours overlap, so together they cover the tensor), and at phase ``p`` it takes position ``(h + p) mod K``,
``h`` a hash of its position in its parameter group. So

* every element is inside its tensor's window at least once in any ``K`` consecutive phases
  (:func:`window_bounds`); a fixed window would watch the same ``f`` of every tensor forever -- under ZeRO the same
  first ``f`` of each rank's partition -- and miss a corruption anywhere else;
* the phase is the count of monitored steps, ``progress.step // stats.interval`` (:func:`sample_phase`): the same on
  every rank, and after a rollback or a resume the replayed steps take the windows they took the first time;
* the window depends only on the tensor's size, its position in its group and the phase, never on which rank owns
  it (DDP's owner split) or on the other tensors a rank holds; the tensors of a group sit at staggered positions,
  so a step's sample is spread over the model. A ZeRO-1/2 flat partition -- one tensor holding many parameters of
  different kinds -- is first cut into up to :data:`MAX_SEGMENTS` segments (:func:`segmented`) for the same reason.

The SDC baseline under a moving window: the rule is unchanged, the warm-up sees the motion. R_t and R_{t−1} are now
taken on different windows, so ΔR_t = |R_t − R_{t−1}| carries, besides the change of the update over one step, the
difference between two samples of the same update. That part is stationary -- the motion is the same in warm-up as
afterwards -- and the windows move from the first step on, so the warm-up mean μ of ΔR, the scale ΔR_t is compared
with, already includes it: a clean run stays as far below the threshold μ/(α√ΔG_t) as with a fixed window. What the
motion costs is sensitivity, through a larger μ; staggering, segments and the minimum window keep it small. On the
demo GPT (0.8M parameters, 100 warm-up steps, f = 1/32) μ grows by 12% (per-tensor windows) and 17% (ZeRO-1/2 flat
partitions on 2 ranks; 57% with one window per partition instead of segments), and the largest ΔR_t/μ after the
warm-up stays below 4 (the rule needs 20/√ΔG_t at α = 0.05). The alternative -- also computing, on each step, R on
the next step's window and comparing R_t with R_{t−1} on the same window -- brings μ back to the fixed window's
(within 3%), but doubles the sampled work, needs a second statistic slot, and loses its pairing on every skipped step;
the measured gain did not justify it. The warm-up should span a full cycle (``detectors.sdc.warmup_steps`` ≥ K) so
that μ has seen every window position. A corruption confined to part of a tensor makes R jump when the window
reaches it, which the rule flags on a step whose gradient norm rose.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from arc_engine.stats.optim_stats import AdamViews, flat_piece, none_free

#: The shortest window: a tensor with fewer elements is taken whole.
MIN_WINDOW_ELEMENTS = 256

#: The most segments a flat partition is cut into (:func:`segmented`).
MAX_SEGMENTS = 16

#: Multiplier of the position hash that staggers the windows of one group's tensors (Knuth's multiplicative hash).
_POSITION_HASH = 2654435761


def window_slots(fraction: float) -> int:
    """K: the number of window positions a tensor cycles through, ⌈1/fraction⌉ (1 when ``fraction`` >= 1)."""
    return 1 if fraction >= 1.0 else math.ceil(1.0 / fraction)


def sample_phase(step: int, interval: int) -> int:
    """The window phase of optimizer step ``step`` when statistics are gathered every ``interval`` steps: the
    number of monitored steps before it, so consecutive monitored steps take consecutive phases. Pure: every rank
    computes the same phase from the same step counter."""
    return step // interval


def window_bounds(numel: int, fraction: float, position: int, phase: int) -> tuple[int, int]:
    """(start, length) of the window of a tensor of ``numel`` elements at ``position`` in its group, at ``phase``.

    ``length`` = max(⌈fraction·numel⌉, ⌈numel/K⌉, :data:`MIN_WINDOW_ELEMENTS`), at most ``numel`` (so K windows are
    enough to cover the tensor); the K starts are ⌊s·(numel − length)/(K − 1)⌋ for s = 0..K−1: consecutive ones are
    at most ``length`` apart, the first is 0 and the last ``numel − length``. Position s = (hash(position) + phase)
    mod K. Pure."""
    slots = window_slots(fraction)
    if slots == 1 or numel <= MIN_WINDOW_ELEMENTS:
        return 0, numel
    length = min(numel, max(MIN_WINDOW_ELEMENTS, math.ceil(fraction * numel), -(-numel // slots)))
    slot = (position * _POSITION_HASH + phase) % slots
    return slot * (numel - length) // (slots - 1), length


def sample_window(tensor: torch.Tensor | None, fraction: float, index: int, phase: int = 0) -> torch.Tensor | None:
    """The :func:`window_bounds` window of ``tensor`` as a flat view (``tensor`` itself when ``fraction`` >= 1),
    placed by ``index`` (its position in its group) and ``phase`` alone: the same window is taken of a parameter,
    its gradient and its moments."""
    if tensor is None or fraction >= 1.0:
        return tensor
    numel = tensor.numel()
    start, length = window_bounds(numel, fraction, index, phase)
    return flat_piece(tensor, start, length, numel)


def sampled(views: AdamViews, fraction: float, cache: WindowCache | None = None, phase: int = 0) -> AdamViews:
    """``views`` cut to one window per tensor at ``phase`` (:func:`sample_window`): Σ U² over the windows divided by
    their element count estimates the update's mean square at ``fraction`` of the cost. ``fraction`` 1: unchanged.
    ``cache``: keeps the windows of tensors that persist between steps (parameters, moments; see
    :class:`WindowCache`), which saves the per-tensor view creation once every phase has been seen."""
    if fraction >= 1.0:
        return views
    if cache is None:
        cache = WindowCache()
    at = views.positions

    def cut(name: str, tensors: list[Any]) -> list[Any]:
        return cache.windows(name, tensors, fraction, at, phase)

    return AdamViews(cut("params", views.params), cut("grads", views.grads), cut("exp_avgs", views.exp_avgs),
                     cut("exp_avg_sqs", views.exp_avg_sqs), views.step, views.hyper, at)


def segment_count(numel: int, fraction: float) -> int:
    """Segments :func:`segmented` cuts a flat tensor of ``numel`` elements into: as many as keep each segment's
    windows at :data:`MIN_WINDOW_ELEMENTS` or more, at most :data:`MAX_SEGMENTS`."""
    return max(1, min(MAX_SEGMENTS, numel // (window_slots(fraction) * MIN_WINDOW_ELEMENTS)))


def segmented(views: AdamViews, fraction: float) -> AdamViews:
    """``views`` of whole flat partitions (ZeRO-1/2: one per parameter group and rank) with each partition cut into
    :func:`segment_count` equal segments (views), placed at ``position x MAX_SEGMENTS + segment``. Their windows,
    staggered, spread the sample over the partition: a single window would be one run moving across parameters of
    different kinds, and R would change with what it lands on. ``fraction`` >= 1: unchanged."""
    counts = [segment_count(grad.numel(), fraction) for grad in views.grads]
    if fraction >= 1.0 or all(count == 1 for count in counts):
        return views
    at = views.positions if views.positions is not None else range(len(views.grads))

    def cut(tensors: Sequence[torch.Tensor | None]) -> list[Any]:
        pieces: list[Any] = []
        for tensor, count in zip(tensors, counts, strict=True):
            pieces += [None] * count if tensor is None else list(tensor.reshape(-1).tensor_split(count))
        return pieces

    positions = [position * MAX_SEGMENTS + j for position, count in zip(at, counts, strict=True) for j in range(count)]
    return AdamViews(cut(views.params), cut(views.grads), cut(views.exp_avgs), cut(views.exp_avg_sqs), views.step,
                     views.hyper, positions)


def segment_windows(tensor: torch.Tensor | None, count: int, fraction: float, position: int,
                    phase: int) -> list[torch.Tensor | None]:
    """The windows at ``phase`` of the ``count`` :func:`segmented` segments of the flat ``tensor`` (at
    ``position``), cut from ``tensor`` itself (the segments are never made): the same elements as
    ``sample_window(segment_j, fraction, position x MAX_SEGMENTS + j, phase)``."""
    if tensor is None:
        return [None] * count
    numel = tensor.numel()
    base, extra = divmod(numel, count)  # tensor_split: the first ``extra`` segments hold one more element
    windows = []
    for j in range(count):
        size = base + (j < extra)
        start, length = window_bounds(size, fraction, position * MAX_SEGMENTS + j, phase)
        windows.append(flat_piece(tensor, j * base + min(j, extra) + start, length, numel))
    return windows


def sampled_segments(views: AdamViews, fraction: float, cache: WindowCache | None = None,
                     phase: int = 0) -> AdamViews:
    """``sampled(segmented(views, fraction), fraction, cache, phase)`` -- the same windows of whole flat partitions
    -- cut straight from the partitions: no segment views are made, and with a ``cache`` the windows of partitions
    that persist between steps (the fp32 partition, the moments) are cut once per window position. The
    ``positions`` of the result are :func:`segmented`'s."""
    counts = [segment_count(grad.numel(), fraction) for grad in views.grads]
    if fraction >= 1.0 or all(count == 1 for count in counts):
        return sampled(views, fraction, cache, phase)
    cache = cache if cache is not None else WindowCache()
    at = list(views.positions if views.positions is not None else range(len(views.grads)))

    def cut(name: str, tensors: list[Any]) -> list[Any]:
        return cache.windows(name, tensors, fraction, at, phase, counts)

    positions = [position * MAX_SEGMENTS + j for position, count in zip(at, counts, strict=True) for j in range(count)]
    return AdamViews(cut("params", views.params), cut("grads", views.grads), cut("exp_avgs", views.exp_avgs),
                     cut("exp_avg_sqs", views.exp_avg_sqs), views.step, views.hyper, positions)


@dataclass
class _CacheEntry:
    fraction: Any  # the fraction, with the segment counts when the tensors are cut into segments
    refs: list[Any]  # weak references (None for a None tensor): a cached list never keeps a tensor alive
    pointers: list[int]
    by_slot: dict[int, list[Any]]
    has_none: bool = False


@dataclass
class _Bounds:
    """The :func:`window_bounds` of one list's tensors at each window position, for lists cut anew on every step
    (fresh gradients): valid while the tensors have the same sizes at the same positions."""

    key: tuple
    by_slot: dict[int, list[tuple[int, int, int]]]


class WindowCache:
    """The :func:`sample_window` views of one parameter group's tensor lists, one set per window position (phase mod
    K), reused while a list holds the same tensor objects over the same memory (identity and ``data_ptr`` checked on
    every call, so a replaced optimizer state, a swapped ``param.data`` or a fresh ``.grad`` gets new windows).

    Windows are kept only for a list seen three times in a row (parameters, moments, DDP's bucket-view gradients): a
    list of fresh tensors on every step (``zero_grad(set_to_none=True)`` gradients) is cut anew each time and never
    held, since a cached view would keep the previous step's gradient memory alive; for such a list only the window
    bounds are kept (per window position, while the sizes do not change), so cutting it costs one view per tensor.
    At most ``max_views`` views are kept per list name; positions beyond it are cut on each visit."""

    #: Views kept per list name over all window positions (a view costs about 0.6 KB of host memory).
    MAX_VIEWS = 1 << 14

    def __init__(self, max_views: int = MAX_VIEWS) -> None:
        self.max_views = max_views
        self._entries: dict[str, _CacheEntry] = {}
        self._bounds: dict[str, _Bounds] = {}
        self._seen: dict[str, list[int]] = {}  # the ids of the list last cut anew, per list name

    def windows(self, name: str, tensors: Sequence[torch.Tensor | None], fraction: float,
                positions: Sequence[int] | None = None, phase: int = 0,
                segments: Sequence[int] | None = None) -> list[Any]:
        """The windows of ``tensors`` at ``phase``, each placed by its entry of ``positions`` (default: its index in
        ``tensors``). ``segments``: flat tensors cut into that many :func:`segmented` segments each, one window per
        segment (:func:`segment_windows`)."""
        at = positions if positions is not None else range(len(tensors))

        def cut() -> list[Any]:
            if segments is None:
                return self._cut(name, tensors, fraction, at, phase)
            return [window for i, t, count in zip(at, tensors, segments, strict=True)
                    for window in segment_windows(t, count, fraction, i, phase)]

        entry = self._entries.get(name)
        key = fraction if segments is None else (fraction, tuple(segments))
        if entry is None or entry.fraction != key or not _same_tensors(entry, tensors):
            # A list seen for the first time is remembered by its objects' ids alone (a hint, never trusted); only
            # when the next call brings the same ids is it held by weak references and checked as above.
            ids = list(map(id, tensors))
            self._entries.pop(name, None)
            if self._seen.get(name) == ids:
                self._entries[name] = _CacheEntry(key, [None if t is None else weakref.ref(t) for t in tensors],
                                                  _pointers(tensors), {}, not none_free(tensors))
            self._seen[name] = ids
            return cut()
        slot = phase % window_slots(fraction)
        windows = entry.by_slot.get(slot)
        if windows is None:
            windows = cut()
            if (len(entry.by_slot) + 1) * max(1, len(windows)) <= self.max_views:
                entry.by_slot[slot] = windows
        return windows

    def _cut(self, name: str, tensors: Sequence[torch.Tensor | None], fraction: float, at: Sequence[int],
             phase: int) -> list[Any]:
        """:func:`sample_window` of each tensor, with the bounds of this window position kept between calls."""
        if fraction >= 1.0 or not none_free(tensors):
            return [sample_window(t, fraction, i, phase) for i, t in zip(at, tensors, strict=True)]
        key = (fraction, tuple(at), tuple(map(torch.Tensor.numel, tensors)))  # type: ignore[arg-type]
        bounds = self._bounds.get(name)
        if bounds is None or bounds.key != key:
            bounds = self._bounds[name] = _Bounds(key, {})
        slot = phase % window_slots(fraction)
        placed = bounds.by_slot.get(slot)
        if placed is None:
            placed = bounds.by_slot[slot] = [(*window_bounds(n, fraction, i, phase), n)
                                             for i, n in zip(at, key[2], strict=True)]
        return list(map(_piece, tensors, placed))


def _piece(tensor: torch.Tensor, bounds: tuple[int, int, int]) -> torch.Tensor:
    return flat_piece(tensor, *bounds)  # type: ignore[return-value]


_call = weakref.ref.__call__  # operator.call, in Python 3.10


def _pointers(tensors: Sequence[torch.Tensor | None]) -> list[int]:
    return [0 if t is None else t.data_ptr() for t in tensors]


def _same_tensors(entry: _CacheEntry, tensors: Sequence[torch.Tensor | None]) -> bool:
    if len(entry.refs) != len(tensors):
        return False
    if not entry.has_none:  # the common case, with C-level loops: identity, then the memory each tensor is on
        return all(map(operator.is_, map(_call, entry.refs), tensors)) \
            and list(map(torch.Tensor.data_ptr, tensors)) == entry.pointers  # type: ignore[arg-type]
    for ref, tensor in zip(entry.refs, tensors, strict=True):
        if (ref is None) != (tensor is None) or (ref is not None and ref() is not tensor):
            return False
    return _pointers(tensors) == entry.pointers

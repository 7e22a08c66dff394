"""Host-memory snapshots of a rank's training state and a ring of them.

A snapshot holds host copies of this rank's state tensors (in the fixed order :meth:`TrainState.live_tensors`
gives them: parameters or their local shards, buffers, optimizer state), the backend's python-side state
(scheduler, loss scaler, framework counters), the Python / NumPy / torch (CPU and CUDA) RNG states, and any extra
picklable state the caller adds (data position, arc_engine's detector state). Restoring copies every tensor back
*in place*, so every alias a framework keeps (DDP buckets, ZeRO flat buffers, FSDP2 shards) sees the old values,
and the continuation retraces the original run bit for bit.

Replicated state is kept once per replica group, not once per rank: a state that says which of its tensors are
identical on every rank of a process group (``replicated()``: DDP's parameters and optimizer state, ZeRO-1/2's
bit16 parameters) has each rank copy only its share of each such tensor (an even cut of its elements); a restore
puts the shares back together with all-gathers over that group, through a staging buffer of bounded size
(:func:`restore` is then collective over the group -- restores are agreed, every rank makes them together).
"""

from __future__ import annotations

import copy
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from arc_engine import internals
from arc_engine.recovery.staging import DTensor, bounded_runs, with_local
from arc_engine.recovery.state import TrainState
from arc_engine.recovery.state_dict_cache import layout


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from on this rank (CUDA only when it is already initialized)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": cuda}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


def to_host(obj: Any) -> Any:
    """A deep copy of ``obj`` with every tensor cloned to CPU memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: to_host(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(value) for value in obj)
    return copy.deepcopy(obj)


def tensor_bytes(obj: Any) -> int:
    """Bytes held by the tensors inside ``obj`` (nested dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(value) for value in obj)
    return 0


def _signature(tensors: list[torch.Tensor]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


@dataclass(frozen=True)
class Snapshot:
    """One rank's training state at the start of optimizer step ``step`` (before its forward pass)."""

    step: int
    tensors: list[torch.Tensor]
    framework: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    has_tensors: bool = True  # False: python state only (capture(..., tensors=False)); cannot be restored
    #: CUDA state: {device: event recorded once its device-to-host copies are done} (None: the copies are done)
    copied: dict[torch.device, Any] | None = None

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.tensors)

    def fence(self) -> None:
        """Make later work on the current CUDA streams wait for this snapshot's copies (device-side, no host sync).
        Call before anything writes the live tensors (the optimizer's update). A no-op on CPU."""
        for device, event in (self.copied or {}).items():
            torch.cuda.current_stream(device).wait_event(event)

    def wait(self) -> None:
        """Block the host until the copies are in the host buffers (before the host reads them). A no-op on CPU."""
        for event in (self.copied or {}).values():
            event.synchronize()


_all_gather_flat = internals.all_gather_flat

#: the largest staging buffer a restore of replicated state all-gathers into, in elements
RESTORE_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Replication:
    """Which live tensors are identical on every rank of ``group`` (``size`` ranks, this one ``rank`` among them):
    each rank snapshots only its share of them."""

    group: Any
    indices: frozenset[int]
    rank: int
    size: int


def replication(state: TrainState, live: list[torch.Tensor]) -> Replication | None:
    """The state's replicated tensors (:meth:`TrainState.replicated`), contiguous ones only; None when it has none
    or the group has one rank."""
    spec = state.replicated()
    if spec is None or not (dist.is_available() and dist.is_initialized()):
        return None
    group, indices = spec
    size = dist.get_world_size(group)
    chosen = frozenset(i for i in indices if 0 <= i < len(live) and live[i].is_contiguous() and live[i].numel())
    if size <= 1 or not chosen:
        return None
    return Replication(group, chosen, dist.get_rank(group), size)


def share_bounds(numel: int, size: int, rank: int) -> tuple[int, int, int]:
    """(start, stop, padded length) of rank ``rank``'s share of ``numel`` elements cut evenly over ``size`` ranks:
    every share is ``ceil(numel / size)`` long but the last ones, which may be shorter or empty. Pure."""
    padded = -(-numel // size)
    start = min(rank * padded, numel)
    return start, min(start + padded, numel), padded


def snapshot_sources(live: list[torch.Tensor], rep: Replication | None) -> list[torch.Tensor]:
    """What a snapshot copies of each live tensor: the tensor, or this rank's share of a replicated one (a view)."""
    if rep is None:
        return live
    sources = []
    for index, tensor in enumerate(live):
        if index in rep.indices:
            start, stop, _ = share_bounds(tensor.numel(), rep.size, rep.rank)
            tensor = tensor.reshape(-1)[start:stop]
        sources.append(tensor)
    return sources


def host_buffers(live: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host tensors shaped like ``live`` to capture into: pinned when the state is on a CUDA device (so the copies
    run at full bandwidth), pageable otherwise."""
    pin = any(t.is_cuda for t in live)
    return [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for t in live]


def state_bytes(state: TrainState) -> int:
    """Bytes a snapshot of ``state``'s tensors holds on this rank (its shares of replicated tensors; nothing is
    copied)."""
    live = state.live_tensors()
    return sum(t.numel() * t.element_size() for t in snapshot_sources(live, replication(state, live)))


@torch.no_grad()
def capture(step: int, state: TrainState, extra: dict[str, Any] | None = None,
            rng: dict[str, Any] | None = None, *, into: list[torch.Tensor] | None = None,
            tensors: bool = True) -> Snapshot:
    """Copy this rank's state to host memory. Local (no communication). On CPU it returns once the copies are
    done; on CUDA the copies run without blocking the host -- the tensors the forward writes on the current stream,
    the others on a side stream that overlaps the next forward -- so call :meth:`Snapshot.fence` before anything
    writes the live tensors and :meth:`Snapshot.wait` before the host reads the copies (``restore`` does).
    ``rng``: the RNG states to record (default: now's). ``into``: host buffers of an earlier snapshot to reuse (used
    when their shapes and dtypes still match; see :class:`SnapshotRing` for the ones it hands back).
    ``tensors=False``: the python state only (for a verified state that is only ever saved to disk from the live
    tensors, never restored from memory)."""
    copies: list[torch.Tensor] = []
    copied = None
    if tensors:
        whole = state.live_tensors()
        live = snapshot_sources(whole, replication(state, whole))
        copies = into if into is not None and _signature(into) == _signature(live) else host_buffers(live)
        if any(t.is_cuda for t in live):
            copied = _copy_from_cuda(copies, live, _forward_written(state, len(live)))
        else:
            for target, source in zip(copies, live, strict=True):
                target.copy_(source.detach())
    return Snapshot(step, copies, to_host(state.extra_state()), rng if rng is not None else rng_state(),
                    to_host(extra or {}), has_tensors=tensors, copied=copied)


def _forward_written(state: TrainState, count: int) -> set[int]:
    """Indices of ``state``'s live tensors that the forward pass may write (module buffers: running statistics):
    its ``forward_written()`` where it says, else all of them (every copy then goes before the forward)."""
    written = state.forward_written()
    return set(written) if written is not None else set(range(count))


_side_streams: dict[torch.device, Any] = {}


def _copy_from_cuda(copies: list[torch.Tensor], live: list[torch.Tensor], early: set[int]) -> dict[torch.device, Any]:
    """Device-to-host copies into the (pinned) ``copies`` that do not block the host: the tensors in ``early`` (which
    the forward writes) on the current stream, so they are copied before the forward runs; the others on a side
    stream per device, which first waits for the current stream and then overlaps the next forward. Returns each
    device's event recorded after its copies; the optimizer must not write the live tensors before it (see
    :meth:`Snapshot.fence`)."""
    late: dict[torch.device, list[int]] = {}
    for index, (target, source) in enumerate(zip(copies, live, strict=True)):
        if not source.is_cuda:
            target.copy_(source.detach())
        elif index in early:
            target.copy_(source.detach(), non_blocking=True)
        else:
            late.setdefault(source.device, []).append(index)
    events = {}
    for device in {t.device for t in live if t.is_cuda}:
        side = _side_streams.get(device)
        if side is None:
            side = _side_streams[device] = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))  # the state as the previous step left it
        with torch.cuda.stream(side):
            for index in late.get(device, []):
                source = live[index].detach()
                copies[index].copy_(source, non_blocking=True)
                source.record_stream(side)
            event = torch.cuda.Event()
            event.record(side)
        events[device] = event
    return events


@torch.no_grad()
def restore(snapshot: Snapshot, state: TrainState) -> dict[str, Any]:
    """Put ``snapshot`` back in place: every state tensor, the framework state, the RNG. Returns a copy of its
    ``extra``; the snapshot itself stays intact. Local, but for ``state.load_extra_state`` (collective for some
    backends: call on every rank together). Raises RuntimeError when the live state no longer has the
    snapshot's structure (e.g. the optimizer re-created its state tensors with other shapes). With replicated
    tensors (see the module docstring) it is collective over their group."""
    if not snapshot.has_tensors:
        raise RuntimeError(f"arc_engine: the snapshot of step {snapshot.step} holds no tensors (taken for a disk "
                           "save only) and cannot be restored")
    snapshot.wait()
    live = state.live_tensors()
    rep = replication(state, live)
    if _signature(snapshot_sources(live, rep)) != _signature(snapshot.tensors):
        raise RuntimeError(f"arc_engine: cannot restore the snapshot of step {snapshot.step}: the live training "
                           f"state has {len(live)} tensors, the snapshot {len(snapshot.tensors)} (or shapes differ)")
    for index, (target, saved) in enumerate(zip(live, snapshot.tensors, strict=True)):
        if rep is None or index not in rep.indices:
            target.copy_(saved, non_blocking=False)
    if rep is not None:
        _restore_replicated(live, snapshot.tensors, rep)
    state.load_extra_state(copy.deepcopy(snapshot.framework))
    set_rng_state(snapshot.rng)
    return copy.deepcopy(snapshot.extra)


def _restore_replicated(live: list[torch.Tensor], shares: list[torch.Tensor], rep: Replication) -> None:
    """Each replicated live tensor from every rank's share: per (device, dtype), runs of tensors whose padded shares
    fit :data:`RESTORE_CHUNK_ELEMENTS` over the group, one all-gather each. Collective over ``rep.group``; every
    rank walks the same tensors in the same order."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}  # one staging buffer holds one dtype
    for index in sorted(rep.indices):
        by_kind.setdefault((live[index].device, live[index].dtype), []).append(index)
    per_rank_limit = max(1, RESTORE_CHUNK_ELEMENTS // rep.size)
    runs = [run for indices in by_kind.values()
            for run in bounded_runs(indices, [share_bounds(live[i].numel(), rep.size, 0)[2] for i in indices],
                                    per_rank_limit)]
    on_device = "nccl" in str(dist.get_backend(rep.group))  # else (gloo) the all-gather runs on host tensors
    for run in runs:
        first = live[run[0]]
        device = first.device if on_device else torch.device("cpu")
        padded = [share_bounds(live[i].numel(), rep.size, rep.rank)[2] for i in run]
        mine = torch.zeros(sum(padded), dtype=first.dtype, device=device)
        offset = 0
        for index, length in zip(run, padded, strict=True):
            share = shares[index]
            mine[offset:offset + share.numel()].copy_(share)
            offset += length
        gathered = torch.empty(rep.size * mine.numel(), dtype=first.dtype, device=device)
        _all_gather_flat(gathered, mine, group=rep.group)
        rows = gathered.view(rep.size, -1)
        offset = 0
        for index, length in zip(run, padded, strict=True):
            target = live[index]
            target.view(-1).copy_(rows[:, offset:offset + length].reshape(-1)[:target.numel()])
            offset += length


def from_snapshot(state_dict: Any, live: list[torch.Tensor],
                  copies: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """``state_dict`` (a :class:`TrainState`'s ``dcp_state_dict``: nested dicts and lists of its live tensors, plain or
    DTensor) with each tensor that *is* one of ``live`` -- the same memory, shape, strides and dtype, contiguous --
    replaced by its host copy in ``copies`` (a snapshot of ``live``, in the same order), and the copies it used.
    Valid while the live state still equals the snapshot (a disk save of the verified state, before the step's
    update): the save then writes the snapshot's host copies instead of staging the same bytes again. A tensor with
    no match stays as it is (the checkpoint stages it)."""
    by_identity = {layout(t): c for t, c in zip(live, copies, strict=True)
                   if t.numel() and t.is_contiguous() and c.shape == t.shape and c.dtype == t.dtype}
    used: list[torch.Tensor] = []

    def swap(obj: Any) -> Any:
        if isinstance(obj, DTensor):
            local = obj.to_local()
            copy_ = by_identity.get(layout(local)) if local.numel() else None
            if copy_ is None:
                return obj
            used.append(copy_)
            return with_local(obj, copy_)
        if isinstance(obj, torch.Tensor):
            copy_ = by_identity.get(layout(obj)) if obj.numel() else None
            if copy_ is None:
                return obj
            used.append(copy_)
            return copy_
        if isinstance(obj, dict):
            return {key: swap(value) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(swap(value) for value in obj)
        return obj

    return swap(state_dict), used


class SnapshotRing:
    """The newest ``capacity`` snapshots, oldest evicted first.

    Capacity is a count, not bytes, so that every rank holds snapshots of the same steps even when their shards
    differ in size: derive it from the byte budget and the largest rank's snapshot (:func:`ring_capacity`)."""

    def __init__(self, capacity: int, busy: Callable[[Snapshot], bool] | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._ring: deque[Snapshot] = deque()
        self._spare: list[torch.Tensor] | None = None
        #: a snapshot whose host buffers something still reads (a disk save written from them): never reused
        self.busy = busy if busy is not None else (lambda snapshot: False)

    def push(self, snapshot: Snapshot) -> bool:
        """Keep ``snapshot``, evicting the oldest as needed (their host buffers go to :meth:`spare_buffers`). False
        when the capacity is 0."""
        if self.capacity == 0:
            return False
        while len(self._ring) >= self.capacity:
            self.recycle(self._ring.popleft())
        self._ring.append(snapshot)
        return True

    def recycle(self, snapshot: Snapshot | None) -> None:
        """Keep the host buffers of a snapshot no longer needed (evicted, or a candidate that was not verified) for
        the next capture. At most one set is kept: with the ring full, every capture reuses the evicted one's. The
        buffers of a :attr:`busy` snapshot are not kept (the next capture allocates)."""
        if snapshot is not None and snapshot.has_tensors and snapshot.tensors and not self.busy(snapshot):
            self._spare = snapshot.tensors

    def spare_buffers(self) -> list[torch.Tensor] | None:
        """Host buffers to capture into (taken: the caller owns them), or None to allocate."""
        spare, self._spare = self._spare, None
        return spare

    def latest(self) -> Snapshot | None:
        return self._ring[-1] if self._ring else None

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self._ring)

    @property
    def steps(self) -> list[int]:
        return [s.step for s in self._ring]

    def __len__(self) -> int:
        return len(self._ring)


#: snapshots an unset ``recovery.memory_ring_mb`` makes room for, and the share of host memory it may take
AUTO_RING_SNAPSHOTS, AUTO_RING_HOST_SHARE = 2, 0.25


def ring_budget_bytes(configured_mb: float | None, largest_snapshot_bytes: int, host_bytes: int,
                      ranks_on_host: int) -> float:
    """The ring's byte budget: ``configured_mb``, or when unset room for :data:`AUTO_RING_SNAPSHOTS` snapshots of the
    largest rank within :data:`AUTO_RING_HOST_SHARE` of the host's memory split over its ranks (no limit when the
    host's memory is unknown). Pure."""
    if configured_mb is not None:
        return configured_mb * 2**20
    wanted = float(AUTO_RING_SNAPSHOTS * largest_snapshot_bytes)
    if host_bytes <= 0:
        return wanted
    return min(wanted, AUTO_RING_HOST_SHARE * host_bytes / max(1, ranks_on_host))


def ring_capacity(budget_bytes: float, largest_snapshot_bytes: int) -> int:
    """How many snapshots of the largest rank fit in ``budget_bytes`` (0: the ring is off, disk tier only)."""
    if largest_snapshot_bytes <= 0:
        return 1 if budget_bytes > 0 else 0
    return int(budget_bytes // largest_snapshot_bytes)

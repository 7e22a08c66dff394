"""Staging for the asynchronous checkpoint: copy what this rank will write into reused host buffers.

The caller's training stall is the staging copy, so it is kept small two ways:

* buffers are reused across saves: ``copy_`` into a warm buffer costs a fraction of a fresh clone (no allocation,
  no page faults);
* a replicated plain tensor (the same key, shape and dtype on several ranks, e.g. DDP weights and optimizer state)
  is written once by DCP anyway, so only one rank (``ReplicaOwners``, balanced by bytes) stages it and passes it to
  DCP; the others leave it out. With DDP on N ranks each rank copies about 1/N of the state.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


def bounded_runs(indices: list[int], sizes: list[int], limit: int) -> list[list[int]]:
    """``indices`` in order, cut into runs whose ``sizes`` add up to at most ``limit`` (a larger one alone): the
    tensors that go through one bounded staging buffer together. Pure."""
    runs: list[list[int]] = []
    total = limit + 1
    for index, size in zip(indices, sizes, strict=True):
        if total + size > limit:
            runs.append([])
            total = 0
        runs[-1].append(index)
        total += size
    return runs

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import DTensor

#: a position inside a nested state dict: the keys / list indices leading to it
KeyPath = tuple


def plain_tensors(obj: Any, path: KeyPath = ()) -> Iterator[tuple[KeyPath, torch.Tensor]]:
    """Every plain (non-DTensor) tensor inside nested dicts, lists and tuples, with its path."""
    if isinstance(obj, DTensor):
        return
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from plain_tensors(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from plain_tensors(value, (*path, index))


def with_local(dtensor: DTensor, local: torch.Tensor) -> DTensor:
    """``dtensor`` with its local shard replaced by ``local`` (a host copy of it): same mesh, placements and global
    shape, no communication."""
    return DTensor.from_local(local, dtensor.device_mesh, dtensor.placements, run_check=False, shape=dtensor.shape,
                              stride=dtensor.stride())


def assign_owners(per_rank: list[list[tuple[KeyPath, tuple, str, int]]]) -> dict[KeyPath, int]:
    """The rank that stages each replicated tensor, from every rank's ``(path, shape, dtype, nbytes)`` list. Pure.

    A path held by several ranks with one shape and dtype is replicated: it goes to the holder with the fewest bytes
    so far (ranks start with their unshared tensors). Paths on one rank, or with differing shapes, get no entry:
    every holder stages them (DCP then decides, or rejects a genuine mismatch)."""
    load = [0] * len(per_rank)
    holders: dict[KeyPath, list[tuple[int, tuple, str, int]]] = {}
    for rank, entries in enumerate(per_rank):
        for path, shape, dtype, nbytes in entries:
            holders.setdefault(path, []).append((rank, shape, dtype, nbytes))
    replicated = []
    for path, held in holders.items():
        if len(held) > 1 and len({(shape, dtype) for _, shape, dtype, _ in held}) == 1:
            replicated.append((held[0][3], repr(path), path, [rank for rank, *_ in held]))
        else:
            for rank, _, _, nbytes in held:
                load[rank] += nbytes
    owners = {}
    for nbytes, _, path, ranks in sorted(replicated, key=lambda item: (-item[0], item[1])):
        owner = min(ranks, key=lambda rank: (load[rank], rank))
        load[owner] += nbytes
        owners[path] = owner
    return owners


class ReplicaOwners:
    """Which rank stages each replicated tensor, agreed across the checkpoint group and cached per state layout.

    ``skipped`` is collective: one all_gather of a 64-bit layout hash per save; when any rank's layout changed, one
    all_gather_object of the layouts and a new assignment. Call it on every rank of ``group`` from the main thread,
    with no other collective of the group in flight."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self._hashes: list[int] | None = None
        self._skipped: frozenset[KeyPath] = frozenset()

    def skipped(self, state_dict: dict[str, Any]) -> frozenset[KeyPath]:
        """Paths of the plain tensors this rank leaves to another rank. Collective (see the class)."""
        layout = [(path, tuple(t.shape), str(t.dtype), t.numel() * t.element_size())
                  for path, t in plain_tensors(state_dict)]
        digest = hashlib.blake2b(repr(layout).encode(), digest_size=8).digest()
        local = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        gathered = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local, group=self.group)
        hashes = [int(value.item()) for value in gathered]
        if hashes != self._hashes:
            per_rank: list[Any] = [None] * self.world_size
            dist.all_gather_object(per_rank, layout, group=self.group)
            owners = assign_owners(per_rank)
            self._skipped = frozenset(path for path, owner in owners.items() if owner != self.rank)
            self._hashes = hashes
        return self._skipped


class HostStager:
    """Copies a state dict's tensors into host buffers reused across saves; Python objects are deep-copied. Local.

    ``stage(state_dict, skipped, stable)`` leaves out the plain tensors at the ``skipped`` paths and passes the host
    tensors whose ``id()`` is in ``stable`` through uncopied (the caller keeps them unchanged until the save is
    done, e.g. a verified snapshot's copies). The buffers of one call stay in use until the next: the caller must
    not stage again while a save still reads the previous result."""

    def __init__(self) -> None:
        self._buffers: dict[KeyPath, torch.Tensor] = {}
        self._copy_devices: set[torch.device] = set()  # CUDA devices this call copied from
        self._stable: frozenset[int] = frozenset()

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def stage(self, state_dict: dict[str, Any], skipped: frozenset[KeyPath] = frozenset(),
              stable: frozenset[int] = frozenset()) -> dict[str, Any]:
        previous, self._buffers, self._copy_devices = self._buffers, {}, set()
        self._stable = stable
        staged = self._copy(state_dict, (), previous, skipped)
        # The device-to-host copies into pinned buffers were non-blocking and the writer reads the buffers: wait for
        # the copies only (an event on each source device's current stream, where they were queued), not for the
        # whole device. The save's one host wait (a disk save is periodic).
        for device in self._copy_devices:
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(device))
            copied.synchronize()
        return staged

    def _copy(self, obj: Any, path: KeyPath, previous: dict[KeyPath, torch.Tensor], skipped: frozenset[KeyPath]) -> Any:
        if isinstance(obj, DTensor):
            return with_local(obj, self._copy_tensor(obj.to_local(), path, previous))
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj, path, previous)
        if isinstance(obj, dict):
            return {key: self._copy(value, (*path, key), previous, skipped) for key, value in obj.items()
                    if (*path, key) not in skipped}
        if isinstance(obj, (list, tuple)):
            # Lists keep every position (DCP addresses list items by index); a skipped tensor there is still staged.
            return type(obj)(self._copy(value, (*path, i), previous, frozenset()) for i, value in enumerate(obj))
        return copy.deepcopy(obj)

    def _copy_tensor(self, source: torch.Tensor, path: KeyPath, previous: dict[KeyPath, torch.Tensor]) -> torch.Tensor:
        if id(source) in self._stable and source.device.type == "cpu":
            return source
        buffer = previous.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
        buffer.copy_(source.detach(), non_blocking=source.is_cuda)
        if source.is_cuda:
            self._copy_devices.add(source.device)
        self._buffers[path] = buffer
        return buffer

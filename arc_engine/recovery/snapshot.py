"""Host-memory snapshots of a rank's training state and a ring of them bounded in bytes.

A snapshot holds this rank's model and optimizer state dicts (tensors copied to host memory, so training can
mutate the live ones), the Python / NumPy / torch (CPU and CUDA) RNG states, the step, and any extra picklable
state the caller adds (data position, arc_engine's own detector state). Restoring puts all of it back bitwise.
This is the in-memory tier of the ARC rollback (verified-stable snapshots, usually no disk read needed); the
persistent DCP tier and the rollback policy build on it.
"""

from __future__ import annotations

import copy
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


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


@dataclass(frozen=True)
class Snapshot:
    """One rank's training state at the start of optimizer step ``step``."""

    step: int
    model: dict[str, Any]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.model) + tensor_bytes(self.optimizer)


def capture(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            extra: dict[str, Any] | None = None) -> Snapshot:
    """Copy this rank's state to host memory. Local (no communication); blocks until the copies are done.
    ``model``: the module whose ``state_dict`` to keep (for DDP pass ``ddp.module`` or the wrapper alike)."""
    return Snapshot(step, to_host(model.state_dict()), to_host(optimizer.state_dict()), rng_state(),
                    to_host(extra or {}))


def restore(snapshot: Snapshot, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Put ``snapshot`` back: parameters and buffers in place, optimizer state, RNG. Returns a copy of its
    ``extra``. The snapshot itself is left intact, so it can be restored again."""
    model.load_state_dict(snapshot.model)
    optimizer.load_state_dict(copy.deepcopy(snapshot.optimizer))
    set_rng_state(snapshot.rng)
    return copy.deepcopy(snapshot.extra)


class SnapshotRing:
    """The newest snapshots whose total size stays within ``max_bytes`` (oldest evicted first)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._ring: deque[Snapshot] = deque()

    def push(self, snapshot: Snapshot) -> bool:
        """Keep ``snapshot``, evicting the oldest as needed. False (nothing kept or evicted) when the snapshot
        alone exceeds ``max_bytes``: the caller must fall back to the disk tier."""
        if snapshot.nbytes > self.max_bytes:
            return False
        while self._ring and self.total_bytes + snapshot.nbytes > self.max_bytes:
            self._ring.popleft()
        self._ring.append(snapshot)
        return True

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

"""The layout of a step's statistics in one flat buffer, and the buffer each rank fills.

Every producer (a DDP comm hook, an optimizer hook, a sharded-optimizer adapter, a monitor) registers named
slots once, before the first monitored step. All ranks of the group must register the same slots in the same
order: the layout's fingerprint is checked across ranks when the pipeline starts.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

import torch


class Reduce(enum.Enum):
    """How a slot's per-rank values combine into the global value.

    ``PER_RANK``: each rank's own observation (loss, local gradient norm); the global view is the vector.
    ``SUM``: each rank holds a partial sum of a sharded quantity (squared norm of its parameter shard);
    the global value is the sum over ranks.
    ``REPLICATED``: every rank should hold the same value (a gradient norm after DDP's all-reduce); the
    global value is the first rank's, and the spread across ranks is itself a consistency signal.
    """

    PER_RANK = "per_rank"
    SUM = "sum"
    REPLICATED = "replicated"


@dataclass(frozen=True)
class StatSpec:
    """One named slot: ``size`` consecutive float64 entries at ``offset``."""

    name: str
    size: int
    reduce: Reduce
    offset: int

    @property
    def span(self) -> slice:
        return slice(self.offset, self.offset + self.size)


class StatLayout:
    """An ordered, append-only registry of statistic slots; frozen when the pipeline starts."""

    def __init__(self) -> None:
        self._specs: dict[str, StatSpec] = {}
        self._size = 0
        self._frozen = False

    def add(self, name: str, size: int, reduce: Reduce) -> StatSpec:
        """Register slot ``name`` (idempotent for an identical spec). Raises after :meth:`freeze`."""
        existing = self._specs.get(name)
        if existing is not None:
            if (existing.size, existing.reduce) != (size, reduce):
                raise ValueError(f"statistic {name!r} already registered as {existing}")
            return existing
        if self._frozen:
            raise RuntimeError(f"cannot add statistic {name!r}: the layout is frozen once monitoring starts")
        if size < 1:
            raise ValueError(f"statistic {name!r}: size must be >= 1, got {size}")
        spec = StatSpec(name, size, reduce, self._size)
        self._specs[name] = spec
        self._size += size
        return spec

    def freeze(self) -> None:
        self._frozen = True

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def size(self) -> int:
        return self._size

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def __getitem__(self, name: str) -> StatSpec:
        return self._specs[name]

    def specs(self) -> list[StatSpec]:
        return list(self._specs.values())

    def fingerprint(self) -> int:
        """A 52-bit digest of names, sizes and reductions (exactly representable in float64)."""
        text = ";".join(f"{s.name}:{s.size}:{s.reduce.value}" for s in self._specs.values())
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 12


class StatBuffer:
    """One rank's statistics for the current step: a flat float64 device tensor laid out by a StatLayout.

    Writers call :meth:`put`, :meth:`add` or :meth:`index_add` with device tensors; nothing here synchronizes
    with the host.
    """

    def __init__(self, layout: StatLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.values = torch.zeros(layout.size, dtype=torch.float64, device=device)

    def view(self, name: str) -> torch.Tensor:
        return self.values[self.layout[name].span]

    def put(self, name: str, value: torch.Tensor | float) -> None:
        """Overwrite slot ``name`` with ``value`` (a scalar broadcasts to the slot's size)."""
        slot = self.view(name)
        if isinstance(value, torch.Tensor):
            slot.copy_(value.detach().reshape(-1))
        else:
            slot.fill_(float(value))

    def add(self, name: str, value: torch.Tensor) -> None:
        """Accumulate ``value`` into slot ``name`` (e.g. one DDP bucket's contribution)."""
        self.view(name).add_(value.detach().to(torch.float64).reshape(-1))

    def index_add(self, name: str, index: torch.Tensor, value: torch.Tensor) -> None:
        """``slot[index[i]] += value[i]``: scatter per-parameter values into per-group entries."""
        self.view(name).index_add_(0, index, value.detach().to(torch.float64))

    def reset(self) -> None:
        self.values.zero_()

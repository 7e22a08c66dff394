"""The layout of a step's statistics in one flat buffer, and the buffer each rank fills.

Every producer (a DDP comm hook, an optimizer hook, a sharded-optimizer adapter, a monitor family) registers named
slots once, before the first monitored step. All ranks of the decision group must register the same slots in the
same order: the layout's fingerprint is checked across ranks when the pipeline starts.

Each slot declares how the ranks' values combine (:class:`Reduce`). When the layout is frozen, slots are placed by
kind -- the SUM block, then the MAX block, then the per-rank detail -- so the per-step agreement reduces two
contiguous ranges of the buffer and never touches the detail.
"""

from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass, replace

import torch


class Reduce(enum.Enum):
    """How a slot's per-rank values combine into the one value every rank agrees on.

    ``SUM``: each rank holds a partial sum (the squared norm of its shard, a count, a flag that is 0 or 1); the
    agreed value is the sum over the decision group. Producers contribute each element once across the job (a
    sharded parameter on the rank holding the shard, a replicated one on its owner: see
    :mod:`arc_engine.stats.partition`), so the sum is exact whatever the parallel layout. NaN/Inf propagate, so a
    non-finite value on any rank makes the agreed value non-finite.
    ``MAX``: the agreed value is the largest over ranks (encode a minimum as a negated value, "any" as a 0/1 flag,
    and the rank holding the maximum as a max-encoded rank id). Producers write finite values: a NaN's ordering is
    backend-defined.
    ``REPLICATED``: every rank holds the same value (e.g. a gradient norm after DDP's all-reduce computed by every
    rank); only the decision group's first rank contributes to the SUM block, so the agreed value is its value.
    ``DETAIL``: each rank's own observation that only makes sense per rank (a gradient sketch); not reduced. Every
    slot's per-rank values -- detail or not -- are fetched by a second, rare collective only on a step where a
    monitor asks for them (:meth:`arc_engine.stats.pipeline.AgreedStats.per_rank`).
    """

    SUM = "sum"
    MAX = "max"
    REPLICATED = "replicated"
    DETAIL = "detail"


#: Placement order of the kinds in the frozen buffer: the SUM all-reduce covers SUM and REPLICATED slots.
_ORDER = (Reduce.SUM, Reduce.REPLICATED, Reduce.MAX, Reduce.DETAIL)


@dataclass(frozen=True)
class StatSpec:
    """One named slot: ``size`` consecutive float64 entries at ``offset`` (-1 until the layout is frozen).

    ``group_size``: for a SUM over the shards of a smaller process group than the decision group (say the tensor-
    parallel shards of a layer, each data-parallel copy holding the same shards), the size of that group; the agreed
    value is then the sum over one copy (the decision group's sum divided by the number of copies). 0: the shards
    span the decision group (each element counted once across the job)."""

    name: str
    size: int
    reduce: Reduce
    offset: int = -1
    group_size: int = 0

    @property
    def span(self) -> slice:
        assert self.offset >= 0, f"statistic {self.name!r}: the layout is not frozen yet"
        return slice(self.offset, self.offset + self.size)


class StatLayout:
    """An ordered, append-only registry of statistic slots; frozen when the pipeline starts."""

    def __init__(self) -> None:
        self._specs: dict[str, StatSpec] = {}
        self._frozen = False
        self._blocks: dict[Reduce, slice] = {}

    def add(self, name: str, size: int, reduce: Reduce, group_size: int = 0) -> StatSpec:
        """Register slot ``name`` (idempotent for an identical spec). Raises after :meth:`freeze`. ``group_size``:
        see :class:`StatSpec` (SUM slots only)."""
        existing = self._specs.get(name)
        if existing is not None:
            if (existing.size, existing.reduce, existing.group_size) != (size, reduce, group_size):
                raise ValueError(f"statistic {name!r} already registered as {existing}")
            return existing
        if self._frozen:
            raise RuntimeError(f"cannot add statistic {name!r}: the layout is frozen once monitoring starts")
        if size < 1:
            raise ValueError(f"statistic {name!r}: size must be >= 1, got {size}")
        if not isinstance(reduce, Reduce):
            raise ValueError(f"statistic {name!r}: reduce must be a Reduce, got {reduce!r}")
        if group_size < 0 or (group_size and reduce is not Reduce.SUM):
            raise ValueError(f"statistic {name!r}: group_size {group_size} needs reduce SUM and a size >= 1")
        spec = StatSpec(name, size, reduce, group_size=group_size)
        self._specs[name] = spec
        return spec

    def freeze(self) -> None:
        """Place every slot (by kind, then registration order) and refuse further additions. Idempotent."""
        if self._frozen:
            return
        offset = 0
        for kind in _ORDER:
            start = offset
            for name, spec in self._specs.items():
                if spec.reduce is kind:
                    self._specs[name] = replace(spec, offset=offset)
                    offset += spec.size
            self._blocks[kind] = slice(start, offset)
        self._frozen = True

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def size(self) -> int:
        return sum(spec.size for spec in self._specs.values())

    def block(self, *kinds: Reduce) -> slice:
        """The contiguous range holding the slots of ``kinds`` (adjacent in placement order). Frozen layouts only."""
        assert self._frozen, "the layout is not frozen yet"
        spans = [self._blocks[kind] for kind in kinds]
        return slice(min(s.start for s in spans), max(s.stop for s in spans))

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def __getitem__(self, name: str) -> StatSpec:
        return self._specs[name]

    def specs(self) -> list[StatSpec]:
        return list(self._specs.values())

    def fingerprint(self) -> int:
        """A 52-bit digest of names, sizes and reductions (exactly representable in float64)."""
        text = ";".join(f"{s.name}:{s.size}:{s.reduce.value}:{s.group_size}" for s in self._specs.values())
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 12


class StatBuffer:
    """One rank's statistics for the current step: a flat float64 device tensor laid out by a frozen StatLayout.

    Writers call :meth:`put`, :meth:`add` or :meth:`index_add` with device tensors; nothing here synchronizes
    with the host.
    """

    def __init__(self, layout: StatLayout, device: torch.device) -> None:
        assert layout.frozen, "freeze the layout before creating its buffer"
        self.layout = layout
        self.device = device
        self.values = torch.zeros(layout.size, dtype=torch.float64, device=device)
        self._max_block = layout.block(Reduce.MAX)
        self.reset()

    def view(self, name: str) -> torch.Tensor:
        return self.values[self.layout[name].span]

    def put(self, name: str, value: torch.Tensor | float) -> None:
        """Overwrite slot ``name`` with ``value`` (a scalar broadcasts to the slot's size)."""
        slot = self.view(name)
        if isinstance(value, torch.Tensor):
            slot.copy_(value.detach().reshape(-1))  # copy_ moves it to the buffer's device
        else:
            slot.fill_(float(value))

    def add(self, name: str, value: torch.Tensor) -> None:
        """Accumulate ``value`` into slot ``name`` (e.g. one DDP bucket's contribution)."""
        self.view(name).add_(value.detach().to(self.values.device, torch.float64).reshape(-1))

    def index_add(self, name: str, index: torch.Tensor, value: torch.Tensor) -> None:
        """``slot[index[i]] += value[i]``: scatter per-parameter values into per-group entries."""
        device = self.values.device
        self.view(name).index_add_(0, index.to(device), value.detach().to(device, torch.float64))

    def reset(self) -> None:
        """Zeros, and -inf in the MAX slots (the identity of MAX: a rank that writes nothing there changes nothing)."""
        self.values.zero_()
        if self._max_block.stop > self._max_block.start:
            self.values[self._max_block].fill_(-math.inf)

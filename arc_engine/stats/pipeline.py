"""Job-wide agreement on a step's statistics: one fixed-size all-reduce per monitored step.

Each rank fills a :class:`~arc_engine.stats.layout.StatBuffer`; :meth:`StatsPipeline.agree` reduces its SUM block
(and, only when the layout has MAX slots, its MAX block) over the decision group and copies the result to the host
once. The bytes moved and the host work depend on the layout's size, not on the number of ranks, so a monitored
step costs the same on 8 ranks and on 16,384 (``scripts/bench_agreement.py``; ``docs/agreement.md``).

Two more collectives, each only when a monitor asks, on a branch taken from agreed values (so every rank of the
group joins it at the same point): :meth:`AgreedStats.follow_up`, a second fixed-size reduction on a periodic step
(its size is the monitor's, not the number of ranks': who is slowest, through :mod:`arc_engine.stats.rank_keys`);
and :meth:`AgreedStats.per_rank`, one all-gather of every rank's buffer, on a step that raised a finding (a fault
being diagnosed, never a healthy or periodic step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from arc_engine import internals
from arc_engine.stats.layout import Reduce, StatBuffer, StatLayout

_all_gather_flat = internals.all_gather_flat


def dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` in group-rank order ([0] without torch.distributed)."""
    if not dist_ready():
        return [0]
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def stats_device(group: dist.ProcessGroup | None, preference: str = "auto",
                 model_device: torch.device | None = None) -> torch.device:
    """The device the statistics buffer should live on for ``group``'s backend.

    ``auto``: a CUDA device when the group's backend includes NCCL and CUDA is available -- the model's
    (``model_device``, when it is a CUDA device), else the current one -- otherwise CPU. ``cuda``: the same CUDA
    device, required. Never touches CUDA unless it is selected.
    """
    if preference == "cpu":
        return torch.device("cpu")
    if preference == "cuda" and not torch.cuda.is_available():
        raise ValueError("stats.device = 'cuda' but CUDA is not available")
    wants_cuda = preference == "cuda" or (
        dist_ready() and "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available())
    if not wants_cuda:
        return torch.device("cpu")
    if model_device is not None and model_device.type == "cuda" and model_device.index is not None:
        return model_device
    return torch.device("cuda", torch.cuda.current_device())


def model_device(params: Sequence[torch.Tensor]) -> torch.device | None:
    """The device of the first parameter (None without parameters): where the model's statistics are made."""
    return params[0].device if params else None


class AgreedStats:
    """One monitored step's statistics as every rank of the decision group agreed on them (host arrays).

    :meth:`total` is the agreed value of a SUM, MAX or REPLICATED slot: identical on every rank, no communication.
    :meth:`local` is this rank's own value of any slot. :meth:`follow_up` reduces one more fixed-size array made from
    each rank's own values; :meth:`per_rank` is every rank's value of any slot (the first call is one all-gather,
    then cached). Both are collectives over the decision group: call them only on a branch that every rank takes --
    one decided from agreed values or from the step number.
    """

    def __init__(self, layout: StatLayout, totals: np.ndarray, local: np.ndarray, ranks: tuple[int, ...],
                 my_row: int, fetch: Callable[[], np.ndarray] | None = None,
                 reduce: Callable[[np.ndarray, Reduce], np.ndarray] | None = None) -> None:
        self.layout = layout
        self._totals = totals
        self._local = local
        self.ranks = ranks
        self.my_row = my_row
        self._fetch = fetch
        self._reduce = reduce
        self._rows: np.ndarray | None = None

    @classmethod
    def from_rows(cls, layout: StatLayout, matrix_rn: np.ndarray, ranks: tuple[int, ...] | None = None,
                  my_row: int = 0) -> AgreedStats:
        """What the pipeline would agree on if the ranks' buffers were the rows of ``matrix_rn`` (tests and
        single-process tools; no communication)."""
        layout.freeze()
        matrix_rn = np.asarray(matrix_rn, dtype=np.float64).reshape(-1, layout.size)
        totals = np.zeros(layout.size)
        for spec in layout.specs():
            rows = matrix_rn[:, spec.span]
            if spec.reduce is Reduce.SUM:
                totals[spec.span] = rows.sum(axis=0)
            elif spec.reduce is Reduce.MAX:
                totals[spec.span] = rows.max(axis=0)
            elif spec.reduce is Reduce.REPLICATED:
                totals[spec.span] = rows[0]
        ranks = tuple(range(matrix_rn.shape[0])) if ranks is None else tuple(ranks)
        stats = cls(layout, totals, matrix_rn[my_row].copy(), ranks, my_row)
        stats._rows = matrix_rn
        return stats

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def detail_fetched(self) -> bool:
        """Whether the per-rank values were fetched for this step (the rare second collective)."""
        return self._rows is not None and self._fetch is not None

    def has(self, name: str) -> bool:
        return name in self.layout

    def total(self, name: str) -> np.ndarray:
        """The agreed value of slot ``name`` (``[size]``); no communication. A DETAIL slot has none."""
        spec = self.layout[name]
        if spec.reduce is Reduce.DETAIL:
            raise ValueError(f"statistic {name!r} is per-rank detail: read it with per_rank() or local()")
        return self._totals[spec.span].copy()

    def local(self, name: str) -> np.ndarray:
        """This rank's own value of slot ``name`` (``[size]``), as it was before the reduction."""
        return self._local[self.layout[name].span].copy()

    def follow_up(self, contribution: Callable[[np.ndarray], np.ndarray], op: Reduce) -> np.ndarray:
        """``contribution(this rank's buffer)`` (a host array of the same size on every rank, made only from the
        buffer and agreed values) reduced by ``op`` (SUM or MAX) over the decision group. Collective: one all-reduce
        of the contribution's size, whatever the number of ranks."""
        if op not in (Reduce.SUM, Reduce.MAX):
            raise ValueError(f"a follow-up reduces by SUM or MAX, not {op}")
        if self._reduce is None:  # built from rows (tests, tools): every row's contribution, reduced here
            assert self._rows is not None
            parts = np.stack([np.asarray(contribution(row), dtype=np.float64) for row in self._rows])
            return parts.sum(axis=0) if op is Reduce.SUM else parts.max(axis=0)
        return self._reduce(np.asarray(contribution(self._local.copy()), dtype=np.float64), op)

    def per_rank(self, name: str) -> np.ndarray:
        """``[num_ranks, size]`` values of slot ``name``, one row per rank of the decision group. Collective on
        the first call of a step (see the class docstring)."""
        if self._rows is None:
            assert self._fetch is not None
            self._rows = self._fetch().reshape(self.num_ranks, -1)
        return self._rows[:, self.layout[name].span]


class StatsPipeline:
    """Agrees on a :class:`StatBuffer` across the decision ``group``.

    :meth:`start` is collective (once: checks that all ranks share the layout, with a fixed-size reduction).
    :meth:`agree` is collective (once per monitored step): one all-reduce (SUM) of the SUM block -- plus one
    all-reduce (MAX) of the MAX block when the layout has one -- and exactly one copy to the host. Both block for
    at most the process group's timeout; a dead peer raises there, on every live rank.
    """

    def __init__(self, layout: StatLayout, group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None) -> None:
        self.layout = layout
        self.group = group
        self.device = device or stats_device(group)
        self.ranks = tuple(group_ranks(group))
        self.num_ranks = len(self.ranks)
        me = dist.get_rank() if dist_ready() else 0
        self.my_row = self.ranks.index(me) if me in self.ranks else 0
        self._copies: np.ndarray | None = None
        self.collectives = 0     # per-step reductions (one, or two with MAX slots)
        self.detail_fetches = 0  # rare per-rank all-gathers
        self.follow_ups = 0      # periodic fixed-size reductions a monitor asked for
        self.host_copies = 0

    @property
    def leader(self) -> int:
        """The global rank that writes job-level outputs for this group (its first rank)."""
        return self.ranks[0]

    def start(self) -> StatBuffer:
        """Freeze the layout, verify it on every rank (collective), and return this rank's buffer."""
        self.layout.freeze()
        if self.num_ranks > 1:
            size, digest = float(self.layout.size), float(self.layout.fingerprint())
            bounds = torch.tensor([size, digest, -size, -digest], dtype=torch.float64, device=self.device)
            dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self.group)
            largest, smallest = bounds[:2].tolist(), (-bounds[2:]).tolist()
            if largest != smallest:
                raise RuntimeError(
                    "arc_engine: ranks registered different statistics (layout size from "
                    f"{smallest[0]:.0f} to {largest[0]:.0f}, fingerprints differ: {largest[1] != smallest[1]}); "
                    "every rank must attach the same monitors, with the same configuration, in the same order")
        self._copies = self._copies_per_entry()
        return StatBuffer(self.layout, self.device)

    def _copies_per_entry(self) -> np.ndarray | None:
        """How many copies of its group each reduced entry's SUM counted (None when every slot spans the decision
        group). ValueError when a slot's group does not tile the decision group."""
        copies = np.ones(self.layout.size)
        for spec in self.layout.specs():
            if spec.group_size:
                if self.num_ranks % spec.group_size:
                    raise ValueError(f"statistic {spec.name!r}: its group of {spec.group_size} ranks does not tile "
                                     f"the decision group of {self.num_ranks}")
                copies[spec.span] = self.num_ranks // spec.group_size
        return None if bool((copies == 1).all()) else copies

    def agree(self, buffer: StatBuffer, *, reduce_max: bool = True) -> AgreedStats:
        """The agreed statistics of this step. Collective over ``group`` (see the class docstring).
        ``reduce_max=False`` (the same on every rank): the MAX block is not reduced and its totals read NaN."""
        layout = self.layout
        sum_block, max_block = layout.block(Reduce.SUM, Reduce.REPLICATED), layout.block(Reduce.MAX)
        reduced_size = max_block.stop
        # [reduced part | this rank's whole buffer]: one device-to-host copy serves totals, local values and detail
        packed = torch.empty(reduced_size + layout.size, dtype=torch.float64, device=buffer.device)
        packed[:reduced_size].copy_(buffer.values[:reduced_size])
        packed[reduced_size:].copy_(buffer.values)
        replicated = layout.block(Reduce.REPLICATED)
        if self.my_row != 0 and replicated.stop > replicated.start:
            packed[replicated].zero_()
        if self.num_ranks > 1:
            if sum_block.stop > sum_block.start:
                self._all_reduce(packed[sum_block], dist.ReduceOp.SUM)
                self.collectives += 1
            if max_block.stop > max_block.start and reduce_max:
                self._all_reduce(packed[max_block], dist.ReduceOp.MAX)
                self.collectives += 1
        host = packed.detach().to("cpu", copy=True).numpy()
        self.host_copies += 1
        totals = np.zeros(layout.size)
        totals[:reduced_size] = host[:reduced_size]
        if self._copies is not None:
            totals /= self._copies
        if not reduce_max:
            totals[max_block] = np.nan
        local_device = packed[reduced_size:]
        return AgreedStats(layout, totals, host[reduced_size:], self.ranks, self.my_row,
                           lambda: self._fetch_detail(local_device, host[reduced_size:]), self._follow_up)

    def _follow_up(self, values: np.ndarray, op: Reduce) -> np.ndarray:
        """``values`` reduced over the group (SUM or MAX), back on the host. Collective."""
        if self.num_ranks == 1:
            return values.copy()
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._all_reduce(tensor, dist.ReduceOp.SUM if op is Reduce.SUM else dist.ReduceOp.MAX)
        self.follow_ups += 1
        return tensor.to("cpu", copy=True).numpy()

    def _fetch_detail(self, local_device: torch.Tensor, local_host: np.ndarray) -> np.ndarray:
        """Every rank's whole buffer as it was before the reduction (``[num_ranks * size]``). Collective."""
        if self.num_ranks == 1:
            return local_host.copy()
        gathered = torch.empty(self.num_ranks * local_device.numel(), dtype=torch.float64, device=local_device.device)
        self._all_gather(gathered, local_device)
        self.detail_fetches += 1
        return gathered.detach().to("cpu", copy=True).numpy()

    # The two collectives, apart so that scripts/bench_agreement.py can stand in for thousands of ranks.

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        dist.all_reduce(tensor, op=op, group=self.group)

    def _all_gather(self, out: torch.Tensor, local: torch.Tensor) -> None:
        _all_gather_flat(out, local, group=self.group)

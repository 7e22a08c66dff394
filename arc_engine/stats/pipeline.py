"""Gather every rank's statistics with one collective and one device-to-host copy per monitored step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from arc_engine.stats.layout import Reduce, StatBuffer, StatLayout

# torch >= 2.13 names it all_gather_single; older releases only have all_gather_into_tensor.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` in group-rank order ([0] without torch.distributed)."""
    if not dist_ready():
        return [0]
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def stats_device(group: dist.ProcessGroup | None, preference: str = "auto") -> torch.device:
    """The device the statistics buffer should live on for ``group``'s backend.

    ``auto``: CUDA (the current device) when the group's backend includes NCCL and CUDA is available,
    otherwise CPU. Never touches CUDA unless it is selected.
    """
    if preference == "cpu":
        return torch.device("cpu")
    if preference == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("stats.device = 'cuda' but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    if dist_ready() and "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class GatheredStats:
    """All ranks' statistics for one step, on the host. Identical on every rank of the group.

    ``matrix_rn``: ranks x layout size (float64); ``ranks``: global rank of each row.
    """

    layout: StatLayout
    matrix_rn: np.ndarray
    ranks: tuple[int, ...]

    def has(self, name: str) -> bool:
        return name in self.layout

    def per_rank(self, name: str) -> np.ndarray:
        """``[num_ranks, size]`` values of slot ``name``, one row per rank."""
        return self.matrix_rn[:, self.layout[name].span]

    def total(self, name: str) -> np.ndarray:
        """The global value of slot ``name`` according to its :class:`Reduce` kind (``[size]``)."""
        spec = self.layout[name]
        rows = self.per_rank(name)
        if spec.reduce is Reduce.REPLICATED:
            return rows[0].copy()
        return rows.sum(axis=0)


class StatsPipeline:
    """Reduces a :class:`StatBuffer` across ``group``.

    :meth:`start` is collective (once, checks that all ranks share the layout). :meth:`gather` is collective
    (once per monitored step): exactly one all-gather of each rank's flat vector, then exactly one copy to the
    host. Both block for at most the process group's timeout; a dead peer raises there, on every live rank.
    """

    def __init__(self, layout: StatLayout, group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None) -> None:
        self.layout = layout
        self.group = group
        self.device = device or stats_device(group)
        self.ranks = tuple(group_ranks(group))
        self.num_ranks = len(self.ranks)
        self.collectives = 0
        self.host_copies = 0

    def start(self) -> StatBuffer:
        """Freeze the layout, verify it on every rank (collective), and return this rank's buffer."""
        self.layout.freeze()
        if self.num_ranks > 1:
            mine = torch.tensor([float(self.layout.size), float(self.layout.fingerprint())],
                                dtype=torch.float64, device=self.device)
            everyone = torch.empty(self.num_ranks * 2, dtype=torch.float64, device=self.device)
            _all_gather_flat(everyone, mine, group=self.group)
            rows = everyone.cpu().view(self.num_ranks, 2)
            if not bool((rows == rows[0]).all()):
                raise RuntimeError(
                    "arc_engine: ranks registered different statistics (layout size/fingerprint per rank: "
                    f"{rows.tolist()}); every rank must attach the same monitors in the same order")
        return StatBuffer(self.layout, self.device)

    def gather(self, buffer: StatBuffer) -> GatheredStats:
        """All ranks' buffers as host arrays. Collective over ``group``."""
        local = buffer.values
        if self.num_ranks > 1:
            gathered = torch.empty(self.num_ranks * local.numel(), dtype=local.dtype, device=local.device)
            _all_gather_flat(gathered, local, group=self.group)
            self.collectives += 1
        else:
            gathered = local
        host = gathered.detach().to("cpu", copy=True).numpy()
        self.host_copies += 1
        return GatheredStats(self.layout, host.reshape(self.num_ranks, -1), self.ranks)

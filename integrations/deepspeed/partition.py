"""The ZeRO-1/2 partition statistics every stage shares (stage 3's sub-groups in ``zero3.py``, the recomputation in
``recompute.py``): DeepSpeed's gradient divisor and the per-group partial sums over this rank's partition."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from arc_engine.engine import ArcEngine
from arc_engine.integrations.deepspeed import internals as deepspeed_internals
from arc_engine.stats import names
from arc_engine.stats.optim_stats import AdamHyper, AdamViews, is_decoupled, leading, step_count, weight_sq_sums
from arc_engine.stats.producers import record_optimizer_stats
from arc_engine.stats.sampling import WindowCache

log = logging.getLogger("arc_engine")

CLIP_EPS = 1e-6  # DeepSpeed's unscale_and_clip_grads adds it to the norm


def grad_divisor(zero: Any, pre_clip_norm: float | torch.Tensor | None = None) -> torch.Tensor | float:
    """DeepSpeed's divisor for raw (loss-scaled, unclipped) gradients in ``unscale_and_clip_grads``:
    loss scale x max(1, (pre-clip norm + 1e-6) / clip). A device tensor when clipping is on (no host sync), else a
    float. ``pre_clip_norm``: the unscaled pre-clip global norm (default: the one DeepSpeed computed for this step,
    already unscaled when the torch optimizer is called; a recomputation passes the corrected one)."""
    loss_scale = float(zero.loss_scale)
    norm = deepspeed_internals.pre_clip_global_norm(zero) if pre_clip_norm is None else pre_clip_norm
    clip = deepspeed_internals.clip_threshold(zero)
    if clip > 0 and norm is not None:
        norm = torch.as_tensor(norm, dtype=torch.float64)
        return loss_scale * torch.clamp((norm + CLIP_EPS) / clip, min=1.0)
    return loss_scale


def add_pre_clip_grad_sq(buffer: Any, group_id: int, pieces: list[torch.Tensor], final: bool,
                         divisor: torch.Tensor | float, loss_scale: float) -> None:
    """Add the unscaled, pre-clip squared norm of ``pieces`` to group ``group_id``'s ``grad_sq`` slot.
    Final pieces are raw / divisor (DeepSpeed already unscaled and clipped them); raw ones still carry the loss
    scale. Either way the result is what DeepSpeed's own pre-clip norm measures."""
    norms_sq = weight_sq_sums(pieces).to(buffer.device)
    factor = (divisor / loss_scale) ** 2 if final else 1.0 / loss_scale**2
    buffer.view(names.GRAD_SQ)[group_id:group_id + 1].add_(norms_sq.sum() * factor)


def device_divisor(zero: Any, device: torch.device,
                   pre_clip_norm: float | torch.Tensor | None = None) -> torch.Tensor | float:
    divisor = grad_divisor(zero, pre_clip_norm)
    return divisor.to(device) if isinstance(divisor, torch.Tensor) else divisor


class PersistentPieces:
    """Pieces cut from flat tensors that live across steps (a master partition, the Adam moments): the same list
    objects while it is the same tensor over the same memory cut the same way, so :class:`WindowCache` can reuse
    their windows instead of cutting them every step."""

    def __init__(self) -> None:
        self._cache: dict[Any, tuple[torch.Tensor, tuple, list[torch.Tensor | None]]] = {}

    def get(self, key: Any, tensor: torch.Tensor, geometry: tuple,
            cut: Callable[[torch.Tensor], list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
        """``cut(tensor)``, reused while ``tensor`` is the object cached under ``key`` at the same address and
        ``geometry`` (how it is cut) is unchanged."""
        cached = self._cache.get(key)
        where = (tensor.data_ptr(), *geometry)
        if cached is None or cached[0] is not tensor or cached[1] != where:
            cached = self._cache[key] = (tensor, where, cut(tensor))
        return cached[2]


class ZeroPartitionStats:
    """Reads one rank's ZeRO-1/2 partitions at the group-0 pre-hook; writes every group's statistics."""

    def __init__(self, engine: ArcEngine, zero_optimizer: Any) -> None:
        self.engine = engine
        self.zero = zero_optimizer
        self.torch_optimizer = deepspeed_internals.wrapped_optimizer(zero_optimizer)
        self.groups = list(self.torch_optimizer.param_groups)  # the dicts DeepSpeed swaps in one at a time
        self.windows = [WindowCache() for _ in self.groups]
        self._pieces = PersistentPieces()
        self._divisor: torch.Tensor | float = 1.0  # the step's gradient divisor (set by record)
        self._place_key: tuple[int, ...] | None = None
        self._place_cache: dict[int, tuple[int, int, int]] = {}

    def parameter_parts(self, param: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's part of module parameter ``param``: (its fp32 master values, its reduced gradient as
        DeepSpeed applies it, unscaled and clipped), the elements of the parameter inside this rank's partition;
        empty lists when none is. Over the ranks the parts are the whole parameter, each element once. Read inside
        the step (after :meth:`record`, before the inner optimizer consumes the gradient)."""
        place = self._places().get(id(param))
        if place is None:
            return [], []
        group_id, start, numel = place
        size = deepspeed_internals.partition_size(self.zero, group_id)
        first = deepspeed_internals.partition_rank(self.zero, group_id) * size
        begin, end = max(start, first) - first, min(start + numel, first + size) - first
        if begin >= end:
            return [], []
        partition = deepspeed_internals.fp32_partitions(self.zero)[group_id].view(-1)
        pieces, final = self.group_gradient(group_id)
        grads, offset = [], 0
        for piece in pieces:
            low, high = max(begin, offset), min(end, offset + piece.numel())
            if low < high:
                part = piece.narrow(0, low - offset, high - low)
                grads.append(part if final else part.double() / self._divisor)
            offset += piece.numel()
        return [partition.narrow(0, begin, end - begin)], grads

    def _places(self) -> dict[int, tuple[int, int, int]]:
        """id(module parameter) -> (group, offset in the group's flat bit16 buffer, elements); the parameters are
        views of that buffer. Rebuilt when a buffer moved."""
        flats = [deepspeed_internals.bit16_flat(self.zero, i) for i in range(len(self.groups))]
        key = tuple(flat.data_ptr() for flat in flats)
        if self._place_key != key:
            self._place_cache = {}
            for group_id, params in enumerate(deepspeed_internals.bit16_groups(self.zero)):
                base = flats[group_id].data_ptr()
                for param in params:
                    offset = (param.data_ptr() - base) // param.element_size()
                    self._place_cache[id(param)] = (group_id, offset, param.numel())
            self._place_key = key
        return self._place_cache

    def group_id(self, optimizer: torch.optim.Optimizer) -> int:
        current = optimizer.param_groups[0]
        return next((i for i, group in enumerate(self.groups) if group is current), 0)

    def is_first_call(self, optimizer: torch.optim.Optimizer) -> bool:
        """This inner ``step()`` is the step's first (group 0): nothing has been applied yet."""
        return self.group_id(optimizer) == 0

    def is_last_call(self, optimizer: torch.optim.Optimizer) -> bool:
        return self.group_id(optimizer) == len(self.groups) - 1

    def group_gradient(self, group_id: int) -> tuple[list[torch.Tensor], bool]:
        """This rank's gradient pieces for ``group_id`` and whether they are already final (unscaled, clipped); no
        pieces once DeepSpeed has dropped them (a step it skipped on overflow)."""
        partition = deepspeed_internals.fp32_partitions(self.zero)[group_id]
        if partition.grad is not None:
            return [partition.grad.view(-1)], True
        pending = deepspeed_internals.pending_gradient(self.zero, group_id)
        if pending is None:
            return [], True
        flat = deepspeed_internals.pending_flat(pending)
        if flat is not None:
            return [flat.view(-1)], False
        return [t.reshape(-1) for t in pending], False

    @torch.no_grad()
    def record(self, with_optimizer_stats: bool, pre_clip_norm: torch.Tensor | None = None) -> None:
        """``pre_clip_norm``: the global norm to unscale and clip with (default: DeepSpeed's; a recomputation
        passes the corrected one)."""
        buffer = self.engine.buffer
        combined = self._divisor = device_divisor(self.zero, buffer.device, pre_clip_norm)
        loss_scale = float(self.zero.loss_scale)
        for group_id, partition in enumerate(deepspeed_internals.fp32_partitions(self.zero)):
            pieces, final = self.group_gradient(group_id)
            with self.engine.own_work.section("deepspeed.reduced_norms"):
                add_pre_clip_grad_sq(buffer, group_id, pieces, final, combined, loss_scale)
            if with_optimizer_stats:
                self._optimizer_stats(group_id, partition, pieces, 1.0 if final else 1.0 / combined)

    def _optimizer_stats(self, group_id: int, partition: torch.Tensor, pieces: list[torch.Tensor],
                         grad_scale: float | torch.Tensor) -> None:
        """Weight norm and sampled update Σ U² of the partition's real elements (the padding DeepSpeed appends to
        the last rank's partition is left out, so a moving window never counts it)."""
        real = partition.numel() - deepspeed_internals.partition_padding(self.zero, group_id)
        views = self._views(group_id, partition, pieces, real)
        record_optimizer_stats(self.engine, group_id, [partition.view(-1).narrow(0, 0, real)], views,
                               self.windows[group_id], grad_scale=grad_scale, flat_partitions=True)

    def _views(self, group_id: int, partition: torch.Tensor, pieces: list[torch.Tensor],
               real: int) -> AdamViews | None:
        """Adam views of the first ``real`` elements of the flat partition, split like the gradient pieces."""
        group = self.groups[group_id]
        decoupled = is_decoupled(self.torch_optimizer, group)
        if decoupled is None:
            return None
        state = self.torch_optimizer.state.get(partition, {})
        sizes = [p.numel() for p in pieces]
        step = step_count(state.get("step", 0))

        def split(name: str, tensor: torch.Tensor | None) -> list[torch.Tensor | None]:
            if tensor is None:
                return [None] * len(sizes)
            return self._pieces.get((group_id, name), tensor, (tuple(sizes), real),
                                    lambda t: leading(t.view(-1).split(sizes), sizes, real))

        return AdamViews(split("params", partition), leading(pieces, sizes, real),
                         split("exp_avg", state.get("exp_avg")), split("exp_avg_sq", state.get("exp_avg_sq")), step,
                         AdamHyper.from_group(group, decoupled))

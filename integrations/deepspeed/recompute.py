"""DeepSpeed ZeRO-1/2 side of the SDC recomputation (:mod:`arc_engine.recovery.recompute`).

Gate slots are the module's trainable parameters (in ``bit16_groups`` order); :class:`LocalGradHooks` judges each
micro-batch's local gradient before DeepSpeed accumulates and reduces it. The reduced gradient lives in this rank's
partition: at the moment arc_engine decides (the torch optimizer's pre-hook for group 0, see ``__init__.py``)
group 0's gradient is final (divided by DeepSpeed's loss scale x clip factor) and the later groups' are raw (loss
scale, unclipped). :meth:`ZeroGradientTarget.apply` therefore:

1. brings group 0 back to raw (x the divisor DeepSpeed used);
2. adds this rank's partition slice of the corrected contribution (x the loss scale);
3. recomputes the pre-clip global norm of the corrected gradient (one scalar all-reduce) and keeps it
   (``pre_clip_norm``) for the statistics it re-records;
4. divides group 0 by the new divisor, and leaves ``ratio`` = DeepSpeed's divisor / new divisor for the later
   groups, which DeepSpeed will still divide by its own: :meth:`rescale_group` fixes each when its turn comes.

With no clipping and loss scale 1 (fp32/bf16 without clipping) the divisors are 1 and only step 2 changes values.
Only gradient values are written (in place, in DeepSpeed's own buffers); no DeepSpeed attribute is, so after a
corrected step DeepSpeed's ``get_global_grad_norm()`` still reports the norm it computed before the correction,
while arc_engine's ``grad_norm`` statistic is the corrected one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from arc_engine.engine import ArcEngine
from arc_engine.integrations.deepspeed import internals as deepspeed_internals
from arc_engine.integrations.deepspeed.partition import ZeroPartitionStats, grad_divisor
from arc_engine.recovery.recompute import ReplicaTarget


class ZeroGradientTarget(ReplicaTarget):
    """The reduced gradient of a ZeRO-1/2 engine, seen through this rank's partitions."""

    per_micro_batch = True

    def __init__(self, engine: ArcEngine, ds_engine: Any, stats: ZeroPartitionStats,
                 param_groups: list[tuple[int, list[torch.Tensor]]]) -> None:
        self.engine = engine
        self.zero = ds_engine.optimizer
        self.stats = stats
        self.module = ds_engine.module
        pairs = [(gid, p) for gid, ps in param_groups for p in ps if p.requires_grad]
        self.params = [p for _, p in pairs]
        self.group_of_p = [gid for gid, _ in pairs]
        self.loss_factor = 1.0 / float(ds_engine.gradient_accumulation_steps())
        self.ratio: torch.Tensor | float = 1.0  # for groups after 0 on the current step (see the module docstring)
        self.pre_clip_norm: torch.Tensor | None = None  # the corrected global norm, once a correction was applied

    def slot_params(self, slot: int) -> list[int]:
        return [slot]

    @torch.no_grad()
    def apply(self, reduced_p: list[torch.Tensor | None], replace: bool) -> None:
        zero = self.zero
        loss_scale = float(zero.loss_scale)
        old_divisor = grad_divisor(zero, self.pre_clip_norm)  # what group 0 was last divided by
        num_groups = len(deepspeed_internals.bit16_groups(zero))
        # no host read per piece
        local_sq = torch.zeros((), dtype=torch.float64, device=self.engine.gathering.pipeline.device)
        for group_id in range(num_groups):
            pieces, final = self.stats.group_gradient(group_id)
            if final:
                for piece in pieces:
                    piece.mul_(old_divisor)
            correction = self._partition_slice(group_id, reduced_p).split([p.numel() for p in pieces])
            for piece, part in zip(pieces, correction, strict=True):
                part = part.to(piece.device, piece.dtype) * loss_scale
                piece.copy_(part) if replace else piece.add_(part)
                local_sq += torch.linalg.vector_norm(piece, dtype=torch.float64).square().to(local_sq.device)
        global_sq = local_sq
        if self.engine.gathering.pipeline.num_ranks > 1:
            dist.all_reduce(global_sq, group=deepspeed_internals.data_parallel_group(zero))
        self.pre_clip_norm = torch.sqrt(global_sq).to(torch.float32) / loss_scale
        new_divisor = grad_divisor(zero, self.pre_clip_norm)
        for group_id in range(num_groups):
            pieces, final = self.stats.group_gradient(group_id)
            if final:
                for piece in pieces:
                    piece.div_(new_divisor)
        self.ratio = grad_divisor(zero) / new_divisor  # later groups: DeepSpeed divides them by its own divisor

    def rescale_group(self, partition_grad: torch.Tensor) -> None:
        """Called for each group after 0 once DeepSpeed divided it by the old divisor; clears nothing."""
        if not (isinstance(self.ratio, float) and self.ratio == 1.0):
            partition_grad.mul_(self.ratio)

    def end_step(self) -> None:
        self.ratio = 1.0
        self.pre_clip_norm = None

    def record_stats(self) -> None:
        self.stats.record(self.engine.wants_optimizer_stats(), pre_clip_norm=self.pre_clip_norm)

    def _partition_slice(self, group_id: int, reduced_p: list[torch.Tensor | None]) -> torch.Tensor:
        """This rank's partition of group ``group_id``'s flat (bit16 layout, padded) corrected gradient."""
        zero = self.zero
        flat = deepspeed_internals.bit16_flat(zero, group_id)
        full = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        index_of = {id(p): i for i, p in enumerate(self.params)}
        for param in deepspeed_internals.bit16_groups(zero)[group_id]:
            i = index_of.get(id(param))
            if i is None or reduced_p[i] is None:
                continue
            offset = (param.data_ptr() - flat.data_ptr()) // param.element_size()
            full[offset:offset + param.numel()] = reduced_p[i].reshape(-1)
        size = deepspeed_internals.partition_size(zero, group_id)
        partition_id = deepspeed_internals.partition_rank(zero, group_id)
        pieces, _ = self.stats.group_gradient(group_id)
        return full[partition_id * size: partition_id * size + sum(p.numel() for p in pieces)]

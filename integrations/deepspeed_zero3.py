"""DeepSpeed ZeRO stage 3: statistics on each rank's own partition, decided inside the optimizer step.

What DeepSpeed 0.19.8 holds (``deepspeed/runtime/zero/stage3.py``, the ground truth): each parameter group is cut
into one or more *sub-groups* (``sub_group_size``); per sub-group ``i`` a flat fp32 master partition
``fp32_partitioned_groups_flat[i]`` with its Adam moments in ``optimizer.state[partition]``, owned by parameter
group ``sub_group_to_group_id[i]``. The partition is the concatenation of each parameter's own partition
(``partition_numel()`` elements), and on the last rank each of those ends in ``groups_padding[i][k]`` padding
elements -- padding sits inside the flat partition, after every parameter, not only at its end.

``DeepSpeedZeroOptimizer_Stage3.step()`` checks overflow and computes the pre-clip global norm first (its own
collectives), then for each sub-group in turn flattens its gradient into ``partition.grad``, unscales and clips it,
and steps the torch optimizer with *every* parameter group present but only the owning group's ``params`` set to
``[partition]`` (the others are ``[]``). So the torch optimizer's step pre-hook fires once per sub-group, and the
call is named by the one partition it holds, not by ``param_groups[0]``. At the first call (sub-group 0) nothing
has been applied yet: that is where arc_engine decides. Then sub-group 0's final gradient is ``partition.grad``
and every later sub-group's is still ``averaged_gradients[i]`` -- one piece per parameter (padding included),
scaled by the loss scale and not yet clipped; arc_engine applies DeepSpeed's own factor, 1 / (loss scale x clip
factor), to them. Sub-groups are summed into their parameter group's slot, padding excluded.
"""

from __future__ import annotations

from typing import Any

import torch

from arc_engine.engine import ArcEngine
from arc_engine.integrations.deepspeed import add_pre_clip_grad_sq, device_divisor
from arc_engine.stats import names
from arc_engine.stats.optim_stats import AdamHyper, is_decoupled, step_count, update_sq_total, weight_sq_sums


def check_supported(zero_optimizer: Any) -> None:
    """Raise ValueError for ZeRO-3 set-ups whose partitions are not on the device at the pre-hook."""
    if getattr(zero_optimizer, "offload_optimizer", False) or getattr(zero_optimizer, "swap_optimizer", False):
        raise ValueError("arc_engine's DeepSpeed ZeRO-3 integration does not support offload_optimizer yet")
    if getattr(zero_optimizer, "use_muon", False):
        raise ValueError("arc_engine's DeepSpeed ZeRO-3 integration does not support Muon yet")


class Zero3PartitionStats:
    """Reads one rank's ZeRO-3 sub-group partitions at the first inner-optimizer call of a step; writes every
    parameter group's statistics (the sum of its sub-groups)."""

    def __init__(self, engine: ArcEngine, zero_optimizer: Any) -> None:
        check_supported(zero_optimizer)
        self.engine = engine
        self.zero = zero_optimizer
        self.torch_optimizer = zero_optimizer.optimizer
        self.groups = list(zero_optimizer.optimizer.param_groups)
        num_sub_groups = len(zero_optimizer.fp16_groups)
        self.group_of = [int(zero_optimizer.sub_group_to_group_id[i]) for i in range(num_sub_groups)]
        # per sub-group, per parameter: (partition size, real elements); the rest is padding, and its fp32
        # master values are not zero, so it is cut out of every statistic
        self.layouts = [[(param.partition_numel(), param.partition_numel() - pad)
                         for param, pad in zip(params, paddings, strict=True)]
                        for params, paddings in zip(zero_optimizer.fp16_groups, zero_optimizer.groups_padding,
                                                    strict=True)]

    @property
    def partitions(self) -> list[torch.Tensor]:
        """The fp32 master partitions, one per sub-group, read live (a checkpoint load may replace them)."""
        return self.zero.fp32_partitioned_groups_flat

    def sub_group_id(self, optimizer: torch.optim.Optimizer) -> int | None:
        """The sub-group this inner-optimizer call steps (the one partition its groups hold), None if none."""
        current = next((p for group in optimizer.param_groups for p in group["params"]), None)
        return next((i for i, partition in enumerate(self.partitions) if partition is current), None)

    def is_first_call(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this pre-hook is the step's first inner call: nothing applied yet, decide here."""
        return self.sub_group_id(optimizer) == 0

    def is_last_call(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this post-hook closes the step's last inner call."""
        return self.sub_group_id(optimizer) == len(self.partitions) - 1

    def real_pieces(self, sub_group_id: int, tensor: torch.Tensor | list[torch.Tensor] | None
                    ) -> list[torch.Tensor | None]:
        """Per parameter, the real (unpadded) elements of a flat sub-group tensor or of its per-parameter list."""
        layout = self.layouts[sub_group_id]
        if tensor is None:
            return [None] * len(layout)
        if isinstance(tensor, torch.Tensor):
            tensor = list(tensor.view(-1).split([size for size, _ in layout]))
        return [t.reshape(-1).narrow(0, 0, real) for t, (_, real) in zip(tensor, layout, strict=True)]

    def sub_group_gradient(self, sub_group_id: int) -> tuple[list[torch.Tensor], bool]:
        """This rank's real gradient pieces for the sub-group and whether they are final (unscaled, clipped)."""
        partition = self.partitions[sub_group_id]
        if partition.grad is not None:
            return self.real_pieces(sub_group_id, partition.grad), True
        return self.real_pieces(sub_group_id, self.zero.averaged_gradients[sub_group_id]), False

    @torch.no_grad()
    def record(self, with_optimizer_stats: bool) -> None:
        """Add this rank's per-group partial sums to the engine buffer. Local, no communication; call at the
        pre-hook of the step's first inner-optimizer call, on every rank."""
        buffer = self.engine.buffer
        combined = device_divisor(self.zero, buffer.device)
        loss_scale = float(self.zero.loss_scale)
        for sub_group_id, group_id in enumerate(self.group_of):
            grads, final = self.sub_group_gradient(sub_group_id)
            add_pre_clip_grad_sq(buffer, group_id, grads, final, combined, loss_scale)
            if with_optimizer_stats:
                self._optimizer_stats(sub_group_id, grads, 1.0 if final else 1.0 / combined)

    def _optimizer_stats(self, sub_group_id: int, grads: list[torch.Tensor],
                         grad_scale: float | torch.Tensor) -> None:
        buffer = self.engine.buffer
        group_id = self.group_of[sub_group_id]
        slot = slice(group_id, group_id + 1)
        partition = self.partitions[sub_group_id]
        weights = self.real_pieces(sub_group_id, partition)
        buffer.view(names.WEIGHT_SQ)[slot].add_(weight_sq_sums(weights).sum().to(buffer.device))
        group = self.groups[group_id]
        decoupled = is_decoupled(self.torch_optimizer, group)
        if decoupled is None:
            return
        state = self.torch_optimizer.state.get(partition, {})
        step = step_count(state.get("step", 0))
        update_sq = update_sq_total(weights, grads, self.real_pieces(sub_group_id, state.get("exp_avg")),
                                    self.real_pieces(sub_group_id, state.get("exp_avg_sq")), step,
                                    AdamHyper.from_group(group, decoupled), grad_scale=grad_scale)
        buffer.view(names.UPDATE_SQ)[slot].add_(update_sq.to(buffer.device))
        buffer.view(names.UPDATE_COUNT)[slot].add_(float(sum(real for _, real in self.layouts[sub_group_id])))

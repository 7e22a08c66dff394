"""DeepSpeed ZeRO stage 3: statistics on each rank's own partition, decided inside the optimizer step.

What DeepSpeed 0.18.0 .. 0.19.8 hold (``deepspeed/runtime/zero/stage3.py``, the ground truth): each parameter
group is cut into one or more *sub-groups* (``sub_group_size``); per sub-group ``i`` a flat fp32 master partition
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
from arc_engine.integrations.deepspeed import internals as deepspeed_internals
from arc_engine.integrations.deepspeed.partition import PersistentPieces, add_pre_clip_grad_sq, device_divisor
from arc_engine.stats.optim_stats import AdamHyper, AdamViews, is_decoupled, step_count
from arc_engine.stats.producers import record_optimizer_stats
from arc_engine.stats.sampling import WindowCache


def check_supported(zero_optimizer: Any) -> None:
    """Raise ValueError for ZeRO-3 set-ups whose partitions are not on the device at the pre-hook."""
    if deepspeed_internals.offloads_optimizer(zero_optimizer):
        raise ValueError("arc_engine's DeepSpeed ZeRO-3 integration does not support offload_optimizer yet")
    if deepspeed_internals.uses_muon(zero_optimizer):
        raise ValueError("arc_engine's DeepSpeed ZeRO-3 integration does not support Muon yet")


class Zero3PartitionStats:
    """Reads one rank's ZeRO-3 sub-group partitions at the first inner-optimizer call of a step; writes every
    parameter group's statistics (the sum of its sub-groups)."""

    def __init__(self, engine: ArcEngine, zero_optimizer: Any) -> None:
        check_supported(zero_optimizer)
        self.engine = engine
        self.zero = zero_optimizer
        self.torch_optimizer = deepspeed_internals.wrapped_optimizer(zero_optimizer)
        self.groups = list(self.torch_optimizer.param_groups)
        sub_group_params = deepspeed_internals.sub_group_params(zero_optimizer)
        num_sub_groups = len(sub_group_params)
        self.group_of = [deepspeed_internals.sub_group_owner(zero_optimizer, i) for i in range(num_sub_groups)]
        # per sub-group, per parameter: (partition size, real elements); the rest is padding, and its fp32
        # master values are not zero, so it is cut out of every statistic
        size = deepspeed_internals.param_partition_numel
        self.layouts = [[(size(param), size(param) - pad) for param, pad in zip(params, paddings, strict=True)]
                        for params, paddings in zip(sub_group_params,
                                                    deepspeed_internals.sub_group_paddings(zero_optimizer),
                                                    strict=True)]
        # per sub-group, each parameter's position in its parameter group (sub-groups cut groups in order): what
        # places its sampled window
        self.positions: list[list[int]] = []
        seen = [0] * len(self.groups)
        for group_id, params in zip(self.group_of, sub_group_params, strict=True):
            self.positions.append(list(range(seen[group_id], seen[group_id] + len(params))))
            seen[group_id] += len(params)
        self.windows = [WindowCache() for _ in range(num_sub_groups)]
        self._pieces = PersistentPieces()
        # id(module parameter) -> (sub-group, index in it): where its partition's pieces are
        self.places = {id(param): (sub_group_id, index) for sub_group_id, params in enumerate(sub_group_params)
                       for index, param in enumerate(params)}
        self._divisor: torch.Tensor | float = 1.0  # the step's gradient divisor (set by record)

    def parameter_parts(self, param: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's partition of module parameter ``param``: (its fp32 master values, its reduced gradient as
        DeepSpeed applies it, unscaled and clipped), padding cut off; over the ranks the whole parameter, each
        element once. Read inside the step (after :meth:`record`)."""
        place = self.places.get(id(param))
        if place is None:
            return [], []
        sub_group_id, index = place
        weight = self.persistent_pieces(sub_group_id, "params", self.partitions[sub_group_id])[index]
        grads, final = self.sub_group_gradient(sub_group_id)
        grad = grads[index]
        parts = [] if grad is None else [grad if final else grad.double() / self._divisor]
        return ([] if weight is None else [weight]), parts

    @property
    def partitions(self) -> list[torch.Tensor]:
        """The fp32 master partitions, one per sub-group, read live (a checkpoint load may replace them)."""
        return deepspeed_internals.sub_group_partitions(self.zero)

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

    def persistent_pieces(self, sub_group_id: int, name: str, tensor: torch.Tensor | None
                          ) -> list[torch.Tensor | None]:
        """:meth:`real_pieces` of a flat tensor that lives across steps (master partition, Adam moments), the same
        list objects while it is the same tensor over the same memory, so :class:`WindowCache` can reuse their
        windows."""
        if tensor is None:
            return self.real_pieces(sub_group_id, None)
        return self._pieces.get((sub_group_id, name), tensor, (),
                                lambda t: self.real_pieces(sub_group_id, t))

    def sub_group_gradient(self, sub_group_id: int) -> tuple[list[torch.Tensor], bool]:
        """This rank's real gradient pieces for the sub-group and whether they are final (unscaled, clipped)."""
        partition = self.partitions[sub_group_id]
        if partition.grad is not None:
            return self.real_pieces(sub_group_id, partition.grad), True
        pending = deepspeed_internals.sub_group_pending_gradient(self.zero, sub_group_id)
        return self.real_pieces(sub_group_id, pending), False

    @torch.no_grad()
    def record(self, with_optimizer_stats: bool) -> None:
        """Add this rank's per-group partial sums to the engine buffer. Local, no communication; call at the
        pre-hook of the step's first inner-optimizer call, on every rank."""
        buffer = self.engine.buffer
        combined = self._divisor = device_divisor(self.zero, buffer.device)
        loss_scale = float(self.zero.loss_scale)
        for sub_group_id, group_id in enumerate(self.group_of):
            grads, final = self.sub_group_gradient(sub_group_id)
            add_pre_clip_grad_sq(buffer, group_id, grads, final, combined, loss_scale)
            if with_optimizer_stats:
                self._optimizer_stats(sub_group_id, grads, 1.0 if final else 1.0 / combined)

    def _optimizer_stats(self, sub_group_id: int, grads: list[torch.Tensor],
                         grad_scale: float | torch.Tensor) -> None:
        """The sub-group's part of its parameter group's weight norm and sampled update Σ U², under the engine's
        settings (``update_sample``, the weight-norm schedule), like every other integration."""
        group_id = self.group_of[sub_group_id]
        partition = self.partitions[sub_group_id]
        weights = self.persistent_pieces(sub_group_id, "partition", partition)
        group = self.groups[group_id]
        decoupled = is_decoupled(self.torch_optimizer, group)
        views = None
        if decoupled is not None:
            state = self.torch_optimizer.state.get(partition, {})
            views = AdamViews(weights, grads, self.persistent_pieces(sub_group_id, "exp_avg", state.get("exp_avg")),
                              self.persistent_pieces(sub_group_id, "exp_avg_sq", state.get("exp_avg_sq")),
                              step_count(state.get("step", 0)), AdamHyper.from_group(group, decoupled),
                              self.positions[sub_group_id])
        record_optimizer_stats(self.engine, group_id, weights, views, self.windows[sub_group_id], grad_scale)

"""DeepSpeed ZeRO-1/2 training state for recovery (:class:`arc_engine.recovery.state.TrainState`).

What one rank holds in DeepSpeed 0.19.8 (``deepspeed/runtime/zero/stage_1_and_2.py``): the module's bit16
parameters (full copies: ZeRO-1/2 partition only the optimizer), per parameter group ``j`` the fp32 master
partition ``single_partition_of_fp32_groups[j]`` and its Adam moments in the wrapped torch optimizer's state, the
loss scaler, and on the engine the LR scheduler and the step/sample counters. Snapshots and checkpoints are taken
between steps, when the bit16 parameters equal the fp32 masters (DeepSpeed re-gathers them at the end of each
step), and restored there too; every tensor is written in place, so DeepSpeed's flat buffers and views stay valid.

The fp32 partitions and moments are rank-local: their checkpoint keys carry the rank, and a checkpoint loads only
into a job with the same data-parallel size (``reshardable = False``; DeepSpeed's universal checkpoint is the tool
for changing it). The bit16 parameters are replicated and written once. ZeRO's partitions, the loss scaler and the
engine's counters are reached through :mod:`arc_engine.integrations.deepspeed_internals`.
"""

from __future__ import annotations

from typing import Any

import torch

from arc_engine.integrations import deepspeed_internals
from arc_engine.recovery.state import (
    add_relative_noise,
    group_hyperparameters,
    load_group_hyperparameters,
    materialize_optimizer_state,
)


class ZeroTrainState:
    """Recovery's view of a DeepSpeed engine running ZeRO stage 1 or 2 (optimizer states on the device)."""

    reshardable = False

    def __init__(self, ds_engine: Any, *, rank: int) -> None:
        self.ds_engine = ds_engine
        self.zero = ds_engine.optimizer
        self.torch_optimizer = deepspeed_internals.wrapped_optimizer(self.zero)
        self.rank = rank

    def _partition_state(self) -> list[tuple[str, torch.Tensor]]:
        named: list[tuple[str, torch.Tensor]] = []
        for j, partition in enumerate(deepspeed_internals.fp32_partitions(self.zero)):
            named.append((f"fp32_{j}", partition))
            state = self.torch_optimizer.state.get(partition, {})
            named += [(f"state_{j}_{k}", state[k]) for k in sorted(state) if isinstance(state[k], torch.Tensor)]
        return named

    def live_tensors(self) -> list[torch.Tensor]:
        module = self.ds_engine.module
        tensors = [*module.parameters(), *module.buffers()] + [t for _, t in self._partition_state()]
        return [t.detach() for t in tensors]

    def extra_state(self) -> dict[str, Any]:
        scheduler = self.ds_engine.lr_scheduler
        return {"param_groups": group_hyperparameters(self.torch_optimizer),
                "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
                "loss_scaler": deepspeed_internals.loss_scaler_state(self.zero),
                "counters": deepspeed_internals.engine_counters(self.ds_engine)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        load_group_hyperparameters(self.torch_optimizer, state["param_groups"])
        if self.ds_engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.ds_engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        deepspeed_internals.restore_loss_scaler(self.zero, state["loss_scaler"])
        deepspeed_internals.restore_engine_counters(self.ds_engine, state["counters"])

    def dcp_state_dict(self) -> dict[str, Any]:
        # A fresh engine (a resume) has no Adam moments yet: create them so the checkpoint loads into them.
        materialize_optimizer_state(self.torch_optimizer)
        module = self.ds_engine.module
        model = {name: t.detach() for name, t in [*module.named_parameters(), *module.named_buffers()]}
        return {"model": model, f"zero_rank{self.rank}": {name: t.detach() for name, t in self._partition_state()}}

    def after_dcp_load(self, state_dict: dict[str, Any]) -> None:
        """Nothing left to do: DCP loaded every tensor in place (bit16 parameters and fp32 masters alike)."""

    @torch.no_grad()
    def perturb(self, scale: float, seed: int) -> None:
        """Perturb the (replicated) bit16 parameters identically on every rank, then take each rank's fp32 master
        partition from them, as DeepSpeed's own checkpoint loading does."""
        params = [p for p in self.ds_engine.module.parameters() if p.requires_grad]
        add_relative_noise(params, scale, seed)
        for j, partition in enumerate(deepspeed_internals.fp32_partitions(self.zero)):
            partition_id = deepspeed_internals.partition_rank(self.zero, j)
            partition.copy_(deepspeed_internals.bit16_partition(self.zero, j, partition_id))

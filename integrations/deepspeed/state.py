"""DeepSpeed ZeRO training state for recovery (:class:`arc_engine.recovery.state.TrainState`), stages 1, 2 and 3.

What one rank holds in DeepSpeed 0.18.0 .. 0.19.8 under ZeRO-1/2 (``deepspeed/runtime/zero/stage_1_and_2.py``): the
module's bit16 parameters (full copies: ZeRO-1/2 partition only the optimizer), per parameter group ``j`` the fp32
master partition ``single_partition_of_fp32_groups[j]`` and its Adam moments in the wrapped torch optimizer's
state, the loss scaler, and on the engine the LR scheduler and the step/sample counters. Snapshots and
checkpoints are taken between steps, when the bit16 parameters equal the fp32 masters (DeepSpeed re-gathers them
at the end of each step), and restored there too; every tensor is written in place, so DeepSpeed's flat buffers
and views stay valid.

Under ZeRO-3 (``stage3.py``) the module's parameters are partitioned too: between steps a parameter's full data
is gone (only the small *persistent* ones stay gathered) and each rank holds, per sub-group ``i``, the flat bit16
partition every parameter's ``ds_tensor`` is a view of, the flat fp32 master partition
``fp32_partitioned_groups_flat[i]`` and its Adam moments. The state recovery saves is the fp32 partitions and the
moments (plus the module's buffers, replicated, and the same python state as ZeRO-1/2); a restore writes them in
place, casts the masters into the bit16 partitions as ZeRO-3's step does, and re-gathers the persistent
parameters (:meth:`Zero3TrainState.load_extra_state`, collective: every rank restores together).

The fp32 partitions and moments are rank-local: their checkpoint keys carry the rank, and a checkpoint loads only
into a job with the same data-parallel size (``reshardable = False``; DeepSpeed's universal checkpoint is the tool
for changing it). The bit16 parameters of ZeRO-1/2 are replicated and written once. ZeRO's partitions, the loss
scaler and the engine's counters are reached through :mod:`arc_engine.integrations.deepspeed.internals`.
"""

from __future__ import annotations

from typing import Any

import torch

from arc_engine.integrations.deepspeed import internals as deepspeed_internals
from arc_engine.recovery.state import (
    TrainState,
    add_relative_noise,
    group_hyperparameters,
    load_group_hyperparameters,
    materialize_optimizer_state,
)


class ZeroTrainState(TrainState):
    """Recovery's view of a DeepSpeed engine running ZeRO stage 1 or 2 (optimizer states on the device)."""

    reshardable = False

    def __init__(self, ds_engine: Any, *, rank: int, lr_scheduler: Any | None = None) -> None:
        self.ds_engine = ds_engine
        self.zero = ds_engine.optimizer
        self.torch_optimizer = deepspeed_internals.wrapped_optimizer(self.zero)
        self.rank = rank
        self.outside_scheduler = lr_scheduler  # one the loop steps itself (DeepSpeed's own is the engine's)

    def _schedulers(self) -> list[Any]:
        return [s for s in (self.ds_engine.lr_scheduler, self.outside_scheduler) if s is not None]

    def _partitions(self) -> list[torch.Tensor]:
        """This rank's fp32 master partitions, one per parameter group (ZeRO-3: per sub-group)."""
        return deepspeed_internals.fp32_partitions(self.zero)

    def _partition_state(self) -> list[tuple[str, torch.Tensor]]:
        """Each fp32 partition, then its optimizer state tensors, under stable names."""
        named: list[tuple[str, torch.Tensor]] = []
        for j, partition in enumerate(self._partitions()):
            named.append((f"fp32_{j}", partition))
            state = self.torch_optimizer.state.get(partition, {})
            named += [(f"state_{j}_{k}", state[k]) for k in sorted(state) if isinstance(state[k], torch.Tensor)]
        return named

    def _model_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The module's tensors recovery keeps: its (replicated) bit16 parameters and its buffers."""
        module = self.ds_engine.module
        return [*module.named_parameters(), *module.named_buffers()]

    def _materialize(self) -> None:
        """Create the optimizer state a fresh engine (a resume) does not have yet, so a checkpoint loads into it."""
        materialize_optimizer_state(self.torch_optimizer)

    def live_tensors(self) -> list[torch.Tensor]:
        return [t.detach() for _, t in self._model_tensors() + self._partition_state()]

    def replicated(self) -> tuple[Any, list[int]] | None:
        """(the data-parallel group, the indices in :meth:`live_tensors` of the bit16 parameters): ZeRO-1/2 keeps
        them whole and identical on every rank, so a snapshot keeps one copy per group."""
        params = {id(param) for param in self.ds_engine.module.parameters()}
        return deepspeed_internals.data_parallel_group(self.zero), \
            [index for index, (_, tensor) in enumerate(self._model_tensors()) if id(tensor) in params]

    def forward_written(self) -> list[int]:
        """Indices in :meth:`live_tensors` of what a forward pass may write (the module's buffers): a CUDA snapshot
        copies only these ahead of the forward, the rest on a side stream (``recovery.snapshot.capture``)."""
        buffers = {id(buffer) for buffer in self.ds_engine.module.buffers()}
        return [index for index, (_, tensor) in enumerate(self._model_tensors()) if id(tensor) in buffers]

    def extra_state(self) -> dict[str, Any]:
        return {"param_groups": group_hyperparameters(self.torch_optimizer),
                "lr_schedulers": [scheduler.state_dict() for scheduler in self._schedulers()],
                "loss_scaler": deepspeed_internals.loss_scaler_state(self.zero),
                "counters": deepspeed_internals.engine_counters(self.ds_engine)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        load_group_hyperparameters(self.torch_optimizer, state["param_groups"])
        for scheduler, saved in zip(self._schedulers(), state["lr_schedulers"], strict=True):
            scheduler.load_state_dict(saved)
        deepspeed_internals.restore_loss_scaler(self.zero, state["loss_scaler"])
        deepspeed_internals.restore_engine_counters(self.ds_engine, state["counters"])

    def dcp_state_dict(self) -> dict[str, Any]:
        self._materialize()
        return {"model": {name: t.detach() for name, t in self._model_tensors()},
                f"zero_rank{self.rank}": {name: t.detach() for name, t in self._partition_state()}}

    def after_dcp_load(self, state_dict: dict[str, Any]) -> None:
        """Nothing left to do: DCP loaded every tensor in place (bit16 parameters and fp32 masters alike)."""

    def masters_changed(self) -> None:
        """The bit16 partitions from the fp32 masters, then gathered into the parameters (DeepSpeed's own
        ``update_lp_params``). Collective over the data-parallel group."""
        deepspeed_internals.refresh_bit16_from_masters(self.zero)

    @torch.no_grad()
    def perturb(self, scale: float, seed: int) -> None:
        """Perturb the (replicated) bit16 parameters identically on every rank, then take each rank's fp32 master
        partition from them, as DeepSpeed's own checkpoint loading does."""
        params = [p for p in self.ds_engine.module.parameters() if p.requires_grad]
        add_relative_noise(params, scale, seed)
        for j, partition in enumerate(deepspeed_internals.fp32_partitions(self.zero)):
            partition_id = deepspeed_internals.partition_rank(self.zero, j)
            partition.copy_(deepspeed_internals.bit16_partition(self.zero, j, partition_id))


class Zero3TrainState(ZeroTrainState):
    """Recovery's view of a DeepSpeed engine running ZeRO stage 3 with the partitions on the device."""

    def _partitions(self) -> list[torch.Tensor]:
        return deepspeed_internals.sub_group_partitions(self.zero)

    def _model_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Only the buffers: the parameters live in the partitions (whole only while gathered)."""
        return list(self.ds_engine.module.named_buffers())

    def _materialize(self) -> None:
        deepspeed_internals.materialize_sub_group_states(self.zero)

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """The python state, then the bit16 partitions and the gathered parameters from the (restored) fp32
        masters. Collective over ZeRO-3's parameter groups: called last in every restore, on every rank."""
        super().load_extra_state(state)
        self._refresh_bit16()

    def masters_changed(self) -> None:
        """The bit16 partitions and the gathered parameters from the fp32 masters (collective)."""
        self._refresh_bit16()

    @torch.no_grad()
    def _refresh_bit16(self) -> None:
        bit16 = deepspeed_internals.sub_group_bit16_partitions(self.zero)
        for target, master in zip(bit16, self._partitions(), strict=True):
            if target is not master:  # the same tensor when the model trains in fp32 (0.18.0 keeps a copy)
                target.copy_(master)
        deepspeed_internals.refresh_gathered_parameters(self.zero)

    @torch.no_grad()
    def perturb(self, scale: float, seed: int) -> None:
        """Perturb each parameter's piece of this rank's fp32 partitions (padding excluded; noise drawn per rank,
        the pieces differ), then refresh the bit16 partitions and the gathered parameters. Collective, like
        :meth:`load_extra_state`."""
        size = deepspeed_internals.param_partition_numel
        pieces = []
        for partition, params, paddings in zip(self._partitions(), deepspeed_internals.sub_group_params(self.zero),
                                               deepspeed_internals.sub_group_paddings(self.zero), strict=True):
            offset = 0
            for param, pad in zip(params, paddings, strict=True):
                if param.requires_grad and size(param) > pad:
                    pieces.append(partition.narrow(0, offset, size(param) - pad))
                offset += size(param)
        add_relative_noise(pieces, scale, seed + self.rank * 7919)
        self._refresh_bit16()

"""What a rollback or a resume restores under megatron-core: :class:`MegatronTrainState` (both tiers of recovery).

One rank's state is its model chunks' parameters and buffers (bf16/fp16 or fp32, full tensors of its TP/PP/EP
shard), and per optimizer member the tensors the inner torch optimizer steps (the DistributedOptimizer's fp32
shards, the Float16Optimizer's fp32 main copies, or the parameters themselves) with their Adam state, plus the
python-side state: learning rates and other group settings, the LR scheduler, the grad scaler. Restoring writes
them back in place, so Megatron's buffers (gradient and parameter buckets, DistOpt views) stay the same memory.

Adam's state is created lazily at the first applied step: a snapshot taken before it has fewer tensors than the
live state after it. Recovery snapshots verified-stable steps, which come after applied steps.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from arc_engine.integrations.megatron import internals as mi
from arc_engine.integrations.megatron.checkpoint import MegatronDiskFormat
from arc_engine.recovery.state import TrainState, add_relative_noise, materialize_optimizer_state


class MegatronTrainState(TrainState):
    """:class:`arc_engine.recovery.state.TrainState` for megatron DDP chunks and a Megatron optimizer."""

    reshardable = False

    def __init__(self, chunks: list[Any], optimizer: Any, lr_scheduler: Any | None = None,
                 checkpoint_args: Any | None = None, native_format: bool = True) -> None:
        self.chunks, self.optimizer, self.lr_scheduler = chunks, optimizer, lr_scheduler
        self.checkpoint_args = checkpoint_args  # () -> what Megatron-LM saves as "args" (see MegatronDiskFormat)
        self.native_format = native_format  # False: this megatron-core lacks what MegatronDiskFormat reads
        self.members = mi.members(optimizer)

    def live_tensors(self) -> list[torch.Tensor]:
        return [tensor for tensor, _ in self._tensors()]

    def forward_written(self) -> list[int]:
        """Indices in :meth:`live_tensors` of what a forward pass may write (the chunks' buffers): a CUDA snapshot
        copies only these ahead of the forward, the rest on a side stream (``recovery.snapshot.capture``)."""
        return [index for index, (_, is_buffer) in enumerate(self._tensors()) if is_buffer]

    def _tensors(self) -> list[tuple[torch.Tensor, bool]]:
        """(tensor, is a module buffer) of every state tensor, each once, in a fixed order."""
        tensors: list[tuple[torch.Tensor, bool]] = []
        seen: set[int] = set()

        def add(tensor: torch.Tensor, is_buffer: bool = False) -> None:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append((tensor.detach(), is_buffer))

        for chunk in self.chunks:
            module = mi.unwrap_chunk(chunk)
            for param in module.parameters():
                add(param)
            for buffer in module.buffers():
                add(buffer, True)
        for member in self.members:
            inner = mi.inner_optimizer(member)
            if inner is None:
                continue
            for group in inner.param_groups:
                for param in group["params"]:
                    add(param)
                    state = inner.state.get(param, {})
                    for key in sorted(state):
                        if isinstance(state[key], torch.Tensor):
                            add(state[key])
        return tensors

    def extra_state(self) -> dict[str, Any]:
        groups = []
        scalers = []
        for member in self.members:
            inner = mi.inner_optimizer(member)
            groups.append([] if inner is None else
                          [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in inner.param_groups])
            scaler = mi.member_grad_scaler(member)
            scalers.append(scaler.state_dict() if scaler is not None else None)
        scheduler = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        return {"param_groups": groups, "grad_scalers": scalers, "lr_scheduler": scheduler}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        for member, groups, scaler_state in zip(self.members, state["param_groups"], state["grad_scalers"],
                                                strict=True):
            inner = mi.inner_optimizer(member)
            if inner is not None:
                for group, values in zip(inner.param_groups, groups, strict=True):
                    group.update(copy.deepcopy(values))
            scaler = mi.member_grad_scaler(member)
            if scaler is not None and scaler_state is not None:
                scaler.load_state_dict(scaler_state)
        if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def native_disk_format(self) -> MegatronDiskFormat | None:
        """Megatron's own checkpoint format for the disk tier (``recovery.checkpoint.format: auto``); None where
        the installed megatron-core lacks what it reads (auto then writes arc_engine's DCP layout)."""
        if not self.native_format:
            return None
        return MegatronDiskFormat(self.chunks, self.optimizer, self.lr_scheduler, self.checkpoint_args)

    def dcp_state_dict(self) -> dict[str, Any]:
        """The disk tier's view (torch.distributed.checkpoint, not reshardable): the model chunks' tensors under a
        key per model-parallel shard (``tp/pp/ep`` ranks; data-parallel replicas share it, so DCP writes one
        copy), each rank's optimizer tensors under its own key (DistributedOptimizer shards differ per
        data-parallel rank). A fresh job (a resume) has no Adam moments yet: they are created first (one step at
        learning rate 0 with zero gradients, which leaves the parameters unchanged) so the checkpoint loads into
        them."""
        from megatron.core import parallel_state

        for member in self.members:
            inner = mi.inner_optimizer(member)
            if inner is not None:
                materialize_optimizer_state(inner)
        shard = (f"tp{parallel_state.get_tensor_model_parallel_rank()}"
                 f".pp{parallel_state.get_pipeline_model_parallel_rank()}"
                 f".ep{parallel_state.get_expert_model_parallel_rank()}")
        model: dict[str, torch.Tensor] = {}
        for index, chunk in enumerate(self.chunks):
            module = mi.unwrap_chunk(chunk)
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                model[f"{index}.{name}"] = tensor.detach()
        optim: dict[str, torch.Tensor] = {}
        for m, member in enumerate(self.members):
            inner = mi.inner_optimizer(member)
            if inner is None:
                continue
            for g, group in enumerate(inner.param_groups):
                for p, param in enumerate(group["params"]):
                    optim[f"{m}.{g}.{p}.param"] = param.detach()
                    state = inner.state.get(param, {})
                    for key in sorted(state):
                        if isinstance(state[key], torch.Tensor):
                            optim[f"{m}.{g}.{p}.{key}"] = state[key].detach()
        return {f"model.{shard}": model, f"optim.rank{torch.distributed.get_rank()}": optim}

    def after_dcp_load(self, state_dict: dict[str, Any]) -> None:
        """Nothing left to do: DCP loaded every tensor in place (model parameters and the stepped masters)."""

    def masters_changed(self) -> None:
        """The fp32 masters changed in place (an importance-weighted rollback): Megatron's own copy to the bf16/fp16
        model parameters (a no-op where the optimizer steps the model parameters). The DistributedOptimizer is
        refused at attach for this (its shards would need a parameter all-gather)."""
        for member in self.members:
            if mi.inner_optimizer(member) is not None:
                mi.copy_main_to_model_params(member)

    @torch.no_grad()
    def perturb(self, scale: float, seed: int) -> None:
        """ARC's escape: noise on the tensors the optimizers step (the fp32 masters), then Megatron's own copy to
        the model parameters. A DistributedOptimizer's shards are disjoint pieces of one replicated tensor and
        every data-parallel rank draws the same noise for the same piece only if the noise is a function of the
        element's place in the full tensor, which this does not guarantee: so the escape is refused there."""
        from megatron.core import parallel_state

        if any(mi.is_distributed(m) for m in self.members):
            raise ValueError("arc_engine: the escape (perturbation) is not supported with Megatron's "
                             "DistributedOptimizer yet; set recovery.max_escapes: 0")
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        for index, member in enumerate(self.members):
            inner = mi.inner_optimizer(member)
            if inner is None:
                continue
            params = [p for g in inner.param_groups for p in g["params"]]
            expert = any(g.get("is_expert_parallel") for g in inner.param_groups)
            # replicas over data parallelism draw the same noise; model-parallel shards differ
            shard = 7919 * tp_rank + 104729 * pp_rank + (15485863 * (ep_rank + 1) if expert else 0)
            add_relative_noise(params, scale, seed + shard + 31 * index)
            mi.copy_main_to_model_params(member)

"""Every read of megatron-core's internals, and every method arc_engine wraps, in one module behind a version check.

What arc_engine needs of megatron-core 0.16.1 and why no public API gives it (the sources in site-packages are the
ground truth; ``../shared/megatron-core-notes.md`` has the checked facts):

* **Local gradients before the data-parallel reduction.** megatron ``DistributedDataParallel`` accumulates each
  gradient into ``param.main_grad``, a view of a contiguous bucket, and reduces a bucket group in
  ``_ParamAndGradBucketGroup.start_grad_sync`` (from a backward hook with ``overlap_grad_reduce``, else from
  ``finalize_model_grads``). Nothing runs between the last accumulation and the reduction except that method, so
  :func:`wrap_start_grad_sync` wraps it on each bucket-group instance: the wrapper reads the bucket before calling
  the original. It issues no collective (it can run inside backward).
* **The veto.** ``MegatronOptimizer.step()`` (and ``ChainedOptimizer.step()``) skip the update when
  ``prepare_grads()`` returns True (found_inf: fp16 overflow). Under bf16 and fp32 nothing sets it. arc_engine
  wraps ``prepare_grads`` on the optimizer instance the training loop steps: the original runs, then arc_engine
  takes its statistics of the reduced gradients, agrees, and returns True when the job decided to skip, so Megatron
  skips through its own path (Adam step counts unchanged, no parameter all-gather, ``update_successful=False``).
  ``step`` is wrapped to close arc_engine's step after Megatron's.
* **The reduced gradient and Adam state of this rank's shard.** After ``prepare_grads`` the inner torch optimizer
  (``member.optimizer``) holds exactly what it will step: the DistributedOptimizer's fp32 shards, the
  Float16Optimizer's fp32 main copies, or the FP32Optimizer's parameters, each with ``.grad`` and Adam's
  ``exp_avg`` / ``exp_avg_sq`` / ``step`` in ``member.optimizer.state``. The model parameters behind each inner
  group are attributes of the member (:func:`model_params_per_group`).
* **Checkpoints in Megatron's own format.** ``dist_checkpointing.save`` runs its whole save, including the final
  gather of write results and a barrier, on the default process group from the calling thread; arc_engine's disk
  tier writes from a background thread on its own gloo group. :func:`prepare_dist_checkpoint` therefore does what
  the ``torch_dist`` strategy does before writing (validation, ``common.pt``, the translation of ShardedTensors to
  DCP with Megatron's save planner), and arc_engine's checkpoint manager writes the result with DCP on its group;
  the directory is then what ``dist_checkpointing.load`` (and Megatron-LM's ``--load``) reads.

Wrapped methods are instance attributes, removed again by the removers these functions return (``Arc.close``);
nothing else of Megatron is assigned. The layouts read here change between releases, so :func:`check_version`
(called by ``attach_megatron``) refuses a megatron-core this module was not tested with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: megatron-core releases whose internals this module was tested against (a local "+..." suffix is ignored).
TESTED_MEGATRON_CORE_VERSIONS = ("0.16.1",)


class UntestedMegatronVersion(RuntimeError):
    """The installed megatron-core is not one arc_engine's Megatron integration was tested with."""


def check_version(installed: str | None = None) -> None:
    """Raise :class:`UntestedMegatronVersion` unless ``installed`` (default: the imported ``megatron.core``'s) is
    one of :data:`TESTED_MEGATRON_CORE_VERSIONS`. Local, no communication."""
    if installed is None:
        import megatron.core

        installed = str(megatron.core.__version__)
    if installed.split("+")[0] not in TESTED_MEGATRON_CORE_VERSIONS:
        raise UntestedMegatronVersion(
            f"arc_engine's Megatron integration reads megatron-core internals and was tested with "
            f"{', '.join(TESTED_MEGATRON_CORE_VERSIONS)}; found {installed}. Install megatron-core=="
            f"{TESTED_MEGATRON_CORE_VERSIONS[-1]} or check integrations/megatron_internals.py against it.")


# ----------------------------------------------------------------------------------------- model chunks, buckets

def unwrap_chunk(chunk: torch.nn.Module) -> torch.nn.Module:
    """The module inside megatron ``DistributedDataParallel`` (and ``Float16Module``): what holds the layers."""
    module = chunk
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def is_megatron_ddp(chunk: object) -> bool:
    from megatron.core.distributed import DistributedDataParallel

    return isinstance(chunk, DistributedDataParallel)


@dataclass
class BucketGroupRef:
    """One megatron bucket group: ``index`` numbers it across all chunks (dense groups, then expert groups), the
    same on every rank of a data-parallel group."""

    index: int
    group: Any
    expert: bool

    def params(self) -> list[torch.nn.Parameter]:
        return [p for bucket in self.group.buckets for p in bucket.params_list]

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's accumulated gradient of every parameter in the group (views of the buckets)."""
        return [p.main_grad for bucket in self.group.buckets for p in bucket.params_list]

    def flat_buffers(self) -> list[torch.Tensor]:
        """The group's buckets as flat tensors (padding included; padding is zero)."""
        return [bucket.grad_data for bucket in self.group.buckets]

    def reduction_started(self) -> bool:
        """Megatron's own early return: in the first batch with ``overlap_grad_reduce``, ``finish_grad_sync`` calls
        ``start_grad_sync`` again after the backward hooks already dispatched the reduction."""
        return bool(self.group.is_first_batch and self.group.grad_reduce_handle is not None)


def bucket_groups(chunks: list[Any]) -> list[BucketGroupRef]:
    """Every bucket group of the megatron DDP ``chunks``, dense then expert-parallel, numbered in that order."""
    refs: list[BucketGroupRef] = []
    for chunk in chunks:
        for group in chunk.bucket_groups:
            refs.append(BucketGroupRef(len(refs), group, False))
        for group in chunk.expert_parallel_bucket_groups:
            refs.append(BucketGroupRef(len(refs), group, True))
    return refs


def replace_method(obj: object, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) \
        -> Callable[[], None]:
    """Set ``obj.<name>`` (on the instance) to ``make(original bound method)``; returns the remover, which drops
    the instance attribute again (or restores an instance attribute that was there before)."""
    had_own = name in vars(obj)
    previous = vars(obj).get(name)
    original = getattr(obj, name)
    setattr(obj, name, make(original))

    def remove() -> None:
        if had_own:
            setattr(obj, name, previous)
        elif name in vars(obj):
            delattr(obj, name)

    return remove


def wrap_start_grad_sync(ref: BucketGroupRef, before: Callable[[BucketGroupRef], None]) -> Callable[[], None]:
    """Run ``before(ref)`` each time Megatron is about to reduce the bucket group (not when Megatron returns early
    because it already did). ``before`` must not communicate. Returns the remover."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def start_grad_sync(*args: Any, **kwargs: Any) -> Any:
            if not ref.reduction_started():
                before(ref)
            return original(*args, **kwargs)

        return start_grad_sync

    return replace_method(ref.group, "start_grad_sync", make)


# ----------------------------------------------------------------------------------------------------- optimizer

def members(optimizer: Any) -> list[Any]:
    """The Megatron optimizers a ``ChainedOptimizer`` steps (itself when it is a single one)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_stub(member: Any) -> bool:
    return bool(getattr(member, "is_stub_optimizer", False)) or getattr(member, "optimizer", None) is None


def inner_optimizer(member: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer a member steps (None for a stub: a rank without parameters of that kind)."""
    return None if is_stub(member) else member.optimizer


class ParamStates(Mapping[Any, Any]):
    """The optimizer state of a Megatron optimizer's members keyed by the parameters their inner torch optimizers
    step (what :func:`arc_engine.recovery.heal.heal_step` passes to the engine's update hooks with
    ``optimizer.param_groups``). ``ChainedOptimizer.state`` is a ``ProxyDict`` keyed by ``(member index, key)``, so
    no parameter can be looked up in it. Reads each member's current ``state`` at every access (a
    ``load_state_dict`` replaces it) and never adds an entry (those states are ``defaultdict``s)."""

    def __init__(self, optimizer: Any) -> None:
        self._members = members(optimizer)

    def _states(self) -> list[Mapping[Any, Any]]:
        return [inner.state for inner in map(inner_optimizer, self._members) if inner is not None]

    def __getitem__(self, param: Any) -> Any:
        for state in self._states():
            if param in state:
                return state[param]
        raise KeyError(param)

    def __contains__(self, param: object) -> bool:
        return any(param in state for state in self._states())

    def __iter__(self) -> Iterator[Any]:
        for state in self._states():
            yield from state

    def __len__(self) -> int:
        return sum(len(state) for state in self._states())


def is_distributed(member: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(member, DistributedOptimizer)


def model_params_per_group(member: Any) -> list[list[torch.nn.Parameter]]:
    """Per group of the member's inner optimizer, the model parameters behind it (what the buckets hold)."""
    if is_stub(member):
        return []
    if is_distributed(member):
        return [[*f16, *f32] for f16, f32 in zip(member.model_float16_groups, member.model_fp32_groups, strict=True)]
    if hasattr(member, "float16_groups"):  # Float16OptimizerWithFloat16Params
        return [[*f16, *f32] for f16, f32 in zip(member.float16_groups, member.fp32_from_fp32_groups, strict=True)]
    return [list(group["params"]) for group in member.optimizer.param_groups]  # FP32Optimizer


def group_label(group: dict) -> str:
    """A name for one of Megatron's parameter groups: dense or expert, decay or no_decay (weight-decay multiplier
    0), and the LR multiplier when it is not 1."""
    kind = "expert" if group.get("is_expert_parallel") else "dense"
    decay = "no_decay" if float(group.get("wd_mult", 1.0)) == 0.0 or float(group.get("weight_decay", 1.0)) == 0.0 \
        else "decay"
    lr_mult = float(group.get("lr_mult", 1.0))
    return f"{kind}.{decay}" + ("" if lr_mult == 1.0 else f".lr_x{lr_mult:g}")


def counts_once(member: Any, param: torch.Tensor) -> bool:
    """Megatron's own rule for the gradient norm (``get_main_grads_for_grad_norm``): a parameter counts unless it
    is a shared copy (tied embeddings on the last pipeline stage) or a duplicate of a tensor-parallel peer's."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import param_is_not_shared

    return param_is_not_shared(param) and tensor_parallel.param_is_not_tensor_parallel_duplicate(
        param, getattr(member, "tp_group", None))


def replica_group(member: Any) -> dist.ProcessGroup | None:
    """The group over which the member's (non-distributed) optimizer holds identical copies of its parameters:
    the data(+context)-parallel group for dense parameters, the expert data-parallel group for expert ones. None
    for a DistributedOptimizer (its shards are disjoint)."""
    from megatron.core import parallel_state

    if is_distributed(member) or is_stub(member):
        return None
    expert = any(g.get("is_expert_parallel") for g in member.optimizer.param_groups)
    if expert:
        return parallel_state.get_expert_data_parallel_group()
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def found_inf_skips(optimizer: Any) -> Callable[[Callable[[bool], bool]], Callable[[], None]]:
    """``found_inf_skips(opt)(decide)``: wrap ``opt.prepare_grads`` so that it returns ``decide(found_inf)``
    (``decide`` runs after Megatron prepared the gradients; True skips the step). Returns the remover."""

    def install(decide: Callable[[bool], bool]) -> Callable[[], None]:
        def make(original: Callable[[], bool]) -> Callable[[], bool]:
            def prepare_grads() -> bool:
                return decide(bool(original()))

            return prepare_grads

        return replace_method(optimizer, "prepare_grads", make)

    return install


def after_step(optimizer: Any, done: Callable[[tuple], None]) -> Callable[[], None]:
    """Wrap ``optimizer.step`` so ``done(result)`` runs after Megatron's step returned. Returns the remover."""

    def make(original: Callable[..., tuple]) -> Callable[..., tuple]:
        def step(*args: Any, **kwargs: Any) -> tuple:
            result = original(*args, **kwargs)
            done(result)
            return result

        return step

    return replace_method(optimizer, "step", make)


# ------------------------------------------------------------------------------------------ model structure

def transformer_layers(chunks: list[Any]) -> list[Any]:
    """Every ``TransformerLayer`` of this rank's chunks (its pipeline stage(s)), in order."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for chunk in chunks for m in unwrap_chunk(chunk).modules() if isinstance(m, TransformerLayer)]


def layer_index(layer: Any) -> int:
    """The layer's 0-based index in the whole model (``layer_number`` is 1-based and includes the pipeline
    offset)."""
    return int(layer.layer_number) - 1


def attention_layout(layer: Any) -> tuple[torch.Tensor, int, int, int, int] | None:
    """``(linear_qkv weight, query groups on this TP rank, query heads per group, head dim, span)`` of a
    self-attention layer whose fused QKV rows are ``[q heads, k, v]`` per query group. ``span``: how many TP ranks
    share one query group's rows (1 when each rank holds whole groups; with fewer query groups than TP ranks, a
    group's rows are split over ``tp / groups`` consecutive TP ranks, and the local weight holds a slice of one
    group: the query-group count returned is then 1, for the rows gathered over those ranks). None without a fused
    ``linear_qkv`` or with an output gate in the rows."""
    from megatron.core import parallel_state

    attention = getattr(layer, "self_attention", None)
    qkv = getattr(attention, "linear_qkv", None)
    weight = getattr(qkv, "weight", None)
    config = layer.config
    if weight is None or getattr(config, "attention_output_gate", False):
        return None
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    tp = parallel_state.get_tensor_model_parallel_world_size()
    head_dim = config.kv_channels or config.hidden_size // heads
    if groups % tp == 0:
        return weight, groups // tp, heads // groups, head_dim, 1
    if tp % groups:
        return None
    return weight, 1, heads // groups, head_dim, tp // groups


def router_of(layer: Any) -> Any | None:
    """The ``TopKRouter`` of a MoE layer (None for a dense MLP)."""
    return getattr(getattr(layer, "mlp", None), "router", None)


def observe_routing(router: Any, observe: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[], None]:
    """Wrap ``router.routing`` so ``observe(logits [tokens, experts], routing_map)`` sees every routing decision
    (the full logits Megatron's outputs do not carry). Returns the remover."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def routing(logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            probs, routing_map = original(logits, *args, **kwargs)
            observe(logits.reshape(-1, logits.shape[-1]), routing_map)
            return probs, routing_map

        return routing

    return replace_method(router, "routing", make)


def parallel_linear_types() -> tuple[type, ...]:
    """megatron-core's tensor-parallel GEMM modules; their forward returns ``(output, bias)``."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


def copy_main_to_model_params(member: Any) -> None:
    """After the fp32 masters of a Float16Optimizer changed outside a step (a rollback's escape), copy them to the
    bf16/fp16 model parameters as Megatron does after a step. No-op for other members."""
    if hasattr(member, "float16_groups") and not is_stub(member):
        member._copy_main_params_to_model_params()


# ----------------------------------------------------------------------------------------- dist_checkpointing

#: the backend and version ``metadata.json`` names: megatron-core's ``torch_dist`` (DCP underneath)
DIST_CKPT_BACKEND = ("torch_dist", 1)
DIST_CKPT_COMMON_FILES = ("common.pt", "metadata.json")


def sharded_object(key: str, data: Any, rank: int, world: int) -> Any:
    """A per-rank object in a dist_checkpointing state dict (one entry per rank of ``world``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(key, data, (world,), (rank,), replica_id=0)


def layout_args(chunks: list[Any]) -> Any:
    """What Megatron-LM's checkpoint loader checks of the ``args`` it saves (model shape, parallel layout), for a
    job that does not run under Megatron-LM's own arguments. No data position (``consumed_train_samples``): a
    Megatron-LM job loading it starts its data from the beginning."""
    import argparse

    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    model = unwrap_chunk(chunks[0])
    return argparse.Namespace(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        add_position_embedding=getattr(model, "position_embedding_type", "learned_absolute") == "learned_absolute",
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        data_parallel_size=ps.get_data_parallel_world_size(), world_size=dist.get_world_size())


def prepare_dist_checkpoint(sharded_state_dict: dict, step_dir: Any, *, coordinator: bool, validate: bool,
                            stage: Callable[[dict[int, torch.Tensor]], dict[int, torch.Tensor]]) -> tuple[dict, Any]:
    """The ``torch_dist`` strategy's save up to the write: apply factories, split off the common part (the
    coordinator writes ``common.pt`` and ``metadata.json`` into ``step_dir``), replace every ShardedTensor's data
    by ``stage``'s host copy (so training can go on while the write runs), translate to DCP. Returns the DCP state
    dict and Megatron's save planner for ``dcp.async_save``. Collective on the default group when ``validate``
    (Megatron's access-integrity check)."""
    import copy

    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    sharded, common = save_preprocess(sharded_state_dict, validate, None)
    if coordinator:
        TorchCommonSaveStrategy("torch", 1).save_common(common, step_dir)
        save_config(CheckpointingConfig(*DIST_CKPT_BACKEND), step_dir)
    tensors: list[Any] = []

    def collect(value: Any) -> Any:
        if isinstance(value, ShardedTensor):
            tensors.append(value)
        return value

    dict_list_map_inplace(collect, sharded)
    staged = stage({i: sh.data for i, sh in enumerate(tensors)})
    copies = {id(sh): copy.copy(sh) for sh in tensors}
    for i, sh in enumerate(tensors):
        copies[id(sh)].data = staged[i]
    dict_list_map_inplace(lambda v: copies.get(id(v), v) if isinstance(v, ShardedTensor) else v, sharded)
    sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, True)  # replica 0 of each piece only
    return mcore_to_pyt_state_dict(sharded, False), MCoreSavePlanner(flatten_state_dict=False)


def load_dist_checkpoint(sharded_state_dict: dict, path: Any) -> dict:
    """``dist_checkpointing.load`` (collective on the default group)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(sharded_state_dict, str(path))


def load_optimizer_state(optimizer: Any, state_dict: Any) -> None:
    """``optimizer.load_state_dict`` from a dist_checkpointing load, then Adam's ``step`` of every parameter from
    its group's saved step. The DistributedOptimizer stores the step in its param groups only and, loading its
    ``dp_reshardable`` parameter state, writes back the live step tensors of the loading template (megatron-core
    0.16.1): without this, a rollback would keep the current step counts. Other members get one step tensor per
    parameter (the load may share one). Under no_grad (the DistributedOptimizer copies into leaf shards)."""
    with torch.no_grad():
        optimizer.load_state_dict(state_dict)
        chained = members(optimizer)
        if len(chained) == 1:
            parts = [state_dict]
        else:
            parts = [v for _, v in sorted(state_dict.items())] if isinstance(state_dict, dict) else list(state_dict)
        for member, part in zip(chained, parts, strict=True):
            inner = inner_optimizer(member)
            saved = part.get("optimizer", {}) if isinstance(part, dict) else {}
            saved_groups = saved.get("param_groups", []) if isinstance(saved, dict) else []
            if inner is None:
                continue
            for index, group in enumerate(inner.param_groups):
                step = saved_groups[index].get("step") if index < len(saved_groups) else None
                for param in group["params"]:
                    state = inner.state.get(param, {})
                    current = state.get("step")
                    if isinstance(current, torch.Tensor):
                        state["step"] = current.clone() if step is None else \
                            torch.tensor(float(step), dtype=current.dtype, device=current.device)


# ----------------------------------------------------------------------------------------- SDC recomputation

def recompute_refusal(chunks: list[Any], optimizer: Any) -> str | None:
    """Why the SDC recomputation cannot run on this Megatron setup (None when it can). Local; the same answer on
    every rank (the settings are job-wide)."""
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    ddp_config = chunks[0].ddp_config
    if getattr(config, "fp16", False):
        return "fp16 (the loss scaler's unscale and overflow check would have to be replayed; bf16 and fp32 work)"
    if getattr(config, "calculate_per_token_loss", False):
        return "calculate_per_token_loss (the gradients are scaled by the job-wide token count after the reduction)"
    if getattr(ddp_config, "num_distributed_optimizer_instances", 1) > 1:
        return "num_distributed_optimizer_instances > 1"
    if getattr(ddp_config, "use_megatron_fsdp", False) or getattr(ddp_config, "overlap_param_gather", False):
        return "megatron FSDP or overlap_param_gather"
    if any(getattr(m, "config", None) is not None and getattr(m.config, "use_precision_aware_optimizer", False)
           for m in members(optimizer)):
        return "the precision-aware optimizer"
    return None


def parallel_coordinates() -> dict[str, Any]:
    """This rank's data-parallel rank (without context parallelism: what picks its batches), its position in the
    model-parallel grid, and the ranks of the groups one forward pass spans (TP, PP, CP, EP, expert TP)."""
    from megatron.core import parallel_state as ps

    groups = [ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
              ps.get_context_parallel_group(), ps.get_expert_model_parallel_group(),
              ps.get_expert_tensor_parallel_group()]
    return {"data_rank": ps.get_data_parallel_rank(),
            "position": (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                         ps.get_context_parallel_rank(), ps.get_expert_model_parallel_rank(),
                         ps.get_expert_tensor_parallel_rank()),
            "peers": [tuple(dist.get_process_group_ranks(g)) for g in groups if g is not None]}


def reduction_of(ref: BucketGroupRef) -> tuple[dist.ProcessGroup, float]:
    """The group a bucket group's gradients are reduced over and the factor Megatron's reduction applies to each
    rank's contribution (``gradient_scaling_factor``, divided by the group size when it averages in the
    collective): the reduced gradient is ``factor x sum over the group``."""
    # the communication group of start_grad_sync (with one distributed-optimizer instance: the whole DP group)
    group = ref.group.intra_distributed_optimizer_instance_group if ref.group.ddp_config.use_distributed_optimizer \
        else ref.group.data_parallel_group
    scales = {float(bucket.gradient_scaling_factor) for bucket in ref.group.buckets}
    assert len(scales) == 1, scales
    factor = scales.pop()
    if ref.group.ddp_config.average_in_collective:
        factor /= dist.get_world_size(group)
    return group, factor


def bucket_params(ref: BucketGroupRef) -> list[list[torch.nn.Parameter]]:
    """The parameters of each bucket of the group."""
    return [list(bucket.params_list) for bucket in ref.group.buckets]


def main_grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's ``main_grad`` (its view of a grad buffer)."""
    return [p.main_grad for p in params]


class IsolatedBackward:
    """Run a forward/backward pass of the chunks (``forward_backward_func``) without touching the step's gradients:
    saves and zeroes every grad buffer, keeps every bucket group from starting its reduction (its
    ``is_last_microbatch`` stays False, the schedule gets no no-sync, grad-sync or finalize hooks: no collective
    over the data-parallel groups), and on exit puts back the buffers and the schedule hooks. Inside, each
    parameter's ``main_grad`` holds this pass's local gradient. Peak extra memory: one copy of the grad buffers."""

    HOOKS = ("no_sync_func", "grad_sync_func", "param_sync_func", "finalize_model_grads_func")

    def __init__(self, chunks: list[Any]) -> None:
        from megatron.core.utils import get_model_config

        self.config = get_model_config(chunks[0])
        self.groups = [g for chunk in chunks for g in (*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups)]
        self.buffers = [bucket.grad_data for g in self.groups for bucket in g.buckets]

    def __enter__(self) -> IsolatedBackward:
        self.saved = [buffer.clone() for buffer in self.buffers]
        self.hooks = {name: getattr(self.config, name, None) for name in self.HOOKS}
        self.last = [g.is_last_microbatch for g in self.groups]
        for buffer in self.buffers:
            buffer.zero_()
        for g in self.groups:
            g.is_last_microbatch = False
        for name in self.HOOKS:
            setattr(self.config, name, None)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, value in self.hooks.items():
            setattr(self.config, name, value)
        for g, last in zip(self.groups, self.last, strict=True):
            g.is_last_microbatch = last
        with torch.no_grad():
            for buffer, saved in zip(self.buffers, self.saved, strict=True):
                buffer.copy_(saved)
        self.saved = []


@torch.no_grad()
def post_reduction(chunks: list[Any], params: list[torch.nn.Parameter],
                   deltas: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """What ``finalize_model_grads`` does after the data-parallel reduction, applied to ``deltas`` (an addition to
    each parameter's reduced gradient, None for none): the all-reduce over the tensor-parallel group of the
    sequence-parallel / QK-layernorm / TP-averaged gradients and the word and position embedding all-reduces over
    the first and last pipeline stages, by Megatron's own functions on a temporary copy in the grad buffers.
    Collective over those groups: every rank calls it. Returns the transformed deltas."""
    import importlib

    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the package exports a function

    embedding = ps.get_embedding_group(check_initialized=False)
    position = ps.get_position_embedding_group(check_initialized=False)
    needed = ps.get_tensor_model_parallel_world_size() > 1 or \
        (embedding is not None and dist.get_world_size(embedding) > 1) or \
        (position is not None and dist.get_world_size(position) > 1)
    if not needed:
        return deltas
    config = get_model_config(chunks[0])
    with IsolatedBackward(chunks):  # saves and zeroes the buffers, puts them back after
        for param, delta in zip(params, deltas, strict=True):
            if delta is not None:
                param.main_grad.copy_(delta.to(param.main_grad.dtype))
        # the groups and calls of finalize_model_grads without a pg_collection
        pp_group = ps.get_pipeline_model_parallel_group()
        fmg._allreduce_non_tensor_model_parallel_grads(chunks, config, ps.get_tensor_model_parallel_group())
        fmg._allreduce_word_embedding_grads(chunks, config, embedding, pp_group)
        fmg._allreduce_position_embedding_grads(chunks, config, position, pp_group)
        return [None if delta is None else param.main_grad.detach().to(torch.float32, copy=True)
                for param, delta in zip(params, deltas, strict=True)]


def inner_grad_views(member: Any) -> list[tuple[torch.Tensor, torch.nn.Parameter, int, int]]:
    """``(inner parameter, model parameter, start, end)`` for each parameter the member's torch optimizer steps:
    its ``.grad`` is elements ``start:end`` of the flattened model parameter's reduced gradient (a
    DistributedOptimizer shard's range; the whole parameter for the other members)."""
    if is_stub(member):
        return []
    views: list[tuple[torch.Tensor, torch.nn.Parameter, int, int]] = []
    if is_distributed(member):
        pairs = [*zip(member.model_float16_groups, member.shard_fp32_from_float16_groups, strict=True),
                 *zip(member.model_fp32_groups, member.shard_fp32_groups, strict=True)]
        for model_group, shard_group in pairs:
            for model_param, shard in zip(model_group, shard_group, strict=True):
                param_range = member._get_model_param_range_map(model_param)["param"]
                views.append((shard, model_param, param_range.start, param_range.end))
        return views
    if hasattr(member, "float16_groups"):  # Float16OptimizerWithFloat16Params
        for model_group, main_group in zip(member.float16_groups, member.fp32_from_float16_groups, strict=True):
            views += [(main, model, 0, model.numel()) for model, main in zip(model_group, main_group, strict=True)]
        views += [(p, p, 0, p.numel()) for group in member.fp32_from_fp32_groups for p in group]
        return views
    return [(p, p, 0, p.numel()) for group in member.optimizer.param_groups for p in group["params"]]


def rng_tracker_states() -> list[torch.Tensor]:
    """The model-parallel RNG tracker's generator states (tensor-parallel dropout), in name order."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states = get_cuda_rng_tracker().get_states()
    return [states[name] for name in sorted(states)]


def set_rng_tracker_states(values: list[torch.Tensor]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    names = sorted(tracker.get_states())
    tracker.set_states(dict(zip(names, values, strict=True)))


def communicates_in_forward(module: torch.nn.Module) -> bool:
    """Whether a megatron-core (or Transformer Engine) layer may make a tensor-parallel collective in its forward
    pass: row-parallel layers reduce their output and vocab-parallel embeddings theirs; column-parallel layers
    gather their input under sequence parallelism or their output with ``gather_output``. By class name, so the
    Transformer Engine variants are covered without importing it; conservative (True at TP=1 too)."""
    name = type(module).__name__
    if "RowParallel" in name or "ParallelEmbedding" in name:
        return True
    if "ColumnParallel" in name:
        return bool(getattr(module, "sequence_parallel", False) or getattr(module, "gather_output", False))
    return False

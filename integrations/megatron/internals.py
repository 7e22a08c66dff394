"""Every read of megatron-core's internals, and every method arc_engine wraps, in one module, checked at attach
by what it reads.

What arc_engine needs of megatron-core and why no public API gives it (the sources in site-packages are the
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
  the ``torch_dist`` strategy does before writing (validation, the common state, the translation of ShardedTensors
  to DCP with Megatron's save planner), and arc_engine's checkpoint manager writes the result with DCP on its
  group; the directory is then what ``dist_checkpointing.load`` (and Megatron-LM's ``--load``) reads.

Wrapped methods are instance attributes, removed again by the removers these functions return (``Arc.close``);
nothing else of Megatron is assigned.

Releases. The integration is tested from 0.16.1 to 0.19.x (:data:`TESTED_MEGATRON_CORE_RANGE`; run on 0.16.1 and
0.19.2, 0.17 and 0.18 read from their sources). Where layouts differ inside it, the functions below follow what the
installed release holds, never a version string: the common (non-tensor) state of a checkpoint is ``common.pt``
through ``TorchCommonSaveStrategy`` (0.16) or ``strategies.common.save_common`` (0.17, 0.18), and a
``common_state`` ShardedObject inside the DCP files (0.19, whose loader still reads a legacy ``common.pt``)
(:func:`dist_checkpoint_layout`). :func:`check_capabilities`, called once at attach, checks that everything a
feature reads is there (modules, attributes, signatures, and the attributes of the live chunks and optimizer):
what every decision reads (:data:`CORE_NEEDS`; without it attach raises :class:`MissingMegatronInternals`), and per
:data:`FEATURES` entry what only that feature reads (without it that feature alone is off, and the adapter names it
in one ``compatibility`` lifecycle event). A release outside the range gets a warning (:func:`check_version`), not
a refusal.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from arc_engine.compat import Capabilities, TestedRange

#: The megatron-core releases arc_engine's Megatron integration is tested with: floor <= version < ceiling.
TESTED_MEGATRON_CORE_RANGE = TestedRange("megatron-core", "0.16.1", "0.20.0", "integrations/megatron/internals.py")

#: The releases the tests ran on: 0.16.1 (Python 3.11 lane) and 0.19.2 (Python 3.12 lane).
TESTED_MEGATRON_CORE_VERSIONS = ("0.16.1", "0.19.2")


class UntestedMegatronVersion(UserWarning):
    """The installed megatron-core is outside :data:`TESTED_MEGATRON_CORE_RANGE` (a warning category, never
    raised)."""


class MissingMegatronInternals(RuntimeError):
    """The installed megatron-core, or the chunks and optimizer passed to attach, lack what every decision reads
    (:data:`CORE_NEEDS`)."""


def installed_version() -> str:
    import megatron.core

    return str(megatron.core.__version__)


def in_tested_range(installed: str) -> bool:
    """Whether ``installed`` (a local "+..." suffix ignored) is inside :data:`TESTED_MEGATRON_CORE_RANGE`."""
    return TESTED_MEGATRON_CORE_RANGE.contains(installed)


def check_version(installed: str | None = None) -> str | None:
    """Warn (:class:`UntestedMegatronVersion`) when ``installed`` (default: the imported ``megatron.core``'s
    version) is outside :data:`TESTED_MEGATRON_CORE_RANGE`, and return the warning's text; None inside it. Never
    raises: what the integration needs is checked by :func:`check_capabilities`. Local, no communication."""
    return TESTED_MEGATRON_CORE_RANGE.check(installed_version() if installed is None else installed,
                                            UntestedMegatronVersion)


# ----------------------------------------------------------------------------------------- capabilities
#
# A need is "module:attribute.path", optionally with the leading parameter names the callable must take:
# "module:function(model, config)". Instance needs are checked on the live chunks and optimizer by the functions
# below (``*_errors``): they return what is missing, in words.

#: What every decision reads: the chunks' class, the optimizer's veto and step, its members and their inner torch
#: optimizers, the model parameters behind each inner group, Megatron's gradient-norm rule and parallel groups.
CORE_NEEDS = (
    "megatron.core.distributed:DistributedDataParallel",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer",
    "megatron.core.transformer.module:param_is_not_shared(param)",
    "megatron.core.tensor_parallel:param_is_not_tensor_parallel_duplicate(param, tp_group)",
    "megatron.core.utils:get_model_config(model)",
    *(f"megatron.core.parallel_state:{name}" for name in (
        "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
        "get_expert_data_parallel_group", "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
        "get_tensor_model_parallel_world_size", "get_pipeline_model_parallel_rank",
        "get_pipeline_model_parallel_world_size", "get_context_parallel_world_size",
        "get_expert_model_parallel_rank", "get_expert_model_parallel_world_size")),
)


@dataclass(frozen=True)
class Feature:
    """A part of the integration that reads megatron-core internals beyond :data:`CORE_NEEDS` and can be turned
    off alone."""

    name: str
    description: str  # what it does, for the compatibility event
    without: str  # what happens when it is off
    needs: tuple[str, ...] = ()  # module needs (see above)
    instance_errors: Callable[[list[Any], Any], list[str]] | None = None  # (chunks, optimizer) -> what is missing


def _need_error(need: str) -> str | None:
    """What is missing of one module need (None: present, with the parameters it names)."""
    path, _, params = need.partition("(")
    module_name, _, attribute = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError:
        return f"module {module_name}"
    for name in attribute.split("."):
        if not hasattr(obj, name):
            return path
        obj = getattr(obj, name)
    wanted = [p.strip() for p in params.rstrip(")").split(",") if p.strip()]
    if wanted:
        try:
            found = [p for p in inspect.signature(obj).parameters if p != "self"][:len(wanted)]
        except (TypeError, ValueError):
            return f"{path} (no signature)"
        if found != wanted:
            return f"{path}({', '.join(wanted)}) (found ({', '.join(found)}))"
    return None


def missing_needs(needs: tuple[str, ...]) -> list[str]:
    """The module needs that the installed megatron-core does not meet, in words."""
    return [error for error in map(_need_error, needs) if error is not None]


def _missing_attributes(obj: Any, names: tuple[str, ...], what: str) -> list[str]:
    return [f"{what}.{name}" for name in names if not hasattr(obj, name)]


def _bucket_group_errors(chunks: list[Any], optimizer: Any) -> list[str]:
    """The bucket groups as :class:`BucketGroupRef` and :func:`wrap_start_grad_sync` read them."""
    errors = [e for chunk in chunks for e in
              _missing_attributes(chunk, ("bucket_groups", "expert_parallel_bucket_groups"), "DistributedDataParallel")]
    if errors:
        return errors
    for group in (g for chunk in chunks for g in (*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups)):
        errors += _missing_attributes(group, ("buckets", "is_first_batch", "grad_reduce_handle", "start_grad_sync"),
                                      "bucket group")
        for bucket in getattr(group, "buckets", ()):
            errors += _missing_attributes(bucket, ("params_list", "grad_data"), "bucket")
            if not errors and not all(hasattr(p, "main_grad") for p in bucket.params_list):
                errors.append("param.main_grad")
        if errors:
            return sorted(set(errors))
    return []


def _recompute_errors(chunks: list[Any], optimizer: Any) -> list[str]:
    """What :class:`IsolatedBackward`, :func:`reduction_of` and :func:`inner_grad_views` read of the live objects."""
    from megatron.core.utils import get_model_config

    errors = _missing_attributes(get_model_config(chunks[0]), IsolatedBackward.HOOKS, "model config")
    errors += _missing_attributes(chunks[0], ("ddp_config",), "DistributedDataParallel")
    for group in (g for chunk in chunks for g in (*getattr(chunk, "bucket_groups", ()),
                                                   *getattr(chunk, "expert_parallel_bucket_groups", ()))):
        errors += _missing_attributes(group, ("is_last_microbatch", "ddp_config"), "bucket group")
        if hasattr(group, "ddp_config"):
            errors += _missing_attributes(group.ddp_config, ("use_distributed_optimizer", "average_in_collective"),
                                          "ddp_config")
            errors += _missing_attributes(group, ("intra_distributed_optimizer_instance_group",)
                                          if getattr(group.ddp_config, "use_distributed_optimizer", False)
                                          else ("data_parallel_group",), "bucket group")
        errors += [e for bucket in getattr(group, "buckets", ())
                   for e in _missing_attributes(bucket, ("gradient_scaling_factor",), "bucket")]
    for member in members(optimizer):
        if is_stub(member):
            continue
        if is_distributed(member):
            errors += _missing_attributes(member, ("shard_fp32_from_float16_groups", "shard_fp32_groups",
                                                   "_get_model_param_range_map"), "DistributedOptimizer")
        elif hasattr(member, "float16_groups"):
            errors += _missing_attributes(member, ("fp32_from_float16_groups",), "Float16Optimizer")
    return sorted(set(errors))


def _transformer_layer_errors(chunks: list[Any], optimizer: Any) -> list[str]:
    errors: list[str] = []
    for layer in transformer_layers(chunks):
        errors += _missing_attributes(layer, ("layer_number", "config"), "TransformerLayer")
        errors += _missing_attributes(getattr(layer, "config", None), (
            "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels"), "config")
    return sorted(set(errors))


def _attention_errors(chunks: list[Any], optimizer: Any) -> list[str]:
    """A ``SelfAttention`` holds its fused QKV projection as ``linear_qkv`` (what :func:`attention_layout` reads)."""
    from megatron.core.transformer.attention import SelfAttention

    errors = _transformer_layer_errors(chunks, optimizer)
    for layer in transformer_layers(chunks):
        attention = getattr(layer, "self_attention", None)
        if isinstance(attention, SelfAttention) and getattr(getattr(attention, "linear_qkv", None), "weight",
                                                            None) is None:
            errors.append("SelfAttention.linear_qkv.weight")
    return sorted(set(errors))


def _router_errors(chunks: list[Any], optimizer: Any) -> list[str]:
    errors = _transformer_layer_errors(chunks, optimizer)
    for layer in transformer_layers(chunks):
        router = router_of(layer)
        if router is not None:
            errors += _missing_attributes(router, ("routing", "weight"), "router")
            errors += _missing_attributes(layer.config, ("moe_router_topk", "num_moe_experts", "sequence_parallel"),
                                          "config")
    return sorted(set(errors))


def _checkpoint_errors(chunks: list[Any], optimizer: Any) -> list[str]:
    if dist_checkpoint_layout() is None:
        return ["a known place for a checkpoint's common state (strategies.common.TorchCommonSaveStrategy, "
                "strategies.common.save_common, or serialization's common_state ShardedObject)"]
    return []


#: The features that can be turned off, each with what it reads beyond :data:`CORE_NEEDS`.
FEATURES = (
    Feature("bucket_statistics",
            "each rank's local gradient statistics, taken as Megatron starts reducing a bucket group (per-rank "
            "gradient norms and non-finite counts, the SDC gradient sketch)",
            "detectors.sdc, detectors.consistency and detectors.r_metric are off; non-finite gradients are still "
            "caught in the reduced gradient (a rank is named for a non-finite loss only)",
            (), _bucket_group_errors),
    Feature("sdc_recompute",
            "the SDC recomputation (detectors.sdc.recompute): an isolated backward pass and Megatron's "
            "post-reduction all-reduces replayed on a correction",
            "detectors.sdc.recompute is off (detection and the agreed skip work)",
            ("megatron.core.distributed.finalize_model_grads:_allreduce_non_tensor_model_parallel_grads"
             "(model, config, tp_group)",
             "megatron.core.distributed.finalize_model_grads:_allreduce_word_embedding_grads"
             "(model, config, embd_group, pp_group)",
             "megatron.core.distributed.finalize_model_grads:_allreduce_position_embedding_grads"
             "(model, config, pos_emb_group, pp_group)",
             "megatron.core.parallel_state:get_embedding_group(check_initialized)",
             "megatron.core.parallel_state:get_position_embedding_group(check_initialized)",
             "megatron.core.parallel_state:get_pipeline_model_parallel_group",
             "megatron.core.parallel_state:get_context_parallel_group",
             "megatron.core.parallel_state:get_expert_tensor_parallel_group",
             "megatron.core.tensor_parallel.random:get_cuda_rng_tracker"),
            _recompute_errors),
    Feature("attention_spectra",
            "the attention families' view of each layer's fused QKV weight (detectors.qk_spectra)",
            "detectors.qk_spectra is off",
            ("megatron.core.transformer.transformer_layer:TransformerLayer",
             "megatron.core.transformer.attention:SelfAttention.get_query_key_value_tensors"),
            _attention_errors),
    Feature("router_observation",
            "every routing decision of the MoE routers, observed through TopKRouter.routing (detectors.router)",
            "detectors.router is off",
            ("megatron.core.transformer.transformer_layer:TransformerLayer",
             "megatron.core.transformer.moe.router:TopKRouter.routing(logits)"),
            _router_errors),
    Feature("megatron_checkpoint",
            "disk checkpoints in Megatron's own dist_checkpointing format (recovery.checkpoint.format auto or "
            "megatron)",
            "format auto writes arc_engine's plain DCP layout; format megatron is refused",
            ("megatron.core.dist_checkpointing:load(sharded_state_dict, checkpoint_dir)",
             "megatron.core.dist_checkpointing.core:CheckpointingConfig",
             "megatron.core.dist_checkpointing.core:save_config(config, checkpoint_dir)",
             "megatron.core.dist_checkpointing.dict_utils:dict_list_map_inplace",
             "megatron.core.dist_checkpointing.mapping:ShardedTensor",
             "megatron.core.dist_checkpointing.mapping:ShardedObject(key, data, global_shape, global_offset, "
             "replica_id)",
             "megatron.core.dist_checkpointing.state_dict_utils:save_preprocess(sharded_state_dict, "
             "validate_access_integrity)",
             "megatron.core.dist_checkpointing.strategies.torch:MCoreSavePlanner",
             "megatron.core.dist_checkpointing.strategies.torch:_replace_state_dict_keys_with_sharded_keys"
             "(sharded_state_dict, keep_only_main_replica)",
             "megatron.core.dist_checkpointing.strategies.torch:mcore_to_pyt_state_dict(state_dict, is_loading)"),
            _checkpoint_errors),
    Feature("gemm_faults",
            "the bitflip fault reaching Megatron's tensor-parallel GEMMs (ColumnParallelLinear, RowParallelLinear)",
            "bitflip faults reach torch's own linear layers only",
            ("megatron.core.tensor_parallel.layers:ColumnParallelLinear",
             "megatron.core.tensor_parallel.layers:RowParallelLinear")),
)


def _core_errors(chunks: list[Any], optimizer: Any) -> list[str]:
    """What every decision reads of the live optimizer: the veto and the step, and per member its inner torch
    optimizer and the model parameters behind each inner group."""
    errors = [f"optimizer.{name}" for name in ("prepare_grads", "step") if not callable(getattr(optimizer, name,
                                                                                               None))]
    for member in members(optimizer):
        if is_stub(member):
            continue
        errors += _missing_attributes(member.optimizer, ("param_groups", "state"), "inner optimizer")
        if is_distributed(member):
            errors += _missing_attributes(member, ("model_float16_groups", "model_fp32_groups"),
                                          "DistributedOptimizer")
        elif hasattr(member, "float16_groups"):
            errors += _missing_attributes(member, ("fp32_from_fp32_groups",), "Float16Optimizer")
    return sorted(set(errors))


def check_capabilities(chunks: list[Any], optimizer: Any, installed: str | None = None) -> Capabilities:
    """Check once, at attach, what the integration reads of the installed megatron-core and of the live
    ``chunks`` (megatron DDP) and ``optimizer``: raise :class:`MissingMegatronInternals` naming what is missing of
    :data:`CORE_NEEDS`, and return the :data:`FEATURES` that are off. Warns (:func:`check_version`) for a release
    outside the tested range. Local, reads only."""
    installed = installed_version() if installed is None else installed
    check_version(installed)
    errors = missing_needs(CORE_NEEDS)
    errors = errors or _core_errors(chunks, optimizer)
    if errors:
        raise MissingMegatronInternals(
            f"arc_engine's Megatron integration cannot read this megatron-core ({installed}; tested: "
            f"{TESTED_MEGATRON_CORE_RANGE.text()}): missing {', '.join(errors)}. Every decision reads these "
            f"(integrations/megatron/internals.py). Install a tested release or train without arc_engine's Megatron "
            f"integration.")
    found = Capabilities(TESTED_MEGATRON_CORE_RANGE, installed,
                         {f.name: (f.description, f.without) for f in FEATURES})
    for feature in FEATURES:
        what = missing_needs(feature.needs)
        if not what and feature.instance_errors is not None:
            what = feature.instance_errors(chunks, optimizer)
        if what:
            found.off[feature.name] = what
    return found


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


def loss_scaler(optimizer: Any) -> tuple[Any, bool] | None:
    """(the grad scaler, whether it is dynamic) of the first member with one (fp16: Megatron scales the loss by
    ``get_loss_scale()`` and unscales the main gradients in ``prepare_grads``), None without one (bf16, fp32)."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    for member in members(optimizer):
        scaler = getattr(member, "grad_scaler", None)
        if scaler is not None:
            return scaler, isinstance(scaler, DynamicGradScaler)
    return None


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
    """Every ``TransformerLayer`` of this rank's chunks (its pipeline stage(s)), in order (none when the release
    has no such class)."""
    try:
        from megatron.core.transformer.transformer_layer import TransformerLayer
    except ImportError:
        return []
    return [m for chunk in chunks for m in unwrap_chunk(chunk).modules() if isinstance(m, TransformerLayer)]


def layer_parameter_names(chunks: list[Any]) -> dict[int, str]:
    """``id(param) -> "layers.<global layer index>.<name in the layer>"`` for the parameters of this rank's
    transformer layers (names that do not collide across pipeline stages); empty where the layers do not carry
    their global number."""
    return {id(param): f"layers.{layer_index(layer)}.{name}" for layer in transformer_layers(chunks)
            if hasattr(layer, "layer_number") for name, param in layer.named_parameters()}


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
#: where Megatron keeps the common state of a ``torch_dist`` checkpoint from 0.19 on: one ShardedObject of this key
COMMON_STATE_KEY = "common_state"


@dataclass(frozen=True)
class DistCheckpointLayout:
    """How the installed ``dist_checkpointing`` lays out a ``torch_dist`` checkpoint's common (non-tensor) state:
    in ``common.pt`` written by ``save_common`` (0.16: ``TorchCommonSaveStrategy``; 0.17, 0.18: a function), or
    (``save_common`` None, 0.19) as the ShardedObject :data:`COMMON_STATE_KEY` inside the DCP files.
    ``common_files``: the files the coordinator writes beside the DCP files."""

    save_common: Callable[[dict, Any], None] | None
    common_files: tuple[str, ...]


def dist_checkpoint_layout() -> DistCheckpointLayout | None:
    """The layout the installed release writes (None: none this module knows). Read from what the release holds:
    0.19's loader has ``serialization._legacy_common_state_exists`` (it reads the common state from the DCP files,
    or from a legacy ``common.pt``); before it, ``strategies.common`` saves ``common.pt``."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import common

    if hasattr(serialization, "_legacy_common_state_exists") and hasattr(serialization, "load_common_state_dict"):
        return DistCheckpointLayout(None, ("metadata.json",))
    if hasattr(common, "TorchCommonSaveStrategy"):
        return DistCheckpointLayout(common.TorchCommonSaveStrategy("torch", 1).save_common,
                                    ("common.pt", "metadata.json"))
    if hasattr(common, "save_common"):
        return DistCheckpointLayout(common.save_common, ("common.pt", "metadata.json"))
    return None


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
    """The ``torch_dist`` strategy's save up to the write: apply factories, split off the common part (written as
    the installed release does, :func:`dist_checkpoint_layout`: the coordinator's ``common.pt``, or a ShardedObject
    in the DCP files; the coordinator writes ``metadata.json`` into ``step_dir``), replace every ShardedTensor's
    data by ``stage``'s host copy (so training can go on while the write runs), translate to DCP. Returns the DCP
    state dict and Megatron's save planner for the disk tier's ``dcp.save``. Collective on the default group when
    ``validate`` (Megatron's access-integrity check)."""
    import copy

    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    layout = dist_checkpoint_layout()
    assert layout is not None, "checked at attach (the megatron_checkpoint feature)"
    sharded, common = save_preprocess(sharded_state_dict, validate, None)
    if layout.save_common is None:  # 0.19: as dist_checkpointing.save, one copy (rank 0's) in the DCP files
        sharded[COMMON_STATE_KEY] = ShardedObject(COMMON_STATE_KEY, common, (1,), (0,), replica_id=dist.get_rank())
    elif coordinator:
        layout.save_common(common, step_dir)
    if coordinator:
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
    0.16.1; 0.19.2 resumes bitwise with this too): without this, a rollback would keep the current step counts.
    Other members get one step tensor per parameter (the load may share one). Under no_grad (the
    DistributedOptimizer copies into leaf shards)."""
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


def is_megatron_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a Megatron optimizer (``get_megatron_optimizer``: it has ``prepare_grads``)."""
    return hasattr(optimizer, "prepare_grads")


def core_attention(layer: Any) -> Any:
    """A transformer layer's attention core (``self_attention.core_attention``), None without one."""
    return getattr(layer.self_attention, "core_attention", None)


def reduced_across_experts(param: torch.Tensor) -> bool:
    """Whether megatron-core all-reduces ``param`` across the expert-parallel group (``allreduce``: False for an
    expert's weights)."""
    return bool(getattr(param, "allreduce", True))


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is split across the tensor-parallel group (``tensor_model_parallel``)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def overlaps_param_gather(chunks: list[Any]) -> bool:
    """Whether megatron DDP overlaps the parameter all-gather with the next forward (``overlap_param_gather``):
    the parameters are then not final at a step's start."""
    return any(getattr(getattr(chunk, "ddp_config", None), "overlap_param_gather", False) for chunk in chunks)


def member_grad_scaler(member: Any) -> Any:
    """The loss scaler of one optimizer of a Megatron (chained) optimizer (None under bf16/fp32)."""
    return getattr(member, "grad_scaler", None)

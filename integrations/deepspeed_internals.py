"""Every read of DeepSpeed's undocumented ZeRO state, in one module, behind a check of the DeepSpeed version.

arc_engine reaches DeepSpeed through its documented surface where one serves: the engine's methods and counters,
the ZeRO optimizer's ``loss_scale`` and ``param_groups``, its ``register_grad_acc_post_hook`` (a callback once
every gradient hook of a backward has fired), and torch's own extension points on the objects DeepSpeed builds
(step hooks of the torch optimizer it wraps, tensor hooks on the module parameters). What none of them gives is
read here, by small named functions, and only here; other modules call these functions.

Why no public DeepSpeed API serves (DeepSpeed 0.19.8):

* **Local gradients before the reduction.** ZeRO-1/2 copy each gradient into a contiguous bucket and reduce the
  bucket from the gradient hook of the parameter that no longer fits in it (the last buckets: in the engine's
  backward epilogue). No hook runs between the fill and the reduction: ``average_tensor`` is an internal method,
  ``register_compile_pass`` acts only under DeepCompile. A torch tensor hook on a parameter runs just before
  DeepSpeed's post-accumulate hook for it, so :func:`bucket_reduced_before` tells from the bucket's fill level
  (read, never written) whether DeepSpeed is about to reduce it, and hands over its contents.
* **Per-partition statistics at the optimizer step.** ``deepspeed.utils.safe_get_full_grad`` /
  ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` work one parameter at a time and, under
  ZeRO-1/2, all-reduce each one (arc_engine takes one collective per step); the ``safe_get_local_*`` functions
  are defined for ZeRO-3 only and still go parameter by parameter, where the rank's partition is one flat tensor.
  The flat fp32 partitions, their pending gradients, the padding and the partition layout are attributes of the
  ZeRO optimizer only.
* **Rollback.** Restoring a snapshot writes back the engine's step counters and the loss scaler's state. DeepSpeed
  has no setter for them other than loading a whole checkpoint from disk, so :func:`restore_engine_counters` and
  :func:`restore_loss_scaler` assign the public attributes DeepSpeed's own checkpoint loading assigns. They are the
  only assignments to a DeepSpeed object in ``integrations/`` (``tests/test_deepspeed_internals.py`` checks it);
  nothing assigns to a private (underscore) attribute or replaces a method. Under ZeRO-3 a restore also writes the
  bit16 sub-group partitions from the fp32 masters and then runs what ZeRO-3's step runs after it updated them
  (:func:`refresh_gathered_parameters`); a resume first creates the lazy optimizer state the checkpoint loads
  into (:func:`materialize_sub_group_states`, one zero-learning-rate step per sub-group in ZeRO-3's own layout).

The layouts read here change between DeepSpeed releases, so :func:`check_version` (called by ``attach_deepspeed``)
refuses a version this module was not tested with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

#: DeepSpeed releases whose ZeRO internals this module was tested against (a local "+..." suffix is ignored).
TESTED_DEEPSPEED_VERSIONS = ("0.19.8",)

#: The engine's step counters a snapshot records and a rollback restores.
ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")

#: The loss scaler's fields that change during training (``DynamicLossScaler.update_scale``); the rest is config.
LOSS_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


class UntestedDeepSpeedVersion(RuntimeError):
    """The installed DeepSpeed is not one arc_engine's DeepSpeed integration was tested with."""


def check_version(installed: str | None = None) -> None:
    """Raise :class:`UntestedDeepSpeedVersion` unless ``installed`` (default: the imported ``deepspeed``'s
    version) is one of :data:`TESTED_DEEPSPEED_VERSIONS`. Local, no communication."""
    if installed is None:
        import deepspeed

        installed = str(deepspeed.__version__)
    if installed.split("+")[0] in TESTED_DEEPSPEED_VERSIONS:
        return
    tested = ", ".join(TESTED_DEEPSPEED_VERSIONS)
    raise UntestedDeepSpeedVersion(
        f"arc_engine's DeepSpeed integration reads ZeRO internals that change between DeepSpeed releases "
        f"(integrations/deepspeed_internals.py); it is tested with deepspeed {tested}, and this environment has "
        f"deepspeed {installed}. Install a tested release (pip install 'deepspeed=={TESTED_DEEPSPEED_VERSIONS[-1]}') "
        f"or train without arc_engine's DeepSpeed integration.")


# ------------------------------------------------------------------ ZeRO optimizer (all stages)

def wrapped_optimizer(zero: Any) -> torch.optim.Optimizer:
    """The torch optimizer the ZeRO optimizer steps once per parameter group (stage 3: per sub-group)."""
    return zero.optimizer


def data_parallel_group(zero: Any) -> dist.ProcessGroup:
    """The data-parallel group ZeRO reduces gradients over."""
    return zero.dp_process_group


def pre_clip_global_norm(zero: Any) -> float | torch.Tensor | None:
    """The global gradient norm DeepSpeed computed for this step, unscaled, before clipping (None if it computes
    none). Valid from the start of the inner optimizer calls of a step."""
    return zero._global_grad_norm


def clip_threshold(zero: Any) -> float:
    """``gradient_clipping`` as the ZeRO optimizer applies it (0: off)."""
    return float(zero.clip_grad)


def uses_dynamic_loss_scale(zero: Any) -> bool:
    return bool(getattr(zero, "dynamic_loss_scale", False))


def offloads_optimizer(zero: Any) -> bool:
    """Whether optimizer states live off the device (ZeRO-1/2 ``cpu_offload``; ZeRO-3 CPU or NVMe offload)."""
    return any(bool(getattr(zero, name, False)) for name in ("cpu_offload", "offload_optimizer", "swap_optimizer"))


def uses_muon(zero: Any) -> bool:
    return bool(getattr(zero, "use_muon", False))


# ------------------------------------------------------------------ ZeRO-1/2 partitions

def is_zero12(zero: Any) -> bool:
    """Whether ``zero`` is DeepSpeed's ZeRO-1/2 optimizer (flat fp32 partition per parameter group)."""
    return hasattr(zero, "single_partition_of_fp32_groups")


def bit16_groups(zero: Any) -> list[list[torch.Tensor]]:
    """Per parameter group, the module parameters (bit16 copies) in DeepSpeed's order."""
    return zero.bit16_groups


def bit16_flat(zero: Any, group_id: int) -> torch.Tensor:
    """The flat buffer group ``group_id``'s module parameters are views of."""
    return zero.bit16_groups_flat[group_id]


def fp32_partitions(zero: Any) -> list[torch.Tensor]:
    """This rank's flat fp32 master partition of each parameter group (the tensors the torch optimizer steps)."""
    return zero.single_partition_of_fp32_groups


def pending_gradient(zero: Any, group_id: int) -> Any:
    """Group ``group_id``'s reduced gradient of this rank's partition before DeepSpeed flattens it into the fp32
    partition's ``.grad``: a tensor list in partition order (or DeepSpeed's buffer object with a ``flat_partition``),
    still loss-scaled and unclipped; None once consumed."""
    return zero.averaged_gradients.get(group_id)


def refresh_bit16_from_masters(zero: Any) -> None:
    """ZeRO-1/2: copy each rank's fp32 master partition into its bit16 partition and all-gather the bit16 groups
    (``update_lp_params``, what DeepSpeed does after a step). Collective over the data-parallel groups."""
    zero.update_lp_params()


def partition_padding(zero: Any, group_id: int) -> int:
    """Padding elements at the end of this rank's partition of group ``group_id``."""
    return int(zero.groups_padding[group_id])


def partition_size(zero: Any, group_id: int) -> int:
    """Elements per rank's partition of group ``group_id`` (padding included)."""
    return int(zero.partition_size[group_id])


def partition_rank(zero: Any, group_id: int) -> int:
    """This rank's partition index in group ``group_id`` (0 without torch.distributed)."""
    if not dist.is_initialized():
        return 0
    return dist.get_rank(group=zero.real_dp_process_group[group_id])


def bit16_partition(zero: Any, group_id: int, partition_id: int) -> torch.Tensor:
    """Partition ``partition_id`` of group ``group_id``'s flat bit16 parameters."""
    return zero.parallel_partitioned_bit16_groups[group_id][partition_id]


# ------------------------------------------------------------------ ZeRO-1/2 reduction buckets

def reduces_contiguous_buckets(zero: Any) -> bool:
    """Whether ZeRO-1/2 reduce gradients through contiguous buckets filled by DeepSpeed's own gradient hooks -- the
    set-up :func:`bucket_reduced_before` and :func:`pending_buckets` describe (no offload, no ZenFlow)."""
    return (bool(getattr(zero, "contiguous_gradients", False)) and hasattr(zero, "ipg_buckets")
            and not offloads_optimizer(zero) and not getattr(zero, "zenflow", False))


def reduces_in_gradient_hooks(zero: Any) -> bool:
    """Whether the reduction runs from DeepSpeed's gradient hooks during the backward (stage 2, or stage 1 with
    ``overlap_comm``); else stage 1 reduces every accumulated gradient in the engine's backward epilogue."""
    return bool(zero.partition_gradients or zero.overlap_comm)


def is_accumulation_boundary(zero: Any) -> bool:
    """Whether the current micro-batch's gradients are reduced (stage 1: only at the accumulation boundary)."""
    return bool(zero.partition_gradients or zero.is_gradient_accumulation_boundary())


def gradient_for_reduction(zero: Any, param: torch.Tensor) -> torch.Tensor | None:
    """The gradient DeepSpeed will reduce for ``param`` (``.grad``, or its fp32 accumulation buffer)."""
    return zero.get_gradient_for_reduction(param)


def bucket_overflow_test(zero: Any, param: torch.Tensor) -> Callable[[], bool]:
    """A test cheap enough for a tensor hook on ``param`` (no DeepSpeed call): whether ``param``'s gradient no longer
    fits in the bucket it goes to, so that DeepSpeed's gradient hook for it, about to run, may reduce that bucket
    first (:func:`bucket_reduced_before` then decides and gives the bucket). DeepSpeed keeps one bucket object per
    communication dtype and empties it in place, so the one read here stays the one it fills."""
    bucket = zero.ipg_buckets.get(zero.get_param_comm_dtype(param))
    numel, limit = param.numel(), zero.reduce_bucket_size
    if bucket is None or numel == 0:
        return lambda: False
    return lambda: bucket.elements + numel > limit


def bucket_reduced_before(zero: Any, param: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """The bucket DeepSpeed reduces at the start of its gradient hook for ``param`` (the one ``param``'s gradient
    does not fit in), as its flat pre-reduction contents and the parameters in it in bucket order; None if that
    hook reduces nothing. Call from a tensor hook on ``param`` (it runs before DeepSpeed's hook). Mirrors
    ``reduce_independent_p_g_buckets_and_remove_grads``; reads only."""
    numel = param.numel()
    if numel == 0 or zero._coalesce_grad_reduction or not is_accumulation_boundary(zero):
        return None
    comm_dtype = zero.get_param_comm_dtype(param)
    bucket = zero.ipg_buckets.get(comm_dtype)
    if bucket is None or bucket.elements + numel <= zero.reduce_bucket_size:
        return None
    return _bucket_contents(zero, comm_dtype, bucket)


def pending_buckets(zero: Any) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Every bucket still waiting for DeepSpeed's backward epilogue to reduce it, as in
    :func:`bucket_reduced_before`. Call once all gradient hooks of a backward have fired."""
    pending = (_bucket_contents(zero, comm_dtype, bucket) for comm_dtype, bucket in zero.ipg_buckets.items())
    return [contents for contents in pending if contents is not None]


def _bucket_contents(zero: Any, comm_dtype: torch.dtype, bucket: Any) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    if not bucket.params or bucket.elements == 0:
        return None
    params = [zero.bit16_groups[group_id][index] for group_id, index, _ in bucket.params]
    oversized = zero.extra_large_param_to_reduce.get(comm_dtype)
    if oversized is not None:  # a gradient larger than a bucket is reduced from where it lies
        return zero.get_gradient_for_reduction(oversized).reshape(-1), params
    return bucket.buffer[bucket.index].narrow(0, 0, bucket.elements), params


# ------------------------------------------------------------------ ZeRO-3 sub-groups

def sub_group_params(zero: Any) -> list[list[torch.Tensor]]:
    """Per ZeRO-3 sub-group, its module parameters."""
    return zero.fp16_groups


def sub_group_owner(zero: Any, sub_group_id: int) -> int:
    """The parameter group ZeRO-3 sub-group ``sub_group_id`` belongs to."""
    return int(zero.sub_group_to_group_id[sub_group_id])


def sub_group_paddings(zero: Any) -> list[list[int]]:
    """Per sub-group, per parameter: padding elements at the end of that parameter's partition on this rank."""
    return zero.groups_padding


def sub_group_partitions(zero: Any) -> list[torch.Tensor]:
    """This rank's flat fp32 master partition of each sub-group, read live (a checkpoint load may replace them)."""
    return zero.fp32_partitioned_groups_flat


def sub_group_pending_gradient(zero: Any, sub_group_id: int) -> list[torch.Tensor]:
    """Sub-group ``sub_group_id``'s reduced gradient pieces (one per parameter, padding included, loss-scaled,
    unclipped) before DeepSpeed flattens them into the partition's ``.grad``."""
    return zero.averaged_gradients[sub_group_id]


def param_partition_numel(param: torch.Tensor) -> int:
    """Elements of a ZeRO-3 parameter's partition on each rank (padding included)."""
    return int(param.partition_numel())


def offloads_parameters(zero: Any) -> bool:
    """Whether ZeRO-3 keeps the bit16 parameter partitions off the device (``offload_param``: CPU or NVMe)."""
    return bool(getattr(zero, "offload_param", False))


def sub_group_bit16_partitions(zero: Any) -> list[torch.Tensor]:
    """This rank's flat bit16 partition of each sub-group: a view of the buffer every parameter's ``ds_tensor``
    (its partition, which the forward all-gathers) lives in. Equal to the fp32 master partition cast to bit16
    between steps (the step copies it over); the same tensor as the master when the model trains in fp32."""
    return zero.fp16_partitioned_groups_flat


@torch.no_grad()
def materialize_sub_group_states(zero: Any) -> None:
    """Create the torch optimizer's state of every sub-group partition that has none yet (it is created lazily
    at the first step), so that a checkpoint can be loaded into it in place: one step per such sub-group with a
    zero gradient and a learning rate of 0, laid out as ``DeepSpeedZeroOptimizer_Stage3._optimizer_step`` lays
    it out (the owning parameter group holds just that partition, every other group nothing, then none again).
    Leaves the partitions unchanged. Local. Call before any arc_engine step hook is registered."""
    optimizer = wrapped_optimizer(zero)
    for sub_group_id, partition in enumerate(sub_group_partitions(zero)):
        if partition in optimizer.state:
            continue
        group = optimizer.param_groups[sub_group_owner(zero, sub_group_id)]
        saved_grad, saved_lr, saved_params = partition.grad, group["lr"], group["params"]
        partition.grad, group["lr"], group["params"] = torch.zeros_like(partition), 0.0, [partition]
        try:
            optimizer.step()
        finally:
            partition.grad, group["lr"], group["params"] = saved_grad, saved_lr, saved_params


def refresh_gathered_parameters(zero: Any) -> None:
    """After recovery wrote the sub-group partitions in place: what the end of ZeRO-3's own step does after it
    updated them -- release every gathered parameter (its full copy is stale), re-gather the persistent ones
    (small parameters ZeRO-3 keeps whole between steps) and drop ZeRO++'s secondary partitions. Collective over
    ZeRO-3's parameter groups: every rank calls it together (a rollback, a resume and an escape are agreed)."""
    zero.parameter_offload.partition_all_parameters()
    persistent = zero.persistent_parameters
    if persistent:
        persistent[0].all_gather(persistent)
    zero.invalidate_secondary_tensor()


# ------------------------------------------------------------------ rollback: the only writes

def engine_counters(ds_engine: Any) -> dict[str, int]:
    return {name: int(getattr(ds_engine, name)) for name in ENGINE_COUNTERS}


def restore_engine_counters(ds_engine: Any, counters: dict[str, int]) -> None:
    """Write back :func:`engine_counters` (public engine attributes, as DeepSpeed's checkpoint loading does)."""
    for name in ENGINE_COUNTERS:
        if name in counters:
            setattr(ds_engine, name, counters[name])


def loss_scaler_state(zero: Any) -> dict[str, Any]:
    """The loss scaler's changing fields (those of :data:`LOSS_SCALER_STATE` it holds as plain numbers)."""
    scaler = getattr(zero, "loss_scaler", None)
    values = {name: getattr(scaler, name, None) for name in LOSS_SCALER_STATE}
    return {name: value for name, value in values.items() if isinstance(value, (bool, int, float))}


def restore_loss_scaler(zero: Any, state: dict[str, Any]) -> None:
    """Write back :func:`loss_scaler_state` (public loss-scaler attributes); keys of older snapshots that are not
    in :data:`LOSS_SCALER_STATE` (configuration) are ignored."""
    scaler = getattr(zero, "loss_scaler", None)
    for name in LOSS_SCALER_STATE:
        if name in state and hasattr(scaler, name):
            setattr(scaler, name, state[name])

"""Every read of DeepSpeed's undocumented ZeRO state, in one module, checked at attach by what it reads.

arc_engine reaches DeepSpeed through its documented surface where one serves: the engine's methods and counters,
the ZeRO optimizer's ``loss_scale`` and ``param_groups``, its ``register_grad_acc_post_hook`` (a callback once
every gradient hook of a backward has fired; DeepSpeed 0.18.3 and later), and torch's own extension points on the
objects DeepSpeed builds (step hooks of the torch optimizer it wraps, tensor hooks on the module parameters). What
none of them gives is read here, by small named functions, and only here; other modules call these functions.

Why no public DeepSpeed API serves (DeepSpeed 0.18.0 .. 0.19.8):

* **Local gradients before the reduction.** ZeRO-1/2 copy each gradient into a contiguous bucket and reduce the
  bucket from the gradient hook of the parameter that no longer fits in it (the last buckets: in the engine's
  backward epilogue). No hook runs between the fill and the reduction: ``average_tensor`` is an internal method,
  ``register_compile_pass`` acts only under DeepCompile. A torch tensor hook on a parameter runs just before
  DeepSpeed's post-accumulate hook for it, so :func:`buckets_reduced_before` tells from the bucket's fill level
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

Releases. The layouts read here change between DeepSpeed releases. The integration is tested from
:data:`TESTED_DEEPSPEED_RANGE`'s floor to its ceiling (0.18.0 .. 0.19.x). Where layouts differ inside it, the
functions below follow what the installed release's objects hold, never a version string: whether an
overflowing bucket is reduced alone or with every other dtype's bucket (``reduce_ipg_grads``' signature: 0.18.9+
alone, 0.18.0 .. 0.18.4 all), the key of an oversized gradient (its communication dtype; in 0.18.0 its own
dtype), gradient coalescing (none in 0.18). :func:`check_capabilities`, called once by ``attach_deepspeed``,
checks that every attribute a feature reads is there: what every step's statistics read (:data:`CORE_NEEDS`;
without it attach raises :class:`MissingDeepSpeedInternals`), and per :data:`FEATURES` entry the reduction
buckets local statistics are read from (0.18.3+) and what a rollback restores (without them only that feature
is off). A release outside the range gets a warning (:func:`check_version`), not a refusal.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from arc_engine.compat import Capabilities, TestedRange

#: The DeepSpeed releases arc_engine's integration is tested with: floor <= version < ceiling.
TESTED_DEEPSPEED_RANGE = TestedRange("deepspeed", "0.18.0", "0.20.0", "integrations/deepspeed/internals.py")

#: The releases the tests ran on: the floor and the newest 0.19.x.
TESTED_DEEPSPEED_VERSIONS = ("0.18.0", "0.19.8")

#: The engine's step counters a snapshot records and a rollback restores.
ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")

#: The loss scaler's fields that change during training (``DynamicLossScaler.update_scale``); the rest is config.
LOSS_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

#: What every step reads of the ZeRO optimizer, per stage family ("zero12", "zero3"): the torch optimizer it wraps,
#: this rank's fp32 partitions, their pending gradients, the pre-clip norm, the clip threshold and the partition
#: layout. Without one of them there are no gradient, weight or update statistics to decide on.
CORE_NEEDS = {
    "zero12": ("optimizer", "dp_process_group", "loss_scale", "clip_grad", "_global_grad_norm",
               "single_partition_of_fp32_groups", "averaged_gradients", "groups_padding", "partition_size",
               "real_dp_process_group", "bit16_groups", "bit16_groups_flat"),
    "zero3": ("optimizer", "dp_process_group", "loss_scale", "clip_grad", "_global_grad_norm",
              "fp32_partitioned_groups_flat", "averaged_gradients", "fp16_groups", "sub_group_to_group_id",
              "groups_padding"),
}


@dataclass(frozen=True)
class Feature:
    """A part of the integration that reads ZeRO internals beyond :data:`CORE_NEEDS` and can be turned off alone."""

    name: str
    description: str  # what it does
    without: str  # what happens when it is off, for the compatibility event
    needs: Mapping[str, tuple[str, ...]]  # stage family -> dotted attribute paths on the ZeRO optimizer
    shape_errors: Callable[[Any], list[str]] | None = None  # once every need is there: what they hold, if wrong


def _bucket_shape_errors(zero: Any) -> list[str]:
    """The reduction buckets as :func:`buckets_reduced_before` reads them: per dtype, a fill level, its parameters,
    its buffers and the index of the one being filled."""
    buckets = zero.ipg_buckets
    if not isinstance(buckets, Mapping):
        return [f"ipg_buckets is a {type(buckets).__name__}, not a dict"]
    return [f"a reduction bucket has no {name}" for bucket in buckets.values()
            for name in ("elements", "params", "buffer", "index") if not hasattr(bucket, name)][:1]


#: The features that can be turned off, each with the attributes it reads (dotted: an attribute of an attribute).
FEATURES = (
    Feature("bucket_local_statistics",
            "each rank's local gradient statistics read from ZeRO-1/2's reduction buckets just before the reduction",
            "local gradient statistics come from tensor hooks on the parameters instead (the same statistics; "
            "ZeRO-1: summed per micro-batch)",
            {"zero12": ("register_grad_acc_post_hook", "ipg_buckets", "reduce_bucket_size", "get_param_comm_dtype",
                        "extra_large_param_to_reduce", "get_gradient_for_reduction", "contiguous_gradients",
                        "partition_gradients", "overlap_comm", "is_gradient_accumulation_boundary",
                        "reduce_ipg_grads")},
            _bucket_shape_errors),
    Feature("rollback",
            "rollback, checkpoints and resume (recovery.enabled): restoring ZeRO's partitions, loss scaler and "
            "counters",
            "recovery.enabled is turned off in the engine's copy of the config (detection and skips work)",
            {"zero12": ("update_lp_params", "parallel_partitioned_bit16_groups", "loss_scaler"),
             "zero3": ("fp16_partitioned_groups_flat", "parameter_offload.partition_all_parameters",
                       "persistent_parameters", "invalidate_secondary_tensor", "loss_scaler")}),
)


class UntestedDeepSpeedVersion(UserWarning):
    """The installed DeepSpeed is outside :data:`TESTED_DEEPSPEED_RANGE` (a warning category, never raised)."""


class MissingDeepSpeedInternals(RuntimeError):
    """The ZeRO optimizer lacks what every step's statistics read (:data:`CORE_NEEDS`)."""


def installed_version() -> str:
    import deepspeed

    return str(deepspeed.__version__)


def check_version(installed: str | None = None) -> str | None:
    """Warn (:class:`UntestedDeepSpeedVersion`) when ``installed`` (default: the imported ``deepspeed``'s version)
    is outside :data:`TESTED_DEEPSPEED_RANGE`, and return the warning's text; None inside it. Never raises: what
    the integration needs is checked by :func:`check_capabilities`. Local, no communication."""
    return TESTED_DEEPSPEED_RANGE.check(installed_version() if installed is None else installed,
                                        UntestedDeepSpeedVersion)


def stage_family(stage: int) -> str:
    return "zero3" if stage == 3 else "zero12"


def _has(obj: Any, path: str) -> bool:
    for name in path.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            return False
    return True


def missing(zero: Any, needs: tuple[str, ...]) -> list[str]:
    """The dotted attribute paths of ``needs`` that ``zero`` does not have."""
    return [path for path in needs if not _has(zero, path)]


def _core_shape_errors(zero: Any, family: str) -> list[str]:
    """What the core attributes hold, where a release could lay them out differently: one fp32 partition per
    parameter group (ZeRO-1/2) or per sub-group (ZeRO-3), pending gradients keyed by group."""
    errors = []
    if not isinstance(zero.averaged_gradients, Mapping):
        errors.append(f"averaged_gradients is a {type(zero.averaged_gradients).__name__}, not a dict")
    if family == "zero12":
        groups = len(zero.optimizer.param_groups)
        counts = {"single_partition_of_fp32_groups": len(zero.single_partition_of_fp32_groups),
                  "bit16_groups": len(zero.bit16_groups), "partition_size": len(zero.partition_size)}
        errors += [f"{name} holds {count} entries for {groups} parameter groups" for name, count in counts.items()
                   if count != groups]
    else:
        sub_groups = len(zero.fp32_partitioned_groups_flat)
        counts = {"fp16_groups": len(zero.fp16_groups), "groups_padding": len(zero.groups_padding)}
        errors += [f"{name} holds {count} entries for {sub_groups} sub-groups" for name, count in counts.items()
                   if count != sub_groups]
        if not all(hasattr(param, "partition_numel") for params in zero.fp16_groups for param in params):
            errors.append("ZeRO-3 parameters have no partition_numel()")
    return errors


def check_capabilities(zero: Any, stage: int, installed: str | None = None) -> Capabilities:
    """Check once, at attach, what the integration reads of ``zero`` (the engine's ZeRO optimizer at ``stage``):
    raise :class:`MissingDeepSpeedInternals` naming what is missing of :data:`CORE_NEEDS`, and return the
    :data:`FEATURES` that are off. Warns (:func:`check_version`) for a release outside the tested range. Local,
    reads only."""
    installed = installed_version() if installed is None else installed
    check_version(installed)
    family = stage_family(stage)
    absent = missing(zero, CORE_NEEDS[family])
    errors = [f"missing {', '.join(absent)}"] if absent else _core_shape_errors(zero, family)
    if errors:
        raise MissingDeepSpeedInternals(
            f"arc_engine's DeepSpeed integration cannot read this ZeRO-{stage} optimizer (deepspeed {installed}; "
            f"tested: {TESTED_DEEPSPEED_RANGE.text()}): {'; '.join(errors)}. Every step's gradient, weight and update "
            f"statistics are read from these (integrations/deepspeed/internals.py). Install a tested release or "
            f"train without arc_engine's DeepSpeed integration.")
    found = Capabilities(TESTED_DEEPSPEED_RANGE, installed, {f.name: (f.description, f.without) for f in FEATURES})
    for feature in FEATURES:
        if family not in feature.needs:
            continue
        what = missing(zero, feature.needs[family])
        if not what and feature.shape_errors is not None:
            what = feature.shape_errors(zero)
        if what:
            found.off[feature.name] = what
    return found


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


def mark_step_not_applied(zero: Any, skipped: bool = True) -> None:
    """After the ZeRO optimizer stepped with the gradients arc_engine dropped: raise its ``overflow`` flag, which
    ``DeepSpeedEngine._take_model_step`` reads right after ``optimizer.step()``. DeepSpeed then books the step as one
    it skipped: no LR scheduler step, ``skipped_steps`` counted, ``was_step_applied()`` False (and Accelerate's
    ``step_was_skipped`` True). ``skipped=False`` lowers it again before the next step: from 0.19 ZeRO clears it at
    every step, but before that it is set only under fp16 (its overflow check), and a stale True would make ZeRO drop
    every later step."""
    if hasattr(zero, "overflow"):
        setattr(zero, "overflow", skipped)  # noqa: B010 - the one write this function exists for (a checked writer)


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


def loss_scale(zero: Any) -> float:
    """The ZeRO optimizer's current loss scale (a Python float; 1 where it keeps none: bf16, fp32)."""
    return float(getattr(zero, "loss_scale", 1.0))


def pending_flat(pending: Any) -> torch.Tensor | None:
    """The flat partition of a pending gradient (:func:`pending_gradient`) where DeepSpeed keeps one, else None (a
    list of pieces)."""
    return getattr(pending, "flat_partition", None)


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
    set-up :func:`buckets_reduced_before` and :func:`pending_buckets` describe (no offload, no ZenFlow)."""
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
    fits in the bucket it goes to, so that DeepSpeed's gradient hook for it, about to run, may reduce buckets
    first (:func:`buckets_reduced_before` then decides and gives them). DeepSpeed keeps one bucket object per
    communication dtype and empties it in place, so the one read here stays the one it fills."""
    bucket = zero.ipg_buckets.get(zero.get_param_comm_dtype(param))
    numel, limit = param.numel(), zero.reduce_bucket_size
    if bucket is None or numel == 0:
        return lambda: False
    return lambda: bucket.elements + numel > limit


def _coalesces_reduction(zero: Any) -> bool:
    """Whether the engine is coalescing this backward's reductions into one (0.19; 0.18 has none)."""
    return bool(getattr(zero, "_coalesce_grad_reduction", False))


def _reduces_one_dtype(zero: Any) -> bool:
    """Whether an overflowing bucket is reduced alone (``reduce_ipg_grads(comm_dtype=...)``, 0.18.9+) or
    together with every other dtype's bucket (``reduce_ipg_grads()``, 0.18.0 .. 0.18.4)."""
    return _reduce_takes_dtype(type(zero))


@functools.cache
def _reduce_takes_dtype(zero_type: type) -> bool:
    """Read from ``reduce_ipg_grads``'s signature, once per ZeRO optimizer class."""
    return "comm_dtype" in inspect.signature(zero_type.reduce_ipg_grads).parameters


def buckets_reduced_before(zero: Any, param: torch.Tensor) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """The buckets DeepSpeed reduces at the start of its gradient hook for ``param`` (because ``param``'s gradient
    does not fit in its bucket), each as its flat pre-reduction contents and the parameters in it in bucket order;
    empty if that hook reduces nothing. Call from a tensor hook on ``param`` (it runs before DeepSpeed's hook).
    Mirrors ``reduce_independent_p_g_buckets_and_remove_grads`` of the installed release; reads only."""
    numel = param.numel()
    if numel == 0 or _coalesces_reduction(zero) or not is_accumulation_boundary(zero):
        return []
    comm_dtype = zero.get_param_comm_dtype(param)
    bucket = zero.ipg_buckets.get(comm_dtype)
    if bucket is None or bucket.elements + numel <= zero.reduce_bucket_size:
        return []
    reduced = [(comm_dtype, bucket)] if _reduces_one_dtype(zero) else list(zero.ipg_buckets.items())
    contents = (_bucket_contents(zero, dtype, reduced_bucket) for dtype, reduced_bucket in reduced)
    return [found for found in contents if found is not None]


def pending_buckets(zero: Any) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Every bucket still waiting for DeepSpeed's backward epilogue to reduce it, as in
    :func:`buckets_reduced_before`. Call once all gradient hooks of a backward have fired."""
    pending = (_bucket_contents(zero, comm_dtype, bucket) for comm_dtype, bucket in zero.ipg_buckets.items())
    return [contents for contents in pending if contents is not None]


def _bucket_contents(zero: Any, comm_dtype: torch.dtype, bucket: Any) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    if not bucket.params or bucket.elements == 0:
        return None
    params = [zero.bit16_groups[group_id][index] for group_id, index, _ in bucket.params]
    # a gradient larger than a bucket is reduced from where it lies; DeepSpeed keys it by its communication dtype
    # (0.18.0: by the parameter's own dtype), so it is found by that
    oversized = next((p for p in zero.extra_large_param_to_reduce.values()
                      if zero.get_param_comm_dtype(p) == comm_dtype), None)
    if oversized is not None:
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
    between steps (the step copies it over). When the model trains in fp32 it is the master itself (0.18.2 and
    later) or a separate fp32 copy (0.18.0)."""
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


def after_engine_step(ds_engine: Any, settle: Callable[[], None]) -> Callable[[], None]:
    """Wrap this engine instance's ``step`` so that ``settle()`` runs each time it returns (the class is untouched;
    DeepSpeed offers no step post-hook, and its optimizer's post-hook fires before its step copies the partitions
    into the bit16 parameters and counts the step). Returns the remover (:func:`restore_engine_step`)."""
    own = vars(ds_engine).get("step")  # an instance-level step of somebody else's, kept
    step = ds_engine.step

    @functools.wraps(step)
    def settling_step(*args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        settle()
        return result

    setattr(ds_engine, "step", settling_step)  # noqa: B010 - the one write this function exists for
    return functools.partial(restore_engine_step, ds_engine, own)


def restore_engine_step(ds_engine: Any, own: Any) -> None:
    """Undo :func:`after_engine_step`: the instance's own ``step`` back, or none (the class's)."""
    if own is not None:
        setattr(ds_engine, "step", own)  # noqa: B010
    elif "step" in vars(ds_engine):
        delattr(ds_engine, "step")


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


def expert_params(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The DeepSpeed-MoE expert parameters among ``params``: DeepSpeed marks them ``allreduce = False`` (they are
    averaged over their expert-data-parallel group, not the data-parallel one; ``deepspeed.moe.utils``)."""
    return [p for p in params if getattr(p, "allreduce", True) is False]

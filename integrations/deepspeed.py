"""DeepSpeed ZeRO stages 1, 2 and 3: statistics on each rank's own partition, decided inside the optimizer step.

Stage 3 differs only in where its partitions live (sub-groups); see ``deepspeed_zero3.py``. Below, stages 1/2.

What DeepSpeed 0.19.8 holds (``deepspeed/runtime/zero/stage_1_and_2.py``, the ground truth): per parameter group
``j`` a flat fp32 master partition ``single_partition_of_fp32_groups[j]`` that the wrapped torch optimizer steps,
with its Adam moments in ``optimizer.state[partition]``. ``DeepSpeedZeroOptimizer.step()`` first checks overflow and
computes the pre-clip global norm (its own collectives), then for each group in turn builds the flat gradient,
unscales and clips it, and calls the torch optimizer with ``param_groups = [group j]``. So the torch optimizer's
step pre-hook fires once per group, and when it fires for group 0 nothing has been applied yet: that is where
arc_engine decides. At that moment group 0's final gradient is ``partition.grad`` and every later group's gradient
is still ``averaged_gradients[j]`` -- the partition's pieces in partition order (padding included), scaled by the
loss scale and not yet clipped; arc_engine applies DeepSpeed's own factor, 1 / (loss scale x clip factor), to them.

Per group, as partial sums over this rank's partition (``Reduce.SUM``: summed over ranks they are exact):
``grad_sq`` (unscaled, before clipping), ``weight_sq`` (fp32 master weights before the update), ``update_sq`` /
``update_count`` (the prospective Adam update, padding excluded). ``grad_sq_local`` / ``grad_nonfinite_local``
(PER_RANK) are this rank's own gradient before ZeRO reduces it, from tensor hooks on the module parameters
(:class:`LocalGradHooks`), so a NaN is named on the rank that produced it.

Steps DeepSpeed skips itself (gradient overflow: fp16 loss scaling, or a NaN/Inf norm in fp32) never reach the
torch optimizer. arc_engine notices them from ``engine.global_steps`` at the next ``record_loss`` or step, gathers
what the ranks recorded for that step, and reports a ``deepspeed_overflow`` event plus the ``non_finite`` finding
naming the rank (every rank sees the same DeepSpeed verdict); outside fp16 dynamic loss scaling they count as
skips, so a persistent overflow escalates per ``policy.max_consecutive_skips``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from arc_engine import runtime
from arc_engine.attach import Arc, register_step_start
from arc_engine.config import ArcConfig, load_config
from arc_engine.engine import ArcEngine
from arc_engine.events import Action, Finding, Severity
from arc_engine.faults import FaultInjector
from arc_engine.integrations.torch_optim import drop_gradients
from arc_engine.monitors.sdc_local import BUCKET_SKETCH_INDEX, LocalGate, add_block_sums, block_sums, zero_where
from arc_engine.recovery.heal import heal_step, restore_learning_rates
from arc_engine.recovery.recompute import RecomputeFn, SDCRecompute, recompute_wanted
from arc_engine.stats import Reduce, names
from arc_engine.stats.optim_stats import (
    AdamHyper,
    AdamViews,
    is_decoupled,
    sampled,
    step_count,
    update_sq_total,
    weight_sq_sums,
)

log = logging.getLogger("arc_engine")

CLIP_EPS = 1e-6  # DeepSpeed's unscale_and_clip_grads adds it to the norm


def grad_divisor(zero: Any) -> torch.Tensor | float:
    """DeepSpeed's divisor for raw (loss-scaled, unclipped) gradients in ``unscale_and_clip_grads``:
    loss scale x max(1, (pre-clip norm + 1e-6) / clip). A device tensor when clipping is on (no host sync), else a
    float. ``_global_grad_norm`` is already unscaled (scaled norm / loss scale) when the optimizer is called."""
    loss_scale = float(zero.loss_scale)
    norm = zero._global_grad_norm
    if zero.clip_grad > 0 and norm is not None:
        norm = torch.as_tensor(norm, dtype=torch.float64)
        return loss_scale * torch.clamp((norm + CLIP_EPS) / zero.clip_grad, min=1.0)
    return loss_scale


def add_pre_clip_grad_sq(buffer: Any, group_id: int, pieces: list[torch.Tensor], final: bool,
                         divisor: torch.Tensor | float, loss_scale: float) -> None:
    """Add the unscaled, pre-clip squared norm of ``pieces`` to group ``group_id``'s ``grad_sq`` slot.
    Final pieces are raw / divisor (DeepSpeed already unscaled and clipped them); raw ones still carry the loss
    scale. Either way the result is what DeepSpeed's own pre-clip norm measures."""
    norms_sq = weight_sq_sums(pieces).to(buffer.device)
    factor = (divisor / loss_scale) ** 2 if final else 1.0 / loss_scale**2
    buffer.view(names.GRAD_SQ)[group_id:group_id + 1].add_(norms_sq.sum() * factor)


def device_divisor(zero: Any, device: torch.device) -> torch.Tensor | float:
    divisor = grad_divisor(zero)
    return divisor.to(device) if isinstance(divisor, torch.Tensor) else divisor


class ZeroPartitionStats:
    """Reads one rank's ZeRO-1/2 partitions at the group-0 pre-hook; writes every group's statistics."""

    def __init__(self, engine: ArcEngine, zero_optimizer: Any) -> None:
        self.engine = engine
        self.zero = zero_optimizer
        self.torch_optimizer = zero_optimizer.optimizer
        self.groups = list(zero_optimizer.optimizer.param_groups)  # the dicts DeepSpeed swaps in one at a time

    def group_id(self, optimizer: torch.optim.Optimizer) -> int:
        current = optimizer.param_groups[0]
        return next((i for i, group in enumerate(self.groups) if group is current), 0)

    def is_first_call(self, optimizer: torch.optim.Optimizer) -> bool:
        """This inner ``step()`` is the step's first (group 0): nothing has been applied yet."""
        return self.group_id(optimizer) == 0

    def is_last_call(self, optimizer: torch.optim.Optimizer) -> bool:
        return self.group_id(optimizer) == len(self.groups) - 1

    def group_gradient(self, group_id: int) -> tuple[list[torch.Tensor], bool]:
        """This rank's gradient pieces for ``group_id`` and whether they are already final (unscaled, clipped)."""
        partition = self.zero.single_partition_of_fp32_groups[group_id]
        if partition.grad is not None:
            return [partition.grad.view(-1)], True
        pending = self.zero.averaged_gradients.get(group_id)
        flat = getattr(pending, "flat_partition", None)
        if flat is not None:
            return [flat.view(-1)], False
        return [t.reshape(-1) for t in pending], False

    @torch.no_grad()
    def record(self, with_optimizer_stats: bool) -> None:
        buffer = self.engine.buffer
        combined = device_divisor(self.zero, buffer.device)
        loss_scale = float(self.zero.loss_scale)
        for group_id, partition in enumerate(self.zero.single_partition_of_fp32_groups):
            pieces, final = self.group_gradient(group_id)
            add_pre_clip_grad_sq(buffer, group_id, pieces, final, combined, loss_scale)
            if with_optimizer_stats:
                self._optimizer_stats(group_id, partition, pieces, 1.0 if final else 1.0 / combined)

    def _optimizer_stats(self, group_id: int, partition: torch.Tensor, pieces: list[torch.Tensor],
                         grad_scale: float | torch.Tensor) -> None:
        buffer = self.engine.buffer
        slot = slice(group_id, group_id + 1)
        if self.engine.wants_weight_stats():
            buffer.view(names.WEIGHT_SQ)[slot].add_(weight_sq_sums([partition.view(-1)]).sum().to(buffer.device))
        views = self._views(group_id, partition, pieces)
        if views is None:
            return
        views = sampled(views, self.engine.config.detectors.sdc.update_sample)
        update_sq = update_sq_total(views.params, views.grads, views.exp_avgs, views.exp_avg_sqs, views.step,
                                    views.hyper, grad_scale=grad_scale)
        buffer.view(names.UPDATE_SQ)[slot].add_(update_sq.to(buffer.device))
        if self.engine.config.detectors.sdc.update_sample < 1.0:
            buffer.view(names.UPDATE_COUNT)[slot].add_(float(sum(g.numel() for g in views.grads)))
        else:
            padding = int(self.zero.groups_padding[group_id])
            buffer.view(names.UPDATE_COUNT)[slot].add_(float(partition.numel() - padding))

    def _views(self, group_id: int, partition: torch.Tensor, pieces: list[torch.Tensor]) -> AdamViews | None:
        """Adam views of the flat partition, split like the gradient pieces (padding's U is exactly 0)."""
        group = self.groups[group_id]
        decoupled = is_decoupled(self.torch_optimizer, group)
        if decoupled is None:
            return None
        state = self.torch_optimizer.state.get(partition, {})
        sizes = [p.numel() for p in pieces]
        step = step_count(state.get("step", 0))

        def split(tensor: torch.Tensor | None) -> list[torch.Tensor | None]:
            return [None] * len(sizes) if tensor is None else list(tensor.view(-1).split(sizes))

        return AdamViews(split(partition), pieces, split(state.get("exp_avg")), split(state.get("exp_avg_sq")),
                         step, AdamHyper.from_group(group, decoupled))


@dataclass(frozen=True)
class _ZeroBucketPlan:
    """One ZeRO reduction bucket's layout: its parameters' sizes (bucket order) and positions in
    :class:`LocalGradHooks`'s list, the first position (the bucket's sketch index), and whether every parameter is
    one of ours."""

    sizes: list[int]
    total: int
    positions: torch.Tensor
    first: int
    known: bool


class LocalGradHooks:
    """Each rank's own gradient before ZeRO reduces it, taken in one of two places:

    * **ZeRO-1/2 buckets** (``zero`` given, ``contiguous_gradients`` on, no gate): DeepSpeed copies each gradient
      into a contiguous bucket and hands the bucket to ``average_tensor`` to reduce; arc_engine wraps that method of
      the optimizer instance and, on monitored steps, takes per-parameter norms of the bucket's slices (one fused
      kernel) and the bucket's :func:`block_sums` before the reduction -- a few kernels per bucket, like the DDP
      comm hook. Stage 2 reduces every micro-batch (the same per-micro-batch norms as the tensor hooks); stage 1
      reduces the accumulated gradient at the accumulation boundary. If a monitored step's gradients never reach
      ``average_tensor`` (a DeepSpeed path that bypasses it), the wrapper is removed and the tensor hooks take over
      from the next step, with a warning.
    * **Tensor hooks** on every trainable module parameter otherwise (ZeRO-3, a gate, non-contiguous gradients):
      they run on the incoming gradient, before accumulation and so before DeepSpeed's reduction hooks.

    Either way the per-call results are queued with no sync; :meth:`flush` folds the queue into per-parameter
    squared norms (summed over micro-batches) and the sketch with a few batched kernels and moves them into the
    PER_RANK slots, once per step. The queue is folded early once it holds :data:`MAX_PENDING_PER_PARAM` entries
    per parameter (backward passes without a step), so its memory stays bounded. With a ``gate``
    (``detectors.sdc.recompute``) a parameter's micro-batch gradient the gate withholds is replaced by zeros before
    DeepSpeed sees it; otherwise the gradient is not modified."""

    #: Queued entries per parameter before the queue is folded into the accumulators without waiting for a step.
    MAX_PENDING_PER_PARAM = 8

    def __init__(self, engine: ArcEngine, param_groups: list[tuple[int, list[torch.Tensor]]],
                 gate: LocalGate | None = None, zero: Any = None) -> None:
        self.engine = engine
        self.gate = gate
        params = [(gid, p) for gid, ps in param_groups for p in ps if p.requires_grad]
        self.params = [p for _, p in params]
        device = engine.pipeline.device
        self.sq_p = torch.zeros(len(params), dtype=torch.float32, device=device)
        self.group_index_p = torch.tensor([gid for gid, _ in params], dtype=torch.long, device=device)
        sketch = names.GRAD_SKETCH_LOCAL in engine.layout
        self.sketch_k = torch.zeros(engine.layout[names.GRAD_SKETCH_LOCAL].size if sketch else 0,
                                    dtype=torch.float64, device=device)
        self._sketch_cache: dict = {}
        self._norms: list[torch.Tensor] = []  # queued: one gradient norm per hook call
        self._norm_index: list[int] = []
        self._sums: list[torch.Tensor] = []  # queued: block sums for the sketch
        self._sum_index: list[int] = []
        self._max_pending = self.MAX_PENDING_PER_PARAM * max(1, len(params))
        self.handles: list[Any] = []
        self._zero: Any = None
        self._bucket_calls = 0
        self._bucket_plans: dict[tuple[int, ...], _ZeroBucketPlan] = {}
        self._original_average: Any = None
        self._had_own_average = False
        if gate is None and zero is not None and getattr(zero, "contiguous_gradients", False) \
                and hasattr(zero, "ipg_buckets") and hasattr(zero, "bit16_groups") and hasattr(zero, "average_tensor"):
            self._zero = zero
            self._position = {id(p): i for i, p in enumerate(self.params)}
            self._original_average = zero.average_tensor
            self._had_own_average = "average_tensor" in vars(zero)
            zero.average_tensor = self._average_tensor  # an instance attribute: shadows the method
        else:
            self._register_tensor_hooks()

    @property
    def by_bucket(self) -> bool:
        """Whether the statistics come from DeepSpeed's reduction buckets (else from tensor hooks)."""
        return self._zero is not None

    def _register_tensor_hooks(self) -> None:
        self.handles = [param.register_hook(self._hook(i)) for i, param in enumerate(self.params)]

    def _unwrap(self) -> None:
        if self._zero is not None:
            if vars(self._zero).get("average_tensor") == self._average_tensor:
                if self._had_own_average:
                    self._zero.average_tensor = self._original_average
                else:
                    del self._zero.average_tensor
            self._zero = None

    def _average_tensor(self, tensor: torch.Tensor, communication_data_type: torch.dtype) -> Any:
        zero = self._zero
        engine = self.engine
        if zero is not None and engine.buffer is not None and engine.is_monitored() and not engine.recomputing:
            self._bucket_calls += 1
            self._record_bucket(tensor, zero.ipg_buckets[communication_data_type].params)
        return self._original_average(tensor, communication_data_type)

    @torch.no_grad()
    def _record_bucket(self, tensor: torch.Tensor, bucket_params: list[tuple[int, int, int]]) -> None:
        """Queue the norms of a bucket's per-parameter slices and its block sums (``bucket_params``: DeepSpeed's
        (group, index in group, param id) of each gradient in the bucket, in bucket order)."""
        key = tuple(entry[2] for entry in bucket_params)
        plan = self._bucket_plans.get(key)
        if plan is None:
            params = [self._zero.bit16_groups[g][i] for g, i, _ in bucket_params]
            positions = [self._position.get(id(p), -1) for p in params]
            if len(self._bucket_plans) >= 64:
                self._bucket_plans.clear()
            sizes = [p.numel() for p in params]
            plan = self._bucket_plans[key] = _ZeroBucketPlan(
                sizes, sum(sizes), torch.tensor(positions, dtype=torch.long, device=self.sq_p.device),
                positions[0] if positions else -1, bool(positions) and min(positions) >= 0)
        if not plan.known or plan.total != tensor.numel():
            return  # not a bucket of our parameters as we know them
        norms = torch._foreach_norm(list(tensor.view(-1).split(plan.sizes)), 2, dtype=torch.float32)
        self.sq_p.index_add_(0, plan.positions, torch.stack(norms).to(self.sq_p.device).square())
        if self.sketch_k.numel():
            sums = block_sums(tensor, self.sketch_k.numel())
            if sums is not None:  # bucket contents are the same on every rank: index it by its first parameter
                self._sums.append(sums)
                self._sum_index.append(BUCKET_SKETCH_INDEX + plan.first)

    def _hook(self, index: int) -> Callable[[torch.Tensor], torch.Tensor | None]:
        @torch.no_grad()
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            engine = self.engine
            if engine.buffer is None or not engine.is_monitored() or engine.recomputing:
                return None
            norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
            self._norms.append(norm)
            self._norm_index.append(index)
            if self.sketch_k.numel():
                sums = block_sums(grad, self.sketch_k.numel())
                if sums is not None:
                    self._sums.append(sums)
                    self._sum_index.append(index)
            if len(self._norms) >= self._max_pending:
                self._fold()
            if self.gate is None:
                return None
            withheld = self.gate.check(index, norm.square(), micro_batch=max(engine.micro_batches_recorded - 1, 0))
            return zero_where(withheld, grad.clone()) if grad.device.type != "cpu" or bool(withheld) else None

        return hook

    @torch.no_grad()
    def _fold(self) -> None:
        """Fold the queue into ``sq_p`` and ``sketch_k`` (batched: a stack, a square and an index_add for the norms;
        a concatenation and an index_add for the sketch) and empty it."""
        if self._norms:
            index = torch.tensor(self._norm_index, dtype=torch.long, device=self.sq_p.device)
            self.sq_p.index_add_(0, index, torch.stack(self._norms).to(self.sq_p.device).square())
            self._norms, self._norm_index = [], []
        if self._sums:
            add_block_sums(self.sketch_k, self._sums, self._sum_index, self._sketch_cache)
            self._sums, self._sum_index = [], []

    @torch.no_grad()
    def flush(self, stepped: bool = True) -> None:
        """Move this step's accumulators into the engine's buffer and clear them (local, device-side).
        ``stepped``: called at the optimizer step of a monitored step (not for a step DeepSpeed skipped), where the
        bucket path must have seen this step's gradients."""
        buffer = self.engine.buffer
        if buffer is None:
            return
        if self._zero is not None and stepped:
            if self._bucket_calls == 0 and self.engine.is_monitored():
                log.warning("arc_engine: DeepSpeed reduced this step's gradients without average_tensor; local "
                            "gradient statistics switch to tensor hooks from the next step")
                self._unwrap()
                self._register_tensor_hooks()
            self._bucket_calls = 0
        self._fold()
        buffer.index_add(names.GRAD_SQ_LOCAL, self.group_index_p, self.sq_p)
        buffer.index_add(names.GRAD_NONFINITE_LOCAL, self.group_index_p, (~torch.isfinite(self.sq_p)).double())
        self.sq_p.zero_()
        if self.sketch_k.numel():
            buffer.view(names.GRAD_SKETCH_LOCAL).add_(self.sketch_k)
            self.sketch_k.zero_()
        if self.gate is not None:
            buffer.view(names.SDC_WITHHELD).add_(self.gate.withheld_count.to(buffer.device))

    def remove(self) -> None:
        self._unwrap()
        for handle in self.handles:
            handle.remove()


def module_param_groups(zero: Any, stage: int) -> list[tuple[int, list[torch.Tensor]]]:
    """(parameter group, module parameters) pairs as the ZeRO optimizer holds them."""
    if stage == 3:
        return [(int(zero.sub_group_to_group_id[i]), list(params)) for i, params in enumerate(zero.fp16_groups)]
    return list(enumerate(list(params) for params in zero.bit16_groups))


class DeepSpeedAdapter:
    """Hooks on the torch optimizer that DeepSpeed's ZeRO optimizer wraps (see the module docstring)."""

    def __init__(self, engine: ArcEngine, ds_engine: Any, local_grads: LocalGradHooks) -> None:
        self.engine = engine
        self.local_grads = local_grads
        self.ds_engine = ds_engine
        self.zero = ds_engine.optimizer
        stage = int(ds_engine.zero_optimization_stage())
        if stage == 3:
            from arc_engine.integrations.deepspeed_zero3 import Zero3PartitionStats

            self.stats: ZeroPartitionStats | Zero3PartitionStats = Zero3PartitionStats(engine, self.zero)
        else:
            self.stats = ZeroPartitionStats(engine, self.zero)
        self.skip_this_step = False
        self.recompute_target: Any = None  # a ZeroGradientTarget when detectors.sdc.recompute is on
        self._saved_lrs: list[Any] | None = None
        self.step_offset = int(ds_engine.global_steps) - engine.step  # DeepSpeed's steps before attach
        self.dynamic_loss_scale = bool(ds_engine.fp16_enabled()) and bool(getattr(self.zero, "dynamic_loss_scale",
                                                                                   False))

    def catch_up(self) -> None:
        """Close the steps DeepSpeed completed without stepping the optimizer (its overflow skips).

        Every rank calls this at the same point (DeepSpeed's overflow verdict is agreed), so on a monitored step it
        gathers what the ranks recorded for the skipped step (loss, local gradients) in that step's one collective
        and names the rank(s) holding NaN/Inf; gradient-norm monitors are not run (DeepSpeed discarded them)."""
        while int(self.ds_engine.global_steps) - self.step_offset > self.engine.step:
            escalate = not self.dynamic_loss_scale
            values = {"deepspeed_skipped_steps": int(self.ds_engine.skipped_steps),
                      "loss_scale": float(getattr(self.zero, "loss_scale", 1.0))}
            finding = Finding("deepspeed_overflow", Action.SKIP if escalate else Action.WARN, Severity.WARNING,
                              "DeepSpeed skipped the step (gradient overflow: NaN/Inf in the gradients or their "
                              "norm)", (), values)
            if self.engine.is_monitored():
                self.local_grads.flush(stepped=False)
                # Under fp16 dynamic loss scaling overflow is routine (the scale is being calibrated): report it,
                # but do not let the non-finite detector turn it into skips that escalate.
                monitors = ("loss_spike",) if self.dynamic_loss_scale else ("non_finite", "loss_spike")
                self.engine.decide(extra_findings=(finding,), only=monitors)
                self.engine.framework_skipped_steps += 1
                self.engine.finish_step()
            else:
                self.engine.skip_by_framework(finding)

    def pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.stats.is_first_call(optimizer):
            self.catch_up()
            self.skip_this_step = False
            if self.engine.is_monitored():
                self.local_grads.flush()
                self.stats.record(self.engine.wants_optimizer_stats())
                self.skip_this_step = not self.engine.decide().applies_update
        elif self.recompute_target is not None and not self.skip_this_step:
            self.recompute_target.rescale_group(optimizer.param_groups[0]["params"][0].grad)
        if self.skip_this_step:
            drop_gradients(optimizer)
        else:  # healing: this group's LR and gradient (DeepSpeed steps the torch optimizer once per group)
            self._saved_lrs = heal_step(self.engine, optimizer.param_groups)

    def post_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._saved_lrs is not None:
            restore_learning_rates(optimizer.param_groups, self._saved_lrs)
            self._saved_lrs = None
        if self.stats.is_last_call(optimizer):
            if self.recompute_target is not None:
                self.recompute_target.end_step()
            self.engine.finish_step()


class DeepSpeedArc(Arc):
    """The :class:`Arc` handle for a DeepSpeed engine; ``record_loss`` also closes DeepSpeed-skipped steps."""

    adapter: DeepSpeedAdapter | None = None

    def record_loss(self, loss: torch.Tensor) -> None:
        if self.adapter is not None:
            self.adapter.catch_up()
        self.engine.record_loss(loss)


def attach_deepspeed(ds_engine: Any, config: ArcConfig | str | Path | None = None, *,
                     group: torch.distributed.ProcessGroup | None = None,
                     recompute_fn: RecomputeFn | None = None) -> DeepSpeedArc:
    """Attach arc_engine to a ``deepspeed.initialize``-d engine running ZeRO stage 1, 2 or 3. Collective: call on
    every rank, once, after ``deepspeed.initialize``. ``group``: defaults to DeepSpeed's data-parallel group.

    Loop contract: ``loss = engine(batch); arc.record_loss(loss); engine.backward(loss); engine.step()``; with
    ``recovery.enabled`` draw batches from ``arc.data_position`` and loop while ``arc.step`` is below the target
    (rollbacks restore the engine's scheduler, loss scaler and step counters too). A SKIP
    applies nothing on any rank (the fp32 partitions and Adam moments are untouched, so the bit16 copies DeepSpeed
    re-gathers are unchanged too); ABORT raises ArcAbort from ``engine.step()`` on every rank.
    ``recompute_fn``: see :func:`arc_engine.attach` (``detectors.sdc.recompute``, ZeRO-1/2; it gets
    ``engine.module``; with gradient accumulation call ``record_loss`` once per micro-batch).
    Raises ValueError for ZeRO-0 and for offloaded optimizer states (not supported yet).
    """
    stage = int(ds_engine.zero_optimization_stage())
    zero = ds_engine.optimizer
    if stage == 3:
        from arc_engine.integrations.deepspeed_zero3 import check_supported

        check_supported(zero)
    elif stage not in (1, 2) or not hasattr(zero, "single_partition_of_fp32_groups"):
        raise ValueError(f"arc_engine's DeepSpeed integration supports ZeRO stages 1, 2 and 3; this engine runs "
                         f"stage {stage} (ZeRO-0 / plain DeepSpeed: not supported yet)")
    elif getattr(zero, "cpu_offload", False):
        raise ValueError("arc_engine's DeepSpeed integration does not support offload_optimizer yet")
    if not isinstance(config, ArcConfig):
        config = load_config(config)
    group = group or zero.dp_process_group
    names_g = [str(g.get("name") or f"group{i}") for i, g in enumerate(zero.optimizer.param_groups)]
    engine = ArcEngine(config, group=group, group_names=names_g, shard_reduce=Reduce.SUM)
    wants_recompute = recompute_wanted(engine, recompute_fn, "DeepSpeed ZeRO-3", stage in (1, 2))
    engine.start()
    if config.recovery.enabled:
        if stage == 3:
            raise ValueError("recovery.enabled: rollback and checkpoints of DeepSpeed ZeRO-3 are not supported yet "
                             "(ZeRO-1/2, DDP and FSDP2 are); disable recovery or use ZeRO-2")
        from arc_engine.integrations.deepspeed_state import ZeroTrainState

        engine.enable_recovery(ZeroTrainState(ds_engine, rank=runtime.global_rank()))  # may resume: counters move
    step_offset = int(ds_engine.global_steps) - engine.step  # DeepSpeed's steps before arc_engine's step 0
    # DeepSpeed's step counter leads arc_engine's until a step it skipped itself is caught up with.
    injector = FaultInjector(config.faults.injections, runtime.global_rank(),
                             lambda: engine.iteration + int(ds_engine.global_steps) - step_offset - engine.step)
    injector.install(ds_engine.module)
    sdc = config.detectors.sdc
    gate = LocalGate(sdc.recompute.gate_factor, sdc.warmup_steps, engine.pipeline.device) if wants_recompute else None
    param_groups = module_param_groups(zero, stage)
    # after the fault hooks: sees their output; ZeRO-1/2 take the statistics from DeepSpeed's reduction buckets
    local_hooks = LocalGradHooks(engine, param_groups, gate, zero if stage in (1, 2) else None)
    adapter = DeepSpeedAdapter(engine, ds_engine, local_hooks)
    if gate is not None:
        from arc_engine.integrations.deepspeed_recompute import ZeroGradientTarget

        target = ZeroGradientTarget(engine, ds_engine, adapter.stats, param_groups)
        adapter.recompute_target = target
        engine.restat = target.record_stats
        engine.sdc_recompute = SDCRecompute(engine, sdc.recompute, gate, target, recompute_fn)
    handles = [zero.optimizer.register_step_pre_hook(adapter.pre_step),
               zero.optimizer.register_step_post_hook(adapter.post_step)]
    engine.lr_multipliers.append(injector.lr_multiplier)
    arc = DeepSpeedArc(engine, injector, [h.remove for h in handles] + [local_hooks.remove,
                                                                        register_step_start(engine, ds_engine.module)])
    arc.adapter = adapter
    return arc

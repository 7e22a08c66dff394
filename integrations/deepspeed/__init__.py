"""DeepSpeed ZeRO stages 1, 2 and 3: statistics on each rank's own partition, decided inside the optimizer step.

Stage 3 differs only in where its partitions live (sub-groups); see ``zero3.py``. Below, stages 1/2.

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
(DETAIL and SUM slots) are this rank's own gradient, read just before ZeRO reduces it (:class:`LocalGradHooks`), so
a NaN is named on the rank that produced it.

arc_engine assigns DeepSpeed objects in four places only (all listed in docs/architecture.md): a rollback's
restore of the engine's step counters and loss scaler, the ZeRO optimizer's overflow flag after a step it skipped
(DeepSpeed then books the step as skipped), the engine's ``forward`` during a curvature measurement (restored
after), and the engine instance's ``step`` (a wrapper that settles the step when DeepSpeed's returns: a rollback is
carried out there, and a step DeepSpeed skipped itself is closed there; removed at ``close``). Everything else is
DeepSpeed's public surface and torch's hooks on the objects DeepSpeed builds; the private state it reads is read
in :mod:`arc_engine.integrations.deepspeed.internals` (checked at attach by what it reads).

Steps DeepSpeed skips itself (gradient overflow: fp16 loss scaling, or a NaN/Inf norm in fp32) never reach the
torch optimizer. arc_engine notices them from ``engine.global_steps`` when ``engine.step()`` returns, gathers
what the ranks recorded for that step, and reports a ``deepspeed_overflow`` event plus the ``non_finite`` finding
naming the rank (every rank sees the same DeepSpeed verdict). Outside fp16 dynamic loss scaling they count as
skips, so a persistent overflow escalates per ``policy.max_consecutive_skips``; under it they are the scaler's
routine (warnings, counted per ``policy.max_consecutive_overflow_skips``) unless the loss was non-finite.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from arc_engine import runtime
from arc_engine.adapter import Adapter
from arc_engine.config import ArcConfig
from arc_engine.engine import ArcEngine
from arc_engine.events import Action, Finding, Severity
from arc_engine.integrations.deepspeed import internals as deepspeed_internals
from arc_engine.integrations.deepspeed.local import LocalGradHooks
from arc_engine.integrations.deepspeed.partition import ZeroPartitionStats
from arc_engine.integrations.pytorch.optim import OVERFLOW_MONITORS, drop_gradients
from arc_engine.monitors.family import LocalGrads, section_of
from arc_engine.monitors.sdc import SDCFamily
from arc_engine.monitors.sdc_local import LocalGate
from arc_engine.recovery.heal import heal_step, restore_learning_rates
from arc_engine.recovery.recompute import RecomputeFn, SDCRecompute
from arc_engine.recovery.state import TrainState
from arc_engine.stats import Reduce
from arc_engine.wiring import Arc, wire

log = logging.getLogger("arc_engine")

def module_param_groups(zero: Any, stage: int) -> list[tuple[int, list[torch.Tensor]]]:
    """(parameter group, module parameters) pairs as the ZeRO optimizer holds them."""
    if stage == 3:
        return [(deepspeed_internals.sub_group_owner(zero, i), list(params))
                for i, params in enumerate(deepspeed_internals.sub_group_params(zero))]
    return list(enumerate(list(params) for params in deepspeed_internals.bit16_groups(zero)))


class ZeroStepHooks:
    """Hooks on the torch optimizer that DeepSpeed's ZeRO optimizer wraps (see the module docstring)."""

    def __init__(self, engine: ArcEngine, ds_engine: Any, local_grads: LocalGradHooks) -> None:
        self.engine = engine
        self.local_grads = local_grads
        self.ds_engine = ds_engine
        self.zero = ds_engine.optimizer
        stage = int(ds_engine.zero_optimization_stage())
        if stage == 3:
            from arc_engine.integrations.deepspeed.zero3 import Zero3PartitionStats

            self.stats: ZeroPartitionStats | Zero3PartitionStats = Zero3PartitionStats(engine, self.zero)
        else:
            self.stats = ZeroPartitionStats(engine, self.zero)
        self.skip_this_step = False
        self.marked = False  # the ZeRO optimizer's overflow flag raised for a step arc_engine skipped
        self.recompute_target: Any = None  # a ZeroGradientTarget when detectors.sdc.recompute is on
        self._saved_lrs: list[Any] | None = None
        self.step_offset = int(ds_engine.global_steps) - engine.progress.step  # DeepSpeed's steps before attach
        self.dynamic_loss_scale = bool(ds_engine.fp16_enabled()) and deepspeed_internals.uses_dynamic_loss_scale(
            self.zero)
        self._loss_scale: tuple[int, float] | None = None  # (step, the loss scale of its backward)

    def note_loss_scale(self) -> None:
        """At each ``record_loss`` (before its backward): the loss scale that step's gradients will carry (a Python
        float in DeepSpeed; it moves on at an overflow before arc_engine closes the skipped step)."""
        self._loss_scale = (self.engine.progress.step, deepspeed_internals.loss_scale(self.zero))

    def backward_loss_scale(self) -> float:
        """The loss scale of the current step's backward (the one noted at its ``record_loss``, else the current)."""
        if self._loss_scale is not None and self._loss_scale[0] == self.engine.progress.step:
            return self._loss_scale[1]
        return deepspeed_internals.loss_scale(self.zero)

    def skip_pending(self) -> bool:
        """DeepSpeed completed a step without stepping the optimizer that :meth:`catch_up` has not closed (local)."""
        return int(self.ds_engine.global_steps) - self.step_offset > self.engine.progress.step

    def catch_up(self) -> None:
        """Close the steps DeepSpeed completed without stepping the optimizer (its overflow skips).

        Every rank calls this at the same point (DeepSpeed's overflow verdict is agreed), so on a monitored step it
        gathers what the ranks recorded for the skipped step (loss, local gradients) in that step's one collective
        and names the rank(s) holding NaN/Inf; gradient-norm monitors are not run (DeepSpeed discarded them)."""
        while self.skip_pending():
            values = {"deepspeed_skipped_steps": int(self.ds_engine.skipped_steps),
                      "loss_scale": deepspeed_internals.loss_scale(self.zero)}
            finding = Finding("deepspeed_overflow", Action.SKIP, Severity.WARNING,
                              "DeepSpeed skipped the step (gradient overflow: NaN/Inf in the gradients or their "
                              "norm)", (), values, by_framework=True)
            # Under fp16 dynamic loss scaling an overflow is routine while DeepSpeed searches its scale: the policy
            # counts it apart (policy.max_consecutive_overflow_skips) unless the loss itself was non-finite.
            overflow = self.dynamic_loss_scale
            if self.engine.is_monitored():
                self.local_grads.flush(stepped=False, loss_scale=self.backward_loss_scale())
                self.engine.decide(extra_findings=() if overflow else (finding,), only=OVERFLOW_MONITORS,
                                   overflow=finding if overflow else None)
                self.engine.finish_step(framework_skipped=True)
            else:
                self.engine.skip_by_framework(finding, overflow=overflow)

    def pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.stats.is_first_call(optimizer):
            self.catch_up()
            self.skip_this_step = False
            if self.engine.is_monitored():
                with self.engine.own_work.section("deepspeed.local_flush"):
                    self.local_grads.flush(loss_scale=self.backward_loss_scale())
                self.stats.record(self.engine.wants_optimizer_stats())
                self.skip_this_step = not self.engine.decide().applies_update
        elif self.recompute_target is not None and not self.skip_this_step:
            self.recompute_target.rescale_group(optimizer.param_groups[0]["params"][0].grad)
        if self.skip_this_step:
            drop_gradients(optimizer)
        else:  # healing: this group's LR and gradient (DeepSpeed steps the torch optimizer once per group)
            self._saved_lrs = heal_step(self.engine, optimizer.param_groups, optimizer.state)

    def post_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._saved_lrs is not None:
            restore_learning_rates(optimizer.param_groups, self._saved_lrs)
            self._saved_lrs = None
        if self.stats.is_last_call(optimizer):
            if self.recompute_target is not None:
                self.recompute_target.end_step()
            if self.skip_this_step:  # DeepSpeed books it as skipped too: its own LR scheduler does not step
                deepspeed_internals.mark_step_not_applied(self.zero)
                self.marked = True
            # DeepSpeed's step goes on after this hook (bit16 copies, its counters, its scheduler): a rollback
            # decided here is carried out when engine.step() returns (after_engine_step)
            self.engine.finish_step(settle=False)

    def after_engine_step(self) -> None:
        """When ``engine.step()`` returns (every rank, each call; DeepSpeed's step is complete): carry out a rollback
        this step decided, then close a step DeepSpeed skipped on its own (which may decide and carry out one), so
        that when ``step()`` returns every counter, DeepSpeed's included, agrees with the tensors."""
        self.engine.settle()
        self.catch_up()

    def unmark(self, *_: Any) -> None:
        """At the next forward: lower the flag :meth:`post_step` raised (see ``mark_step_not_applied``)."""
        if self.marked:
            deepspeed_internals.mark_step_not_applied(self.zero, skipped=False)
            self.marked = False


#: what each feature of :data:`deepspeed_internals.FEATURES` turns off in the config when its internals are missing
CONFIG_OFF: dict[str, tuple[str, ...]] = {"rollback": ("recovery.enabled",)}


class ZeroAdapter(Adapter):
    """:class:`arc_engine.adapter.Adapter` for a ``deepspeed.initialize``-d engine running ZeRO stage 1, 2 or 3:
    every slot is a partial sum over the ranks' partitions (``Reduce.SUM``); the decision is taken in the step
    pre-hook of the torch optimizer ZeRO wraps."""

    shard_reduce = Reduce.SUM

    def __init__(self, ds_engine: Any, lr_scheduler: Any | None = None) -> None:
        if lr_scheduler is not None and lr_scheduler is ds_engine.lr_scheduler:
            lr_scheduler = None  # the engine's own: DeepSpeed steps it, recovery restores it as the engine's
        elif lr_scheduler is not None and ds_engine.lr_scheduler is not None:
            raise ValueError("arc_engine.attach: this DeepSpeed engine steps its own LR scheduler (the config's "
                             "'scheduler' or deepspeed.initialize(lr_scheduler=)); lr_scheduler= is for a scheduler "
                             "the training loop steps itself, next to an engine without one")
        self.lr_scheduler = lr_scheduler
        self.ds_engine = ds_engine
        self.zero = ds_engine.optimizer
        self.stage = int(ds_engine.zero_optimization_stage())
        if self.stage == 3:
            from arc_engine.integrations.deepspeed.zero3 import check_supported

            check_supported(self.zero)
        elif self.stage not in (1, 2):
            raise ValueError(f"arc_engine's DeepSpeed integration supports ZeRO stages 1, 2 and 3; this engine runs "
                             f"stage {self.stage} (ZeRO-0 / plain DeepSpeed: not supported yet)")
        elif not deepspeed_internals.is_zero12(self.zero):
            raise ValueError(f"arc_engine's DeepSpeed integration reads the ZeRO-1/2 optimizer; this ZeRO-{self.stage} "
                             f"engine steps a {type(self.zero).__name__} instead (DeepSpeed runs ZeRO-1 with bf16 "
                             "through its BF16_Optimizer), which it does not read yet: use ZeRO-2 for bf16, or "
                             "ZeRO-1 with fp32 or fp16")
        elif deepspeed_internals.offloads_optimizer(self.zero):
            raise ValueError("arc_engine's DeepSpeed integration does not support offload_optimizer yet")
        # what this release holds of what the integration reads: warns outside the tested range, raises only when
        # the partition statistics cannot be read; the features it turns off are reported at install
        self.capabilities = deepspeed_internals.check_capabilities(self.zero, self.stage)
        self.name = f"DeepSpeed ZeRO-{self.stage}"
        self.module = ds_engine.module
        self.torch_optimizer = deepspeed_internals.wrapped_optimizer(self.zero)
        self.group_names = [str(g.get("name") or f"group{i}") for i, g in enumerate(self.torch_optimizer.param_groups)]
        self.params = [p for p in ds_engine.module.parameters() if p.requires_grad]
        self.data_parallel_group = deepspeed_internals.data_parallel_group(self.zero)
        self.recompute_group = self.data_parallel_group
        self.supports_recompute = self.stage in (1, 2)
        # ZeRO-1/2 reduce from hooks on each parameter's gradient accumulation, after its tensor hooks have run, over
        # the data-parallel group; a DeepSpeed-MoE expert's over its expert-data-parallel group: left out
        if self.stage in (1, 2):
            experts = deepspeed_internals.expert_params(self.params)
            dense = tuple(p for p in self.params if id(p) not in {id(e) for e in experts})
            left_out = (f"{len(experts)} DeepSpeed-MoE expert parameter(s), averaged over their expert-data-parallel "
                        "group: the bad-data quarantine leaves them out" if experts else "")
            self.local_grad_reduction = LocalGrads(dense, self.data_parallel_group, left_out)
            if left_out and runtime.global_rank() == 0:
                log.info("arc_engine: %s", left_out)
        self.hooks: ZeroStepHooks | None = None

    @property
    def local_grads(self) -> LocalGradHooks | None:
        """The local-gradient producer (after :meth:`install`)."""
        return self.hooks.local_grads if self.hooks is not None else None

    @contextlib.contextmanager
    def diagnosing(self) -> Iterator[None]:
        """During a curvature measurement the engine's forward is its module's: DeepSpeed's forward arms its
        backward prologue and epilogue (enter_backward, the gradient reduction) for any backward through its output,
        which a Hessian-vector product would set off with no gradients to reduce. Restored afterwards."""
        engine = self.ds_engine
        own = vars(engine).get("forward")  # an instance-level forward of its own (a compiled engine), kept
        engine.forward = engine.module.forward
        try:
            yield
        finally:
            if own is not None:
                engine.forward = own
            else:
                del engine.forward

    def effective_config(self, config: ArcConfig) -> ArcConfig:
        """``config`` with what this release's internals cannot serve turned off (``recovery.enabled`` without what a
        rollback restores): a copy, named in the ``compatibility`` event. Local."""
        return self.capabilities.effective_config(config, CONFIG_OFF)

    def check_config(self, config: ArcConfig) -> None:
        sdc = section_of(config, SDCFamily())
        if sdc.enabled and sdc.recompute.enabled and bool(self.ds_engine.fp16_enabled()):
            raise ValueError("detectors.sdc.recompute is not supported under DeepSpeed fp16: its loss scaler checks "
                             "the gradients for overflow before arc_engine decides, so a recomputed gradient would "
                             "bypass that check; turn the recomputation off (SDC detection and skipping still work)")
        if config.recovery.enabled and self.stage == 3 and deepspeed_internals.offloads_parameters(self.zero):
            raise ValueError("recovery.enabled: rollback and checkpoints of DeepSpeed ZeRO-3 with offload_param "
                             "(parameter partitions on the CPU or NVMe) are not supported yet; keep the parameters "
                             "on the device or disable recovery")

    def decision_group(self, requested: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        return requested

    def train_state(self) -> TrainState:
        from arc_engine.integrations.deepspeed.state import Zero3TrainState, ZeroTrainState

        state_type = Zero3TrainState if self.stage == 3 else ZeroTrainState
        return state_type(self.ds_engine, rank=runtime.global_rank(), lr_scheduler=self.lr_scheduler)

    def holds_whole_model(self) -> bool:
        return self.stage in (1, 2)  # ZeRO-3 partitions the parameters

    def fault_step(self, engine: ArcEngine) -> Callable[[], int]:
        """The step attempt: DeepSpeed's step counter leads arc_engine's until a step it skipped itself is caught
        up with (called after a resume, so the offset counts DeepSpeed's steps before arc_engine's step 0)."""
        ds_engine = self.ds_engine
        step_offset = int(ds_engine.global_steps) - engine.progress.step
        return lambda: engine.progress.iteration + int(ds_engine.global_steps) - step_offset - engine.progress.step

    def install(self, engine: ArcEngine, recompute_fn: RecomputeFn | None) -> list[Callable[[], None]]:
        sdc = section_of(engine.config, SDCFamily())
        gate = LocalGate(sdc.recompute.gate_factor, sdc.warmup_steps, engine.gathering.pipeline.device) \
            if recompute_fn is not None else None
        compatibility = self.capabilities.report()
        if compatibility is not None:  # one event naming every feature that is off (and an untested release)
            engine.emit_lifecycle("compatibility", *compatibility)
        param_groups = module_param_groups(self.zero, self.stage)
        # after the fault hooks: sees their output; ZeRO-1/2 take the statistics from what DeepSpeed is about to
        # reduce, where the release holds what that reads
        buckets = self.stage in (1, 2) and self.capabilities.has("bucket_local_statistics")
        local_grads = LocalGradHooks(engine, param_groups, gate, self.zero if buckets else None)
        self.hooks = hooks = ZeroStepHooks(engine, self.ds_engine, local_grads)
        engine.gathering.use_partition_parts(hooks.stats.parameter_parts)  # per-parameter views (weight health)
        if recompute_fn is not None:
            from arc_engine.integrations.deepspeed.recompute import ZeroGradientTarget

            target = ZeroGradientTarget(engine, self.ds_engine, hooks.stats, param_groups)
            hooks.recompute_target = target
            engine.use_recompute(SDCRecompute(engine, sdc.recompute, gate, target, recompute_fn), target.record_stats)
        timed = engine.own_work.wrap
        handles = [self.torch_optimizer.register_step_pre_hook(timed("deepspeed.pre_step", hooks.pre_step)),
                   self.torch_optimizer.register_step_post_hook(timed("deepspeed.post_step", hooks.post_step)),
                   self.ds_engine.module.register_forward_pre_hook(hooks.unmark)]
        return [*(h.remove for h in handles), local_grads.remove,
                deepspeed_internals.after_engine_step(self.ds_engine, hooks.after_engine_step)]

    def framework_skip_pending(self) -> bool:
        """Whether DeepSpeed skipped a step (overflow) that arc_engine has not closed yet (local: DeepSpeed's
        public step counter against arc_engine's; the closing itself, collective, runs at the next record_loss or
        optimizer step)."""
        return self.hooks is not None and self.hooks.skip_pending()

    def close_framework_skips(self) -> None:
        """Close the steps DeepSpeed skipped on its own (normally already closed when its ``step()`` returned)."""
        if self.hooks is not None:
            self.hooks.catch_up()

    def before_record_loss(self) -> None:
        """Close the steps DeepSpeed skipped on its own before this micro-batch (see ZeroStepHooks.catch_up)."""
        if self.hooks is not None:
            self.hooks.catch_up()
            self.hooks.note_loss_scale()


def attach_deepspeed(ds_engine: Any, config: ArcConfig | str | Path | None = None, *,
                     group: dist.ProcessGroup | None = None, recompute_fn: RecomputeFn | None = None,
                     lr_scheduler: Any | None = None) -> Arc:
    """Attach arc_engine to a ``deepspeed.initialize``-d engine running ZeRO stage 1, 2 or 3. Collective: call on
    every rank, once, after ``deepspeed.initialize``. ``group``: the decision group (default: the whole job).

    Loop contract: ``loss = engine(batch); arc.record_loss(loss); engine.backward(loss); engine.step()``; with
    ``recovery.enabled`` draw batches from ``arc.progress.data_position`` and loop while ``arc.progress.step`` is below
    the target (rollbacks restore the engine's scheduler, loss scaler and step counters too). A SKIP
    applies nothing on any rank (the fp32 partitions and Adam moments are untouched, so the bit16 copies DeepSpeed
    re-gathers are unchanged too); ABORT raises ArcAbort from ``engine.step()`` on every rank.
    ``recompute_fn``: see :func:`arc_engine.attach` (``detectors.sdc.recompute``, ZeRO-1/2; it gets
    ``engine.module``; with gradient accumulation call ``record_loss`` once per micro-batch).
    Raises ValueError for ZeRO-0 and for offloaded optimizer states (not supported yet), and
    :class:`~arc_engine.integrations.deepspeed.internals.MissingDeepSpeedInternals` where the ZeRO optimizer lacks
    what every step's statistics read. A release outside the tested range (``deepspeed_internals.
    TESTED_DEEPSPEED_RANGE``) gets a warning; features whose internals it lacks are turned off and named in one
    ``compatibility`` lifecycle event (see ``internals.py``).
    ``lr_scheduler``: a scheduler the loop steps itself, outside the engine (e.g. the Hugging Face Trainer's):
    recovery snapshots and restores it with the engine; step it only when ``arc.last_step_applied``. Refused
    (ValueError) next to an engine that steps a scheduler of its own.
    """
    return wire(ZeroAdapter(ds_engine, lr_scheduler), config, group=group, recompute_fn=recompute_fn)

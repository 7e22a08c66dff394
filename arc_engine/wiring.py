"""``arc_engine.wiring``: the one place that wires arc_engine into a training step, for every framework.

Every framework is a small :class:`~arc_engine.adapter.Adapter` in ``integrations/``: what each rank owns of
parameters, gradients and optimizer state, where the step hooks sit, how a step is dropped or applied, what a
rollback restores. :func:`wire` does the rest once for all of them (config, engine, fault injection, recovery, the
SDC recomputation, the watchdog, the sinks) and returns the :class:`Arc` the loop holds.
:func:`arc_engine.attach.attach` picks the adapter.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from arc_engine import internals, runtime
from arc_engine.adapter import Adapter
from arc_engine.config import EXIT_BAD_CONFIG, ArcConfig, ArcSetupError, load_config
from arc_engine.diagnostics import curvature
from arc_engine.engine import ArcEngine
from arc_engine.events import Severity
from arc_engine.faults import FaultInjector
from arc_engine.monitors.family import section_of
from arc_engine.monitors.straggler import StragglerFamily
from arc_engine.progress import Progress
from arc_engine.recovery.recompute import RecomputeFn, recompute_wanted
from arc_engine.recovery.rollback import Recovery
from arc_engine.stats.timing import ComputeProbe, is_compiled, local_compute_modules


@dataclass
class Arc:
    """What :func:`attach` returns: the engine plus the hooks it installed."""

    engine: ArcEngine
    faults: FaultInjector
    _removers: list[Any]
    adapter: Adapter = field(repr=False)

    def record_loss(self, loss: torch.Tensor) -> None:
        """See :meth:`ArcEngine.record_loss`."""
        self.adapter.before_record_loss()  # e.g. DeepSpeed: close the steps it skipped on its own
        self.engine.record_loss(loss)

    def record_validation_loss(self, loss: float | torch.Tensor) -> None:
        """See :meth:`ArcEngine.record_validation_loss`."""
        self.engine.record_validation_loss(loss)

    def end_step(self) -> None:
        """Where the loop's optimizer step has returned, loss scaler included (after ``scaler.update()``; the
        trainer callbacks call it at their step end): a step the framework skipped on its own (a GradScaler's
        overflow) is closed now instead of at the next forward, so a rollback or stop it escalates to happens here:
        :class:`~arc_engine.ArcAbort` is raised from this call. Every rank (collective when the step was
        monitored); nothing to do after a step the framework took."""
        if not self.engine.closed:
            self.adapter.close_framework_skips()

    @property
    def progress(self) -> Progress:
        """arc_engine's counters (:class:`~arc_engine.progress.Progress`: step, iteration, data position, applied
        steps, the steps not applied by cause), the same on every rank. Read them; arc_engine writes them. A loop
        draws its batches from ``progress.data_position``, shows ``progress.applied_steps`` as its step counter,
        and learns that a rollback happened when ``progress.rolled_back`` grows across an optimizer step."""
        return self.engine.progress

    @property
    def last_step_applied(self) -> bool:
        """Whether the last optimizer step changed the parameters (False after a skip, a rollback, or a step the
        framework skipped on its own, e.g. DeepSpeed's fp16 overflow -- known here as soon as its ``step()``
        returns, before arc_engine closes it; local, never a collective)."""
        if self.adapter.framework_skip_pending():
            return False
        return self.engine.progress.last_applied

    @property
    def lr_factor(self) -> float:
        """The healing factor on the learning rate after a rollback (1.0 in normal training and without
        ``recovery.enabled``): the LR each step applies is the scheduler's times this. Local; identical on every
        rank."""
        recovery = self.engine.recovery
        return recovery.lr_factor if recovery is not None else 1.0

    def batch_generator(self, seed: int = 0) -> torch.Generator:
        """For loops that draw random batches (nanoGPT's ``get_batch``): a CPU generator seeded from ``seed``, this
        step's data position (:attr:`progress`) and this rank, so the batch of each data position is a fixed draw.
        Draw with
        it (``torch.randint(n, (batch,), generator=arc.batch_generator())``) and a rollback skips or replays exactly
        the batches ``recovery.skip_data`` says, and a resumed run draws what the first run would have. Local."""
        position = self.progress.data_position
        return torch.Generator().manual_seed((seed * 1_000_003 + position) * 65_537 + runtime.global_rank())

    def measure_curvature(self, loss_fn: Callable[[], torch.Tensor]) -> dict[str, float]:
        """The loss's curvature at the current parameters (``diagnostics.curvature``): call between steps, on every
        rank of the decision group, with ``loss_fn`` computing this rank's loss on a held micro-batch through the
        model as you train it (a DDP-wrapped model works: Hessian-vector products never reach ``.grad``, so DDP
        reduces nothing; a DeepSpeed engine works, its forward standing aside for the measurement). Returns the
        ranks' mean ``hessian_trace``, ``lambda_max``, ``sam_sharpness`` and ``loss``, also reported as a
        ``curvature`` event and ``arc/curvature/...`` metrics. The parameters, gradients and RNG
        state are left as they were. ValueError where the parameters are sharded (FSDP2, DeepSpeed ZeRO-3,
        megatron-core model parallelism): a Hessian-vector product needs each rank's whole model."""
        module = self.adapter.module
        params = [p for p in module.parameters() if p.requires_grad]
        if not self.adapter.holds_whole_model():
            raise ValueError(f"arc.measure_curvature: {self.adapter.name} holds sharded parameters; curvature "
                             "diagnostics need each rank's whole model (DDP, DeepSpeed ZeRO-1/2, a plain module, "
                             "megatron-core without model parallelism)")
        engine, config = self.engine, self.engine.config.diagnostics.curvature
        with self.adapter.diagnosing(), engine.between_steps():
            result = curvature.measure_agreed(loss_fn, params, group=engine.group,
                                              device=engine.gathering.pipeline.device,
                                              probes=config.probes, iterations=config.power_iterations,
                                              rho=config.sam_rho, seed=config.seed * 1_000_003 + engine.progress.step)
        engine.emit_lifecycle("curvature", f"Hessian trace {result['hessian_trace']:.4g}, largest eigenvalue "
                              f"{result['lambda_max']:.4g}, SAM sharpness {result['sam_sharpness']:.4g} at loss "
                              f"{result['loss']:.4g} (mean over {result['ranks']} rank(s))", result)
        if engine.reporter.emits:
            engine.sinks.log_metrics(engine.progress.step,
                                     {f"arc/curvature/{key}": result[key] for key in curvature.KEYS})
        return {key: result[key] for key in curvature.KEYS}

    def curvature_due(self) -> bool:
        """Whether the step about to run is one of the periodic curvature measurements (every
        ``diagnostics.curvature.every`` optimizer steps; never when 0): ``if arc.curvature_due():
        arc.measure_curvature(held_loss)`` between steps."""
        every = self.engine.config.diagnostics.curvature.every
        return every > 0 and self.engine.progress.step % every == 0

    def watchdog_paused(self) -> contextlib.AbstractContextManager[None]:
        """A known long phase between steps (evaluation, a checkpoint of your own): the hang watchdog does not count
        its time. ``with arc.watchdog_paused(): evaluate()``."""
        watchdog = self.engine.watchdog
        return watchdog.paused() if watchdog is not None else contextlib.nullcontext()

    def summary(self) -> dict[str, Any]:
        return self.engine.summary()

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state)

    def close(self) -> None:
        """Remove the optimizer hooks and fault hooks, emit the summary, close sinks. Local, idempotent.
        (A DDP comm hook cannot be unregistered; after close it only performs the default all-reduce.)"""
        if not self.engine.closed:  # e.g. a last step the loss scaler skipped
            self.adapter.before_close()
        for remove in self._removers:
            remove()
        self._removers.clear()
        self.faults.remove()
        _mark_attached(self.adapter.module, False)
        self.engine.close()

    def __enter__(self) -> Arc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

def wire(adapter: Adapter, config: ArcConfig | str | Path | None, *, group: dist.ProcessGroup | None = None,
         recompute_fn: RecomputeFn | None = None) -> Arc:
    """The common wiring of every framework: collective, on every rank, once. Validates the config against the
    adapter, builds and starts the engine over the decision group (agreeing on the run id, the layout and the sinks;
    the watchdog starts with it), enables recovery (which may resume from a checkpoint), installs fault injection,
    then the adapter's hooks, then the step-start hook."""
    if not isinstance(config, ArcConfig):
        config = load_config(config)
    config = adapter.effective_config(config)  # what the installed release cannot serve is off (an event says so)
    if _is_attached(adapter.module):
        raise ValueError("arc_engine.attach: this model already has an arc_engine attached; two engines would both "
                         "hook and decide every step (call arc.close() on the first one before attaching again)")
    adapter.check_config(config)
    engine = ArcEngine(config, group=adapter.decision_group(group), group_names=adapter.group_names,
                       shard_reduce=adapter.shard_reduce, params=adapter.params,
                       parts=adapter.parts, exact_sketch_size=adapter.exact_sketch_size,
                       local_grads=adapter.local_grad_reduction)
    wants_recompute = recompute_wanted(engine, recompute_fn, adapter.name, adapter.supports_recompute,
                                       required_group=adapter.recompute_group)
    engine.start()
    if config.recovery.enabled:
        try:
            recovery = Recovery(engine, adapter.train_state())
            engine.use_recovery(recovery)
            recovery.start()  # collective; may resume: counters move
        except ArcSetupError as err:
            _end_setup(engine, err)
    injector = FaultInjector(config.faults.injections, runtime.global_rank(), adapter.fault_step(engine),
                             recomputing=lambda: engine.recomputing)
    error: ValueError | None = None
    try:  # a fault's parameter may exist on some ranks only (pipeline stages): agree before training starts
        injector.install(adapter.module)
    except ValueError as err:
        error = err
    runtime.raise_on_every_rank(error, engine.group, "installing the configured faults")
    removers = adapter.install(engine, recompute_fn if wants_recompute else None)
    engine.add_lr_multiplier(injector.lr_multiplier)
    if injector.acts_before_update:  # only then: heal_step walks no parameter list for faults in normal training
        engine.add_update_hook(injector.before_update)
    if injector.reports_events:
        engine.add_event_source(injector.system_events)
    removers.append(register_step_start(engine, adapter.module, adapter.before_step_start))
    straggler = section_of(config, StragglerFamily())
    compiled = straggler.enabled and straggler.compute_every and is_compiled([adapter.module])
    if compiled:  # the probe adds and removes module hooks every few steps: a compiled forward may ignore them
        engine.emit_action(engine.progress.step, "compute_probe_off", Severity.WARNING,
                           "detectors.straggler: the model runs through torch.compile, which ignores module hooks "
                           "added after compilation: the compute probe is off (forward sections are still timed; "
                           "set detectors.straggler.compute_every: 0 to silence this)", {}, detector="straggler")
    if straggler.enabled and straggler.compute_every and not compiled:  # after the fault hooks (a slowed module)
        limit = straggler.compute_modules
        modules = adapter.compute_modules(limit)
        if modules is None:
            modules = local_compute_modules([adapter.module], limit)
        probe = ComputeProbe(modules, engine.gathering.pipeline.device, config.stats.interval * straggler.compute_every)
        engine.gathering.use_probe(probe)  # its times go into the families' StepView
        engine.add_step_hooks(probe)       # it samples at the steps' starts
    _mark_attached(adapter.module, True)
    return Arc(engine, injector, removers, adapter)


def _end_setup(engine: ArcEngine, err: ArcSetupError) -> None:
    """End every rank of a job that cannot start (the error was agreed, so every rank is here): one line on the
    decision group's first rank, an error event, the engine closed (watchdog stopped), ``SystemExit(2)``."""
    message = f"arc_engine: cannot start: {err}"
    engine.emit_action(engine.progress.step, "setup_failed", Severity.ERROR, message, {"exit_code": EXIT_BAD_CONFIG},
                       detector="setup")
    engine.close()
    if engine.rank == engine.gathering.pipeline.leader:
        print(message, file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_CONFIG)


_ATTACHED = "_arc_engine_attached"


def _is_attached(module: Any) -> bool:
    try:
        return bool(vars(module).get(_ATTACHED, False))
    except TypeError:  # an object without a __dict__: no guard
        return False


def _mark_attached(module: Any, attached: bool) -> None:
    with contextlib.suppress(AttributeError, TypeError):  # an object without a __dict__: no guard
        object.__setattr__(module, _ATTACHED, attached)


def check_optimizer_owns(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that holds none of ``model``'s trainable parameters (built for another model, or for
    the parameters before FSDP2 replaced them): nothing would train and every NaN would look persistent."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    owned = {id(p) for group in internals.optimizer_param_groups(optimizer) for p in group["params"]}
    if trainable and not trainable & owned:
        raise ValueError(f"arc_engine.attach: the optimizer holds none of the model's {len(trainable)} trainable "
                         "parameters (built for another model, or before DDP/FSDP2 wrapped it? build the optimizer "
                         "from the model you pass to attach)")


def register_step_start(engine: ArcEngine, model: torch.nn.Module,
                        before: Callable[[], None] | None = None) -> Any:
    """A forward pre-hook that opens each step (:meth:`ArcEngine.on_step_start`), ahead of any hook a wrapper
    (FSDP2's all-gather) registered; ``before()`` (the adapter's) runs first at every training forward. A forward
    without gradients (an evaluation, a generation, a probe -- on some ranks only, between steps) is not a step: it
    runs nothing of arc_engine's, no collective. Returns the hook's remover."""

    def start(module: torch.nn.Module, args: object) -> None:
        if not torch.is_grad_enabled():
            return
        if before is not None:
            before()
        engine.on_step_start()

    handle = model.register_forward_pre_hook(start, prepend=True)
    return handle.remove

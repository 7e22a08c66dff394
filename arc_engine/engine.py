"""The ArcEngine: one commit point per monitored step.

Producers (integrations) write device-side statistics into the engine's :class:`StatBuffer`; at the optimizer
step the engine agrees on them across the whole job with one fixed-size reduction (:mod:`arc_engine.stats.pipeline`),
lets each monitor judge the same host arrays, asks the policy for one decision, reports it to the sinks, and tells
the integration what to do. Every rank of the decision group -- by default every rank of the job, so that
tensor-, pipeline- and expert-parallel peers of different data-parallel groups never part ways -- runs the same
code on the same numbers, so every rank takes the same action at the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from arc_engine import runtime
from arc_engine.config.schema import ArcConfig
from arc_engine.data_ledger import LEDGER_FILE, DataLedger, read_ledger
from arc_engine.diagnostics import curvature
from arc_engine.events import Action, Event, Finding, Severity
from arc_engine.lost_peers import LostPeerWatch
from arc_engine.monitors import Monitor, missing_stats
from arc_engine.monitors.family import (
    HOOKS,
    FamilyContext,
    ModelParts,
    MonitorFamily,
    Producer,
    StepView,
    section_of,
)
from arc_engine.monitors.registry import families
from arc_engine.own_work import OwnWork
from arc_engine.policy import ArcAbort, Decision, DecisionPolicy
from arc_engine.recovery.state import TrainState
from arc_engine.reporter import Reporter
from arc_engine.sinks import SinkSet
from arc_engine.sinks.wandb_sink import active_wandb_run
from arc_engine.stats import (
    AgreedStats,
    Reduce,
    StatBuffer,
    StatLayout,
    StatsPipeline,
    model_device,
    names,
    stats_device,
)
from arc_engine.stats.timing import ComputeProbe, SectionClock
from arc_engine.watchdog import AGREEING, LOSS_RECORDED, STEP_STARTED, HangWatchdog, ProgressBoard

if TYPE_CHECKING:
    from arc_engine.recovery.recompute import SDCRecompute
    from arc_engine.recovery.rollback import Recovery

log = logging.getLogger("arc_engine")


class ArcEngine:
    """Per-rank engine. Construct on every rank of ``group`` with the same arguments, then :meth:`start`.

    ``group``: the decision group: every rank of it agrees on each monitored step's statistics and takes the same
    action. None: the whole job (the default world group). A narrower group must still span every model-parallel
    peer of its ranks, or peers may take different actions.
    ``group_names``: names of the optimizer's parameter groups (G slots per gradient statistic).
    ``shard_reduce``: how ranks' gradient/weight/update slots combine: SUM for sharded optimizers (each rank holds
    its partition) and for DDP when each rank takes the parameters it owns (:mod:`arc_engine.stats.partition`);
    REPLICATED when every rank computes the whole value (the group's first rank's is used).
    ``params``: this rank's trainable parameters as the adapter holds them (what family producers may read).
    ``parts``: the model's structure as the adapter describes it (attention and router shards), for the families
    that monitor a mechanism. ``exact_sketch_size``: the local gradient's element count when the adapter can write
    it whole as the gradient sketch (DDP), else 0. ``local_grad_hooks``: tensor hooks on ``params`` see and replace
    each rank's local gradient before the reduction (DDP, ZeRO-1/2).

    The engine knows no monitor family: it registers the adapters' standard slots, then asks every enabled family
    (:mod:`arc_engine.monitors.registry`) for its statistics, producers and monitors.
    """

    def __init__(self, config: ArcConfig, *, group: dist.ProcessGroup | None = None,
                 group_names: list[str] | None = None, shard_reduce: Reduce = Reduce.REPLICATED,
                 sinks: SinkSet | None = None, params: Sequence[torch.Tensor] = (),
                 parts: ModelParts | None = None, exact_sketch_size: int = 0,
                 local_grad_hooks: bool = False) -> None:
        self.config = config
        self.group = group
        self.rank = runtime.global_rank()
        self.group_names = list(group_names or ["group0"])
        self.params = list(params)
        self.layout = StatLayout()
        for name, size, reduce in names.adapter_statistics(len(self.group_names), shard_reduce):
            self.layout.add(name, size, reduce)
        device = stats_device(group, config.stats.device, model_device(self.params))
        # stats.own_work: the engine's entry points and the families' producers timed as pieces (unchanged when off)
        self.own_work = OwnWork(config.stats.own_work, device)
        self.clock = SectionClock(device)  # this rank's forward and iteration times (families read them)
        #: this rank's sampled local compute time (set by the wiring when detectors.straggler wants it)
        self.probe: ComputeProbe | None = None
        #: the adapter's per-parameter partition views where the optimizer partitions parameters (DeepSpeed ZeRO):
        #: ``partition_parts(param)`` = (this rank's master values, its final gradient), see StepView
        self.partition_parts: Callable[[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor]]] | None = None
        self.local_events = 0  # this rank's system events so far (hang reports), for the families that count them
        self.families: list[tuple[MonitorFamily, FamilyContext]] = []
        self._max_dues: list[Callable[[int], bool] | None] = []  # per MAX statistic: its steps (None: every one)
        self.monitors: list[Monitor] = []
        self.producers: list[Producer] = []
        for family in families():
            context = FamilyContext(config, section_of(config, family), self.group_names, shard_reduce, parts,
                                    exact_sketch_size, local_grad_hooks)
            if not family.enabled(context):
                continue
            self.families.append((family, context))
            for decl in family.statistics(context):
                self.layout.add(decl.name, decl.size, decl.reduce, decl.group_size())
                if decl.reduce is Reduce.MAX:
                    self._max_dues.append(decl.due)
            self.monitors.extend(family.monitors(context))
            for producer in family.producers(context):
                if producer.hook not in HOOKS:
                    raise ValueError(f"monitor family {family.name!r}: producer hook {producer.hook!r} is not one "
                                     f"of {list(HOOKS)}")
                self.producers.append(dataclasses.replace(
                    producer, write=self.own_work.wrap(f"{family.name}.producer", producer.write)))
        #: the monitors that may scale a step's gradients (their ``gradient_coefficient(stats)``)
        self._stabilisers = [m.gradient_coefficient for m in self.monitors if hasattr(m, "gradient_coefficient")]
        #: the monitors that shape the update or a rollback (``detectors.fisher``): ``before_update(params, step)``
        #: in an applied optimizer step where ``updates_on(step)``; ``set_reference()``, ``before_restore()``,
        #: ``after_restore(step)`` from recovery
        self._shapers = [m for m in self.monitors if hasattr(m, "before_update")]
        #: the monitors that gather per-rank values on some steps (``rank_metrics()``, for ``ranks.jsonl``)
        self._rank_reporters = [m for m in self.monitors if hasattr(m, "rank_metrics")]
        self.policy = DecisionPolicy(config.policy)
        self.pipeline = StatsPipeline(self.layout, group, device)
        self.reporter = Reporter(config, self.rank, sinks)
        self.buffer: StatBuffer | None = None
        self.run_id = ""
        self.run_dir = Path(config.run.run_dir)
        self.step = 0            # optimizer steps of the training state (goes back on a rollback)
        self.iteration = 0       # step attempts, monotonic (faults and wall-clock reports use it)
        self.data_position = 0   # index of the next batch to train on, one per optimizer step
        self.ledger = DataLedger()  # the skipped and suspect data positions (arc_engine.data_ledger)
        self.applied_steps = 0   # steps whose update reached the parameters since the start (rewound on rollback)
        self.unapplied_steps = 0  # steps closed without their update (skips of any origin, a rollback's step)
        self._last_applied = True  # whether the last closed step's update was applied
        self.recovery: Recovery | None = None
        self.sdc_recompute: SDCRecompute | None = None  # see use_recompute (detectors.sdc.recompute)
        self.restat: Callable[[], None] | None = None    # the adapter's re-recording of reduced statistics
        #: adapters' queued per-bucket results, folded into the buffer once per step before the agreement
        self.folds: list[Callable[[], None]] = []
        self.recomputing = False  # True while recompute_fn runs: reduction-side hooks stand aside
        self.recomputed_losses: list[torch.Tensor] | None = None  # record_loss calls while recompute_fn runs
        self.locations: dict[int, str] = {}  # global rank -> "host:device" (gathered at start when SDC is on)
        self.lr_multipliers: list[Callable[[], float]] = []  # e.g. injected learning-rate faults
        #: called in every applied optimizer step before the update (e.g. injected optimizer-state faults)
        self.update_hooks: list[Callable[[list[dict[str, Any]], Mapping[Any, Any] | None], None]] = []
        #: asked once per step attempt for system events to add to ``local_events`` (e.g. injected hardware events)
        self.event_sources: list[Callable[[], int]] = []
        self._step_open = False
        self._diagnosing = False  # a diagnostic (curvature) runs the model between steps
        self.monitored_steps = 0
        self.last_decision: Decision | None = None
        self.last_stats: AgreedStats | None = None
        self._loss_count = 0
        self._sketch_due = (-1, False)  # (step, wants_sketch() on it)
        self.framework_skipped_steps = 0
        self._closed = False
        self.watchdog: HangWatchdog | None = None
        self.lost_peers: LostPeerWatch | None = None
        for piece in ("on_step_start", "record_loss", "decide", "finish_step", "skip_by_framework"):
            setattr(self, piece, self.own_work.wrap(piece, getattr(self, piece)))

    # ------------------------------------------------------------------ setup

    def start(self) -> ArcEngine:
        """Collective over the decision group (once): agree on the run id, freeze and verify the statistics layout,
        open sinks (on the group's first rank; W&B on one elected rank)."""
        self.run_id = runtime.agree_on_run_id(self.config.run.run_id, self.group)
        self.run_dir = Path(self.config.run.run_dir) / self.run_id
        # findings and alerts name the host and device of a rank
        self.locations = runtime.gather_locations(self.group)
        for monitor in self.monitors:
            on_start = getattr(monitor, "on_start", None)
            if on_start is not None:
                on_start(self.locations)
        wandb_cfg = self.config.sinks.wandb
        wandb_owner = False
        if wandb_cfg.enabled:  # one rank per job: the one holding the script's W&B run, else the lowest rank
            holds_run = wandb_cfg.reuse_run and active_wandb_run() is not None
            wandb_owner = runtime.elect_rank(holds_run, self.group) == self.rank
        for monitor in list(self.monitors):
            lacking = missing_stats(monitor, self.layout)
            if lacking:
                log.warning("arc_engine: monitor %s disabled: statistics %s are not produced", monitor.name, lacking)
                self.monitors.remove(monitor)
        self.buffer = self.pipeline.start()
        self._open_ledger()
        self.reporter.open(self.run_id, self.run_dir, leader=self.rank == self.pipeline.leader,
                           wandb_owner=wandb_owner, locations=self.locations)
        if self.config.watchdog.enabled:
            store = runtime.default_store()
            world = dist.get_world_size() if dist.is_initialized() else 1
            board = ProgressBoard(store, self.run_id, world) if store is not None else None
            watchdog = self.config.watchdog  # observe mode: a hang is alerted, the rank never ended
            if self.config.observing and watchdog.action == "abort":
                watchdog = dataclasses.replace(watchdog, action="alert")
            self.watchdog = HangWatchdog(watchdog, runtime.global_rank(), self.run_dir,
                                         self._watchdog_report, lambda: self.iteration, board=board,
                                         world_size=world, on_abort=self.reporter.close).start()
            if world > 1:  # a rank lost mid-step is named by the survivors (arc_engine.lost_peers)
                self.lost_peers = LostPeerWatch(self.watchdog).install()
        self.emit_lifecycle("start", f"arc_engine attached: {self.pipeline.num_ranks} ranks, monitors "
                            f"{[m.name for m in self.monitors]}, run dir {self.run_dir}")
        return self

    def _open_ledger(self) -> None:
        """Collective: the group's first rank reads the run directory's data ledger (a relaunch continues it) and
        shares it; it writes the new entries."""
        leader = self.rank == self.pipeline.leader
        path = self.run_dir / LEDGER_FILE
        entries: list[Any] = [[]]
        if leader:
            try:
                entries[0] = read_ledger(path)
            except (OSError, ValueError) as err:  # bad input loses nothing: start a new ledger beside it
                log.warning("arc_engine: the data ledger %s is unreadable (%s): not honoured", path, err)
        if self.pipeline.num_ranks > 1:
            dist.broadcast_object_list(entries, group_src=0, group=self.group)
        self.ledger.merge(entries[0])
        self.ledger.open(path if leader else None)

    def enable_recovery(self, state: TrainState) -> Recovery | None:
        """Attach the ARC rollback loop over ``state`` when ``recovery.enabled`` (after :meth:`start`).
        Collective: creates the checkpoint group and resumes from the newest committed checkpoint if configured.
        Call it before the integration's optimizer hooks exist (a resume may step a fresh optimizer once to
        materialize its state). Returns None when recovery is disabled."""
        if not self.config.recovery.enabled:
            return None
        from arc_engine.recovery.rollback import Recovery

        self.recovery = Recovery(self, state)
        self.policy.can_rollback = True
        self.recovery.start()
        return self.recovery

    def use_recompute(self, recompute: SDCRecompute, restat: Callable[[], None]) -> None:
        """Resolve withheld gradients and update-RMS flags by recomputation (``detectors.sdc.recompute``; set by the
        adapter at install). ``restat`` re-records the reduced-gradient statistics after a correction."""
        self.sdc_recompute, self.restat = recompute, restat

    def use_partition_parts(self, parts: Callable[[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor]]]
                            ) -> None:
        """Where the optimizer partitions the parameters, the adapter's per-parameter view of this rank's part:
        ``parts(param)`` = (master values, final gradient) pieces (families read it through
        :attr:`StepView.partition_parts`)."""
        self.partition_parts = parts

    def add_lr_multiplier(self, multiplier: Callable[[], float]) -> None:
        """Multiply each step's learning rate by ``multiplier()`` (e.g. an injected learning-rate fault)."""
        self.lr_multipliers.append(multiplier)

    def add_update_hook(self, hook: Callable[[list[dict[str, Any]], Mapping[Any, Any] | None], None]) -> None:
        """Call ``hook(param_groups, state)`` in every applied optimizer step, after the step's checks and decision
        and before the update (:func:`arc_engine.recovery.heal.heal_step`), with the optimizer's parameter groups
        and its state keyed by their parameters (None where the integration has none). Local; e.g. injected
        optimizer-state and collective faults. Without one, the step walks no parameter list for it."""
        self.update_hooks.append(hook)

    def add_event_source(self, source: Callable[[], int]) -> None:
        """Add ``source()`` to :attr:`local_events` once per step attempt, at its start (:meth:`on_step_start`):
        system events of this rank that the families counting them (the R-Metric's λ) see. Local; e.g. injected
        hardware events."""
        self.event_sources.append(source)

    def on_step_start(self) -> None:
        """Call at the first forward pass of each step, on every rank (the integrations do, from a forward
        pre-hook). Carries out a pending rollback or takes a due snapshot (a no-op without recovery), and counts
        the event sources' new system events; once per step attempt."""
        if self._step_open or self._diagnosing:  # (a diagnostic's forward pass is not a step)
            return
        self._step_open = True
        self.clock.start()
        if self.probe is not None:
            self.probe.start(self.step)
        if self.watchdog is not None:
            self.watchdog.reached(STEP_STARTED)
        if self.recovery is not None:  # a rollback's restore or a snapshot is not a hang
            with self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext():
                self.recovery.on_step_start()
        if self.sdc_recompute is not None:
            self.sdc_recompute.capture()
        for source in self.event_sources:
            self.local_events += source()

    def _watchdog_report(self, kind: str, message: str, values: dict[str, Any]) -> None:
        """From the watchdog thread: a hang or a lost rank (critical), or a hang's end or the job stopped by its
        launcher (info), through this rank's sinks."""
        severity = Severity.CRITICAL if kind == "hang" else Severity.INFO
        self.local_events += int(kind == "hang")
        self.reporter.emit(Event(self.run_id, self.step, "detection", "hang", severity, "none", message,
                                 (self.rank,), values, iteration=self.iteration))

    # ------------------------------------------------------------------ per step

    def is_monitored(self) -> bool:
        """Whether the current step gathers statistics (every ``stats.interval`` steps)."""
        return self.step % self.config.stats.interval == 0

    def wants_optimizer_stats(self) -> bool:
        """Whether the adapters compute the prospective update RMS on the current step: a monitored step on which
        some family asks for it (the SDC rule: every monitored step; otherwise ``stats.optimizer_stats_every``)."""
        return self.is_monitored() and any(family.optimizer_stats_due(context, self.step)[0]
                                           for family, context in self.families)

    def wants_weight_stats(self) -> bool:
        """Whether the adapters also compute weight norms on the current step (some family asks; the SDC rule does
        not, so it does not make them run every step)."""
        return self.is_monitored() and any(family.optimizer_stats_due(context, self.step)[1]
                                           for family, context in self.families)

    def wants_sketch(self) -> bool:
        """Whether the adapters add the local gradient sketch (``grad_sketch_local``) on the current step: a
        monitored step on which some family asks for it. Cached per step (the adapters ask once per bucket)."""
        if self._sketch_due[0] != self.step:
            due = names.GRAD_SKETCH_LOCAL in self.layout and self.is_monitored() and any(
                getattr(family, "sketch_due", None) is not None and family.sketch_due(context, self.step)
                for family, context in self.families)
            self._sketch_due = (self.step, due)
        return self._sketch_due[1]

    def record_loss(self, loss: torch.Tensor) -> None:
        """Record this rank's loss for the current step (call once per micro-batch; the mean is used).

        Device-side only, no host sync. Any rank may record a NaN: the gathered verdict stays agreed. While an SDC
        recomputation re-runs the step, the losses go to the recomputation instead (they replace this rank's loss
        before any detector judges the corrected step).
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"record_loss expects the loss as a torch.Tensor (one number, e.g. the micro-batch's "
                            f"mean loss); got {type(loss).__name__}")
        if self.recomputing:
            if self.recomputed_losses is not None:
                self.recomputed_losses.append(loss.detach().float().reshape(()))
            return
        if self.watchdog is not None:
            self.watchdog.reached(LOSS_RECORDED)
        self.clock.loss()  # on every step: on CUDA a monitored step reads the previous step's marks
        if self.buffer is None or not self.is_monitored():
            return
        self.buffer.add(names.LOSS, loss.detach().float())
        self._loss_count += 1

    def record_validation_loss(self, loss: float | torch.Tensor) -> None:
        """Record a validation loss (after an evaluation, on the ranks that computed one; a tensor is read to the
        host here). Local: it travels with the next monitored step's agreement to the monitors that take it (the
        R-Metric's ΔL, which then uses the mean over the ranks that recorded one instead of the training loss)."""
        value = float(loss.detach().float().reshape(())) if isinstance(loss, torch.Tensor) else float(loss)
        for monitor in self.monitors:
            take = getattr(monitor, "record_validation_loss", None)
            if take is not None:
                take(value)

    @property
    def micro_batches_recorded(self) -> int:
        """Losses recorded so far in the current step (the running micro-batch's index + 1)."""
        return self._loss_count

    def decide(self, extra_findings: tuple[Finding, ...] = (), only: tuple[str, ...] | None = None, *,
               overflow: Finding | None = None,
               overflow_if_nonfinite: Callable[[], Finding] | None = None) -> Decision:
        """Collective on monitored steps: gather, judge, decide, report. Call once per optimizer step on every
        rank, after gradients are reduced and before they are applied. Raises :class:`ArcAbort` (on every rank)
        when the decision is ABORT. On unmonitored steps returns a no-op decision without communicating.

        ``extra_findings``: verdicts from outside the monitors, identical on every rank (e.g. the framework
        skipped the step); ``only``: names of the monitors to run (None: all), for steps whose statistics are
        partial. ``overflow``: the framework's dynamic loss scaler skipped this step (the finding says so);
        ``overflow_if_nonfinite``: it skips the step itself when the agreed gradient is non-finite (a fused
        optimizer that reads the scaler's verdict on the device), and this makes the finding. Either way a skip
        for non-finite gradients at a finite loss counts as the scaler's routine overflow
        (:class:`~arc_engine.policy.DecisionPolicy`)."""
        assert self.buffer is not None, "ArcEngine.start() was not called"
        if not self.is_monitored():
            return Decision(self.step, Action.NONE)
        if self._loss_count:
            self.buffer.view(names.LOSS).div_(self._loss_count)
        self.buffer.put(names.LOSS_COUNT, float(self._loss_count))
        self.buffer.put(names.LOSS_RANKS, float(self._loss_count > 0))
        stats = self._agree()
        extra = list(extra_findings)
        recompute = self.sdc_recompute
        resolved = recompute is not None and only is None and recompute.needs_resolution(stats)
        if resolved:  # some rank withheld its gradient: recompute there, correct, judge the corrected step
            extra += recompute.resolve(stats)
            stats = self._regather()
        monitors = [m for m in self.monitors if only is None or m.name in only]
        findings = [f for monitor in monitors for f in monitor.evaluate(self.step, stats)]
        if recompute is not None and only is None and not resolved and recompute.wants_recompute_all(findings):
            first = [dataclasses.replace(f, action=Action.WARN, message=f"before recomputing: {f.message}")
                     for f in findings]  # on record; the verdict on the recomputed step decides
            extra += [*first, *recompute.recompute_all()]
            stats = self._regather()
            findings = [f for monitor in monitors for f in monitor.evaluate(self.step, stats)]
        self.last_stats = stats
        if overflow is None and overflow_if_nonfinite is not None and _gradient_nonfinite(stats):
            overflow = overflow_if_nonfinite()
        if overflow is not None:
            extra.append(overflow)
        findings += extra
        findings = self._with_data_positions(findings)
        routine = overflow is not None and _loss_finite(stats)
        decision = self.policy.decide(self.step, findings, overflow=routine)
        if self.recovery is not None:
            decision = self.recovery.on_decision(decision)
        decision = _with_exit_code(decision)
        self.last_decision = decision
        self._ledger(decision)
        self._report(decision)
        self.reporter.metrics(self.step, self.monitors, {"arc/skipped_steps": float(self.policy.skipped_steps),
                                                         "arc/iteration": float(self.iteration)})
        if self._rank_reporters:
            self.reporter.rank_metrics(self.step, self.iteration, self._rank_reporters)
        self._abort_if_needed(decision, commit_monitors=True)
        return decision

    def _with_data_positions(self, findings: list[Finding]) -> list[Finding]:
        """``bad_data`` findings with the data position this step consumed; plus, where the data ledger skipped
        this position for bad data before (a resumed or replaying run), the finding that skips it again."""
        position = self.data_position
        out = [dataclasses.replace(f, message=f"{f.message} (data position {position})",
                                   values={**f.values, "data_position": position}) if f.bad_data else f
               for f in findings]
        known = self.ledger.bad(position)
        if known is not None and not any(f.bad_data for f in out):
            ranks = tuple(known["ranks"])
            whose = f" on rank {', '.join(map(str, ranks))}" if ranks else ""
            out.append(Finding("data_ledger", Action.SKIP, Severity.WARNING,
                               f"data position {position} was skipped for bad data{whose} at step {known['step']} "
                               f"(data ledger): skipped again", ranks=ranks, bad_data=True,
                               values={"data_position": position, "first_step": known["step"]}))
        return out

    def _ledger(self, decision: Decision) -> None:
        """Record the step's batch when its update is not applied or a finding blames it (identical on every
        rank; the group's first rank writes the file)."""
        blamed = [f for f in decision.findings if f.bad_data]
        if decision.applies_update and not blamed:
            return
        causes = [f for f in decision.findings if f.action >= Action.SKIP] or blamed
        dropped = decision.applies_update and any(f.data_dropped for f in blamed)
        self.ledger.record(first=self.data_position, step=self.step, iteration=self.iteration,
                           action="dropped" if dropped else decision.action.name.lower(), bad_data=bool(blamed),
                           ranks=[r for f in blamed for r in f.ranks], detectors=[f.detector for f in causes],
                           reason=(blamed or causes)[0].message if (blamed or causes) else "")

    def _agree(self) -> AgreedStats:
        """Collective: run the families' producers and let monitors write what only they know of this rank (before
        the reduction), then agree."""
        assert self.buffer is not None
        for fold in self.folds:
            fold()
        if self.producers:
            view = StepView(self.step, self.params, self.clock.times(), self.local_events,
                            tuple(self.probe.take()) if self.probe is not None else (), self.partition_parts)
            for producer in self.producers:
                producer.write(self.buffer, view)
        for monitor in self.monitors:
            prepare = getattr(monitor, "before_agreement", None)
            if prepare is not None:
                with self.own_work.section(f"{monitor.name}.before_agreement"):
                    prepare(self.buffer)
        if self.watchdog is not None:  # a peer's hang report shows this rank as waiting for the others
            self.watchdog.reached(AGREEING)
        with self.own_work.section("agree"):
            return self.pipeline.agree(self.buffer, reduce_max=self._max_due())

    def _max_due(self) -> bool:
        """Whether this step's agreement reduces the MAX slots (any of them due; agreed: a function of the step)."""
        return any(due is None or due(self.step) for due in self._max_dues)

    def _regather(self) -> AgreedStats:
        """Collective: after a correction of the reduced gradient, re-record the reduced statistics (keeping the
        pre-reduction ones, except a recomputing rank's own) and agree again."""
        assert self.buffer is not None and self.restat is not None
        for name in names.REDUCED_GRADIENT_SLOTS:
            if name in self.layout:
                self.buffer.view(name).zero_()
        if self.sdc_recompute is not None:
            self.sdc_recompute.write_local_stats(self.buffer)
        self.restat()
        return self._agree()

    def log_warning(self, message: str) -> None:
        """A local warning through Python logging (e.g. a recomputation that raised on this rank)."""
        log.warning("arc_engine rank %d: %s", self.rank, message)

    def _abort_if_needed(self, decision: Decision, *, commit_monitors: bool) -> None:
        if decision.action != Action.ABORT:
            return
        if commit_monitors:
            self._commit(decision)
        else:
            self.policy.commit(decision)
        reasons = [f.message for f in decision.findings if f.detector in ("policy", "recovery")]
        reason = "; ".join(reasons) or next((f.message for f in reversed(decision.findings)
                                             if f.action == Action.ABORT), "abort")
        self.close()
        raise ArcAbort(f"arc_engine stopped training at step {self.step}: {reason}", self.step, decision.exit_code)

    def skip_by_framework(self, finding: Finding, *, overflow: bool = False) -> None:
        """Close the current (unmonitored) step as one the training framework itself did not apply (e.g. DeepSpeed's
        overflow check). Local: call it only with facts every rank shares (the framework's own agreed verdict). The
        finding goes through the policy, so a run of such skips escalates like any other (``finding.action`` SKIP),
        or, with ``overflow`` (a dynamic loss scaler's), past ``policy.max_consecutive_overflow_skips``. No monitor
        folds this step into its baseline. Raises ArcAbort on escalation."""
        decision = self.policy.decide(self.step, [finding], overflow=overflow)
        if self.recovery is not None:
            decision = self.recovery.on_decision(decision)
        self.last_decision = decision
        self._report(decision)
        self._abort_if_needed(decision, commit_monitors=False)
        self.policy.commit(decision)
        self._observe(decision)
        self.framework_skipped_steps += 1
        self._close_step(decision)

    def finish_step(self, *, framework_skipped: bool = False) -> None:
        """Close the current step (after the optimizer step ran or was skipped; ``framework_skipped``: the framework
        skipped it on its own after a decision was taken). Local, no communication."""
        self.framework_skipped_steps += int(framework_skipped)
        decision = self.last_decision if self.last_decision and self.last_decision.step == self.step else None
        if decision is not None:
            self._commit(decision)
        self._close_step(decision)

    def _close_step(self, decision: Decision | None) -> None:
        if self.buffer is not None:
            self.buffer.reset()
        self._loss_count = 0
        self._step_open = False
        self.step += 1
        self.iteration += 1
        self.data_position += 1
        applied = decision is None or decision.applies_update
        self._last_applied = applied
        self.applied_steps += int(applied)
        self.unapplied_steps += int(not applied)
        if self.recovery is not None:
            self.recovery.on_step_end(decision)
        if self.watchdog is not None:
            self.watchdog.heartbeat()
        self.own_work.end_step()

    def measure_curvature(self, loss_fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor]
                          ) -> dict[str, float]:
        """``diagnostics.curvature``, collective over the decision group: each rank measures the loss's Hessian
        trace, largest eigenvalue and SAM sharpness with ``loss_fn`` (its held micro-batch) at ``params``
        (:func:`arc_engine.diagnostics.curvature.measure`); the ranks agree on whether every one succeeded (an error
        on any rank raises on every rank) and average the values. Reported as a ``curvature`` event and metrics
        (``arc/curvature/...``). Between steps, outside the hang watchdog's count."""
        config = self.config.diagnostics.curvature
        keys = ("loss", "hessian_trace", "lambda_max", "sam_sharpness")
        local: dict[str, float] | None = None
        error: Exception | None = None
        self._diagnosing = True
        try:
            with self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext():
                local = curvature.measure(loss_fn, params, probes=config.probes, iterations=config.power_iterations,
                                          rho=config.sam_rho, seed=config.seed * 1_000_003 + self.step)
        except Exception as err:  # agreed below: every rank raises, none waits alone in the reduction
            error = err
        finally:
            self._diagnosing = False
        runtime.raise_on_every_rank(error, self.group, "measuring curvature")
        assert local is not None
        values = torch.tensor([local[key] for key in keys], dtype=torch.float64, device=self.pipeline.device)
        ranks = 1
        if dist.is_available() and dist.is_initialized():
            ranks = dist.get_world_size(self.group)
            if ranks > 1:
                dist.all_reduce(values, group=self.group)
                values /= ranks
        result = dict(zip(keys, values.tolist(), strict=True))
        self.emit_lifecycle("curvature", f"Hessian trace {result['hessian_trace']:.4g}, largest eigenvalue "
                            f"{result['lambda_max']:.4g}, SAM sharpness {result['sam_sharpness']:.4g} at loss "
                            f"{result['loss']:.4g} (mean over {ranks} rank(s))", {**result, "ranks": ranks})
        if self.reporter.emits:
            self.reporter.sinks.log_metrics(self.step, {f"arc/curvature/{k}": v for k, v in result.items()})
        return result

    def gradient_coefficient(self) -> float:
        """What the integrations multiply this step's gradients by before the update (1.0 in normal training):
        recovery's healing clip times the monitors' stabilisation (``gradient_coefficient(stats)`` of a monitor,
        e.g. ``detectors.dynamics.stabilize``), all from this step's agreed statistics, so every rank scales alike."""
        coefficient = self.recovery.clip_coefficient() if self.recovery is not None else 1.0
        stats, decision = self.last_stats, self.last_decision
        if not self._stabilisers or stats is None or decision is None or decision.step != self.step:
            return coefficient
        for stabilise in self._stabilisers:
            coefficient *= stabilise(stats)
        return coefficient

    @property
    def shaping(self) -> bool:
        """Whether a monitor shapes updates or rollbacks (:meth:`before_update`)."""
        return bool(self._shapers)

    def before_update(self, param_groups: list[dict[str, Any]]) -> None:
        """In an applied optimizer step, before the update, with the optimizer's parameter groups (the tensors it
        steps, their gradients final): the shaping monitors that have work on this step (``updates_on(step)``) read
        or add to the gradients (``detectors.fisher``: the Fisher estimate, the EWC penalty). Local; the parameter
        list is walked only on such a step."""
        due = [monitor for monitor in self._shapers if monitor.updates_on(self.step)]
        if not due:
            return
        params = [p for group in param_groups for p in group["params"]]
        for monitor in due:
            monitor.before_update(params, self.step)

    def set_reference(self) -> None:
        """The live state is the one training continues from safely: a snapshot recovery just verified (before the
        update), or the state an escape left (local)."""
        for monitor in self._shapers:
            monitor.set_reference()

    def before_restore(self) -> None:
        """Recovery is about to restore a snapshot over the live state (local)."""
        for monitor in self._shapers:
            monitor.before_restore()

    def after_restore(self) -> bool:
        """Recovery restored a snapshot (training resumes from :attr:`step`): the shaping monitors may edit the
        stepped tensors (the importance-weighted rollback). True when one did; the same on every rank."""
        edited = False
        for monitor in self._shapers:
            edited = monitor.after_restore(self.step) or edited
        return edited

    def step_lr_factor(self) -> float:
        """What the integrations multiply this step's learning rate by (and undo after the step): recovery's
        healing factor times any registered multiplier. 1.0 in normal training."""
        factor = self.recovery.lr_factor if self.recovery is not None else 1.0
        for multiplier in self.lr_multipliers:
            factor *= multiplier()
        return factor

    def rewind(self, step: int, data_position: int, applied_steps: int | None = None) -> None:
        """Set the step counter and data position (and, where the restored state recorded it, the count of applied
        steps) after a rollback or resume (local; every rank does the same)."""
        self.step = step
        self.data_position = data_position
        if applied_steps is not None:
            self.applied_steps = int(applied_steps)

    @property
    def last_step_applied(self) -> bool:
        """False when the previous step's update was skipped (e.g. to gate an LR-scheduler step)."""
        return self._last_applied

    def _report(self, decision: Decision) -> None:
        skipped = self.policy.skipped_steps + int(decision.action == Action.SKIP and not decision.overflow)
        self.reporter.decision(decision, self.iteration, skipped)

    def _commit(self, decision: Decision) -> None:
        applied = decision.applies_update
        for monitor in self.monitors:
            monitor.commit(decision.step, applied)
        self.policy.commit(decision)
        self._observe(decision)
        self.monitored_steps += 1

    def _observe(self, decision: Decision) -> None:
        """Show the step's agreed decision (every finding, the framework's own skips included) to the monitors that
        count events (``observe(decision)``, e.g. the R-Metric's λ). Local; identical on every rank."""
        for monitor in self.monitors:
            observe = getattr(monitor, "observe", None)
            if observe is not None:
                observe(decision)

    # ------------------------------------------------------------------ reporting

    @property
    def sinks(self) -> SinkSet:
        """This rank's sinks (add one of your own with ``engine.sinks.add(sink)``)."""
        return self.reporter.sinks

    @property
    def wandb_owner(self) -> bool:
        return self.reporter.wandb_owner

    @property
    def event_counts(self) -> Counter[str]:
        return self.reporter.event_counts

    def emit_lifecycle(self, what: str, message: str, values: dict[str, Any] | None = None) -> None:
        """Report a lifecycle event (resume, checkpoint, ...) through this rank's sinks (:mod:`arc_engine.reporter`)."""
        self.reporter.lifecycle(self.step, self.iteration, what, message, values)

    def emit_action(self, step: int, action: str, severity: Severity, message: str, values: dict[str, Any], *,
                    detector: str = "recovery") -> None:
        """Report an action taken by a subsystem (``recovery``: rollback, escape; ``checkpoint``: a failed save, a
        fallback, the disk tier turned off) for ``step``."""
        self.reporter.emit(Event(self.run_id, step, "action", detector, severity, action, message, (), values,
                                 iteration=self.iteration))

    def emit_finding(self, finding: Finding) -> None:
        """Report a finding made outside the per-step path (e.g. by an on-demand diagnostic)."""
        self.reporter.finding(self.step, self.iteration, finding)

    def summary(self) -> dict[str, Any]:
        """Counts for the end-of-run report (identical on every rank)."""
        summary = {"steps": self.step, "iterations": self.iteration, "monitored_steps": self.monitored_steps,
                   "skipped_steps": self.policy.skipped_steps,
                   "framework_skipped_steps": self.framework_skipped_steps, "detections": dict(self.event_counts),
                   "collectives": self.pipeline.collectives, "detail_fetches": self.pipeline.detail_fetches,
                   "follow_ups": self.pipeline.follow_ups, "run_dir": str(self.run_dir)}
        if self.recovery is not None:
            summary["recovery"] = self.recovery.summary()
        if self.own_work.enabled:
            report = self.own_work.report()
            summary["own_work"] = {"host_ms": report.host_ms, "device_ms": report.device_ms,
                                   "step_ms": report.step_ms, "fraction": report.fraction, "pieces": report.pieces}
        return summary

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Emit the summary and close the sinks (idempotent, local)."""
        if self._closed:
            return
        self._closed = True
        if self.probe is not None:
            self.probe.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.lost_peers is not None:
            self.lost_peers.remove()
        if self.recovery is not None:
            self.recovery.close()
        summary = self.summary()
        if self.own_work.enabled:  # stats.own_work: the per-piece table, one line per piece
            lines = self.own_work.report().lines()
            for line in lines:
                log.info("arc_engine rank %d: %s", self.rank, line)
            self.emit_lifecycle("own_work", f"rank {self.rank}: {lines[0]}", summary["own_work"])
        detections = ", ".join(f"{k}={v}" for k, v in sorted(summary["detections"].items())) or "none"
        self.emit_lifecycle("summary", f"{summary['steps']} steps, {summary['skipped_steps']} skipped, "
                            f"detections: {detections}", summary)
        self.reporter.close()

    # ------------------------------------------------------------------ state

    def monitor_state_dict(self) -> dict[str, Any]:
        """The detectors' baselines (what a rollback restores with the training state)."""
        return {m.name: m.state_dict() for m in self.monitors}

    def load_monitor_state_dict(self, state: dict[str, Any]) -> None:
        for monitor in self.monitors:
            if monitor.name in state:
                monitor.load_state_dict(state[monitor.name])

    def counters_state_dict(self) -> dict[str, Any]:
        """Cumulative counters a rollback keeps but a restart restores."""
        return {"iteration": self.iteration, "monitored_steps": self.monitored_steps,
                "framework_skipped_steps": self.framework_skipped_steps, "policy": self.policy.state_dict(),
                "unapplied_steps": self.unapplied_steps,
                "event_counts": dict(self.event_counts), "data_ledger": self.ledger.state_dict()}

    def load_counters_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.monitored_steps = int(state["monitored_steps"])
        self.framework_skipped_steps = int(state["framework_skipped_steps"])
        self.unapplied_steps = int(state.get("unapplied_steps", 0))
        self.policy.load_state_dict(state["policy"])
        self.reporter.event_counts = Counter(state.get("event_counts", {}))
        self.ledger.load_state_dict(state.get("data_ledger", {}))

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume monitoring exactly (step counter, data position, policy, every monitor)."""
        return {"step": self.step, "data_position": self.data_position, "applied_steps": self.applied_steps,
                "monitors": self.monitor_state_dict(), **self.counters_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rewind(int(state["step"]), int(state.get("data_position", state["step"])),
                    state.get("applied_steps", state["step"]))
        self.load_monitor_state_dict(state["monitors"])
        self.load_counters_state_dict({"iteration": state["step"], "framework_skipped_steps": 0, **state})


def _loss_finite(stats: AgreedStats) -> bool:
    """Whether the agreed loss (summed over the ranks that recorded one) is finite."""
    return names.LOSS not in stats.layout or bool(np.isfinite(stats.total(names.LOSS)).all())


def _gradient_nonfinite(stats: AgreedStats) -> bool:
    """Whether any rank's local gradient or the reduced gradient holds NaN/Inf."""
    counts = stats.total(names.GRAD_NONFINITE_LOCAL)
    return bool((counts > 0).any() or not np.isfinite(counts).all()
                or not np.isfinite(stats.total(names.GRAD_SQ)).all())


def _with_exit_code(decision: Decision) -> Decision:
    """An ABORT takes the exit code a finding asks for (e.g. a faulty device), else keeps the policy's."""
    if decision.action != Action.ABORT:
        return decision
    codes = [f.values["exit_code"] for f in decision.findings if f.action == Action.ABORT and "exit_code" in f.values]
    return dataclasses.replace(decision, exit_code=int(codes[0])) if codes else decision

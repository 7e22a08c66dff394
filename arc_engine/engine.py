"""The ArcEngine: one commit point per monitored step.

Producers write device-side statistics into the step's buffer; at the optimizer step the engine agrees on them
across the decision group with one fixed-size reduction, lets every monitor judge the same host arrays, asks the
policy for one decision, reports it and tells the integration what to do. Every rank runs the same code on the same
numbers, so every rank takes the same action at the same step. The engine knows no monitor family
(:mod:`arc_engine.monitors.assembly`) and no recovery mechanism (:mod:`arc_engine.step_hooks`).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from arc_engine import runtime
from arc_engine.config.schema import ArcConfig
from arc_engine.data_ledger import LEDGER_FILE, DataLedger
from arc_engine.events import Action, Event, Finding, Severity
from arc_engine.lost_peers import LostPeerWatch
from arc_engine.monitors import missing_stats
from arc_engine.monitors.assembly import assemble
from arc_engine.monitors.family import ModelParts, StepView
from arc_engine.monitors.hooks import MonitorHooks
from arc_engine.own_work import OwnWork
from arc_engine.policy import ArcAbort, Decision, DecisionPolicy
from arc_engine.policy.decision import gradient_nonfinite, loss_finite, with_exit_code
from arc_engine.progress import Counted, Progress
from arc_engine.reporter import Reporter
from arc_engine.sinks import SinkSet
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, StatLayout, StatsPipeline, names
from arc_engine.stats.pipeline import model_device, stats_device
from arc_engine.stats.timing import ComputeProbe, SectionClock
from arc_engine.step_hooks import Recovering, StatsResolver, StepHooks
from arc_engine.watchdog import AGREEING, LOSS_RECORDED, STEP_STARTED, HangWatchdog, start_watchdog

log = logging.getLogger("arc_engine")

PartitionParts = Callable[[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor]]]


class ArcEngine:
    """Per-rank engine. Construct on every rank of ``group`` (the decision group; None: the whole job) with the
    same arguments, then :meth:`start`. The adapter says how its statistics combine (``shard_reduce``), which
    parameters this rank holds (``params``), the model's structure (``parts``), whether it can write the local
    gradient whole as the sketch (``exact_sketch_size``) and whether tensor hooks see local gradients
    (``local_grad_hooks``)."""

    step, iteration, data_position, applied_steps = Counted(), Counted(), Counted(), Counted()
    unapplied_steps, monitored_steps, framework_skipped_steps = Counted(), Counted(), Counted()

    def __init__(self, config: ArcConfig, *, group: dist.ProcessGroup | None = None,
                 group_names: list[str] | None = None, shard_reduce: Reduce = Reduce.REPLICATED,
                 sinks: SinkSet | None = None, params: Sequence[torch.Tensor] = (),
                 parts: ModelParts | None = None, exact_sketch_size: int = 0,
                 local_grad_hooks: bool = False) -> None:
        self.config, self.group, self.rank = config, group, runtime.global_rank()
        self.group_names = list(group_names or ["group0"])
        self.params = list(params)
        self.layout = StatLayout()
        for name, size, reduce in names.adapter_statistics(len(self.group_names), shard_reduce):
            self.layout.add(name, size, reduce)
        device = stats_device(group, config.stats.device, model_device(self.params))
        self.own_work = OwnWork(config.stats.own_work, device)  # stats.own_work: arc_engine's own time, by piece
        self.clock = SectionClock(device)  # this rank's forward and iteration times (families read them)
        self.assembly = assemble(config, self.layout, group_names=self.group_names, shard_reduce=shard_reduce,
                                 parts=parts, exact_sketch_size=exact_sketch_size,
                                 local_grad_hooks=local_grad_hooks, wrap=self.own_work.wrap,
                                 current_step=lambda: self.step)
        self.monitors = self.assembly.monitors
        self.hooks = MonitorHooks()  # the monitors' optional methods, gathered at start
        self.policy = DecisionPolicy(config.policy)
        self.pipeline = StatsPipeline(self.layout, group, device)
        self.reporter = Reporter(config, self.rank, sinks)
        self.buffer: StatBuffer | None = None
        self.run_id, self.run_dir = "", Path(config.run.run_dir)
        self.progress = Progress()  # step, iteration, data position, applied steps... (the Counted attributes)
        self.local_events = 0     # this rank's system events so far (hang reports, injected events)
        self.ledger = DataLedger()  # the skipped and suspect data positions
        self.locations: dict[int, str] = {}  # global rank -> "host:device"
        self.recovery: Recovering | None = None
        self.sdc_recompute: StatsResolver | None = None
        self.probe: ComputeProbe | None = None
        self.partition_parts: PartitionParts | None = None  # where the optimizer partitions parameters (ZeRO)
        self.lr_multipliers: list[Callable[[], float]] = []
        self.update_hooks: list[Callable[[list[dict[str, Any]], Mapping[Any, Any] | None], None]] = []
        self.event_sources: list[Callable[[], int]] = []
        self.last_decision: Decision | None = None
        self.last_stats: AgreedStats | None = None
        self.watchdog: HangWatchdog | None = None
        self.lost_peers: LostPeerWatch | None = None
        self._step_hooks: list[StepHooks] = []
        self._folds: list[Callable[[], None]] = []
        self._restat: Callable[[], None] | None = None
        self._recomputed: list[torch.Tensor] | None = None  # record_loss while a recomputation runs
        self._step_open = self._diagnosing = self._closed = False
        self._loss_count = 0
        self._sketch_due = (-1, False)  # (step, wants_sketch() on it)
        for method in (self.on_step_start, self.record_loss, self.decide, self.finish_step, self.skip_by_framework):
            setattr(self, method.__name__, self.own_work.wrap(method.__name__, method))

    # ------------------------------------------------------------------ setup

    def start(self) -> ArcEngine:
        """Collective over the decision group (once): agree on the run id, freeze and verify the statistics layout,
        read the data ledger, open sinks (on the group's first rank; W&B on one elected rank), start the
        watchdog."""
        self.run_id = runtime.agree_on_run_id(self.config.run.run_id, self.group)
        self.run_dir = Path(self.config.run.run_dir) / self.run_id
        self.locations = runtime.gather_locations(self.group)
        for monitor in list(self.monitors):
            lacking = missing_stats(monitor, self.layout)
            if lacking:
                log.warning("arc_engine: monitor %s disabled: statistics %s are not produced", monitor.name, lacking)
                self.monitors.remove(monitor)
        self.hooks = MonitorHooks.gather(self.monitors)
        for on_start in self.hooks.on_start:
            on_start(self.locations)
        self.buffer = self.pipeline.start()
        leader = self.rank == self.pipeline.leader
        self.ledger.open_shared(self.run_dir / LEDGER_FILE, leader=leader, group=self.group,
                                num_ranks=self.pipeline.num_ranks)
        self.reporter.open(self.run_id, self.run_dir, leader=leader, group=self.group, locations=self.locations)
        if self.config.watchdog.enabled:
            self.watchdog = start_watchdog(self.config.watchdog, observing=self.config.observing,
                                           run_id=self.run_id, run_dir=self.run_dir, report=self._watchdog_report,
                                           iteration=lambda: self.iteration, on_abort=self.reporter.close)
            if self.watchdog.world_size > 1:  # a rank lost mid-step is named by the survivors
                self.lost_peers = LostPeerWatch(self.watchdog).install()
        self.emit_lifecycle("start", f"arc_engine attached: {self.pipeline.num_ranks} ranks, monitors "
                            f"{[m.name for m in self.monitors]}, run dir {self.run_dir}")
        return self

    def use_recovery(self, recovery: Recovering) -> None:
        """The rollback loop decides with the policy from now on (``recovery.enabled``; set by the wiring)."""
        self.recovery = recovery
        self.policy.can_rollback = True
        self._step_hooks.insert(0, recovery)

    def use_recompute(self, resolver: StatsResolver, restat: Callable[[], None]) -> None:
        """Resolve the statistics of suspect steps with ``resolver`` (``detectors.sdc.recompute``); ``restat``
        re-records the reduced-gradient statistics after a correction."""
        self.sdc_recompute, self._restat = resolver, restat
        self._step_hooks.append(resolver)

    def use_probe(self, probe: ComputeProbe) -> None:
        """A sampled local compute time, read into each monitored step's :class:`StepView` (``compute``)."""
        self.probe = probe
        self._step_hooks.append(probe)

    def use_partition_parts(self, parts: PartitionParts) -> None:
        """Where the optimizer partitions the parameters: ``parts(param)`` = this rank's (master values, final
        gradient) pieces, for the families (:attr:`StepView.partition_parts`)."""
        self.partition_parts = parts

    def add_fold(self, fold: Callable[[], None]) -> None:
        """``fold()`` runs once per monitored step before the agreement (an adapter's queued per-bucket results)."""
        self._folds.append(fold)

    def add_lr_multiplier(self, multiplier: Callable[[], float]) -> None:
        """Multiply each step's learning rate by ``multiplier()`` (e.g. an injected learning-rate fault)."""
        self.lr_multipliers.append(multiplier)

    def add_update_hook(self, hook: Callable[[list[dict[str, Any]], Mapping[Any, Any] | None], None]) -> None:
        """``hook(param_groups, state)`` in every applied optimizer step before the update
        (:func:`arc_engine.recovery.heal.heal_step`). Local; e.g. injected optimizer-state faults."""
        self.update_hooks.append(hook)

    def add_event_source(self, source: Callable[[], int]) -> None:
        """Add ``source()`` to :attr:`local_events` at each step attempt's start (e.g. injected hardware events)."""
        self.event_sources.append(source)

    # ------------------------------------------------------------------ per step

    def on_step_start(self) -> None:
        """At the first forward pass of each step attempt, on every rank (a forward pre-hook): the step hooks run
        (a pending rollback, a due snapshot, the recomputation's RNG capture, the probe), outside the watchdog's
        count."""
        if self._step_open or self._diagnosing:  # (a diagnostic's forward pass is not a step)
            return
        self._step_open = True
        self.clock.start()
        if self.watchdog is not None:
            self.watchdog.reached(STEP_STARTED)
        with self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext():
            for hooks in self._step_hooks:
                hooks.on_step_start(self.step)
        for source in self.event_sources:
            self.local_events += source()

    def is_monitored(self) -> bool:
        """Whether the current step gathers statistics (every ``stats.interval`` steps)."""
        return self.step % self.config.stats.interval == 0

    def wants_optimizer_stats(self) -> bool:
        """Whether the adapters compute the prospective update RMS on the current step."""
        return self.is_monitored() and self.assembly.optimizer_stats_due(self.step)[0]

    def wants_weight_stats(self) -> bool:
        """Whether the adapters compute weight norms on the current step."""
        return self.is_monitored() and self.assembly.optimizer_stats_due(self.step)[1]

    def wants_sketch(self) -> bool:
        """Whether the adapters add the local gradient sketch on the current step (cached per step)."""
        if self._sketch_due[0] != self.step:
            due = names.GRAD_SKETCH_LOCAL in self.layout and self.is_monitored() and \
                self.assembly.sketch_due(self.step)
            self._sketch_due = (self.step, due)
        return self._sketch_due[1]

    @property
    def recomputing(self) -> bool:
        """True while a recomputation re-runs the step (reduction-side hooks and faults stand aside)."""
        return self._recomputed is not None

    @contextlib.contextmanager
    def recording_recomputation(self) -> Iterator[list[torch.Tensor]]:
        """While a recomputation runs, :meth:`record_loss` appends to the yielded list instead."""
        self._recomputed = []
        try:
            yield self._recomputed
        finally:
            self._recomputed = None

    def record_loss(self, loss: torch.Tensor) -> None:
        """Record this rank's loss for the current step (once per micro-batch; the mean is used). Device-side, no
        host sync."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"record_loss expects the loss as a torch.Tensor (one number, e.g. the micro-batch's "
                            f"mean loss); got {type(loss).__name__}")
        if self._recomputed is not None:
            self._recomputed.append(loss.detach().float().reshape(()))
            return
        if self.watchdog is not None:
            self.watchdog.reached(LOSS_RECORDED)
        self.clock.loss()  # on every step: on CUDA a monitored step reads the previous step's marks
        if self.buffer is None or not self.is_monitored():
            return
        self.buffer.add(names.LOSS, loss.detach().float())
        self._loss_count += 1

    def record_validation_loss(self, loss: float | torch.Tensor) -> None:
        """A validation loss (read to the host here), for the monitors that take one. Local."""
        value = float(loss.detach().float().reshape(())) if isinstance(loss, torch.Tensor) else float(loss)
        for take in self.hooks.validation:
            take(value)

    @property
    def micro_batches_recorded(self) -> int:
        """Losses recorded so far in the current step."""
        return self._loss_count

    def decide(self, extra_findings: tuple[Finding, ...] = (), only: tuple[str, ...] | None = None, *,
               overflow: Finding | None = None,
               overflow_if_nonfinite: Callable[[], Finding] | None = None) -> Decision:
        """Collective on monitored steps: gather, judge, decide, report; once per optimizer step on every rank,
        after gradients are reduced and before they are applied. Raises :class:`ArcAbort` on every rank on ABORT.

        ``extra_findings``: agreed verdicts from outside the monitors; ``only``: the monitors to run (partial
        statistics). ``overflow``: the framework's loss scaler skipped this step; ``overflow_if_nonfinite``: it
        skips it when the agreed gradient is non-finite, and this makes the finding."""
        assert self.buffer is not None, "ArcEngine.start() was not called"
        if not self.is_monitored():
            return Decision(self.step, Action.NONE)
        if self._loss_count:
            self.buffer.view(names.LOSS).div_(self._loss_count)
        self.buffer.put(names.LOSS_COUNT, float(self._loss_count))
        self.buffer.put(names.LOSS_RANKS, float(self._loss_count > 0))
        stats = self._agree()
        monitors = [m for m in self.monitors if only is None or m.name in only]

        def evaluate(agreed: AgreedStats) -> list[Finding]:
            return [f for monitor in monitors for f in monitor.evaluate(self.step, agreed)]

        extra = list(extra_findings)
        if self.sdc_recompute is not None and only is None:
            stats, findings, own = self.sdc_recompute.judge(stats, evaluate, self._regather)
            extra += own
        else:
            findings = evaluate(stats)
        self.last_stats = stats
        if overflow is None and overflow_if_nonfinite is not None and gradient_nonfinite(stats):
            overflow = overflow_if_nonfinite()
        findings = self.ledger.with_position(findings + extra + ([overflow] if overflow else []), self.data_position)
        decision = self.policy.decide(self.step, findings, overflow=overflow is not None and loss_finite(stats))
        if self.recovery is not None:
            decision = self.recovery.on_decision(decision)
        decision = self.last_decision = with_exit_code(decision)
        self.ledger.record_decision(decision, position=self.data_position, iteration=self.iteration)
        self._report(decision)
        self.reporter.metrics(self.step, self.monitors, {"arc/skipped_steps": float(self.policy.skipped_steps),
                                                         "arc/iteration": float(self.iteration)})
        if self.hooks.rank_reporters:
            self.reporter.rank_metrics(self.step, self.iteration, self.hooks.rank_reporters)
        self._abort_if_needed(decision, commit_monitors=True)
        return decision

    def _agree(self) -> AgreedStats:
        """Collective: the adapters' folds, the families' producers, the monitors' own values, then agree."""
        assert self.buffer is not None
        for fold in self._folds:
            fold()
        if self.assembly.producers:
            view = StepView(self.step, self.params, self.clock.times(), self.local_events,
                            tuple(self.probe.take()) if self.probe is not None else (), self.partition_parts)
            for producer in self.assembly.producers:
                producer.write(self.buffer, view)
        for name, prepare in self.hooks.before_agreement:
            with self.own_work.section(f"{name}.before_agreement"):
                prepare(self.buffer)
        if self.watchdog is not None:  # a peer's hang report shows this rank as waiting for the others
            self.watchdog.reached(AGREEING)
        with self.own_work.section("agree"):
            return self.pipeline.agree(self.buffer, reduce_max=self.assembly.max_due(self.step))

    def _regather(self) -> AgreedStats:
        """Collective: after a correction of the reduced gradient, re-record the reduced statistics (keeping the
        pre-reduction ones, except a recomputing rank's own) and agree again."""
        assert self.buffer is not None and self.sdc_recompute is not None and self._restat is not None
        for name in names.REDUCED_GRADIENT_SLOTS:
            if name in self.layout:
                self.buffer.view(name).zero_()
        self.sdc_recompute.write_local_stats(self.buffer)
        self._restat()
        return self._agree()

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
        """Close the current (unmonitored) step as one the framework itself did not apply (e.g. DeepSpeed's overflow
        check). Local: only with facts every rank shares. The finding goes through the policy (a run of them
        escalates); no monitor folds the step into its baseline. Raises ArcAbort on escalation."""
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
        skipped it on its own after a decision was taken). Local."""
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
        self.progress.close_step(decision is None or decision.applies_update)
        if self.recovery is not None:
            self.recovery.on_step_end(decision)
        if self.watchdog is not None:
            self.watchdog.heartbeat()
        self.own_work.end_step()

    def _commit(self, decision: Decision) -> None:
        for monitor in self.monitors:
            monitor.commit(decision.step, decision.applies_update)
        self.policy.commit(decision)
        self._observe(decision)
        self.monitored_steps += 1

    def _observe(self, decision: Decision) -> None:
        for observe in self.hooks.observers:
            observe(decision)

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[None]:
        """A diagnostic runs the model between steps: its forward opens no step; the watchdog does not count it."""
        self._diagnosing = True
        try:
            with self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext():
                yield
        finally:
            self._diagnosing = False

    def rewind(self, step: int, data_position: int, applied_steps: int | None = None,
               iteration: int | None = None) -> None:
        """After a rollback or resume (:meth:`Progress.rewind`). Local; every rank does the same."""
        self.progress.rewind(step, data_position, applied_steps, iteration)

    @property
    def last_step_applied(self) -> bool:
        """False when the previous step's update was skipped (e.g. to gate an LR-scheduler step)."""
        return self.progress.last_applied

    # ------------------------------------------------------------------ reporting

    def _report(self, decision: Decision) -> None:
        skipped = self.policy.skipped_steps + int(decision.action == Action.SKIP and not decision.overflow)
        self.reporter.decision(decision, self.iteration, skipped)

    def _watchdog_report(self, kind: str, message: str, values: dict[str, Any]) -> None:
        """From the watchdog thread: a hang or a lost rank (critical), or a hang's end (info)."""
        self.local_events += int(kind == "hang")
        severity = Severity.CRITICAL if kind == "hang" else Severity.INFO
        self.reporter.emit(Event(self.run_id, self.step, "detection", "hang", severity, "none", message,
                                 (self.rank,), values, iteration=self.iteration))

    @property
    def sinks(self) -> SinkSet:
        """This rank's sinks (add one of your own with ``engine.sinks.add(sink)``)."""
        return self.reporter.sinks

    @property
    def event_counts(self) -> Counter[str]:
        return self.reporter.event_counts

    def emit_lifecycle(self, what: str, message: str, values: dict[str, Any] | None = None) -> None:
        """A lifecycle event (resume, checkpoint, ...) through this rank's sinks."""
        self.reporter.lifecycle(self.step, self.iteration, what, message, values)

    def emit_action(self, step: int, action: str, severity: Severity, message: str, values: dict[str, Any], *,
                    detector: str = "recovery") -> None:
        """An action a subsystem took (rollback, escape, a failed checkpoint save...) for ``step``."""
        self.reporter.emit(Event(self.run_id, step, "action", detector, severity, action, message, (), values,
                                 iteration=self.iteration))

    def emit_finding(self, finding: Finding) -> None:
        """A finding made outside the per-step path (e.g. by an on-demand diagnostic)."""
        self.reporter.finding(self.step, self.iteration, finding)

    def log_warning(self, message: str) -> None:
        """A local warning through Python logging."""
        log.warning("arc_engine rank %d: %s", self.rank, message)

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
        """Stop the step hooks and the watchdog, emit the summary, close the sinks (idempotent, local)."""
        if self._closed:
            return
        self._closed = True
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.lost_peers is not None:
            self.lost_peers.remove()
        for hooks in reversed(self._step_hooks):
            hooks.close()
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
        return {**self.progress.counters(), "policy": self.policy.state_dict(),
                "event_counts": dict(self.event_counts), "data_ledger": self.ledger.state_dict()}

    def load_counters_state_dict(self, state: dict[str, Any]) -> None:
        self.progress.load_counters(state)
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


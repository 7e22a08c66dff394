"""The ArcEngine: one commit point per monitored step.

Producers (integrations) write device-side statistics into the engine's :class:`StatBuffer`; at the optimizer
step the engine gathers every rank's buffer once, lets each monitor judge the same host arrays, asks the policy
for one decision, reports it to the sinks, and tells the integration what to do. Every rank runs the same code on
the same numbers, so every rank takes the same action at the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from arc_engine import runtime
from arc_engine.config.schema import ArcConfig
from arc_engine.events import Action, Event, Finding, Severity
from arc_engine.monitors import (
    GradNormMonitor,
    LossSpikeMonitor,
    Monitor,
    NonFiniteMonitor,
    OptimizerStatsMonitor,
    SDCMonitor,
    missing_stats,
)
from arc_engine.policy import ArcAbort, Decision, DecisionPolicy
from arc_engine.recovery.state import TrainState
from arc_engine.sinks import ConsoleSink, JsonlSink, SinkSet
from arc_engine.sinks.wandb_sink import WandbSink, active_wandb_run
from arc_engine.stats import GatheredStats, Reduce, StatBuffer, StatLayout, StatsPipeline, names, stats_device
from arc_engine.watchdog import HangWatchdog

if TYPE_CHECKING:
    from arc_engine.recovery.recompute import SDCRecompute
    from arc_engine.recovery.rollback import Recovery

log = logging.getLogger("arc_engine")


class ArcEngine:
    """Per-rank engine. Construct on every rank of ``group`` with the same arguments, then :meth:`start`.

    ``group_names``: names of the optimizer's parameter groups (G slots per gradient statistic).
    ``shard_reduce``: how ranks' gradient/weight/update slots combine: SUM for sharded optimizers (each rank holds
    its partition) and for DDP when each rank takes the parameters it owns (:mod:`arc_engine.stats.partition`);
    REPLICATED when every rank computes the whole value (the first rank's is used).
    """

    def __init__(self, config: ArcConfig, *, group: dist.ProcessGroup | None = None,
                 group_names: list[str] | None = None, shard_reduce: Reduce = Reduce.REPLICATED,
                 sinks: SinkSet | None = None) -> None:
        self.config = config
        self.group = group
        self.rank = runtime.global_rank()
        self.group_names = list(group_names or ["group0"])
        self.layout = StatLayout()
        num_groups = len(self.group_names)
        self.layout.add(names.LOSS, 1, Reduce.PER_RANK)
        self.layout.add(names.LOSS_COUNT, 1, Reduce.PER_RANK)
        self.layout.add(names.GRAD_SQ_LOCAL, num_groups, Reduce.PER_RANK)
        self.layout.add(names.GRAD_NONFINITE_LOCAL, num_groups, Reduce.PER_RANK)
        self.layout.add(names.GRAD_SQ, num_groups, shard_reduce)
        if config.stats.optimizer_stats_every or config.detectors.sdc.enabled:
            for name in (names.WEIGHT_SQ, names.UPDATE_SQ, names.UPDATE_COUNT):
                self.layout.add(name, num_groups, shard_reduce)
        if config.detectors.sdc.enabled and config.detectors.sdc.sketch_size:
            self.layout.add(names.GRAD_SKETCH_LOCAL, config.detectors.sdc.sketch_size, Reduce.PER_RANK)
        if config.detectors.sdc.enabled and config.detectors.sdc.recompute.enabled:
            self.layout.add(names.SDC_WITHHELD, 1, Reduce.PER_RANK)
        self.monitors: list[Monitor] = self._build_monitors()
        self.policy = DecisionPolicy(config.policy)
        self.pipeline = StatsPipeline(self.layout, group, stats_device(group, config.stats.device))
        self.sinks = sinks or SinkSet()
        self.buffer: StatBuffer | None = None
        self.run_id = ""
        self.run_dir = Path(config.run.run_dir)
        self.step = 0            # optimizer steps of the training state (goes back on a rollback)
        self.iteration = 0       # step attempts, monotonic (faults and wall-clock reports use it)
        self.data_position = 0   # index of the next batch to train on, one per optimizer step
        self.recovery: Recovery | None = None
        self.sdc_recompute: SDCRecompute | None = None  # set by the integration (detectors.sdc.recompute)
        self.restat: Callable[[], None] | None = None    # the integration's re-recording of reduced statistics
        self.recomputing = False  # True while recompute_fn runs: reduction-side hooks stand aside
        self.locations: dict[int, str] = {}  # global rank -> "host:device" (gathered at start when SDC is on)
        self.lr_multipliers: list[Callable[[], float]] = []  # e.g. injected learning-rate faults
        self._step_open = False
        self.monitored_steps = 0
        self.last_decision: Decision | None = None
        self.last_stats: GatheredStats | None = None
        self.event_counts: Counter[str] = Counter()
        self._loss_count = 0
        self.framework_skipped_steps = 0
        self._metrics_due = 0
        self._closed = False
        self.watchdog: HangWatchdog | None = None
        self.wandb_owner = False  # this rank talks to W&B (one rank per job; see start())

    # ------------------------------------------------------------------ setup

    def add_monitor(self, monitor: Monitor) -> None:
        """Register an extra monitor (before :meth:`start`); its slots must already be in ``layout``."""
        if self.buffer is not None:
            raise RuntimeError("add monitors before ArcEngine.start()")
        self.monitors.append(monitor)

    def start(self) -> ArcEngine:
        """Collective (once): agree on the run id, freeze and verify the statistics layout, open sinks."""
        self.run_id = runtime.agree_on_run_id(self.config.run.run_id, self.group)
        self.run_dir = Path(self.config.run.run_dir) / self.run_id
        # findings and alerts name the host and device of a rank
        self.locations = runtime.gather_locations(self.group)
        for monitor in self.monitors:
            if isinstance(monitor, SDCMonitor):
                monitor.locations = self.locations
        wandb_cfg = self.config.sinks.wandb
        if wandb_cfg.enabled:  # one rank per job: the one holding the script's W&B run, else the lowest rank
            holds_run = wandb_cfg.reuse_run and active_wandb_run() is not None
            self.wandb_owner = runtime.elect_rank(holds_run, self.group) == self.rank
        for monitor in list(self.monitors):
            lacking = missing_stats(monitor, self.layout)
            if lacking:
                log.warning("arc_engine: monitor %s disabled: statistics %s are not produced", monitor.name, lacking)
                self.monitors.remove(monitor)
        self.buffer = self.pipeline.start()
        if self._owns_sinks():
            self._open_default_sinks()
        if self.wandb_owner:
            self.sinks.add(WandbSink(wandb_cfg, self.run_id, str(self.run_dir), self.locations,
                                     dataclasses.asdict(self.config)))
        if self.config.watchdog.enabled:
            self.watchdog = HangWatchdog(self.config.watchdog, self.rank, self.run_dir, self._watchdog_report,
                                         lambda: self.iteration).start()
        self._emit_lifecycle("start", f"arc_engine attached: {self.pipeline.num_ranks} ranks, monitors "
                             f"{[m.name for m in self.monitors]}, run dir {self.run_dir}")
        return self

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

    def on_step_start(self) -> None:
        """Call at the first forward pass of each step, on every rank (the integrations do, from a forward
        pre-hook). Carries out a pending rollback or takes a due snapshot; a no-op without recovery."""
        if self._step_open:
            return
        self._step_open = True
        if self.recovery is not None:  # a rollback's restore or a snapshot is not a hang
            with self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext():
                self.recovery.on_step_start()
        if self.sdc_recompute is not None:
            self.sdc_recompute.capture()

    def _build_monitors(self) -> list[Monitor]:
        det = self.config.detectors
        monitors: list[Monitor] = []
        if det.non_finite.enabled:
            monitors.append(NonFiniteMonitor(det.non_finite, self.group_names))
        if det.loss_spike.enabled:
            monitors.append(LossSpikeMonitor(det.loss_spike))
        if det.grad_norm.enabled:
            monitors.append(GradNormMonitor(det.grad_norm))
        if det.sdc.enabled:
            monitors.append(SDCMonitor(det.sdc))
        if self.config.stats.optimizer_stats_every or det.sdc.enabled:
            monitors.append(OptimizerStatsMonitor(self.group_names))
        return monitors

    def _owns_sinks(self) -> bool:
        """Whether this rank writes the console and JSONL sinks (global rank 0 unless ``sinks.all_ranks``)."""
        return self.config.sinks.all_ranks or self.rank == 0

    def _emits(self) -> bool:
        """Whether this rank has sinks to report to (its own, or the job's W&B sink)."""
        return self._owns_sinks() or self.wandb_owner

    def _watchdog_report(self, kind: str, message: str, values: dict[str, Any]) -> None:
        """From the watchdog thread: a hang (critical) or its end (info), through this rank's sinks."""
        severity = Severity.CRITICAL if kind == "hang" else Severity.INFO
        self._emit(Event(self.run_id, self.step, "detection", "hang", severity, "none", message, (self.rank,),
                         values, iteration=self.iteration))

    def _open_default_sinks(self) -> None:
        cfg = self.config.sinks
        suffix = f".rank{self.rank}" if cfg.all_ranks else ""
        if cfg.console.enabled:
            self.sinks.add(ConsoleSink(Severity.parse(cfg.console.min_severity), cfg.console.color))
        if cfg.jsonl.enabled:
            self.sinks.add(JsonlSink(self.run_dir / (cfg.jsonl.events_file + suffix),
                                     self.run_dir / (cfg.jsonl.metrics_file + suffix)))

    # ------------------------------------------------------------------ per step

    def is_monitored(self) -> bool:
        """Whether the current step gathers statistics (every ``stats.interval`` steps)."""
        return self.step % self.config.stats.interval == 0

    def wants_optimizer_stats(self) -> bool:
        """Whether producers should compute the update RMS on the current step (every monitored step with SDC)."""
        if self.config.detectors.sdc.enabled:
            return self.is_monitored()
        return self.wants_weight_stats()

    def wants_weight_stats(self) -> bool:
        """Whether producers should also compute weight norms (``stats.optimizer_stats_every``; the SDC rule does
        not need them, so it does not make them run every step)."""
        every = self.config.stats.optimizer_stats_every
        return bool(every) and self.step % (self.config.stats.interval * every) == 0

    def record_loss(self, loss: torch.Tensor) -> None:
        """Record this rank's loss for the current step (call once per micro-batch; the mean is used).

        Device-side only, no host sync. Any rank may record a NaN: the gathered verdict stays agreed.
        """
        if self.buffer is None or not self.is_monitored():
            return
        self.buffer.add(names.LOSS, loss.detach().float())
        self._loss_count += 1

    @property
    def micro_batches_recorded(self) -> int:
        """Losses recorded so far in the current step (the running micro-batch's index + 1)."""
        return self._loss_count

    def decide(self, extra_findings: tuple[Finding, ...] = (), only: tuple[str, ...] | None = None) -> Decision:
        """Collective on monitored steps: gather, judge, decide, report. Call once per optimizer step on every
        rank, after gradients are reduced and before they are applied. Raises :class:`ArcAbort` (on every rank)
        when the decision is ABORT. On unmonitored steps returns a no-op decision without communicating.

        ``extra_findings``: verdicts from outside the monitors, identical on every rank (e.g. the framework
        skipped the step); ``only``: names of the monitors to run (None: all), for steps whose statistics are
        partial."""
        assert self.buffer is not None, "ArcEngine.start() was not called"
        if not self.is_monitored():
            return Decision(self.step, Action.NONE)
        if self._loss_count:
            self.buffer.view(names.LOSS).div_(self._loss_count)
        self.buffer.put(names.LOSS_COUNT, float(self._loss_count))
        stats = self.pipeline.gather(self.buffer)
        extra = list(extra_findings)
        recompute = self.sdc_recompute
        resolved = recompute is not None and only is None and recompute.needs_resolution(stats)
        if resolved:  # some rank withheld its gradient: recompute there, correct, judge the corrected step
            extra += recompute.resolve(stats)
            stats = self._regather()
        monitors = [m for m in self.monitors if only is None or m.name in only]
        findings = [f for monitor in monitors for f in monitor.evaluate(self.step, stats)]
        if recompute is not None and only is None and not resolved and any(f.detector == "sdc" for f in findings):
            first = [dataclasses.replace(f, action=Action.WARN, message=f"before recomputing: {f.message}")
                     for f in findings]  # on record; the verdict on the recomputed step decides
            extra += [*first, *recompute.recompute_all()]
            stats = self._regather()
            findings = [f for monitor in monitors for f in monitor.evaluate(self.step, stats)]
        self.last_stats = stats
        findings += extra
        decision = self.policy.decide(self.step, findings)
        if self.recovery is not None:
            decision = self.recovery.on_decision(decision)
        decision = _with_exit_code(decision)
        self.last_decision = decision
        self._report(decision)
        self._maybe_log_metrics(stats)
        self._abort_if_needed(decision, commit_monitors=True)
        return decision

    def _regather(self) -> GatheredStats:
        """Collective: after a correction of the reduced gradient, re-record the reduced statistics (keeping the
        per-rank pre-reduction ones, except a recomputing rank's own) and gather again."""
        assert self.buffer is not None and self.restat is not None
        per_rank = {spec.name: self.buffer.view(spec.name).clone() for spec in self.layout.specs()
                    if spec.reduce == Reduce.PER_RANK}
        self.buffer.reset()
        for name, values in per_rank.items():
            self.buffer.view(name).copy_(values)
        if self.sdc_recompute is not None:
            self.sdc_recompute.write_local_stats(self.buffer)
        self.restat()
        return self.pipeline.gather(self.buffer)

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

    def skip_by_framework(self, finding: Finding) -> None:
        """Close the current step as one the training framework itself did not apply (e.g. DeepSpeed's overflow
        check). Local: call it only with facts every rank shares (the framework's own agreed verdict). The finding
        goes through the policy, so a run of such skips escalates like any other (``finding.action`` SKIP), or is
        only reported (WARN). No monitor folds this step into its baseline. Raises ArcAbort on escalation."""
        decision = self.policy.decide(self.step, [finding])
        if self.recovery is not None:
            decision = self.recovery.on_decision(decision)
        self.last_decision = decision
        self._report(decision)
        self._abort_if_needed(decision, commit_monitors=False)
        self.policy.commit(decision)
        self.framework_skipped_steps += 1
        self._close_step(decision)

    def finish_step(self) -> None:
        """Close the current step (after the optimizer step ran or was skipped). Local, no communication."""
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
        if self.recovery is not None:
            self.recovery.on_step_end(decision)
        if self.watchdog is not None:
            self.watchdog.heartbeat()

    def step_lr_factor(self) -> float:
        """What the integrations multiply this step's learning rate by (and undo after the step): recovery's
        healing factor times any registered multiplier. 1.0 in normal training."""
        factor = self.recovery.lr_factor if self.recovery is not None else 1.0
        for multiplier in self.lr_multipliers:
            factor *= multiplier()
        return factor

    def rewind(self, step: int, data_position: int) -> None:
        """Set the step counter and data position after a rollback or resume (local; every rank does the same)."""
        self.step = step
        self.data_position = data_position

    @property
    def last_step_applied(self) -> bool:
        """False when the previous step's update was skipped (e.g. to gate an LR-scheduler step)."""
        decision = self.last_decision
        return decision is None or decision.step != self.step - 1 or decision.applies_update

    def _commit(self, decision: Decision) -> None:
        applied = decision.applies_update
        for monitor in self.monitors:
            monitor.commit(decision.step, applied)
        self.policy.commit(decision)
        self.monitored_steps += 1

    # ------------------------------------------------------------------ reporting

    def _report(self, decision: Decision) -> None:
        action = decision.action.name.lower()
        for finding in decision.findings:
            self.event_counts[finding.detector] += 1
            self._emit(Event(self.run_id, decision.step, "detection", finding.detector, finding.severity, action,
                             finding.message, finding.ranks, finding.values))
        if decision.action in (Action.SKIP, Action.ABORT):
            verb = {Action.SKIP: "update not applied on any rank", Action.ABORT: "stopping every rank"}
            skipped = self.policy.skipped_steps + int(decision.action == Action.SKIP)
            self._emit(Event(self.run_id, decision.step, "action", "engine", Severity.WARNING
                             if decision.action == Action.SKIP else Severity.CRITICAL, action,
                             f"{verb.get(decision.action, action)} (skipped so far: {skipped})",
                             tuple(sorted({r for f in decision.findings for r in f.ranks})),
                             {"skipped_steps": skipped}))

    def _maybe_log_metrics(self, stats: GatheredStats) -> None:
        interval = self.config.sinks.metrics_interval
        if not interval or not self._emits():
            return
        self._metrics_due += 1
        if self._metrics_due % interval:
            return
        metrics = {f"arc/{m.name}/{k}": v for m in self.monitors for k, v in m.metrics().items()}
        metrics["arc/skipped_steps"] = float(self.policy.skipped_steps)
        metrics["arc/iteration"] = float(self.iteration)
        self.sinks.log_metrics(self.step, metrics)

    def _emit(self, event: Event) -> None:
        if self._emits():
            self.sinks.emit(dataclasses.replace(event, iteration=self.iteration) if event.iteration < 0 else event)

    def _emit_lifecycle(self, what: str, message: str, values: dict[str, Any] | None = None) -> None:
        self._emit(Event(self.run_id, self.step, "lifecycle", what, Severity.INFO, "none", message,
                         values=values or {}))

    def emit_lifecycle(self, what: str, message: str, values: dict[str, Any] | None = None) -> None:
        """Report a lifecycle event (resume, checkpoint, ...) through the sinks (rank 0 unless ``all_ranks``)."""
        self._emit_lifecycle(what, message, values)

    def emit_action(self, step: int, action: str, severity: Severity, message: str, values: dict[str, Any]) -> None:
        """Report an action taken by a subsystem (rollback, escape) for ``step``."""
        self._emit(Event(self.run_id, step, "action", "recovery", severity, action, message, (), values))

    def emit_finding(self, finding: Finding) -> None:
        """Report a finding made outside the per-step path (e.g. by an on-demand diagnostic)."""
        self._emit(Event(self.run_id, self.step, "detection", finding.detector, finding.severity,
                         finding.action.name.lower(), finding.message, finding.ranks, finding.values))

    def summary(self) -> dict[str, Any]:
        """Counts for the end-of-run report (identical on every rank)."""
        summary = {"steps": self.step, "iterations": self.iteration, "monitored_steps": self.monitored_steps,
                   "skipped_steps": self.policy.skipped_steps,
                   "framework_skipped_steps": self.framework_skipped_steps, "detections": dict(self.event_counts),
                   "collectives": self.pipeline.collectives, "run_dir": str(self.run_dir)}
        if self.recovery is not None:
            summary["recovery"] = self.recovery.summary()
        return summary

    def close(self) -> None:
        """Emit the summary and close the sinks (idempotent, local)."""
        if self._closed:
            return
        self._closed = True
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.recovery is not None:
            self.recovery.close()
        summary = self.summary()
        detections = ", ".join(f"{k}={v}" for k, v in sorted(summary["detections"].items())) or "none"
        self._emit_lifecycle("summary", f"{summary['steps']} steps, {summary['skipped_steps']} skipped, "
                             f"detections: {detections}", summary)
        self.sinks.close()

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
                "event_counts": dict(self.event_counts)}

    def load_counters_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.monitored_steps = int(state["monitored_steps"])
        self.framework_skipped_steps = int(state["framework_skipped_steps"])
        self.policy.load_state_dict(state["policy"])
        self.event_counts = Counter(state.get("event_counts", {}))

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume monitoring exactly (step counter, data position, policy, every monitor)."""
        return {"step": self.step, "data_position": self.data_position, "monitors": self.monitor_state_dict(),
                **self.counters_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rewind(int(state["step"]), int(state.get("data_position", state["step"])))
        self.load_monitor_state_dict(state["monitors"])
        self.load_counters_state_dict({"iteration": state["step"], "framework_skipped_steps": 0, **state})


def _with_exit_code(decision: Decision) -> Decision:
    """An ABORT takes the exit code a finding asks for (e.g. a faulty device), else keeps the policy's."""
    if decision.action != Action.ABORT:
        return decision
    codes = [f.values["exit_code"] for f in decision.findings if f.action == Action.ABORT and "exit_code" in f.values]
    return dataclasses.replace(decision, exit_code=int(codes[0])) if codes else decision

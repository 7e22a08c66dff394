"""What the engine tells: events and metrics through this rank's sinks.

Console and JSONL sinks are written by the decision group's first rank (global rank 0 for the default, job-wide
group), or by every rank with ``sinks.all_ranks``; W&B by one elected rank of the group. Every verdict is computed
from agreed statistics on every rank, so whichever rank writes, it writes what every rank decided. All methods are
local (no communication) and never raise into training (a failing sink is disabled by :class:`SinkSet`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from arc_engine import runtime, stop_record
from arc_engine.config.schema import ArcConfig
from arc_engine.device_ledger import DEVICES_FILE, assess, excluded_hosts, read_devices
from arc_engine.events import Action, Event, Finding, Severity
from arc_engine.monitors import Monitor
from arc_engine.policy import Decision
from arc_engine.sinks import ConsoleSink, JsonlSink, SinkSet
from arc_engine.sinks.devices import DeviceLedgerSink
from arc_engine.sinks.wandb_sink import WandbSink, active_wandb_run

log = logging.getLogger("arc_engine")

def farthest_from_median(per_rank: dict[int, float], limit: int) -> dict[int, float]:
    """``per_rank`` when it has at most ``limit`` ranks, else the ``limit`` ranks farthest from the median (a
    non-finite value counts as farthest), in rank order. Pure."""
    if len(per_rank) <= limit:
        return dict(per_rank)
    finite = sorted(v for v in per_rank.values() if math.isfinite(v))
    median = finite[len(finite) // 2] if finite else 0.0
    distance = {rank: abs(v - median) if math.isfinite(v) else math.inf for rank, v in per_rank.items()}
    kept = sorted(per_rank, key=lambda rank: (-distance[rank], rank))[:limit]
    return {rank: per_rank[rank] for rank in sorted(kept)}


class Reporter:
    """One rank's reporting. :meth:`open` once the run id, the run directory and the roles are agreed."""

    def __init__(self, config: ArcConfig, rank: int, sinks: SinkSet | None = None) -> None:
        self.config = config
        self.rank = rank
        self.sinks = sinks or SinkSet()
        self.run_id = ""
        self.run_dir = Path(config.run.run_dir)
        self.owns_sinks = False   # console and JSONL
        self.wandb_owner = False  # this rank talks to W&B (one rank per job)
        self.event_counts: Counter[str] = Counter()
        self._metrics_due = 0
        self.leader = False
        self.leader_rank = 0
        self._ledger: DeviceLedgerSink | None = None
        self.locations: dict[int, str] = {}
        #: the stop record of a stop under way (an abort decided, a hang's abort), written at close (stop.json)
        self.stopping: dict[str, Any] | None = None
        self._stop_written = False

    def open(self, run_id: str, run_dir: Path, *, leader: bool, group: dist.ProcessGroup | None,
             locations: dict[int, str]) -> None:
        """Collective over ``group``: open the sinks this rank owns: console and JSONL on the group's ``leader`` (or
        every rank with ``sinks.all_ranks``), W&B on one rank of the job: the one holding the script's W&B run
        (``sinks.wandb.reuse_run``), else the lowest."""
        self.run_id, self.run_dir = run_id, run_dir
        cfg = self.config.sinks
        self.owns_sinks = cfg.all_ranks or leader
        holds_run = cfg.wandb.enabled and cfg.wandb.reuse_run and active_wandb_run() is not None
        # one gather: who holds the script's W&B run, and the launch's name in the device ledger (the leader's)
        gathered = runtime.gather_by_rank((bool(holds_run), f"{run_id}@{time.time():.3f}"), group)
        elected = min([rank for rank, (holds, _) in gathered.items() if holds] or gathered)
        wandb_owner = cfg.wandb.enabled and elected == self.rank
        self.wandb_owner = wandb_owner
        self.leader_rank = min(gathered)
        launch = gathered[self.leader_rank][1]
        if self.owns_sinks:
            suffix = f".rank{self.rank}" if cfg.all_ranks else ""
            if cfg.console.enabled:
                self.sinks.add(ConsoleSink(Severity.parse(cfg.console.min_severity), cfg.console.color))
            if cfg.jsonl.enabled:
                self.sinks.add(JsonlSink(run_dir / (cfg.jsonl.events_file + suffix),
                                         run_dir / (cfg.jsonl.metrics_file + suffix),
                                         run_dir / (cfg.jsonl.ranks_file + suffix)))
        if wandb_owner:
            self.sinks.add(WandbSink(cfg.wandb, run_id, str(run_dir), locations, dataclasses.asdict(self.config)))
        self.leader, self.locations = leader, dict(locations)
        # the job's device ledger (the run root's): written by the leader; the others hold it in reserve for a lost
        # leader (:meth:`hang`), under the same launch name
        self._ledger = DeviceLedgerSink(self.devices_path, locations, run_id, launch=launch)
        if leader:  # the ledger, and the stop record of a launch under way
            self.sinks.add(self._ledger)
            previous = stop_record.read(run_dir)  # the last launch's stop, kept inside this one's record
            self._write_stop({**stop_record.running(0), "previous": {k: v for k, v in (previous or {}).items()
                                                                     if k != "previous"} or None})

    @property
    def emits(self) -> bool:
        """Whether this rank has sinks to report to (its own, or the job's W&B sink)."""
        return self.owns_sinks or self.wandb_owner

    def emit(self, event: Event) -> None:
        if self.emits:
            self.sinks.emit(event)

    def lifecycle(self, step: int, iteration: int, what: str, message: str,
                  values: dict[str, Any] | None = None) -> None:
        self.emit(Event(self.run_id, step, "lifecycle", what, Severity.INFO, "none", message, values=values or {},
                        iteration=iteration))

    def finding(self, step: int, iteration: int, finding: Finding, action: str | None = None) -> None:
        """A detection event for ``finding`` (``action``: the decision's, else the finding's own)."""
        self.event_counts[finding.detector] += 1
        values = {**finding.values, "hardware": finding.hardware} if finding.hardware else finding.values
        self.emit(Event(self.run_id, step, "detection", finding.detector, finding.severity,
                        action or finding.action.name.lower(), finding.message, finding.ranks, values,
                        iteration=iteration))

    def action(self, step: int, iteration: int, detector: str, severity: Severity, action: str, message: str,
               values: dict[str, Any]) -> None:
        """An action a subsystem took for ``step`` (rollback, escape, a failed checkpoint save...)."""
        self.emit(Event(self.run_id, step, "action", detector, severity, action, message, (), values,
                        iteration=iteration))

    def decision(self, decision: Decision, iteration: int, not_applied_before: int) -> None:
        """Every finding of ``decision``, then the action taken when it stops the update (skip or abort);
        ``not_applied_before``: the steps not applied before this one (:attr:`Progress.steps_not_applied`)."""
        action = decision.action.name.lower()
        for finding in decision.findings:
            self.finding(decision.step, iteration, finding, action)
        observed = decision.observed
        if observed is not None and observed > max(decision.action, Action.CHECKPOINT):
            verb = {Action.SKIP: "skipped the update", Action.ROLLBACK: "rolled back",
                    Action.ABORT: "stopped every rank"}.get(observed, observed.name.lower())
            self.emit(Event(self.run_id, decision.step, "action", "engine",
                            Severity.CRITICAL if observed == Action.ABORT else Severity.WARNING, action,
                            f"observe mode: acting, arc_engine would have {verb}; nothing was done "
                            "(policy.mode: observe)", tuple(sorted({r for f in decision.findings for r in f.ranks})),
                            {"would_have": observed.name.lower()}, iteration=iteration))
        if decision.action in (Action.SKIP, Action.ABORT):
            skip = decision.action == Action.SKIP
            verb = "stopping every rank" if not skip else \
                "the loss scaler skipped the update on every rank (overflow)" if decision.overflow else \
                "update not applied on any rank"
            self.emit(Event(self.run_id, decision.step, "action", "engine",
                            Severity.WARNING if skip else Severity.CRITICAL, action,
                            f"{verb} (steps not applied before this one: {not_applied_before})",
                            tuple(sorted({r for f in decision.findings for r in f.ranks})),
                            {"steps_not_applied": not_applied_before}, iteration=iteration))

    def metrics(self, step: int, monitors: Sequence[Monitor], extra: dict[str, float]) -> None:
        """Every ``sinks.metrics_interval``-th call: the monitors' metrics as ``arc/<monitor>/<name>``, plus
        ``extra``."""
        interval = self.config.sinks.metrics_interval
        if not interval or not self.emits:
            return
        self._metrics_due += 1
        if self._metrics_due % interval:
            return
        values = {f"arc/{m.name}/{k}": v for m in monitors for k, v in m.metrics().items()}
        self.sinks.log_metrics(step, {**values, **extra})

    def rank_metrics(self, step: int, iteration: int, monitors: Sequence[Any]) -> None:
        """The per-rank statistics that ``monitors`` (those with a ``rank_metrics()``: name -> {global rank: value};
        most steps have none) gathered on this step, as ``<monitor>/<name>``, each cut to ``sinks.jsonl.ranks_max``
        ranks."""
        if not self.owns_sinks:
            return
        values: dict[str, dict[int, float]] = {}
        ranks = 0
        for monitor in monitors:
            for name, per_rank in monitor.rank_metrics().items():
                ranks = max(ranks, len(per_rank))
                values[f"{monitor.name}/{name}"] = farthest_from_median(per_rank, self.config.sinks.jsonl.ranks_max)
        if values:
            self.sinks.log_ranks(step, iteration, values, ranks)

    def hang(self, step: int, iteration: int, kind: str, message: str, values: dict[str, Any]) -> None:
        """From the watchdog thread: a hang or a lost rank (critical), or a hang's end (info), on this rank."""
        severity = Severity.CRITICAL if kind == "hang" else Severity.INFO
        blamed = [("lost", values.get("lost_ranks")), ("hung", values.get("stuck_ranks"))] if kind == "hang" else []
        for evidence, ranks in blamed:  # the device ledger's evidence: the ranks lost or stopped
            if ranks:
                values = {**values, "hardware": evidence, "hardware_ranks": list(ranks)}
                break
        if values.get("abort") or values.get("error") == "SIGTERM":  # the watchdog or the launcher ends this rank
            self.stopping = stop_record.on_hang(values, step)
        event = Event(self.run_id, step, "detection", "hang", severity, "none", message, (self.rank,), values,
                      iteration=iteration)
        self.emit(event)
        lost = set(values.get("lost_ranks") or ())
        if not self.leader and self._ledger is not None and self.leader_rank in lost and \
                self.rank == min(set(self.locations) - lost, default=-1):
            self._ledger.emit(event)  # the leader, which writes the ledger, is the one lost: its successor does

    def close_run(self, step: int, iteration: int, summary: dict[str, Any], own_work: list[str]) -> None:
        """The end of the run on this rank: its own-work table (``stats.own_work``: logged, and its first line as an
        event), the summary event, the sinks closed."""
        for line in own_work:
            log.info("arc_engine rank %d: %s", self.rank, line)
        if own_work:
            self.lifecycle(step, iteration, "own_work", f"rank {self.rank}: {own_work[0]}", summary["own_work"])
        detections = ", ".join(f"{k}={v}" for k, v in sorted(summary["detections"].items())) or "none"
        # called from arc.close(): in a finally block or a with block's exit, what the training loop raised is still
        # the exception being handled
        self.stopping = self.stopping or stop_record.at_close(step, sys.exc_info()[1])
        self.lifecycle(step, iteration, "summary", f"{summary['steps']} steps, {summary['applied_steps']} applied, "
                       f"{summary['steps_not_applied']} not applied (policy {summary['skipped_by_policy']}, rollback "
                       f"{summary['rolled_back']}, framework {summary['skipped_by_framework']}), "
                       f"detections: {detections}", summary)
        self.close()

    @property
    def devices_path(self) -> Path:
        return Path(self.config.run.run_dir) / DEVICES_FILE

    def close(self) -> None:
        """The stop record (when a stop is under way: ``stop.json`` and one ``stop`` event), then the sinks closed."""
        if self.stopping is not None and not self._stop_written:
            self._stop_written = True
            try:
                excluded = excluded_hosts(assess(read_devices(self.devices_path)[0])) if self.leader else []
            except (OSError, ValueError, KeyError):
                excluded = []
            record = stop_record.complete(self.stopping, self.locations, excluded)
            record["previous"] = (stop_record.read(self.run_dir) or {}).get("previous")
            if self.leader or record["cause"] in ("hang", "terminated"):  # (a lost leader writes nothing)
                self._write_stop(record)
            # (a job stopped by its launcher, every rank alive, is no alert: a cancellation or a preemption)
            quiet = record["exit_code"] == 0 or (record["cause"] == "terminated" and not record["ranks"])
            severity = Severity.INFO if quiet else Severity.CRITICAL
            self.emit(Event(self.run_id, int(record["step"]), "lifecycle", "stop", severity, "none",
                            stop_record.describe(record).replace("\n", "; "), tuple(record["ranks"]), record))
        self.sinks.close()

    def _write_stop(self, record: dict[str, Any]) -> None:
        try:
            stop_record.write(self.run_dir, record)
        except OSError as err:
            log.warning("arc_engine: %s cannot be written (%s)", self.run_dir / stop_record.STOP_FILE, err)

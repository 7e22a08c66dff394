"""The ArcEngine: one commit point per monitored step.

Producers write device-side statistics into the step's buffer; at the optimizer step the engine agrees on them
across the decision group with one fixed-size reduction, lets every monitor judge the same host arrays, asks the
policy for one decision, reports it and tells the integration what to do. Every rank runs the same code on the same
numbers, so every rank takes the same action at the same step. The engine knows no monitor family
(:mod:`arc_engine.monitors.assembly`) and no recovery mechanism (:mod:`arc_engine.step_hooks`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from arc_engine import runtime, stop_record
from arc_engine.config.schema import ArcConfig
from arc_engine.data_ledger import LEDGER_FILE, DataLedger
from arc_engine.events import Action, Finding, Severity
from arc_engine.gathering import StepGathering
from arc_engine.lost_peers import LostPeerWatch
from arc_engine.monitors.family import LocalGrads, ModelParts
from arc_engine.monitors.hooks import MonitorHooks
from arc_engine.own_work import OwnWork
from arc_engine.policy import ArcAbort, Decision, DecisionPolicy
from arc_engine.policy.decision import gradient_nonfinite, loss_finite, not_applied_cause, with_exit_code
from arc_engine.progress import Progress
from arc_engine.reporter import Reporter
from arc_engine.sinks import SinkSet
from arc_engine.stats import AgreedStats, Reduce, StatBuffer
from arc_engine.stats.pipeline import model_device, stats_device
from arc_engine.step_hooks import Recovering, StatsResolver, StepHooks
from arc_engine.watchdog import AGREEING, LOSS_RECORDED, STEP_STARTED, HangWatchdog, start_watchdog


class ArcEngine:
    """Per-rank engine: construct on every rank of ``group`` (the decision group; None: the whole job) with the
    same arguments, then :meth:`start`. The adapter's arguments are :class:`arc_engine.gathering.StepGathering`'s."""

    def __init__(self, config: ArcConfig, *, group: dist.ProcessGroup | None = None,
                 group_names: list[str] | None = None, shard_reduce: Reduce = Reduce.REPLICATED,
                 sinks: SinkSet | None = None, params: Sequence[torch.Tensor] = (),
                 parts: ModelParts | None = None, exact_sketch_size: int = 0,
                 local_grads: LocalGrads | None = None) -> None:
        self.config, self.group, self.rank = config, group, runtime.global_rank()
        self.group_names = list(group_names or ["group0"])
        device = stats_device(group, config.stats.device, model_device(params))
        self.own_work = OwnWork(config.stats.own_work, device)  # stats.own_work: arc_engine's own time, by piece
        self.gathering = StepGathering(config, group, device, self.own_work, group_names=self.group_names,
                                       shard_reduce=shard_reduce, params=params, parts=parts,
                                       exact_sketch_size=exact_sketch_size, local_grads=local_grads,
                                       current_step=lambda: self.progress.step)
        self.hooks = MonitorHooks()  # the monitors' optional methods, gathered at start
        self.policy = DecisionPolicy(config.policy, num_ranks=self.gathering.pipeline.num_ranks)
        self.reporter = Reporter(config, self.rank, sinks)
        self.buffer: StatBuffer | None = None
        self.run_id, self.run_dir = "", Path(config.run.run_dir)
        self.progress = Progress()  # the counters (arc.progress)
        self.local_events = self.device_events = 0  # system events so far: hang reports + the device's own
        self.ledger = DataLedger()  # the skipped and suspect data positions
        self.locations: dict[int, str] = {}  # global rank -> "host:device"
        self.recovery: Recovering | None = None
        self.sdc_recompute: StatsResolver | None = None
        self.lr_multipliers: list[Callable[[], float]] = []
        self.update_hooks: list[Callable[[list[dict[str, Any]], Mapping[Any, Any] | None], None]] = []
        self.event_sources: list[Callable[[], int]] = []
        self.last_decision: Decision | None = None
        self.last_stats: AgreedStats | None = None
        self.watchdog: HangWatchdog | None = None
        self.lost_peers: LostPeerWatch | None = None
        self._step_hooks: list[StepHooks] = []
        self._rerecord: Callable[[], None] | None = None
        self._step_open = self._diagnosing = self._closed = False
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
        self.hooks = self.gathering.assembly.start(self.gathering.layout, self.locations)
        self.buffer = self.gathering.start(self.hooks.before_agreement)
        leader = self.rank == self.gathering.pipeline.leader
        self.ledger.open_shared(self.run_dir / LEDGER_FILE, leader=leader, group=self.group,
                                num_ranks=self.gathering.pipeline.num_ranks)
        self.reporter.open(self.run_id, self.run_dir, leader=leader, group=self.group, locations=self.locations)
        if self.config.watchdog.enabled:
            self.watchdog = start_watchdog(self.config.watchdog, observing=self.config.observing,
                                           run_id=self.run_id, run_dir=self.run_dir, report=self._watchdog_report,
                                           iteration=lambda: self.progress.iteration, on_abort=self.reporter.close)
            if self.watchdog.world_size > 1:  # a rank lost mid-step is named by the survivors
                self.lost_peers = LostPeerWatch(self.watchdog).install()
        self.emit_lifecycle("start", f"arc_engine attached: {self.gathering.pipeline.num_ranks} ranks, monitors "
                            f"{[m.name for m in self.gathering.assembly.monitors]}, run dir {self.run_dir}")
        return self

    def use_recovery(self, recovery: Recovering) -> None:
        """The rollback loop decides with the policy from now on (``recovery.enabled``; set by the wiring)."""
        self.recovery = recovery
        self.policy.can_rollback = True
        self._step_hooks.insert(0, recovery)

    def use_recompute(self, resolver: StatsResolver, rerecord: Callable[[], None]) -> None:
        """``resolver`` judges suspect steps; ``rerecord`` records the reduced gradient's statistics again."""
        self.sdc_recompute, self._rerecord = resolver, rerecord
        self._step_hooks.append(resolver)

    def add_step_hooks(self, hooks: StepHooks) -> None:
        """``hooks.on_step_start(step)`` at every step attempt's start, ``hooks.close()`` at close."""
        self._step_hooks.append(hooks)

    def add_lr_multiplier(self, multiplier: Callable[[], float]) -> None:
        """Each step's learning rate times ``multiplier()`` (:func:`arc_engine.recovery.heal.step_lr_factor`)."""
        self.lr_multipliers.append(multiplier)

    def add_update_hook(self, hook: Callable[[list[dict[str, Any]], Mapping[Any, Any] | None], None]) -> None:
        """``hook(param_groups, state)`` before every applied update (:func:`arc_engine.recovery.heal.heal_step`)."""
        self.update_hooks.append(hook)

    def add_event_source(self, source: Callable[[], int]) -> None:  # this rank's device events, read at step start
        self.event_sources.append(source)

    # ------------------------------------------------------------------ per step

    def on_step_start(self) -> None:
        """At each step attempt's first forward, every rank: the step hooks (a due snapshot, the recomputation's
        RNG capture, the probe), the watchdog paused."""
        if self._step_open or self._diagnosing:  # (a diagnostic's forward pass is not a step)
            return
        self._step_open = True
        self.gathering.clock.start()
        if self.watchdog is not None:
            self.watchdog.reached(STEP_STARTED)
        with self.paused():
            for hooks in self._step_hooks:
                hooks.on_step_start(self.progress.step)
        for source in self.event_sources:
            events = source()
            self.local_events, self.device_events = self.local_events + events, self.device_events + events

    def is_monitored(self) -> bool:  # the current step gathers statistics (every ``stats.interval`` steps)
        return self.progress.step % self.config.stats.interval == 0

    def wants_optimizer_stats(self) -> bool:
        """Whether the adapters compute the prospective update RMS on the current step."""
        return self.is_monitored() and self.gathering.assembly.optimizer_stats_due(self.progress.step)[0]

    def wants_weight_stats(self) -> bool:
        """Whether the adapters compute weight norms on the current step."""
        return self.is_monitored() and self.gathering.assembly.optimizer_stats_due(self.progress.step)[1]

    def wants_sketch(self) -> bool:
        """Whether the adapters add the local gradient sketch on the current step."""
        return self.is_monitored() and self.gathering.sketch_due(self.progress.step)

    @property
    def recomputing(self) -> bool:  # a recomputation re-runs the step (reduction-side hooks and faults stand aside)
        return self.gathering.recomputing

    def record_loss(self, loss: torch.Tensor) -> None:
        """This rank's loss for the current step (once per micro-batch; the mean is used). No host sync."""
        if self.gathering.record_loss(loss, self.is_monitored()) and self.watchdog is not None:
            self.watchdog.reached(LOSS_RECORDED)

    def record_validation_loss(self, loss: float | torch.Tensor) -> None:
        """A validation loss (read to the host here), for the monitors that take one. Local."""
        value = float(loss.detach().float().reshape(())) if isinstance(loss, torch.Tensor) else float(loss)
        for take in self.hooks.validation:
            take(value)

    def decide(self, extra_findings: tuple[Finding, ...] = (), only: tuple[str, ...] | None = None, *,
               overflow: Finding | None = None,
               overflow_if_nonfinite: Callable[[], Finding] | None = None) -> Decision:
        """Collective on monitored steps, once per optimizer step on every rank, before the update: agree, judge,
        decide, report; :class:`ArcAbort` on every rank on ABORT. ``extra_findings``: agreed verdicts from outside;
        ``only``: the monitors to run; ``overflow``: the loss scaler skipped this step (``overflow_if_nonfinite``:
        it does when the agreed gradient is non-finite, and this makes the finding)."""
        if not self.is_monitored():
            return Decision(self.progress.step, Action.NONE)
        stats = self.gathering.agree(self.progress.step, (self.local_events, self.device_events), self._waiting)
        monitors = [m for m in self.gathering.assembly.monitors if only is None or m.name in only]

        def evaluate(agreed: AgreedStats) -> list[Finding]:
            return [f for monitor in monitors for f in monitor.evaluate(self.progress.step, agreed)]

        extra = list(extra_findings)
        if self.sdc_recompute is not None and only is None:
            stats, findings, own = self.sdc_recompute.judge(stats, evaluate, self._regather)
            extra += own
        else:
            findings = evaluate(stats)
        self.last_stats = stats
        if overflow is None and overflow_if_nonfinite is not None and gradient_nonfinite(stats):
            overflow = overflow_if_nonfinite()
        progress = self.progress
        findings = self.ledger.with_position([*findings, *extra, *([overflow] if overflow else [])],
                                             progress.data_position)
        decision = self.policy.decide(progress.step, findings, overflow=overflow is not None and loss_finite(stats))
        if self.recovery is not None:
            decision = self.recovery.on_decision(decision)
        decision = self.last_decision = with_exit_code(decision)
        self.ledger.record_decision(decision, position=progress.data_position, iteration=progress.iteration)
        self._report(decision)
        self.reporter.metrics(progress.step, self.gathering.assembly.monitors, progress.metrics())
        if self.hooks.rank_reporters:
            self.reporter.rank_metrics(progress.step, progress.iteration, self.hooks.rank_reporters)
        self._abort_if_needed(decision, commit_monitors=True)
        return decision

    def _waiting(self) -> None:
        if self.watchdog is not None:  # a peer's hang report shows this rank as waiting for the others
            self.watchdog.reached(AGREEING)

    def _regather(self) -> AgreedStats:
        assert self.sdc_recompute is not None and self._rerecord is not None
        return self.gathering.regather(self.progress.step, (self.local_events, self.device_events), self._waiting,
                                       self.sdc_recompute.write_local_stats, self._rerecord)

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
        self.reporter.stopping = self.reporter.stopping or stop_record.on_decision(decision, reason)
        self.close()
        step = self.progress.step
        raise ArcAbort(f"arc_engine stopped training at step {step}: {reason}", step, decision.exit_code)

    def skip_by_framework(self, finding: Finding, *, overflow: bool = False) -> None:
        """Close the current (unmonitored) step as one the framework itself did not apply (e.g. DeepSpeed's overflow
        check), after its step returned. Local: only with facts every rank shares. The finding goes through the
        policy (a run of them escalates); no monitor folds the step into its baseline. Raises ArcAbort on escalation."""
        decision = self.policy.decide(self.progress.step, [finding], overflow=overflow)
        if self.recovery is not None:
            decision = self.recovery.on_decision(decision)
        self.last_decision = decision
        self._report(decision)
        self._abort_if_needed(decision, commit_monitors=False)
        self.policy.commit(decision)
        self._observe(decision)
        self._close_step(decision)

    def finish_step(self, *, framework_skipped: bool = False, settle: bool = True) -> None:
        """Close the current step (``framework_skipped``: the framework skipped it after a decision). Local, but a
        rollback decided here is carried out (:meth:`settle`) unless ``settle=False``: the framework's step goes on
        after this call (DeepSpeed's), and the adapter settles where it returns."""
        decision = self.last_decision if self.last_decision and self.last_decision.step == self.progress.step else None
        if decision is not None:
            self._commit(decision)
        self._close_step(decision, settle=settle, framework_skipped=framework_skipped)

    def settle(self) -> None:
        """Where the framework's step returned, every rank: carry out a rollback it decided (tensors and counters
        together; the watchdog paused)."""
        if self.recovery is None:
            return
        with self.paused():
            self.recovery.settle()

    def _close_step(self, decision: Decision | None, *, settle: bool = True, framework_skipped: bool = False) -> None:
        self.gathering.reset()
        self._step_open = False
        self.progress.close_step(not_applied_cause(decision, framework_skipped))
        if self.recovery is not None:
            self.recovery.on_step_end(decision)
            if settle:
                self.settle()
        if self.watchdog is not None:
            self.watchdog.heartbeat()
        self.own_work.end_step()

    def _commit(self, decision: Decision) -> None:
        for monitor in self.gathering.assembly.monitors:
            monitor.commit(decision.step, decision.applies_update)
        self.policy.commit(decision)
        self._observe(decision)
        self.progress.monitored_steps += 1

    def _observe(self, decision: Decision) -> None:
        for observe in self.hooks.observers:
            observe(decision)

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[None]:
        """A diagnostic runs the model between steps: its forward opens no step; the watchdog does not count it."""
        self._diagnosing = True
        try:
            with self.paused():
                yield
        finally:
            self._diagnosing = False

    def paused(self) -> contextlib.AbstractContextManager[None]:  # a known long phase: the watchdog does not count it
        return self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()

    def rewind(self, step: int, data_position: int, applied_steps: int | None = None,
               iteration: int | None = None) -> None:
        """After a rollback or resume (:meth:`Progress.rewind`). Local; every rank does the same."""
        self.progress.rewind(step, data_position, applied_steps, iteration)

    # ------------------------------------------------------------------ reporting

    def _report(self, decision: Decision) -> None:
        self.reporter.decision(decision, self.progress.iteration, self.progress.steps_not_applied)

    def _watchdog_report(self, kind: str, message: str, values: dict[str, Any]) -> None:
        self.local_events += int(kind == "hang")  # (a system event: the R-Metric's λ counts it)
        self.reporter.hang(self.progress.step, self.progress.iteration, kind, message, values)

    @property
    def sinks(self) -> SinkSet:  # this rank's sinks (add one of your own with ``engine.sinks.add(sink)``)
        return self.reporter.sinks

    def emit_lifecycle(self, what: str, message: str, values: dict[str, Any] | None = None) -> None:
        """A lifecycle event (resume, checkpoint, ...) through this rank's sinks."""
        self.reporter.lifecycle(self.progress.step, self.progress.iteration, what, message, values)

    def emit_action(self, step: int, action: str, severity: Severity, message: str, values: dict[str, Any], *,
                    detector: str = "recovery") -> None:
        """An action a subsystem took (rollback, escape, a failed checkpoint save...) for ``step``."""
        self.reporter.action(step, self.progress.iteration, detector, severity, action, message, values)

    def summary(self) -> dict[str, Any]:
        """Counts for the end-of-run report (identical on every rank)."""
        pipeline = self.gathering.pipeline
        summary = {**self.progress.counts(), "detections": dict(self.reporter.event_counts),
                   "collectives": pipeline.collectives, "detail_fetches": pipeline.detail_fetches,
                   "follow_ups": self.gathering.pipeline.follow_ups, "run_dir": str(self.run_dir)}
        if self.recovery is not None:
            summary["recovery"] = self.recovery.summary()
        if self.own_work.enabled:
            summary["own_work"] = self.own_work.report().summary()
        return summary

    closed = property(lambda self: self._closed)

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
        own_work = self.own_work.report().lines() if self.own_work.enabled else []
        self.reporter.close_run(self.progress.step, self.progress.iteration, self.summary(), own_work)

    # ------------------------------------------------------------------ state

    def counters_state_dict(self) -> dict[str, Any]:
        """Cumulative counters a rollback keeps but a restart restores."""
        return {**self.progress.counters(), "policy": self.policy.state_dict(),
                "event_counts": dict(self.reporter.event_counts), "data_ledger": self.ledger.state_dict()}

    def load_counters_state_dict(self, state: dict[str, Any]) -> None:
        self.progress.load_counters(state)
        self.policy.load_state_dict(state["policy"])
        self.reporter.event_counts = Counter(state.get("event_counts", {}))
        self.ledger.load_state_dict(state.get("data_ledger", {}))

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume monitoring exactly (step counter, data position, policy, every monitor)."""
        progress = self.progress
        return {"step": progress.step, "data_position": progress.data_position, "applied_steps": progress.applied_steps,
                "monitors": self.gathering.assembly.state_dict(), **self.counters_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rewind(int(state["step"]), int(state.get("data_position", state["step"])),
                    state.get("applied_steps", state["step"]))
        self.gathering.assembly.load_state_dict(state["monitors"])
        self.load_counters_state_dict({"iteration": state["step"], **state})


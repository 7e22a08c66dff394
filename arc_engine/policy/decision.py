"""One decision per monitored step, computed identically on every rank from the gathered findings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from arc_engine.config.schema import PolicyConfig
from arc_engine.events import Action, Finding, Severity
from arc_engine.progress import FRAMEWORK, POLICY, ROLLBACK
from arc_engine.stats import AgreedStats, names

#: Exit code of a run that arc_engine stopped (persistent failure or an ``abort`` action).
EXIT_ABORT = 3
#: Exit code of a run whose recovery gave up: the rollbacks and escapes of one episode were exhausted.
EXIT_RECOVERY_EXHAUSTED = 4
#: Exit code of a run stopped because a device was found faulty (silent data corruption reproduced on one rank but
#: not by a healthy peer); the device is listed in the run directory's ``quarantine.json``.
EXIT_FAULTY_DEVICE = 5
#: Exit code of a rank the hang watchdog ended (``watchdog.action: abort``): no step completed for ``abort_after``
#: timeouts in a row; the ``hang`` event names the ranks that stopped.
EXIT_HANG = 6
#: Exit code of a run that rolls back by relaunching (``recovery.rollback: relaunch``, e.g. under Megatron-LM's
#: ``pretrain()``, which owns the iteration counter and the data): relaunch loading the checkpoint and skipping the
#: batches that ``relaunch.json`` in the run directory names.
EXIT_RELAUNCH = 7


class ArcAbort(RuntimeError):
    """Raised on every rank, at the same step, when the decision is ABORT. ``exit_code`` is for the launcher."""

    def __init__(self, message: str, step: int, exit_code: int = EXIT_ABORT) -> None:
        super().__init__(message)
        self.step = step
        self.exit_code = exit_code


@dataclass(frozen=True)
class Decision:
    """The agreed verdict for one step: the strongest action among the findings (plus escalation)."""

    step: int
    action: Action
    findings: tuple[Finding, ...] = ()
    escape: bool = False  # a ROLLBACK that also perturbs the weights and skips ahead (ARC's ESCAPING state)
    exit_code: int = EXIT_ABORT  # for ABORT
    #: a dynamic loss scaler skipped the step itself (non-finite gradients at a finite loss): a routine overflow
    overflow: bool = False
    #: skipped for bad data (a ``bad_data`` finding among those asking for the skip): counted apart
    data: bool = False
    #: an overflow skip's findings blamed these ranks only (not every rank): a run of them is a fault (the policy's)
    overflow_ranks: tuple[int, ...] = ()
    #: ``policy.mode: observe``: the step's verdict as ``act`` would have carried it out, before escalation (an
    #: observer keeps no run of skips); ``action`` is then what happened: NONE, or the framework's own skip.
    #: None under ``act``
    observed: Action | None = None

    @property
    def applies_update(self) -> bool:
        return self.action <= Action.CHECKPOINT


class DecisionPolicy:
    """Turns findings into a :class:`Decision`, escalating runs of skipped steps.

    Pure given its state: the same findings and state give the same decision on every rank.

    A step a dynamic loss scaler skipped itself (``overflow=True``) is routine while the scaler searches its scale:
    it is a SKIP whose findings are reported as warnings at most, counted apart from the other skips and escalated
    only past ``max_consecutive_overflow_skips``. Except where the same ranks, and not all of the ``num_ranks``,
    hold the non-finite values step after step: a scale too high overflows wherever the gradients are large, and a
    halved scale ends it, but one rank's NaN survives any scale (a faulty device, that rank's data). Such a run counts
    like any other skip, and escalates past ``max_consecutive_skips`` naming those ranks, before the scaler's scale
    collapses. A skip that a ``bad_data`` finding asks for skips that data: those count apart too, up to
    ``max_consecutive_data_skips``.

    Under ``policy.mode: observe`` the decision records what ``act`` would have done (``observed``) and carries out
    nothing: its action is NONE, or SKIP where the framework already skipped the step (an overflow, a finding
    ``by_framework``), and nothing escalates.
    """

    def __init__(self, config: PolicyConfig, *, can_rollback: bool = False, num_ranks: int = 1) -> None:
        self.config = config
        self.can_rollback = can_rollback
        self.num_ranks = num_ranks
        self.consecutive_skips = 0
        self.consecutive_overflow_skips = 0
        self.consecutive_data_skips = 0
        self.skipped_steps = 0
        # the ranks a run of overflow skips blamed, each time the same (not every rank), and the run's length
        self.overflow_ranks: tuple[int, ...] = ()
        self.overflow_ranks_run = 0

    def _blamed_overflow(self, findings: list[Finding]) -> tuple[tuple[int, ...], int]:
        """The ranks this overflow's findings blame when not every rank, and how many overflows in a row blamed
        exactly them (this one included); ((), 0) otherwise."""
        ranks = tuple(sorted({rank for f in findings if not f.by_framework and f.action >= Action.SKIP
                              for rank in f.ranks}))
        if not ranks or len(ranks) >= self.num_ranks:
            return (), 0
        return ranks, (self.overflow_ranks_run + 1 if ranks == self.overflow_ranks else 1)

    def decide(self, step: int, findings: list[Finding], *, overflow: bool = False) -> Decision:
        if overflow:
            findings = [f if f.severity <= Severity.WARNING else dataclasses.replace(f, severity=Severity.WARNING)
                        for f in findings]
        action = max((f.action for f in findings), default=Action.NONE)
        if overflow:
            action = max(action, Action.SKIP)
        if self.config.mode == "observe":
            happened = Action.SKIP if overflow or any(f.by_framework for f in findings) else Action.NONE
            return Decision(step, happened, tuple(findings), overflow=overflow, observed=action)
        extra: list[Finding] = []
        data = not overflow and action == Action.SKIP and any(f.bad_data and f.action == Action.SKIP
                                                              for f in findings)
        blamed, run = self._blamed_overflow(findings) if overflow else ((), 0)
        if overflow and run > self.config.max_consecutive_skips:
            count, bound, key = run - 1, self.config.max_consecutive_skips, "max_consecutive_skips"
            what = (f"steps the loss scaler would skip for non-finite gradients on rank {', '.join(map(str, blamed))} "
                    "only")
            cause = "lowering the loss scale does not end it: a fault on those ranks, not the scaler's search"
        elif overflow:
            count, bound, key = (self.consecutive_overflow_skips, self.config.max_consecutive_overflow_skips,
                                 "max_consecutive_overflow_skips")
            what, cause = "steps would be skipped for a loss-scale overflow", "the fault is persistent"
        elif data:
            count, bound, key = (self.consecutive_data_skips, self.config.max_consecutive_data_skips,
                                 "max_consecutive_data_skips")
            blamed = sorted({rank for f in findings if f.bad_data for rank in f.ranks})
            what = "steps would be skipped for bad data" + (f" (rank {', '.join(map(str, blamed))})" if blamed else "")
            cause = "the bad data does not end"
        else:
            count, bound, key = (self.consecutive_skips, self.config.max_consecutive_skips, "max_consecutive_skips")
            what, cause = "steps would be skipped", "the fault is persistent"
        if action == Action.SKIP and count + 1 > bound:
            action = Action.parse(self.config.on_persistent_failure)
            extra.append(Finding(
                "policy", action, Severity.CRITICAL,
                f"{count + 1} consecutive {what} (policy.{key} = {bound}): {cause}",
                ranks=blamed, values={"consecutive_skips": count + 1, "overflow": overflow, "bad_data": data}))
        if action == Action.ROLLBACK and not self.can_rollback:
            action = Action.ABORT
            extra.append(Finding("policy", Action.ABORT, Severity.CRITICAL,
                                 "rollback requested but recovery is not enabled (recovery.enabled: false): "
                                 "stopping instead"))
        return Decision(step, action, (*findings, *extra), overflow=overflow and action == Action.SKIP,
                        data=data and action == Action.SKIP, overflow_ranks=blamed)

    def commit(self, decision: Decision) -> None:
        """Record that ``decision`` was carried out. ``skipped_steps`` counts arc_engine's own skips; a scaler's
        overflow skip neither counts there nor ends a run of them."""
        if decision.overflow:
            self.consecutive_overflow_skips += 1
            same = decision.overflow_ranks and decision.overflow_ranks == self.overflow_ranks
            self.overflow_ranks_run = self.overflow_ranks_run + 1 if same else int(bool(decision.overflow_ranks))
            self.overflow_ranks = decision.overflow_ranks
        elif decision.action == Action.SKIP and decision.data:
            self.consecutive_data_skips += 1
            self.skipped_steps += 1
        elif decision.action == Action.SKIP:
            self.consecutive_skips += 1
            self.skipped_steps += 1
        else:  # an applied step ends the runs of skips; so does a rollback (it changes the state)
            self.consecutive_skips = 0
            self.consecutive_overflow_skips = 0
            self.consecutive_data_skips = 0
        if not decision.overflow:
            self.overflow_ranks, self.overflow_ranks_run = (), 0

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive_skips": self.consecutive_skips, "skipped_steps": self.skipped_steps,
                "consecutive_overflow_skips": self.consecutive_overflow_skips,
                "consecutive_data_skips": self.consecutive_data_skips,
                "overflow_ranks": list(self.overflow_ranks), "overflow_ranks_run": self.overflow_ranks_run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive_skips = int(state["consecutive_skips"])
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_overflow_skips = int(state.get("consecutive_overflow_skips", 0))
        self.consecutive_data_skips = int(state.get("consecutive_data_skips", 0))
        self.overflow_ranks = tuple(int(rank) for rank in state.get("overflow_ranks", ()))
        self.overflow_ranks_run = int(state.get("overflow_ranks_run", 0))


def loss_finite(stats: AgreedStats) -> bool:
    """Whether the agreed loss (summed over the ranks that recorded one) is finite."""
    return names.LOSS not in stats.layout or bool(np.isfinite(stats.total(names.LOSS)).all())


def gradient_nonfinite(stats: AgreedStats) -> bool:
    """Whether any rank's local gradient or the reduced gradient holds NaN/Inf."""
    counts = stats.total(names.GRAD_NONFINITE_LOCAL)
    return bool((counts > 0).any() or not np.isfinite(counts).all()
                or not np.isfinite(stats.total(names.GRAD_SQ)).all())


def with_exit_code(decision: Decision) -> Decision:
    """An ABORT takes the exit code a finding asks for (e.g. a faulty device), else keeps the policy's."""
    if decision.action != Action.ABORT:
        return decision
    codes = [f.values["exit_code"] for f in decision.findings if f.action == Action.ABORT and "exit_code" in f.values]
    return dataclasses.replace(decision, exit_code=int(codes[0])) if codes else decision


def not_applied_cause(decision: Decision | None, framework_skipped: bool = False) -> str | None:
    """Why a step closed with ``decision`` did not reach the parameters (:data:`~arc_engine.progress.ROLLBACK`,
    :data:`~arc_engine.progress.FRAMEWORK`: the framework or its loss scaler skipped it, whatever else asked,
    :data:`~arc_engine.progress.POLICY`), None when it did. ``framework_skipped``: the framework skipped it after
    a decision that would have applied it."""
    if decision is not None and decision.action == Action.ROLLBACK:
        return ROLLBACK
    if decision is not None and not decision.applies_update:
        by_framework = decision.overflow or any(f.by_framework for f in decision.findings)
        return FRAMEWORK if by_framework else POLICY
    return FRAMEWORK if framework_skipped else None

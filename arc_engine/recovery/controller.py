"""The ARC recovery state machine (paper §3.1, Algorithm 1): TRAINING -> RECOVERING -> ESCAPING.

Pure bookkeeping over agreed decisions, so every rank holds the same state and resolves a failure the same way:

* a ROLLBACK decision returns to the newest verified-stable state and heals (learning rate x
  ``lr_reduction_factor``, compounding over consecutive rollbacks, then back to the scheduled rate linearly over
  ``lr_recovery_steps`` healthy steps);
* after ``max_consecutive_rollbacks`` rollbacks with no new verified-stable state in between, the next failure
  ESCAPES (rollback plus weight perturbation plus a data skip-ahead);
* after ``max_escapes`` escapes in one episode, training stops with :data:`EXIT_RECOVERY_EXHAUSTED`, so a
  persistent failure can never loop forever. An episode ends after ``lr_recovery_steps`` healthy steps.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from arc_engine.config.schema import RecoveryConfig
from arc_engine.events import Action, Finding, Severity
from arc_engine.policy.decision import EXIT_RECOVERY_EXHAUSTED, Decision


class RecoveryState(enum.Enum):
    TRAINING = "training"
    RECOVERING = "recovering"
    ESCAPING = "escaping"


class RecoveryController:
    """Counters and transitions; no tensors, no communication. ``state_dict`` survives restarts."""

    def __init__(self, config: RecoveryConfig) -> None:
        self.config = config
        self.state = RecoveryState.TRAINING
        self.stable_steps = 0           # consecutive healthy steps (since the last failure)
        self.consecutive_rollbacks = 0  # rollbacks with no new verified-stable state in between
        self.escapes = 0                # escapes in the current episode
        self.rollbacks = 0              # total, for reports
        self.total_escapes = 0
        self.lr_floor = 1.0             # the learning-rate factor right after the last rollback

    # ------------------------------------------------------------------ decisions

    def resolve(self, decision: Decision, *, has_target: bool) -> Decision:
        """Turn a ROLLBACK decision into what recovery will do: rollback, escape, skip (nothing verified to go back
        to yet) or abort (recovery exhausted). Other decisions pass through. Pure."""
        if decision.action != Action.ROLLBACK:
            return decision
        if not has_target:
            escalated = any(f.detector == "policy" for f in decision.findings)
            action = Action.ABORT if escalated else Action.SKIP
            note = Finding("recovery", action, Severity.ERROR if escalated else Severity.WARNING,
                           "rollback requested but no verified-stable state exists yet (the first one comes after "
                           f"recovery.checkpoint_freq = {self.config.checkpoint_freq} healthy steps): "
                           + ("stopping" if escalated else "skipping the step instead"))
            return dataclasses.replace(decision, action=action, findings=(*decision.findings, note))
        if self.consecutive_rollbacks < self.config.max_consecutive_rollbacks:
            return decision
        if self.escapes < self.config.max_escapes:
            note = Finding("recovery", Action.ROLLBACK, Severity.ERROR,
                           f"{self.consecutive_rollbacks} consecutive rollbacks did not clear the failure: escaping "
                           f"(perturb weights x {self.config.perturbation_scale}, skip "
                           f"{self.config.skip_ahead_steps} batches; escape {self.escapes + 1} of "
                           f"{self.config.max_escapes})",
                           values={"consecutive_rollbacks": self.consecutive_rollbacks, "escapes": self.escapes})
            return dataclasses.replace(decision, escape=True, findings=(*decision.findings, note))
        note = Finding("recovery", Action.ABORT, Severity.CRITICAL,
                       f"recovery exhausted: {self.consecutive_rollbacks} consecutive rollbacks and "
                       f"{self.escapes} escapes (recovery.max_escapes = {self.config.max_escapes}) did not clear "
                       "the failure; stopping (exit code 4)",
                       values={"rollbacks": self.rollbacks, "escapes": self.escapes})
        return dataclasses.replace(decision, action=Action.ABORT, exit_code=EXIT_RECOVERY_EXHAUSTED,
                                   findings=(*decision.findings, note))

    # ------------------------------------------------------------------ transitions

    def on_rollback(self, decision: Decision) -> None:
        """A rollback (or escape) is being carried out."""
        self.lr_floor = max(self.lr_factor * self.config.lr_reduction_factor, 1e-6)
        self.rollbacks += 1
        self.stable_steps = 0
        if decision.escape:
            self.escapes += 1
            self.total_escapes += 1
            self.consecutive_rollbacks = 0
            self.state = RecoveryState.ESCAPING
        else:
            self.consecutive_rollbacks += 1
            self.state = RecoveryState.RECOVERING

    def on_healthy_step(self) -> bool:
        """An applied step. Returns True when a snapshot is due (every ``checkpoint_freq`` healthy steps)."""
        self.stable_steps += 1
        if self.state is not RecoveryState.TRAINING and self.stable_steps >= self.config.lr_recovery_steps:
            self.state, self.escapes, self.lr_floor = RecoveryState.TRAINING, 0, 1.0
        return self.stable_steps % self.config.checkpoint_freq == 0

    def on_unhealthy_step(self) -> None:
        """A skipped step (no update): the healthy run is broken, no snapshot from it."""
        self.stable_steps = 0

    def on_verified(self) -> None:
        """A new verified-stable snapshot exists: the rollbacks so far are no longer consecutive."""
        self.consecutive_rollbacks = 0
        if self.state is RecoveryState.ESCAPING:
            self.state = RecoveryState.RECOVERING

    @property
    def lr_factor(self) -> float:
        """The learning-rate multiplier for the current step: 1 in TRAINING, else a linear ramp from the floor."""
        if self.lr_floor >= 1.0:
            return 1.0
        ramp = min(1.0, self.stable_steps / self.config.lr_recovery_steps)
        return self.lr_floor + (1.0 - self.lr_floor) * ramp

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.state.value, "stable_steps": self.stable_steps,
                "consecutive_rollbacks": self.consecutive_rollbacks, "escapes": self.escapes,
                "rollbacks": self.rollbacks, "total_escapes": self.total_escapes, "lr_floor": self.lr_floor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = RecoveryState(state["state"])
        for key in ("stable_steps", "consecutive_rollbacks", "escapes", "rollbacks", "total_escapes"):
            setattr(self, key, int(state[key]))
        self.lr_floor = float(state["lr_floor"])

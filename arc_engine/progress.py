"""The training progress every rank counts alike: :class:`Progress`, the one place arc_engine's counters live
(``arc.progress``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: why a step was closed without its update reaching the parameters (:meth:`Progress.close_step`)
POLICY, ROLLBACK, FRAMEWORK = "policy", "rollback", "framework"


@dataclass
class Progress:
    """arc_engine's counters, identical on every rank of the decision group (``arc.progress``: read them, never
    write them). Each has one name and one meaning in the events, the metrics (``arc/<name>``), the summary and the
    trainer callbacks' logs (``arc_<name>``).

    ``step``: optimizer steps of the training state (it goes back on a rollback: the restored state's).
    ``iteration``: step attempts, applied or not; never goes back (fault injection and the watchdog count these).
    ``data_position``: the next batch to train on, one per step attempt (it moves past skipped data and follows
    ``recovery.skip_data`` on a rollback). Draw batches from it, not from a loop counter.
    ``applied_steps``: steps whose update reached the parameters (a rollback takes it back to the restored
    state's); what a trainer's own step counter (``global_step``) should show.
    ``monitored_steps``: steps whose statistics were agreed and judged.
    The steps closed without their update, by cause (none goes back; a step two causes skipped counts once):
    ``skipped_by_policy`` (arc_engine's policy skipped it: a detector, bad data, the data ledger),
    ``rolled_back`` (the step that decided a rollback or escape), ``skipped_by_framework`` (the framework or its
    loss scaler skipped it on its own: a DeepSpeed, GradScaler or megatron-core overflow), and their sum
    :attr:`steps_not_applied`.
    ``last_applied``: whether the last closed step's update reached the parameters."""

    step: int = 0
    iteration: int = 0
    data_position: int = 0
    applied_steps: int = 0
    monitored_steps: int = 0
    skipped_by_policy: int = 0
    rolled_back: int = 0
    skipped_by_framework: int = 0
    last_applied: bool = True

    @property
    def steps_not_applied(self) -> int:
        """Steps closed without their update, whatever the cause."""
        return self.skipped_by_policy + self.rolled_back + self.skipped_by_framework

    def close_step(self, not_applied: str | None) -> None:
        """One step attempt ends: applied (``not_applied`` None) or not, by :data:`POLICY`, :data:`ROLLBACK` or
        :data:`FRAMEWORK`."""
        self.step += 1
        self.iteration += 1
        self.data_position += 1
        self.last_applied = not_applied is None
        self.applied_steps += int(not_applied is None)
        self.skipped_by_policy += int(not_applied == POLICY)
        self.rolled_back += int(not_applied == ROLLBACK)
        self.skipped_by_framework += int(not_applied == FRAMEWORK)

    def rewind(self, step: int, data_position: int, applied_steps: int | None = None,
               iteration: int | None = None) -> None:
        """After a rollback or resume (where the restored state recorded them, the applied steps and attempt)."""
        self.step, self.data_position = int(step), int(data_position)
        if applied_steps is not None:
            self.applied_steps = int(applied_steps)
        if iteration is not None:
            self.iteration = int(iteration)

    def counts(self) -> dict[str, int]:
        """The counts the summary and the metrics report, by name (``steps_not_applied`` included)."""
        return {"steps": self.step, "iterations": self.iteration, "applied_steps": self.applied_steps,
                "monitored_steps": self.monitored_steps, "steps_not_applied": self.steps_not_applied,
                "skipped_by_policy": self.skipped_by_policy, "rolled_back": self.rolled_back,
                "skipped_by_framework": self.skipped_by_framework}

    def metrics(self) -> dict[str, float]:
        """What every monitored step's metrics carry (``arc/<name>``; ``arc/step`` is every metric row's step)."""
        return {"arc/iteration": float(self.iteration), "arc/applied_steps": float(self.applied_steps),
                "arc/steps_not_applied": float(self.steps_not_applied),
                "arc/skipped_by_policy": float(self.skipped_by_policy), "arc/rolled_back": float(self.rolled_back),
                "arc/skipped_by_framework": float(self.skipped_by_framework)}

    def counters(self) -> dict[str, Any]:
        """The cumulative counters a rollback keeps but a restart restores."""
        return {"iteration": self.iteration, "monitored_steps": self.monitored_steps,
                "skipped_by_policy": self.skipped_by_policy, "rolled_back": self.rolled_back,
                "skipped_by_framework": self.skipped_by_framework}

    def load_counters(self, state: dict[str, Any]) -> None:
        """Take back :meth:`counters` (a checkpoint of an earlier release: its not-applied steps unsplit, counted as
        the policy's besides the framework's)."""
        self.iteration = int(state["iteration"])
        self.monitored_steps = int(state["monitored_steps"])
        if "skipped_by_policy" in state:
            self.skipped_by_policy = int(state["skipped_by_policy"])
            self.rolled_back = int(state["rolled_back"])
            self.skipped_by_framework = int(state["skipped_by_framework"])
        else:
            self.skipped_by_framework = int(state.get("framework_skipped_steps", 0))
            self.skipped_by_policy = max(int(state.get("unapplied_steps", 0)) - self.skipped_by_framework, 0)
            self.rolled_back = 0

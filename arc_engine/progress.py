"""The training progress every rank counts alike: steps, attempts, data positions, applied and unapplied steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Progress:
    """``step``: optimizer steps of the training state (goes back on a rollback); ``iteration``: step attempts,
    monotonic; ``data_position``: the next batch to train on, one per step; ``applied_steps``: steps whose update
    reached the parameters (rewound on rollback); ``unapplied_steps``: steps closed without it (never goes back)."""

    step: int = 0
    iteration: int = 0
    data_position: int = 0
    applied_steps: int = 0
    unapplied_steps: int = 0
    monitored_steps: int = 0
    framework_skipped_steps: int = 0
    last_applied: bool = True

    def close_step(self, applied: bool) -> None:
        self.step += 1
        self.iteration += 1
        self.data_position += 1
        self.last_applied = applied
        self.applied_steps += int(applied)
        self.unapplied_steps += int(not applied)

    def rewind(self, step: int, data_position: int, applied_steps: int | None = None,
               iteration: int | None = None) -> None:
        """After a rollback or resume (where the restored state recorded them, the applied steps and attempt)."""
        self.step, self.data_position = int(step), int(data_position)
        if applied_steps is not None:
            self.applied_steps = int(applied_steps)
        if iteration is not None:
            self.iteration = int(iteration)

    def counters(self) -> dict[str, Any]:
        """The cumulative counters a rollback keeps but a restart restores."""
        return {"iteration": self.iteration, "monitored_steps": self.monitored_steps,
                "framework_skipped_steps": self.framework_skipped_steps, "unapplied_steps": self.unapplied_steps}

    def load_counters(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.monitored_steps = int(state["monitored_steps"])
        self.framework_skipped_steps = int(state["framework_skipped_steps"])
        self.unapplied_steps = int(state.get("unapplied_steps", 0))


class Counted:
    """An attribute of the owner's :class:`Progress` (``owner.progress``), read and written through the owner."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj.progress, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.progress, self.name, value)

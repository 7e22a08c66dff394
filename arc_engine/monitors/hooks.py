"""The hooks a step's monitors override (:class:`~arc_engine.monitors.base.Monitor`'s optional methods), gathered
once, so that the engine calls lists and a hook no monitor overrides costs nothing per step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from arc_engine.monitors.base import Monitor, overrides
from arc_engine.stats import AgreedStats, StatBuffer

if TYPE_CHECKING:
    from arc_engine.policy import Decision


@dataclass
class MonitorHooks:
    """The monitors' optional methods, by role (see the module docstring)."""

    on_start: list[Callable[[dict[int, str]], None]] = field(default_factory=list)
    before_agreement: list[tuple[str, Callable[[StatBuffer], None]]] = field(default_factory=list)
    observers: list[Callable[[Decision], None]] = field(default_factory=list)
    validation: list[Callable[[float], None]] = field(default_factory=list)
    rank_reporters: list[Monitor] = field(default_factory=list)
    gradient_factors: list[Callable[[AgreedStats], float]] = field(default_factory=list)
    shapers: list[Monitor] = field(default_factory=list)  # the update shapers (before_update)

    @classmethod
    def gather(cls, monitors: Sequence[Monitor]) -> MonitorHooks:
        hooks = cls()
        for monitor in monitors:
            if overrides(monitor, "on_start"):
                hooks.on_start.append(monitor.on_start)
            if overrides(monitor, "before_agreement"):
                hooks.before_agreement.append((monitor.name, monitor.before_agreement))
            if overrides(monitor, "observe"):
                hooks.observers.append(monitor.observe)
            if overrides(monitor, "record_validation_loss"):
                hooks.validation.append(monitor.record_validation_loss)
            if overrides(monitor, "rank_metrics"):
                hooks.rank_reporters.append(monitor)
            if overrides(monitor, "gradient_coefficient"):
                hooks.gradient_factors.append(monitor.gradient_coefficient)
            if overrides(monitor, "before_update"):
                hooks.shapers.append(monitor)
        return hooks

    def gradient_factor(self, stats: AgreedStats) -> float:
        """The product of the monitors' gradient coefficients for this step's agreed statistics."""
        coefficient = 1.0
        for factor in self.gradient_factors:
            coefficient *= factor(stats)
        return coefficient

    @property
    def shaping(self) -> bool:
        """Whether a monitor shapes updates or rollbacks."""
        return bool(self.shapers)

    def before_update(self, param_groups: list[dict[str, Any]], step: int) -> None:
        """The shapers with work on ``step`` see the optimizer's stepped tensors; the parameter list is walked only
        on such a step."""
        due = [shaper for shaper in self.shapers if shaper.updates_on(step)]
        if due:
            params = [p for group in param_groups for p in group["params"]]
            for shaper in due:
                shaper.before_update(params, step)

    def set_reference(self) -> None:
        for shaper in self.shapers:
            shaper.set_reference()

    def before_restore(self) -> None:
        for shaper in self.shapers:
            shaper.before_restore()

    def after_restore(self, step: int) -> bool:
        """True when a shaper edited the restored tensors (the same on every rank)."""
        edited = False
        for shaper in self.shapers:
            edited = shaper.after_restore(step) or edited
        return edited

"""The optional methods of a step's monitors, gathered once, so the engine calls lists and never asks a monitor.

Besides the :class:`~arc_engine.monitors.base.Monitor` contract a monitor may define any of these, and is then
called at that point of every step (locally, with values identical on every rank):

* ``on_start(locations)``: once, with the job's ``global rank -> "host:device"``;
* ``before_agreement(buffer)``: write what only this monitor knows of this rank into the step's buffer;
* ``observe(decision)``: every agreed decision after its commit, the framework's own skips included;
* ``record_validation_loss(value)``: a validation loss the loop recorded;
* ``rank_metrics()``: per-rank values for ``ranks.jsonl`` on the steps that gathered them;
* ``gradient_coefficient(stats)``: a factor for this step's gradients;
* the :class:`UpdateShaper` methods: it reads or edits the update and takes part in a rollback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from arc_engine.monitors.base import Monitor
from arc_engine.stats import AgreedStats, StatBuffer

if TYPE_CHECKING:
    from arc_engine.policy import Decision


class UpdateShaper(Protocol):
    """A monitor that shapes the update or a rollback (``detectors.fisher``: the Fisher estimate, the EWC penalty,
    the importance-weighted rollback)."""

    def updates_on(self, step: int) -> bool:
        """Whether :meth:`before_update` has work on ``step`` (the same on every rank)."""
        ...

    def before_update(self, params: list[torch.Tensor], step: int) -> None:
        """In an applied optimizer step, before the update, with the stepped tensors (their gradients final)."""
        ...

    def set_reference(self) -> None:
        """The live state is the one training continues from safely (a verified snapshot, an escape's state)."""
        ...

    def before_restore(self) -> None:
        """Recovery is about to restore a snapshot over the live state."""
        ...

    def after_restore(self, step: int) -> bool:
        """Recovery restored a snapshot of ``step``; True when this edited the stepped tensors."""
        ...


@dataclass
class MonitorHooks:
    """The monitors' optional methods, by role (see the module docstring)."""

    on_start: list[Callable[[dict[int, str]], None]] = field(default_factory=list)
    before_agreement: list[tuple[str, Callable[[StatBuffer], None]]] = field(default_factory=list)
    observers: list[Callable[[Decision], None]] = field(default_factory=list)
    validation: list[Callable[[float], None]] = field(default_factory=list)
    rank_reporters: list[Any] = field(default_factory=list)
    gradient_factors: list[Callable[[AgreedStats], float]] = field(default_factory=list)
    shapers: list[UpdateShaper] = field(default_factory=list)

    @classmethod
    def gather(cls, monitors: Sequence[Monitor]) -> MonitorHooks:
        hooks = cls()
        for monitor in monitors:
            if (method := getattr(monitor, "on_start", None)) is not None:
                hooks.on_start.append(method)
            if (method := getattr(monitor, "before_agreement", None)) is not None:
                hooks.before_agreement.append((monitor.name, method))
            if (method := getattr(monitor, "observe", None)) is not None:
                hooks.observers.append(method)
            if (method := getattr(monitor, "record_validation_loss", None)) is not None:
                hooks.validation.append(method)
            if getattr(monitor, "rank_metrics", None) is not None:
                hooks.rank_reporters.append(monitor)
            if (method := getattr(monitor, "gradient_coefficient", None)) is not None:
                hooks.gradient_factors.append(method)
            if getattr(monitor, "before_update", None) is not None:
                hooks.shapers.append(monitor)  # type: ignore[arg-type]
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

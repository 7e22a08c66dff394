"""The monitor seam: :class:`Monitor`, the base class of every detector family's monitors, with no-op defaults."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from arc_engine.events import Finding
from arc_engine.seams import check_overrides
from arc_engine.stats import AgreedStats, StatBuffer, StatLayout

if TYPE_CHECKING:
    from arc_engine.policy import Decision


class Monitor:
    """A detector: pure math over gathered statistics plus a little state. Subclass it and override what the
    detector needs; the engine calls every method directly (a hook left alone does nothing and costs nothing: the
    hooks a monitor overrides are gathered once, :class:`~arc_engine.monitors.hooks.MonitorHooks`).

    Lifecycle per monitored step, identical on every rank:

    1. :meth:`evaluate` reads the agreed statistics (never device tensors) and returns findings. It must not
       mutate history: the step may yet be skipped. It reads agreed totals; per-rank values
       (:meth:`AgreedStats.per_rank`, a collective on first use) only on a branch decided from agreed totals,
       so that every rank asks at the same point.
    2. :meth:`commit` is told whether the step was applied; only then does the monitor fold the step's
       values into its baselines.

    :meth:`state_dict` / :meth:`load_state_dict` make a monitor survive a rollback or restart. The optional hooks
    (called locally, with values identical on every rank) follow. A method whose name starts like a hook's
    (``on_``, ``before_``, ``after_``, ``record_``, ...) but is none of them is a TypeError when the class is
    defined: a misspelt override would never run.
    """

    name: str = ""

    HOOK_PREFIXES = ("on_", "before_", "after_", "record_", "rank_", "gradient_", "updates_", "set_", "observe")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_overrides(cls, Monitor, Monitor.HOOK_PREFIXES)

    # ------------------------------------------------------------------ the contract

    def required_stats(self) -> tuple[str, ...]:
        """Slots this monitor reads; it is disabled (with a warning) when a slot is not in the layout."""
        return ()

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        raise NotImplementedError

    def commit(self, step: int, applied: bool) -> None:
        """Whether monitored step ``step`` was applied: fold its values into the baselines only then."""

    def metrics(self) -> dict[str, float]:
        """The latest values worth plotting (``arc/<name>/...`` in metric sinks)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned."""

    # ------------------------------------------------------------------ optional hooks (no-op defaults)

    def on_start(self, locations: dict[int, str]) -> None:
        """Once, at the engine's start, with the job's ``global rank -> "host:device"``."""

    def before_agreement(self, buffer: StatBuffer) -> None:
        """Write what only this monitor knows of this rank (e.g. its own history) into the step's buffer, right
        before the agreement."""

    def observe(self, decision: Decision) -> None:
        """Every agreed decision after its commit, the framework's own skips included."""

    def record_validation_loss(self, value: float) -> None:
        """A validation loss the loop recorded."""

    def rank_metrics(self) -> dict[str, dict[int, float]]:
        """Per-rank values for ``ranks.jsonl`` on the steps that gathered them (``name -> rank -> value``)."""
        return {}

    def gradient_coefficient(self, stats: AgreedStats) -> float:
        """A factor for this step's gradients (from the agreed statistics). Default 1."""
        return 1.0

    # the update shaper's hooks (``detectors.fisher``: the Fisher estimate, the EWC penalty, the importance-weighted
    # rollback): a monitor that overrides :meth:`before_update` reads or edits the update and takes part in a
    # rollback

    def updates_on(self, step: int) -> bool:
        """Whether :meth:`before_update` has work on ``step`` (the same on every rank)."""
        return False

    def before_update(self, params: list[torch.Tensor], step: int) -> None:
        """In an applied optimizer step, before the update, with the stepped tensors (their gradients final)."""

    def set_reference(self) -> None:
        """The live state is the one training continues from safely (a verified snapshot, an escape's state)."""

    def before_restore(self) -> None:
        """Recovery is about to restore a snapshot over the live state."""

    def after_restore(self, step: int) -> bool:
        """Recovery restored a snapshot of ``step``; True when this edited the stepped tensors."""
        return False


def overrides(monitor: Monitor, hook: str) -> bool:
    """Whether ``monitor``'s class overrides ``hook`` (one of :class:`Monitor`'s methods)."""
    return getattr(type(monitor), hook) is not getattr(Monitor, hook)


def missing_stats(monitor: Monitor, layout: StatLayout) -> list[str]:
    """The slots ``monitor`` needs that ``layout`` lacks."""
    return [name for name in monitor.required_stats() if name not in layout]

"""The monitor contract shared by every detector family."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from arc_engine.events import Finding
from arc_engine.stats import AgreedStats, StatLayout


@runtime_checkable
class Monitor(Protocol):
    """A detector: pure math over gathered statistics plus a little state.

    Lifecycle per monitored step, identical on every rank:

    1. :meth:`evaluate` reads the agreed statistics (never device tensors) and returns findings. It must not
       mutate history: the step may yet be skipped. It reads agreed totals; per-rank values
       (:meth:`AgreedStats.per_rank`, a collective on first use) only on a branch decided from agreed totals,
       so that every rank asks at the same point.
    2. :meth:`commit` is told whether the step was applied; only then does the monitor fold the step's
       values into its baselines.

    ``state_dict`` / ``load_state_dict`` make a monitor survive a rollback or restart.

    Optionally, ``before_agreement(buffer)`` writes values only the monitor holds for this rank (e.g. its own
    history) into the step's buffer right before the agreement; ``observe(decision)`` sees every agreed decision
    after the commit (the framework's own skips included); ``record_validation_loss(value)`` takes what the loop
    records after an evaluation.
    """

    name: str

    def required_stats(self) -> tuple[str, ...]:
        """Slots this monitor reads; it is disabled (with a warning) when a slot is not in the layout."""
        ...

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]: ...

    def commit(self, step: int, applied: bool) -> None: ...

    def metrics(self) -> dict[str, float]:
        """The latest values worth plotting (``arc/<name>/...`` in metric sinks)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def missing_stats(monitor: Monitor, layout: StatLayout) -> list[str]:
    """The slots ``monitor`` needs that ``layout`` lacks."""
    return [name for name in monitor.required_stats() if name not in layout]

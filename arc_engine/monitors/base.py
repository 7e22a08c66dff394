"""The monitor contract shared by every detector family."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from arc_engine.events import Finding
from arc_engine.stats import GatheredStats, StatLayout


@runtime_checkable
class Monitor(Protocol):
    """A detector: pure math over gathered statistics plus a little state.

    Lifecycle per monitored step, identical on every rank:

    1. :meth:`evaluate` reads the gathered statistics (never device tensors, never a collective) and
       returns findings. It must not mutate history: the step may yet be skipped.
    2. :meth:`commit` is told whether the step was applied; only then does the monitor fold the step's
       values into its baselines.

    ``state_dict`` / ``load_state_dict`` make a monitor survive a rollback or restart.
    """

    name: str

    def required_stats(self) -> tuple[str, ...]:
        """Slots this monitor reads; it is disabled (with a warning) when a slot is not in the layout."""
        ...

    def evaluate(self, step: int, stats: GatheredStats) -> list[Finding]: ...

    def commit(self, step: int, applied: bool) -> None: ...

    def metrics(self) -> dict[str, float]:
        """The latest values worth plotting (``arc/<name>/...`` in metric sinks)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def missing_stats(monitor: Monitor, layout: StatLayout) -> list[str]:
    """The slots ``monitor`` needs that ``layout`` lacks."""
    return [name for name in monitor.required_stats() if name not in layout]

"""The protocols between the engine and the parts that act at its step points without being monitors.

The engine knows them only by these protocols: the recovery loop (:class:`Recovering`), the SDC recomputation
(:class:`StatsResolver`), anything with work at each step's start (:class:`StepHooks`, e.g. the straggler family's
compute probe). They in turn see the engine only as :class:`EngineAccess`, so neither imports the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch.distributed as dist

    from arc_engine.config.schema import ArcConfig
    from arc_engine.data_ledger import DataLedger
    from arc_engine.events import Finding, Severity
    from arc_engine.gathering import StepGathering
    from arc_engine.monitors.hooks import MonitorHooks
    from arc_engine.own_work import OwnWork
    from arc_engine.policy import Decision
    from arc_engine.progress import Progress
    from arc_engine.stats import AgreedStats, StatBuffer


class StepHooks(Protocol):
    """Work at the start of every step attempt (before its first forward) and at the engine's close."""

    def on_step_start(self, step: int) -> None: ...

    def close(self) -> None: ...


class Recovering(StepHooks, Protocol):
    """The rollback loop (:class:`arc_engine.recovery.rollback.Recovery`): it may turn a decision into a rollback,
    carries one out when the framework's step has returned, and heals the steps after it."""

    def on_decision(self, decision: Decision) -> Decision: ...

    def on_step_end(self, decision: Decision | None) -> None: ...

    def settle(self) -> None:
        """Carry out the rollback planned in the step just closed (tensors and counters together; collective for
        the disk tier). Nothing to do without one."""
        ...

    def clip_coefficient(self) -> float:
        """The healing gradient clip of the current step (1.0 in normal training)."""
        ...

    @property
    def lr_factor(self) -> float:
        """The healing learning-rate factor of the current step (1.0 in normal training)."""
        ...

    @property
    def rollbacks(self) -> int: ...

    def summary(self) -> dict[str, Any]: ...


Evaluate = Callable[["AgreedStats"], list["Finding"]]


class StatsResolver(StepHooks, Protocol):
    """Corrects a step's agreed statistics before the verdict (the SDC recomputation: a rank that withheld its
    gradient, or a step every rank recomputes)."""

    def judge(self, stats: AgreedStats, evaluate: Evaluate, regather: Callable[[], AgreedStats]
              ) -> tuple[AgreedStats, list[Finding], list[Finding]]:
        """Collective. ``evaluate(stats)`` runs the monitors; ``regather()`` agrees again after a correction.
        Returns the statistics to judge the step by, the monitors' findings on them, and findings of its own."""
        ...

    def write_local_stats(self, buffer: StatBuffer) -> None:
        """Before a re-agreement: this rank's recomputed pre-reduction statistics (nothing where it recomputed
        nothing)."""
        ...


class EngineAccess(Protocol):
    """What recovery and the SDC recomputation use of the engine."""

    config: ArcConfig
    group: dist.ProcessGroup | None
    rank: int
    run_id: str
    run_dir: Path
    progress: Progress
    locations: dict[int, str]
    ledger: DataLedger
    own_work: OwnWork
    hooks: MonitorHooks
    gathering: StepGathering
    buffer: StatBuffer | None
    last_decision: Decision | None
    last_stats: AgreedStats | None

    def emit_action(self, step: int, action: str, severity: Severity, message: str, values: dict[str, Any], *,
                    detector: str = "recovery") -> None: ...

    def emit_lifecycle(self, what: str, message: str, values: dict[str, Any] | None = None) -> None: ...

    def rewind(self, step: int, data_position: int, applied_steps: int | None = None,
               iteration: int | None = None) -> None: ...

    def counters_state_dict(self) -> dict[str, Any]: ...

    def wants_optimizer_stats(self) -> bool: ...

    def is_monitored(self) -> bool: ...

    def load_counters_state_dict(self, state: dict[str, Any]) -> None: ...

    def paused(self) -> contextlib.AbstractContextManager[None]: ...

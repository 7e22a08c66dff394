"""The sink contract and the dispatcher that keeps a failing sink from ever stopping training."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from arc_engine.events import Event
from arc_engine.seams import check_overrides

log = logging.getLogger("arc_engine.sinks")


class Sink:
    """Receives events and metrics: the base class of every sink (a sink of your own too: subclass it and override
    what it keeps). Called on the training thread of the ranks that own sinks (rank 0 by default):
    implementations must be quick, or hand work to a background thread (the W&B sink does)."""

    name: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_overrides(cls, Sink, ("emit", "log_"))

    def emit(self, event: Event) -> None:
        """One event (a detection, an action, a lifecycle event)."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """The step's metrics (``arc/...``)."""

    def log_ranks(self, step: int, iteration: int, values: dict[str, dict[int, float]], ranks: int) -> None:
        """Per-rank statistics (``name -> rank -> value``) on the steps that gathered them (the JSONL sink keeps
        them in ``ranks.jsonl``)."""

    def close(self) -> None:
        """At the end of the run (flush, finish)."""


class SinkSet:
    """Fans events out to sinks. A sink that raises is reported once (logging) and disabled after
    ``max_failures`` consecutive errors; training never sees the exception. Thread-safe: the hang watchdog reports
    from its own thread; a call waits at most ``LOCK_TIMEOUT_S`` for another one and is dropped (logged) after."""

    LOCK_TIMEOUT_S = 10.0

    def __init__(self, sinks: list[Sink] | None = None, max_failures: int = 3) -> None:
        self.sinks: list[Sink] = list(sinks or [])
        self.max_failures = max_failures
        self._failures: dict[str, int] = {}
        self.disabled: set[str] = set()
        self._lock = threading.RLock()

    def add(self, sink: Sink) -> None:
        if not isinstance(sink, Sink):
            raise TypeError(f"arc_engine sinks: {type(sink).__name__} is not a Sink (subclass "
                            "arc_engine.sinks.Sink and override emit / log_metrics / log_ranks / close)")
        self.sinks.append(sink)

    def emit(self, event: Event) -> None:
        for sink in self._active():
            self._call(sink, sink.emit, event)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self._active():
            self._call(sink, sink.log_metrics, step, metrics)

    def log_ranks(self, step: int, iteration: int, values: dict[str, dict[int, float]], ranks: int) -> None:
        """Per-rank statistics, to the sinks that keep them (``log_ranks``: the JSONL sink)."""
        for sink in self._active():
            self._call(sink, sink.log_ranks, step, iteration, values, ranks)

    def close(self) -> None:
        for sink in self._active():
            self._call(sink, sink.close)

    def _active(self) -> list[Sink]:
        return [s for s in self.sinks if s.name not in self.disabled]

    def _call(self, sink: Sink, method: Callable[..., None], *args: object) -> None:
        if not self._lock.acquire(timeout=self.LOCK_TIMEOUT_S):
            log.warning("arc_engine sink %r: %s dropped (another thread has held the sinks for %.0f s)",
                        sink.name, method.__name__, self.LOCK_TIMEOUT_S)
            return
        try:
            method(*args)
            self._failures[sink.name] = 0
        except Exception as err:  # a sink must never stop training
            count = self._failures.get(sink.name, 0) + 1
            self._failures[sink.name] = count
            if count == 1:
                log.warning("arc_engine sink %r failed in %s (%s: %s); training continues",
                            sink.name, method.__name__, type(err).__name__, err)
            if count >= self.max_failures:
                self.disabled.add(sink.name)
                log.warning("arc_engine sink %r disabled after %d consecutive failures", sink.name, count)
        finally:
            self._lock.release()

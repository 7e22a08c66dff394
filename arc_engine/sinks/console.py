"""A readable console sink: one line per event, colored by severity when the stream is a terminal."""

from __future__ import annotations

import sys
from typing import TextIO

from arc_engine.events import Event, Severity
from arc_engine.sinks.base import Sink

_COLORS = {Severity.DEBUG: "2", Severity.INFO: "36", Severity.WARNING: "33", Severity.ERROR: "31",
           Severity.CRITICAL: "1;31"}


def format_event(event: Event, color: bool = False) -> str:
    """``[arc] step 30 ERROR   non_finite -> SKIP | ranks [1] | message``."""
    level = event.severity.name
    level = f"\x1b[{_COLORS[event.severity]}m{level:<8}\x1b[0m" if color else f"{level:<8}"
    ranks = f" | ranks {list(event.ranks)}" if event.ranks else ""
    action = f" -> {event.action.upper()}" if event.action not in ("", "none") else ""
    return f"[arc] step {event.step:>6} {level} {event.detector}{action}{ranks} | {event.message}"


class ConsoleSink(Sink):
    """Prints events at or above ``min_severity``; metrics are not printed (they go to files/W&B)."""

    name = "console"

    def __init__(self, min_severity: Severity = Severity.INFO, color: str = "auto",
                 stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.min_severity = min_severity
        self.color = color == "always" or (color == "auto" and self.stream.isatty())

    def emit(self, event: Event) -> None:
        if event.severity >= self.min_severity:
            print(format_event(event, self.color), file=self.stream, flush=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        return None

    def close(self) -> None:
        self.stream.flush()

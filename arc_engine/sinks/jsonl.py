"""Append-only JSON-lines logs: ``events.jsonl``, ``metrics.jsonl`` and ``ranks.jsonl`` in the run directory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO

from arc_engine.events import Event, json_safe
from arc_engine.sinks.base import Sink


class JsonlSink(Sink):
    """One JSON object per line, flushed per record so a crash never leaves a half-written line behind
    the last complete one (readers may drop a trailing partial line)."""

    name = "jsonl"

    def __init__(self, events_path: Path, metrics_path: Path, ranks_path: Path | None = None) -> None:
        self.events_path = events_path
        self.metrics_path = metrics_path
        self.ranks_path = ranks_path
        events_path.parent.mkdir(parents=True, exist_ok=True)
        self._events: IO[str] = open(events_path, "a", encoding="utf-8")  # noqa: SIM115
        self._metrics: IO[str] = open(metrics_path, "a", encoding="utf-8")  # noqa: SIM115
        self._ranks: IO[str] | None = None  # opened at the first per-rank record

    def emit(self, event: Event) -> None:
        self._write(self._events, event.to_json())

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._write(self._metrics, json.dumps({"step": step, **json_safe(metrics)}, sort_keys=True))

    def log_ranks(self, step: int, iteration: int, values: dict[str, dict[int, float]], ranks: int) -> None:
        """One line of per-rank statistics: ``{"step", "iteration", "ranks" (the group's size), "values": {name:
        {global rank: value}}}``."""
        if self.ranks_path is None:
            return
        if self._ranks is None:
            self._ranks = open(self.ranks_path, "a", encoding="utf-8")  # noqa: SIM115
        record = {"step": step, "iteration": iteration, "ranks": ranks,
                  "values": {name: {str(rank): value for rank, value in per_rank.items()}
                             for name, per_rank in values.items()}}
        self._write(self._ranks, json.dumps(json_safe(record), sort_keys=True))

    def close(self) -> None:
        for handle in (self._events, self._metrics, self._ranks):
            if handle is not None and not handle.closed:
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()

    @staticmethod
    def _write(handle: IO[str], line: str) -> None:
        handle.write(line + "\n")
        handle.flush()


def read_jsonl(path: Path) -> list[dict]:
    """Parse a JSONL file written by :class:`JsonlSink`, ignoring a trailing partial line."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records

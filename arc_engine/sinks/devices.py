"""The device ledger's writer: a sink that appends each hardware finding to ``devices.jsonl``
(:mod:`arc_engine.device_ledger` holds the rule and the reader)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from arc_engine.device_ledger import append_line
from arc_engine.events import Event
from arc_engine.sinks.base import Sink

log = logging.getLogger("arc_engine")


class DeviceLedgerSink(Sink):
    """Appends the job's hardware evidence to the device ledger (added by the reporter on the decision group's
    first rank; its successor writes a lost leader's). ``locations``: global rank -> ``host:device``; ``run_id``: this
    run's id; ``launch``: the launch's name, the same on every rank (default: made here).
    A write that fails is reported once; training goes on."""

    def __init__(self, path: Path, locations: dict[int, str], run_id: str, launch: str | None = None) -> None:
        self.path, self.locations, self.run_id = path, dict(locations), run_id
        self.launch = launch or f"{run_id}@{time.time():.3f}"
        self._seen: set[tuple[int, int, str]] = set()
        self._warned = False

    def emit(self, event: Event) -> None:
        kind = event.values.get("hardware") if event.kind == "detection" else None
        if not kind:
            return
        blamed = [int(r) for r in event.values.get("hardware_ranks", event.ranks)]
        if not blamed or len(set(blamed)) >= len(self.locations) > 1:  # the whole job's, not a device's
            return
        for rank in sorted(set(blamed)):
            key = (rank, event.iteration, str(kind))
            if key in self._seen:
                continue
            self._seen.add(key)
            host, _, device = self.locations.get(rank, "?:?").partition(":")
            self._write({"time": event.time, "run": self.run_id, "launch": self.launch, "step": event.step,
                         "iteration": event.iteration, "rank": rank, "host": host, "device": device,
                         "evidence": kind, "detector": event.detector, "message": event.message[:300],
                         "data_position": event.values.get("data_position")})

    def _write(self, record: dict[str, Any]) -> None:
        try:
            append_line(self.path, record)
        except OSError as err:
            if not self._warned:
                self._warned = True
                log.warning("arc_engine: the device ledger %s cannot be written (%s): hardware evidence is in the "
                            "events only", self.path, err)


__all__ = ["DeviceLedgerSink"]

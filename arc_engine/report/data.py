"""What a run report reads from a run directory: the event log, the metrics and the per-rank statistics that the
JSONL sink wrote (``events.jsonl``, ``metrics.jsonl``, ``ranks.jsonl``; with ``sinks.all_ranks`` the files carry a
``.rank<N>`` suffix and rank 0's are read). Pure Python, no torch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arc_engine import stop_record
from arc_engine.sinks import read_jsonl

#: Actions drawn on the timeline, and how (matplotlib marker / line style per action).
MARKED_ACTIONS = ("skip", "recompute", "rollback", "escape", "checkpoint", "abort")
#: Severities at which an event is an alert (what W&B's ``wandb.alert`` receives at its default level).
ALERT_SEVERITIES = frozenset({"error", "critical"})


@dataclass
class RunData:
    """One run's records. ``series``: metric name -> (iterations, values); ``ranks``: statistic name -> list of
    (iteration, {global rank: value}); ``summary``: the summary event's values (empty when the run did not close)."""

    run_dir: Path
    run_id: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    ranks: dict[str, list[tuple[int, dict[int, float]]]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    attached: dict[str, Any] = field(default_factory=dict)
    stop: dict[str, Any] | None = None  # stop.json: why the run stopped (arc_engine.stop_record)

    @property
    def findings(self) -> list[dict[str, Any]]:
        """Detections and actions, in order."""
        return [e for e in self.events if e.get("kind") in ("detection", "action")]

    def monitors(self) -> dict[str, list[str]]:
        """Monitor name -> its metric names (``arc/<monitor>/<name>``), in first-seen order."""
        found: dict[str, list[str]] = defaultdict(list)
        for name in self.series:
            parts = name.split("/")
            if len(parts) >= 3 and parts[0] == "arc":
                found[parts[1]].append(name)
        return dict(found)


def _number(value: Any) -> float:
    try:
        return float(value)  # the JSONL sink writes NaN and Inf as strings
    except (TypeError, ValueError):
        return math.nan


def _find(run_dir: Path, name: str) -> Path | None:
    for candidate in (run_dir / name, run_dir / f"{name}.rank0"):
        if candidate.is_file():
            return candidate
    return None


def load_run(run_dir: Path) -> RunData:
    """Read a run directory. Raises FileNotFoundError when it holds no event log."""
    events_path = _find(run_dir, "events.jsonl")
    if events_path is None:
        raise FileNotFoundError(f"{run_dir}: no events.jsonl (an arc_engine run directory has one; "
                                f"is sinks.jsonl.enabled off?)")
    data = RunData(run_dir=run_dir, events=read_jsonl(events_path), stop=stop_record.read(run_dir))
    for event in data.events:
        data.run_id = data.run_id or str(event.get("run_id", ""))
        if event.get("kind") == "lifecycle" and event.get("detector") == "summary":
            data.summary = dict(event.get("values", {}))
        if event.get("kind") == "lifecycle" and event.get("detector") == "start":
            data.attached = {"message": event.get("message", "")}
    metrics_path = _find(run_dir, "metrics.jsonl")
    if metrics_path is not None:
        columns: dict[str, tuple[list[int], list[float]]] = {}
        for record in read_jsonl(metrics_path):
            iteration = int(_number(record.get("arc/iteration", record.get("step", 0))))
            for name, value in record.items():
                if name in ("step", "arc/iteration"):
                    continue
                xs, ys = columns.setdefault(name, ([], []))
                xs.append(iteration)
                ys.append(_number(value))
        data.series = columns
    ranks_path = _find(run_dir, "ranks.jsonl")
    if ranks_path is not None:
        for record in read_jsonl(ranks_path):
            iteration = int(record.get("iteration", record.get("step", 0)))
            for name, values in record.get("values", {}).items():
                per_rank = {int(rank): _number(value) for rank, value in values.items()}
                data.ranks.setdefault(name, []).append((iteration, per_rank))
    return data


__all__ = ["ALERT_SEVERITIES", "MARKED_ACTIONS", "RunData", "load_run"]

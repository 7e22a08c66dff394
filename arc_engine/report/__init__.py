"""``arc-engine report RUN_DIR``: a static HTML page with PNG figures of one arc_engine run, written to
``RUN_DIR/report/index.html`` -- what an engineer opens after a night's run.

The page holds the run's summary table; the loss over step attempts with every detection, skip, recomputation,
rollback, escape, checkpoint and alert marked; one panel per monitor family (each of its metrics over steps, its
detections marked); the per-rank statistics (``ranks.jsonl``: a line per rank); and the list of detections and
actions. It reads only the run directory's JSONL files (:mod:`arc_engine.report.data`), so it works on a finished,
crashed or still running job, and on a copy of the folder on a laptop.
"""

from __future__ import annotations

import re
from pathlib import Path

from arc_engine.report.data import RunData, load_run
from arc_engine.report.page import write_page
from arc_engine.report.plots import monitor_panels, rank_panel, timeline


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write the report of ``run_dir`` into ``out`` (default ``run_dir/report``); returns the page's path. Raises
    FileNotFoundError without an event log, RuntimeError without matplotlib."""
    data = load_run(run_dir)
    out = out or run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    figures: dict[str, list[tuple[str, str]]] = {"Timeline": [], "Monitors": [], "Per rank": []}
    timeline(data, out / "timeline.png")
    figures["Timeline"].append(("timeline.png", "loss over step attempts; vertical lines: actions; ticks at the "
                                "bottom: detections by severity; triangles at the top: alerts"))
    for monitor, names in data.monitors().items():
        name = f"monitor-{_file_name(monitor)}.png"
        monitor_panels(data, monitor, names, out / name)
        figures["Monitors"].append((name, f"{monitor}: its metrics (arc/{monitor}/...), its detections marked"))
    for statistic in data.ranks:
        name = f"ranks-{_file_name(statistic)}.png"
        rank_panel(data, statistic, out / name)
        figures["Per rank"].append((name, f"{statistic}, per rank, on the steps it was gathered"))
    return write_page(data, figures, out / "index.html")


__all__ = ["RunData", "load_run", "write_report"]

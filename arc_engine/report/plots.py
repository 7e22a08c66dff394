"""The report's figures as PNG files (matplotlib, Agg backend: no display needed).

Every figure shares the x axis of the run's step attempts (``iteration``: it keeps counting through rollbacks, so a
replay is drawn after what it replaced) and the same marks: actions as vertical lines (rollback, escape, abort,
recompute, checkpoint) or crosses (skip), detections as ticks along the bottom colored by severity, alerts as
triangles along the top.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from arc_engine.report.data import ALERT_SEVERITIES, RunData

SEVERITY_COLORS = {"debug": "#bbbbbb", "info": "#4c9be8", "warning": "#f0a020", "error": "#d62728",
                   "critical": "#7b0000"}
ACTION_STYLES = {"rollback": ("#d62728", "--"), "escape": ("#000000", "-."), "abort": ("#000000", "-"),
                 "recompute": ("#9467bd", ":"), "checkpoint": ("#2ca02c", ":")}
MAX_RANK_LINES = 16
MAX_PANELS = 9


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError("arc-engine report draws its figures with matplotlib: pip install 'arc-engine[report]' "
                           "(or matplotlib>=3.8)") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _mark(ax: Any, data: RunData, detector: str | None = None) -> None:
    """The run's events on ``ax`` (only ``detector``'s detections when given; actions always)."""
    for event in data.findings:
        x = event.get("iteration", event.get("step", 0))
        action, severity = event.get("action"), event.get("severity", "info")
        if event["kind"] == "action" and action in ACTION_STYLES:
            color, style = ACTION_STYLES[action]
            ax.axvline(x, color=color, linestyle=style, linewidth=1.2, alpha=0.8)
        elif event["kind"] == "detection" and (detector is None or event.get("detector") == detector):
            ax.plot([x], [0.0], marker="|", markersize=12, color=SEVERITY_COLORS.get(severity, "#888888"),
                    transform=ax.get_xaxis_transform(), clip_on=False)
        if severity in ALERT_SEVERITIES:
            ax.plot([x], [1.0], marker="v", markersize=7, color=SEVERITY_COLORS[severity],
                    transform=ax.get_xaxis_transform(), clip_on=False)


def _legend(ax: Any) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=color, linestyle=style, label=action)
               for action, (color, style) in ACTION_STYLES.items()]
    handles += [Line2D([], [], color=SEVERITY_COLORS[s], marker="|", linestyle="", markersize=10,
                       label=f"detection ({s})") for s in ("warning", "error", "critical")]
    handles.append(Line2D([], [], color=SEVERITY_COLORS["error"], marker="v", linestyle="", label="alert"))
    handles.append(Line2D([], [], color="#d62728", marker="x", linestyle="", label="skipped step"))
    ax.legend(handles=handles, loc="upper left", fontsize=7, ncol=4, framealpha=0.8)


def _scale(ax: Any, values: list[float]) -> None:
    finite = _finite(values)
    if finite and min(finite) > 0 and max(finite) / min(finite) > 100:
        ax.set_yscale("log")


def timeline(data: RunData, path: Path) -> Path:
    """The loss over step attempts with every action, detection and alert marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 4.2))
    name = next((n for n in ("arc/loss_spike/loss", "arc/consistency/loss_mean", "arc/r_metric/loss")
                 if n in data.series), None)
    if name is not None:
        xs, ys = data.series[name]
        ax.plot(xs, ys, color="#1f77b4", linewidth=1.0, label="loss (mean over ranks)")
        _scale(ax, ys)
        bad = [x for x, y in zip(xs, ys, strict=True) if not math.isfinite(y)]
        if bad:
            ax.plot(bad, [1.0] * len(bad), "x", color="#7b0000", transform=ax.get_xaxis_transform(),
                    label="non-finite loss")
        skipped = {e.get("iteration") for e in data.findings if e.get("action") == "skip"}
        points = [(x, y) for x, y in zip(xs, ys, strict=True) if x in skipped and math.isfinite(y)]
        if points:
            ax.plot(*zip(*points, strict=True), "x", color="#d62728", markersize=7)
    else:
        ax.text(0.5, 0.5, "no loss metric in metrics.jsonl (sinks.metrics_interval = 0?)", ha="center",
                transform=ax.transAxes)
    _mark(ax, data)
    _legend(ax)
    ax.set_xlabel("step attempt (iteration)")
    ax.set_ylabel("loss")
    ax.set_title(f"{data.run_id}: loss, detections and actions")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def monitor_panels(data: RunData, monitor: str, names: list[str], path: Path) -> Path:
    """One small plot per metric of ``monitor`` (at most ``MAX_PANELS``), with its detections marked."""
    plt = _pyplot()
    shown = names[:MAX_PANELS]
    cols = min(3, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, shown, strict=False):
        xs, ys = data.series[name]
        ax.plot(xs, ys, linewidth=0.9, color="#333333")
        _scale(ax, ys)
        _mark(ax, data, detector=monitor)
        ax.set_title(name.split("/", 2)[-1], fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown):]:
        ax.set_visible(False)
    fig.suptitle(f"{monitor}" + (f" ({len(names) - len(shown)} more metrics in metrics.jsonl)"
                                 if len(names) > len(shown) else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def rank_panel(data: RunData, name: str, path: Path) -> Path:
    """A per-rank statistic over step attempts: a line per rank (up to ``MAX_RANK_LINES`` ranks), else the
    ranks' minimum, median and maximum with the rank that is most often the maximum drawn on its own."""
    plt = _pyplot()
    points = data.ranks[name]
    ranks = sorted({rank for _, values in points for rank in values})
    fig, ax = plt.subplots(figsize=(12, 3.2))
    xs = [x for x, _ in points]
    if len(ranks) <= MAX_RANK_LINES:
        for rank in ranks:
            ax.plot(xs, [values.get(rank, math.nan) for _, values in points], linewidth=0.9, marker=".",
                    markersize=3, label=f"rank {rank}")
        ax.legend(fontsize=7, ncol=min(8, len(ranks)), loc="upper left")
    else:
        lows, mids, highs, tops = [], [], [], []
        for _, values in points:
            finite = sorted(v for v in values.values() if math.isfinite(v))
            lows.append(finite[0] if finite else math.nan)
            mids.append(finite[len(finite) // 2] if finite else math.nan)
            highs.append(finite[-1] if finite else math.nan)
            tops.append(max(values, key=lambda r: values[r] if math.isfinite(values[r]) else -math.inf))
        worst = max(set(tops), key=tops.count)
        ax.fill_between(xs, lows, highs, color="#1f77b4", alpha=0.2, label=f"min-max over {len(ranks)} ranks")
        ax.plot(xs, mids, color="#1f77b4", linewidth=0.9, label="median")
        ax.plot(xs, [values.get(worst, math.nan) for _, values in points], color="#d62728", linewidth=0.9,
                label=f"rank {worst} (most often the maximum)")
        ax.legend(fontsize=7, loc="upper left")
    _mark(ax, data)
    ax.set_title(f"per rank: {name}", fontsize=10)
    ax.set_xlabel("step attempt (iteration)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


__all__ = ["monitor_panels", "rank_panel", "timeline"]

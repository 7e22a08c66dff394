"""The report's static HTML page: the summary table, the timeline, one panel per monitor family, the per-rank
panels and the list of detections and actions. Plain HTML and CSS plus one small script that counts the figures
that loaded (``data-figures-loaded`` on ``<body>``, read by the headless-browser test); no network access.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from arc_engine.report.data import ALERT_SEVERITIES, RunData

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1250px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } img { max-width: 100%; border: 1px solid #eee; margin: 4px 0; }
.warning { background: #fff4e0; } .error { background: #fde2e2; } .critical { background: #f8c8c8; }
.muted { color: #777; font-size: 0.85em; }
"""

SCRIPT = """
window.addEventListener("load", function () {
  var images = Array.prototype.slice.call(document.images);
  var loaded = images.filter(function (img) { return img.complete && img.naturalWidth > 0; }).length;
  document.body.setAttribute("data-figures-loaded", String(loaded));
  document.body.setAttribute("data-figures", String(images.length));
});
"""


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{html.escape(str(k))}: {_cell(v)}" for k, v in value.items()) or "-"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value) if len(value) <= 12 else f"{len(value)} values"
    return html.escape(str(value))


def summary_rows(data: RunData) -> list[tuple[str, str]]:
    """(label, value) rows of the summary table."""
    summary = data.summary
    detections = [e for e in data.events if e.get("kind") == "detection"]
    actions = [e for e in data.events if e.get("kind") == "action"]
    alerts = [e for e in data.findings if e.get("severity") in ALERT_SEVERITIES]
    by_action: dict[str, int] = {}
    for event in data.findings:
        action = str(event.get("action"))
        if action not in ("none", "warn"):
            by_action[action] = by_action.get(action, 0) + 1
    rows = [("run", data.run_id or data.run_dir.name), ("run directory", str(data.run_dir))]
    if summary:
        rows += [("optimizer steps", _cell(summary.get("steps"))),
                 ("step attempts (iterations)", _cell(summary.get("iterations"))),
                 ("applied steps", _cell(summary.get("applied_steps"))),
                 ("steps not applied: policy skips, rolled back, framework skips",
                  _cell([summary.get(key) for key in ("skipped_by_policy", "rolled_back", "skipped_by_framework")])),
                 ("detections by detector", _cell(summary.get("detections", {})))]
        recovery = summary.get("recovery")
        if recovery:
            rows += [("rollbacks / escapes", f"{recovery.get('rollbacks', 0)} / {recovery.get('escapes', 0)}"),
                     ("restored from memory / disk",
                      f"{recovery.get('restored_from_memory', 0)} / {recovery.get('restored_from_disk', 0)}"),
                     ("disk checkpoints committed", _cell(recovery.get("checkpoint_saves", {}).get("committed", 0)))]
        rows.append(("collectives / per-rank fetches",
                     f"{summary.get('collectives', '-')} / {summary.get('detail_fetches', '-')}"))
    else:
        rows.append(("summary", "none: the run did not close (still running, or killed)"))
    rows += [("detection events", str(len(detections))), ("action events", str(len(actions))),
             ("actions taken", _cell(by_action) if by_action else "none"), ("alerts (error or critical)",
                                                                             str(len(alerts)))]
    return rows


def render(data: RunData, figures: dict[str, list[tuple[str, str]]]) -> str:
    """The page. ``figures``: section -> [(file name relative to the page, caption)]."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>arc_engine report: {html.escape(data.run_id)}</title>", f"<style>{STYLE}</style>",
             f"<script>{SCRIPT}</script></head><body>",
             f"<h1>arc_engine run report: {html.escape(data.run_id or data.run_dir.name)}</h1>"]
    if data.stop is not None:  # first: why the run stopped, and what to do
        stop = data.stop
        parts.append('<h2>Why it stopped</h2><table class="stop">')
        rows = [("cause", f"{stop.get('cause')} (exit code {stop.get('exit_code')}) at step {stop.get('step')}"),
                ("what", stop.get("message")), ("blamed", f"ranks {stop.get('ranks') or '-'} "
                                                          f"({', '.join(stop.get('devices') or ()) or '-'})"),
                ("evidence", "; ".join(f"{e.get('detector')}: {e.get('message')}" for e in stop.get("evidence", ()))
                 or "-"), ("excluded hosts", ", ".join(stop.get("excluded_hosts") or ()) or "none"),
                ("suggested", stop.get("suggested"))]
        parts += [f"<tr><th>{label}</th><td>{html.escape(str(value))}</td></tr>" for label, value in rows]
        parts.append("</table>")
    if data.attached:
        parts.append(f'<p class="muted">{html.escape(data.attached["message"])}</p>')
    parts.append("<h2>Summary</h2><table>")
    parts += [f"<tr><th>{html.escape(label)}</th><td>{value}</td></tr>" for label, value in summary_rows(data)]
    parts.append("</table>")
    for section, items in figures.items():
        parts.append(f"<h2>{html.escape(section)}</h2>")
        if not items:
            parts.append('<p class="muted">nothing recorded for this section</p>')
        for name, caption in items:
            parts.append(f'<figure><img src="{html.escape(name)}" alt="{html.escape(caption)}">'
                         f'<figcaption class="muted">{html.escape(caption)}</figcaption></figure>')
    parts.append("<h2>Detections and actions</h2>")
    findings = data.findings
    if findings:
        parts.append("<table><tr><th>iteration</th><th>step</th><th>kind</th><th>detector</th><th>action</th>"
                     "<th>severity</th><th>ranks</th><th>message</th></tr>")
        for event in findings:
            severity = str(event.get("severity", ""))
            parts.append(f'<tr class="{html.escape(severity)}"><td>{_cell(event.get("iteration"))}</td>'
                         f'<td>{_cell(event.get("step"))}</td><td>{_cell(event.get("kind"))}</td>'
                         f'<td>{_cell(event.get("detector"))}</td><td>{_cell(event.get("action"))}</td>'
                         f"<td>{html.escape(severity)}</td><td>{_cell(event.get('ranks', []))}</td>"
                         f"<td>{_cell(event.get('message', ''))}</td></tr>")
        parts.append("</table>")
    else:
        parts.append('<p class="muted">no detection and no action: a clean run</p>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_page(data: RunData, figures: dict[str, list[tuple[str, str]]], path: Path) -> Path:
    path.write_text(render(data, figures))
    return path


__all__ = ["render", "summary_rows", "write_page"]

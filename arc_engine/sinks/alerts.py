"""What an alert says, and how often: pure functions and a small rate limiter, shared by alerting sinks (W&B).

* :func:`alert_title`: under 64 characters, what and where ("SDC suspected on rank 5 (node-3:gpu1)").
* :func:`alert_text`: step, ranks with their host and device, detector, the values that tripped it, the action
  taken, the run directory.
* :class:`AlertLimiter`: per key (detector + ranks), the first alert goes out; repeats within ``window_s`` are
  counted and go out as one summary ("NaN/Inf values on rank 3: 41 more in the last 10 min") when the window ends.
* :func:`redact`: removes secrets (the W&B API key) from any text that is about to be logged.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from arc_engine.events import Event, Severity, json_safe

#: W&B rejects longer titles; ours stay under this.
MAX_TITLE = 63
MAX_VALUES_CHARS = 1200

#: What each detector's alert is called (the title's first words); others use the detector's name.
WHAT = {
    "non_finite": "NaN/Inf values",
    "loss_spike": "Loss spike",
    "grad_norm": "Gradient norm anomaly",
    "sdc": "SDC suspected",
    "sdc_recompute": "SDC recomputation",
    "optimizer": "Optimizer statistics",
    "hang": "No step completed",
    "recovery": "Recovery",
    "policy": "Policy escalation",
    "framework": "Step skipped by the framework",
}

#: Titles of the engine's per-step action events and of recovery's actions, by action.
ACTION_WHAT = {"skip": "Step skipped", "rollback": "Rolled back", "escape": "Escaped (perturbed, skipped ahead)",
               "abort": "Training stopped", "warn": "Warning"}


def alert_level(severity: Severity) -> str:
    """The W&B alert level (``wandb.AlertLevel`` value) of a severity: ERROR for error and critical, WARN for
    warning, INFO below."""
    if severity >= Severity.ERROR:
        return "ERROR"
    return "WARN" if severity >= Severity.WARNING else "INFO"


def where(ranks: tuple[int, ...], locations: dict[int, str]) -> str:
    """" on rank 5 (node-3:gpu1)", " on ranks 1, 3", " on 9 ranks", or "" (a global finding)."""
    if not ranks:
        return ""
    if len(ranks) == 1:
        location = locations.get(ranks[0])
        return f" on rank {ranks[0]}" + (f" ({location})" if location else "")
    listed = ", ".join(str(r) for r in ranks)
    return f" on ranks {listed}" if len(listed) <= 20 else f" on {len(ranks)} ranks"


def alert_what(event: Event) -> str:
    """What happened, in words: the action for the engine's and recovery's action events, else the detector.
    Also the first half of the rate-limit key (:class:`AlertLimiter`)."""
    if event.detector in ("engine", "recovery") and event.action in ACTION_WHAT:
        return ACTION_WHAT[event.action]
    return WHAT.get(event.detector, event.detector.replace("_", " ").capitalize())


def alert_title(event: Event, locations: dict[int, str]) -> str:
    """What and where, at most :data:`MAX_TITLE` characters."""
    return _clip(alert_what(event) + where(event.ranks, locations), MAX_TITLE)


def alert_text(event: Event, locations: dict[int, str], run_dir: str, repeats: int = 0) -> str:
    """The alert body: everything a person needs to act (markdown-friendly plain text)."""
    ranks = ", ".join(f"{r} ({locations[r]})" if r in locations else str(r) for r in event.ranks) or "all (global)"
    values = json.dumps(json_safe(event.values), sort_keys=True, default=str)
    lines = [
        event.message,
        f"step {event.step} (iteration {event.iteration}) · run {event.run_id}",
        f"detector: {event.detector} · severity: {event.severity.name.lower()} · action taken: {event.action}",
        f"ranks: {ranks}",
        f"values: {_clip(values, MAX_VALUES_CHARS)}",
        f"run directory: {run_dir}",
    ]
    if repeats:
        lines.append(f"{repeats} earlier repeat(s) of this alert were not sent separately (rate limit)")
    return "\n".join(lines)


def summary_title(title: str, count: int, window_s: float) -> str:
    """"<title>: 41 more in the last 10 min", clipped to :data:`MAX_TITLE` (the count always survives)."""
    tail = f": {count} more in the last {_duration(window_s)}"
    return _clip(title, MAX_TITLE - len(tail)) + tail


def _duration(seconds: float) -> str:
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:max(0, limit - 1)] + "…"


@dataclass
class Pending:
    """A key's suppressed repeats since its last alert."""

    last_sent: float
    count: int = 0
    last_event: Event | None = None


@dataclass
class Outgoing:
    """One alert to send."""

    title: str
    text: str
    level: str


@dataclass
class AlertLimiter:
    """Deduplicates and rate-limits alerts per key = (:func:`alert_what`, ranks). Not thread-safe (one owner
    thread).

    :meth:`offer`: the alert for an event if its key has not alerted within ``window_s``, else None (counted).
    :meth:`due`: summaries of the keys whose window has ended with repeats pending (all of them with ``force``).
    """

    window_s: float
    locations: dict[int, str] = field(default_factory=dict)
    run_dir: str = ""
    pending: dict[tuple[str, tuple[int, ...]], Pending] = field(default_factory=dict)
    sent: int = 0
    suppressed: int = 0

    def offer(self, event: Event, now: float) -> Outgoing | None:
        key = (alert_what(event), event.ranks)
        state = self.pending.get(key)
        if state is not None and now - state.last_sent < self.window_s:
            state.count += 1
            state.last_event = event
            self.suppressed += 1
            return None
        repeats = state.count if state is not None else 0
        self.pending[key] = Pending(last_sent=now)
        self.sent += 1
        return Outgoing(alert_title(event, self.locations), alert_text(event, self.locations, self.run_dir, repeats),
                        alert_level(event.severity))

    def due(self, now: float, force: bool = False) -> list[Outgoing]:
        out = []
        for state in self.pending.values():
            if state.count and state.last_event is not None and (force or now - state.last_sent >= self.window_s):
                event = state.last_event
                title = summary_title(alert_title(event, self.locations), state.count, self.window_s)
                text = (f"{state.count} more alert(s) like this one were suppressed in the last "
                        f"{_duration(self.window_s)}; the latest:\n"
                        + alert_text(event, self.locations, self.run_dir))
                out.append(Outgoing(title, text, alert_level(event.severity)))
                state.count, state.last_event, state.last_sent = 0, None, now
                self.sent += 1
        return out


#: Long opaque tokens (API keys and the like): runs of 32+ key characters.
_TOKEN = re.compile(r"[A-Za-z0-9_\-]{32,}")


def redact(text: str, secrets: tuple[str, ...] | None = None) -> str:
    """``text`` without secrets: the values of ``secrets`` (default: ``WANDB_API_KEY`` from the environment)
    and any long opaque token are replaced by ``***``."""
    secrets = secrets if secrets is not None else tuple(v for v in (os.environ.get("WANDB_API_KEY"),) if v)
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return _TOKEN.sub("***", text)

"""Weights & Biases sink: alerts and metrics from one rank, on a background thread that never hurts training.

The training thread only puts items in a bounded queue (``put_nowait``; overflow is dropped and counted). A
daemon thread owns everything W&B: it attaches to the run on its first item -- an active ``wandb.run`` is reused
(DeepSpeed's W&B monitor, Megatron's ``--wandb-project``, the user's ``wandb.init``), otherwise it calls
``wandb.init`` with the configured project and the id ``arc-<run id>`` (``resume="allow"``: after a restart with
the same arc run id the same W&B run continues, and W&B's own step keeps increasing) -- then sends

* alerts (``run.alert``) for events at or above ``alert_min_severity``, deduplicated and rate-limited per
  detector + ranks by :class:`~arc_engine.sinks.alerts.AlertLimiter`, with summaries of suppressed repeats;
* metrics (``run.log``) under ``arc/``, with ``arc/step`` (goes back after a rollback) and ``arc/iteration``. On
  the sink's own run W&B's step (``_step``) is the x-axis: it only increases, across rollbacks and, online, across
  restarts (the resumed run continues it). On a reused run they are logged with ``commit=False`` so they join the
  row of the script's next own ``log`` call and never move its step.

Any W&B failure (missing package, ``wandb.init`` raising or timing out, no network, a bad key, rate limits) is
logged once, without secrets (:func:`~arc_engine.sinks.alerts.redact`); the sink then drops its metrics and
training goes on. Alerts are not lost: every alert that could not be sent (W&B failed, the queue was full, the
close timed out with it still queued) is kept, and ``close`` writes them to
``<run_dir>/<run_id>/undelivered_alerts.jsonl`` and says how many there are; ``arc-engine resend-alerts FILE``
sends them once W&B is reachable. ``close`` flushes pending summaries and waits at most ``close_timeout_s``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import queue
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from arc_engine import internals
from arc_engine.config.schema import WandbSinkConfig
from arc_engine.events import Event, Severity, json_safe
from arc_engine.sinks.alerts import AlertLimiter, Outgoing, alert_level, alert_text, alert_title, redact
from arc_engine.sinks.base import Sink

log = logging.getLogger("arc_engine.sinks.wandb")

_STOP = object()
#: Alerts W&B did not get, one JSON object per line (title, level, text, the event), in the run directory.
UNDELIVERED_FILE = "undelivered_alerts.jsonl"


def resend_alerts(path: Path, config: WandbSinkConfig, run_id: str) -> int:
    """Send the alerts of an ``undelivered_alerts.jsonl`` to W&B (the run ``arc-<run id>``, resumed); returns how
    many were sent. Raises on a W&B failure (nothing is removed: run it again)."""
    import wandb

    records = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not records:
        return 0
    run = wandb.init(project=config.project, entity=config.entity, mode=config.mode, dir=config.dir,
                     id=wandb_run_id(run_id), resume="allow",
                     settings=wandb.Settings(init_timeout=config.init_timeout_s, console="off"))
    try:
        for record in records:
            run.alert(title=f"[resent] {record['title']}", text=record["text"], level=record["level"],
                      wait_duration=0)
    finally:
        run.finish()
    return len(records)


def wandb_run_id(run_id: str) -> str:
    """The W&B run id for an arc run id: ``arc-<run id>`` with characters W&B rejects replaced (at most 64)."""
    return re.sub(r"[^A-Za-z0-9_\-]", "-", f"arc-{run_id}")[:64]


def active_wandb_run() -> Any | None:
    """The W&B run active in this process (``wandb.run``), or None (also when wandb is not installed). Does not
    import wandb if the process has not."""
    return internals.wandb_active_run(sys.modules.get("wandb"))


class WandbSink(Sink):
    """A :class:`~arc_engine.sinks.base.Sink` that forwards to W&B from a background thread (see module doc).

    ``locations``: global rank -> "host:device" for alert titles; ``run_dir``: the arc run directory (alert text,
    and the default W&B ``dir``); ``run_config``: logged as the W&B run config when the sink starts the run.
    ``clock`` is injectable for tests of the rate limit.
    """

    name = "wandb"

    def __init__(self, config: WandbSinkConfig, run_id: str, run_dir: str, locations: dict[int, str] | None = None,
                 run_config: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.run_id = run_id
        self.run_dir = run_dir
        self.run_config = run_config or {}
        self.min_severity = Severity.parse(config.alert_min_severity)
        self.limiter = AlertLimiter(config.alert_wait_s, dict(locations or {}), run_dir)
        self.clock = clock
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=config.queue_size)
        self.dropped = 0
        self.failed: str | None = None  # why the sink stopped talking to W&B (redacted), None while healthy
        self.reused = False
        self.run: Any | None = None
        self._closed = False
        self._undelivered: list[dict[str, Any]] = []  # alerts W&B did not get (written at close)
        self._undelivered_lock = threading.Lock()
        self.undelivered_path: Path | None = None
        if importlib.util.find_spec("wandb") is None:
            self.failed = "the wandb package is not installed (pip install 'arc_engine[wandb]')"
            log.warning("arc_engine W&B sink disabled: %s; training continues without W&B", self.failed)
        self._thread = threading.Thread(target=self._loop, name="arc-wandb-sink", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training thread

    def emit(self, event: Event) -> None:
        if event.severity >= self.min_severity:
            if self.failed is not None and not self._closed:
                self._keep(event)
            else:
                self._put(("alert", event))

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._put(("metrics", step, dict(metrics)))

    def close(self) -> None:
        """Flush (summaries of suppressed alerts included) and stop the thread, waiting at most
        ``close_timeout_s``; finishes the W&B run only if this sink started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.queue.put(_STOP, timeout=self.config.close_timeout_s)
        except queue.Full:
            log.warning("arc_engine W&B sink: queue still full at close; pending items are dropped")
        self._thread.join(self.config.close_timeout_s)
        if self._thread.is_alive():
            log.warning("arc_engine W&B sink: W&B did not finish within %.0f s; not waiting longer",
                        self.config.close_timeout_s)
            self._drain()
        self._write_undelivered()

    @property
    def undelivered(self) -> int:
        """Alerts W&B did not get so far."""
        with self._undelivered_lock:
            return len(self._undelivered)

    def _keep(self, event: Event) -> None:
        record = {"title": alert_title(event, self.limiter.locations), "level": alert_level(event.severity),
                  "text": alert_text(event, self.limiter.locations, self.run_dir), "event": event.to_dict()}
        with self._undelivered_lock:
            self._undelivered.append(record)

    def _drain(self) -> None:
        """The alerts still queued when the thread is gone or stuck (close)."""
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple) and item[0] == "alert":
                self._keep(item[1])

    def _write_undelivered(self) -> None:
        with self._undelivered_lock:
            records = list(self._undelivered)
        if not records:
            return
        path = Path(self.run_dir) / UNDELIVERED_FILE
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as out:
                for record in records:
                    out.write(json.dumps(json_safe(record), sort_keys=True) + "\n")
            self.undelivered_path = path
            where = f"kept in {path} (send them with `arc-engine resend-alerts {path}`)"
        except OSError as err:
            where = f"and could not be kept ({err})"
        message = f"arc_engine W&B sink: {len(records)} alert(s) were not delivered to W&B; {where}"
        log.warning(message)
        print(f"[arc] {message}", file=sys.stderr)

    def _put(self, item: tuple) -> None:
        if self._closed or self.failed is not None:
            return
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            if item[0] == "alert":
                self._keep(item[1])
            if self.dropped == 1:
                log.warning("arc_engine W&B sink: queue full (%d items; W&B is slow or unreachable): dropping "
                            "items, training continues", self.config.queue_size)

    # ------------------------------------------------------------------ background thread

    def _loop(self) -> None:
        poll = max(0.05, min(1.0, self.config.alert_wait_s / 10 or 1.0))
        while True:
            try:
                item = self.queue.get(timeout=poll)
            except queue.Empty:
                item = None
            if item is _STOP:
                self._guard(self._flush, True)
                self._guard(self._finish)
                return
            if item is not None:
                if self.failed is not None and item[0] == "alert":
                    self._keep(item[1])  # W&B is gone: keep it for a resend
                else:
                    self._guard(self._handle, item)
            self._guard(self._flush, False)

    def _guard(self, function: Callable[..., None], *args: Any) -> None:
        if self.failed is not None:
            return
        try:
            function(*args)
        except Exception as err:  # W&B must never reach the training thread
            self.failed = redact(f"{type(err).__name__}: {err}")
            log.warning("arc_engine W&B sink disabled (%s); training continues without W&B", self.failed)

    def _handle(self, item: tuple) -> None:
        if item[0] == "alert":
            outgoing = self.limiter.offer(item[1], self.clock())
            if outgoing is not None:
                try:
                    self._send(outgoing)
                except Exception:
                    self._keep(item[1])
                    raise
        else:
            _, step, metrics = item
            self._log(step, metrics)

    def _flush(self, force: bool) -> None:
        for outgoing in self.limiter.due(self.clock(), force):
            self._send(outgoing)

    def _attach(self) -> Any:
        if self.run is not None:
            return self.run
        existing = active_wandb_run() if self.config.reuse_run else None
        if existing is not None:
            self.run, self.reused = existing, True
            log.info("arc_engine W&B sink: reusing the active W&B run %s", internals.wandb_run_id(existing))
        else:
            import wandb

            self.run = wandb.init(
                project=self.config.project, entity=self.config.entity, name=self.config.name or self.run_id,
                group=self.config.group, mode=self.config.mode, dir=self.config.dir or self.run_dir,
                id=wandb_run_id(self.run_id), resume="allow", config={"arc_engine": self.run_config},
                settings=wandb.Settings(init_timeout=self.config.init_timeout_s, console="off"),
            )
        return self.run

    def _send(self, outgoing: Outgoing) -> None:
        self._attach().alert(title=outgoing.title, text=outgoing.text, level=outgoing.level,
                             wait_duration=self.config.alert_wait_s)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        run = self._attach()
        row = {**metrics, "arc/step": step}
        row.setdefault("arc/iteration", step)
        if self.reused:
            run.log(row, commit=False)
        else:
            run.log(row)

    def _finish(self) -> None:
        if self.run is not None and not self.reused:
            self.run.finish()

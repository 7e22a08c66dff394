"""The hang watchdog: notices when a rank stops completing steps, alerts, and dumps every thread's Python stack.

Each rank runs one daemon thread. The training thread only calls :meth:`HangWatchdog.heartbeat` when a step
completes (one clock read and a few assignments). The thread wakes every second (or every 1/20 of a shorter
timeout); when the time since
the last completed step exceeds :func:`hang_timeout` it writes ``<run_dir>/stacks/rank<N>-iter<I>.txt`` (every
thread's stack, via ``sys._current_frames``) and reports a critical ``hang`` event through ``report`` (the rank's
sinks: W&B alert, console, JSONL). It fires once per hang and re-arms on the next completed step, which it reports
as an info ``hang`` event with the stall's length.

It never communicates with other ranks: a rank stuck in a dead collective keeps its watchdog thread (the
collective releases the GIL while it waits), and a peer stuck elsewhere times out on its own watchdog.
:meth:`paused` marks known long phases (a rollback's restore, a synchronous checkpoint) that must not count.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from arc_engine.config.schema import WatchdogConfig

log = logging.getLogger("arc_engine.watchdog")


def hang_timeout(config: WatchdogConfig, completed_steps: int, longest_step_s: float) -> float:
    """Seconds without a completed step that count as a hang: ``initial_timeout_s`` until ``warmup_steps`` steps
    have completed, then ``safety_factor`` x the longest step since, clamped to [min_timeout_s, max_timeout_s].
    Pure."""
    if completed_steps < config.warmup_steps or longest_step_s <= 0:
        return config.initial_timeout_s
    return min(config.max_timeout_s, max(config.min_timeout_s, config.safety_factor * longest_step_s))


def format_stacks() -> str:
    """Every live thread's Python stack, named (the calling thread's included)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} (ident {ident}) ---\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class HangWatchdog:
    """One rank's watchdog (see module doc). ``report(kind, message, values)`` is called from the watchdog thread
    with ``kind`` "hang" (critical) or "resumed" (info); it must not block for long (sinks are queue-backed).
    ``iteration`` reads the engine's current step attempt for file names and messages."""

    def __init__(self, config: WatchdogConfig, rank: int, run_dir: Path,
                 report: Callable[[str, str, dict], None], iteration: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.rank = rank
        self.run_dir = Path(run_dir)
        self.report = report
        self.iteration = iteration
        self.clock = clock
        self.completed_steps = 0
        self.longest_step_s = 0.0
        self.fired = 0
        self.last_dump: Path | None = None
        self._last_beat = clock()
        self._hung_since: float | None = None
        self._pauses = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"arc-hang-watchdog-rank{rank}", daemon=True)

    def start(self) -> HangWatchdog:
        self._last_beat = self.clock()
        self._thread.start()
        return self

    @property
    def timeout_s(self) -> float:
        return hang_timeout(self.config, self.completed_steps, self.longest_step_s)

    def heartbeat(self) -> None:
        """A step completed (training thread; cheap)."""
        now = self.clock()
        with self._lock:
            elapsed = now - self._last_beat
            self.completed_steps += 1
            # the warm-up's steps (compilation, first communicators) do not set the timeout
            if self.completed_steps > self.config.warmup_steps and self._hung_since is None:
                self.longest_step_s = max(self.longest_step_s, elapsed)
            self._last_beat = now
            hung_since, self._hung_since = self._hung_since, None
        if hung_since is not None:
            self._safe_report("resumed", f"rank {self.rank} completed a step again after {now - hung_since:.0f} s "
                              "without one", {"stalled_s": round(now - hung_since, 3)})

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A known long phase: the time it takes does not count towards a hang (nestable)."""
        with self._lock:
            self._pauses += 1
        try:
            yield
        finally:
            with self._lock:
                self._pauses -= 1
                self._last_beat = self.clock()

    def stop(self) -> None:
        """Stop the thread (waits at most a second; it is a daemon)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(1.0)

    # ------------------------------------------------------------------ watchdog thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            timeout = self.timeout_s
            self._stop.wait(max(0.05, min(1.0, timeout / 20)))
            with self._lock:
                stalled = self.clock() - self._last_beat
                due = self._pauses == 0 and self._hung_since is None and stalled > timeout
                if due:
                    self._hung_since = self._last_beat
            if due:
                self._fire(stalled, timeout)

    def _fire(self, stalled: float, timeout: float) -> None:
        self.fired += 1
        iteration = self.iteration()
        where = ""
        if self.config.dump_stacks:
            path = self.run_dir / "stacks" / f"rank{self.rank}-iter{iteration}.txt"
            try:
                write_atomically(path, f"arc_engine hang watchdog, rank {self.rank}, pid {os.getpid()}, "
                                       f"iteration {iteration}, no step completed for {stalled:.1f} s "
                                       f"(timeout {timeout:.1f} s)\n\n{format_stacks()}")
                self.last_dump, where = path, f"; stacks in {path}"
            except OSError as err:
                where = f"; stack dump failed: {err}"
        message = (f"no step completed on rank {self.rank} for {stalled:.1f} s (timeout {timeout:.1f} s, after "
                   f"{self.completed_steps} steps){where}")
        log.error("arc_engine: %s", message)
        self._safe_report("hang", message, {"stalled_s": round(stalled, 3), "timeout_s": round(timeout, 3),
                                            "completed_steps": self.completed_steps,
                                            "stack_dump": str(self.last_dump) if self.last_dump else None})

    def _safe_report(self, kind: str, message: str, values: dict) -> None:
        try:
            self.report(kind, message, values)
        except Exception as err:  # the watchdog must outlive any sink
            log.warning("arc_engine watchdog: reporting failed (%s: %s)", type(err).__name__, err)

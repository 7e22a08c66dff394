"""The hang watchdog: notices when a rank stops completing steps, alerts, and dumps every thread's Python stack.

Each rank runs one daemon thread. The training thread only calls :meth:`HangWatchdog.heartbeat` when a step
completes (one clock read and a few assignments). The thread wakes every second (or every 1/20 of a shorter
timeout); when the time since
the last completed step exceeds :func:`hang_timeout` it writes ``<run_dir>/stacks/rank<N>-iter<I>.txt`` (every
thread's stack, via ``sys._current_frames``) and reports a critical ``hang`` event through ``report`` (the rank's
sinks: W&B alert, console, JSONL). It fires once per hang and re-arms on the next completed step, which it reports
as an info ``hang`` event with the stall's length.

It never takes part in a collective: a rank stuck in a dead collective keeps its watchdog thread (the
collective releases the GIL while it waits), and a peer stuck elsewhere times out on its own watchdog.
:meth:`paused` marks known long phases (a rollback's restore, a synchronous checkpoint) that must not count.

**Who is stuck.** The training thread keeps a progress counter in a plain attribute: 4 x steps completed, plus
the furthest point of the current step it reached (1: its first forward began, 2: it recorded a loss, i.e. its
forward ran and its backward -- with the framework's gradient reduction -- is next, 3: it waits in the step's
agreement). The watchdog thread publishes it to a :class:`ProgressBoard` (the job's c10d store) when it changed,
at most every ``min(5 s, timeout / 4)``. On a hang every rank reads the board: the ranks behind the
others (the lowest progress) are the ones that stopped; the ranks ahead of them are waiting for them in a
collective. A dead rank stops publishing and is behind too. Equal progress everywhere: no rank is ahead (a dead
collective, or every rank stuck alike).

**A rank lost mid-step** (SIGKILL, a node gone) under gloo does not hang its peers: their collective with it fails
and ends the training loop, or the launcher ends them; :mod:`arc_engine.lost_peers` then names the lost ranks from
their heartbeats on this board (:meth:`ProgressBoard.lost_ranks`). Under NCCL the survivors block in the
collective instead, and the hang path below names the rank behind.

**Ending a hang** (``action: abort``): after ``abort_after`` timeouts in a row without a completed step, the
watchdog reports a critical ``hang`` event with ``"abort": true``, flushes the sinks (bounded) and exits the
process with :data:`~arc_engine.policy.decision.EXIT_HANG` (``os._exit``: the training thread may be stuck anywhere).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from arc_engine import runtime
from arc_engine.config.schema import WatchdogConfig
from arc_engine.policy.decision import EXIT_HANG

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


#: The longest a rank's published progress lags its own (see :meth:`HangWatchdog._publish`).
PUBLISH_EVERY_S = 5.0
#: Points of a step the progress counter tells apart (see the module docstring).
STEP_STARTED, LOSS_RECORDED, AGREEING, PHASES = 1, 2, 3, 4


class ProgressBoard:
    """Each rank's progress in a c10d store under ``arc/<run id>/progress/<rank>`` (written by that rank's watchdog
    thread as ``<progress>:<beat>``, the beat counting its writes: a heartbeat; read on a hang and on a failed
    collective), and ``arc/<run id>/left/<rank>`` once a rank has ended on purpose (a report made, a clean close).
    :meth:`publish`, :meth:`read` and :meth:`leave` swallow store errors: the board is an aid to the reports, never
    a new way to fail. :meth:`lost_ranks` raises them: its caller bounds it and reports the store unreachable."""

    def __init__(self, store: Any, run_id: str, world_size: int) -> None:
        self.store, self.prefix, self.world_size = store, f"arc/{run_id}/progress/", world_size
        self.left_prefix = f"arc/{run_id}/left/"
        self._beat = 0

    def publish(self, rank: int, progress: int, every_s: float = PUBLISH_EVERY_S + 1.0) -> None:
        """This rank's progress and heartbeat; ``every_s``: the longest time until its next beat (what a look for lost
        ranks waits for, twice)."""
        self._beat += 1
        with contextlib.suppress(Exception):
            self.store.set(f"{self.prefix}{rank}", f"{progress}:{self._beat}:{every_s:.3f}")

    def leave(self, rank: int) -> None:
        """This rank ends on purpose: its heartbeat stopping does not make it lost."""
        with contextlib.suppress(Exception):
            self.store.set(f"{self.left_prefix}{rank}", "1")

    def read(self) -> dict[int, int]:
        """{rank: progress} of the ranks that published (never blocks on a missing key)."""
        with contextlib.suppress(Exception):
            return {rank: int(value.split(":")[0]) for rank, value in self._values(range(self.world_size)).items()}
        return {}

    def lost_ranks(self, rank: int, wait_s: float, poll_s: float = 0.5) -> list[int]:
        """The other ranks whose heartbeat does not move for two of their beats (at most ``wait_s``) and that did not
        leave on purpose: lost. Evidence about each peer only: a healthy peer still training, or late to notice the
        failure, keeps beating (its watchdog thread publishes every ``min(5 s, timeout / 4)``, and says so with each
        beat). A few store calls per poll, over the ranks not yet seen alive only. Raises the store's errors."""
        pending = [r for r in range(self.world_size) if r != rank]
        first = self._values(pending)
        beats = [float(value.split(":")[2]) for value in first.values() if value.count(":") == 2]
        deadline = time.monotonic() + min(wait_s, 2 * max(beats, default=wait_s / 2))
        while True:
            left = set(pending) - set(self._missing(self.left_prefix, pending))
            current = self._values(pending)
            pending = [r for r in pending if r not in left and current.get(r) == first.get(r)]
            if not pending or time.monotonic() >= deadline:
                return pending
            time.sleep(poll_s)

    def wait_left(self, ranks: list[int], wait_s: float, poll_s: float = 0.5) -> list[int]:
        """Wait (at most ``wait_s``) until every rank of ``ranks`` has left; the ones that have not. Raises the
        store's errors."""
        deadline = time.monotonic() + wait_s
        while True:
            missing = self._missing(self.left_prefix, ranks)
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(poll_s)

    def _values(self, ranks: Any) -> dict[int, str]:
        """{rank: raw progress value} of the ``ranks`` that published: one ``check`` and one ``multi_get`` when all
        did (never a blocking ``get`` of a missing key)."""
        ranks = list(ranks)
        present = [r for r in ranks if r not in set(self._missing(self.prefix, ranks))]
        if not present:
            return {}
        values = self.store.multi_get([f"{self.prefix}{r}" for r in present])
        return {r: bytes(v).decode() for r, v in zip(present, values, strict=True)}

    def _missing(self, prefix: str, ranks: list[int]) -> list[int]:
        """The ``ranks`` without a ``<prefix><rank>`` key, by bisection (one ``check`` when none is missing)."""
        if not ranks or self.store.check([f"{prefix}{r}" for r in ranks]):
            return []
        if len(ranks) == 1:
            return list(ranks)
        middle = len(ranks) // 2
        return self._missing(prefix, ranks[:middle]) + self._missing(prefix, ranks[middle:])


def stuck_ranks(progress: dict[int, int], world_size: int) -> list[int]:
    """The ranks behind the others: the lowest progress, or none published. Empty when every rank is level
    (nobody is ahead, so nobody is waiting for a particular rank). Pure."""
    if not progress:
        return []
    missing = [rank for rank in range(world_size) if rank not in progress]
    lowest = min(progress.values())
    behind = sorted([rank for rank, value in progress.items() if value == lowest and lowest < max(progress.values())]
                    + missing)
    return behind


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
                 clock: Callable[[], float] = time.monotonic, board: ProgressBoard | None = None,
                 world_size: int = 1, on_abort: Callable[[], None] | None = None,
                 exit: Callable[[int], None] = os._exit) -> None:
        self.config = config
        self.rank = rank
        self.run_dir = Path(run_dir)
        self.report = report
        self.iteration = iteration
        self.clock = clock
        self.completed_steps = 0
        self.longest_step_s = 0.0
        self.fired = 0
        self.board, self.world_size = board, world_size
        self.on_abort, self.exit = on_abort, exit
        self.progress = 0            # 2 x completed steps (+1 while waiting in the agreement); training thread
        self._published_at = -math.inf
        self._timeouts = 0           # timeouts in a row in the current hang
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
            self.progress = PHASES * self.completed_steps
            self._timeouts = 0
            # the warm-up's steps (compilation, first communicators) do not set the timeout
            if self.completed_steps > self.config.warmup_steps and self._hung_since is None:
                self.longest_step_s = max(self.longest_step_s, elapsed)
            self._last_beat = now
            hung_since, self._hung_since = self._hung_since, None
        if hung_since is not None:
            self._safe_report("resumed", f"rank {self.rank} completed a step again after {now - hung_since:.0f} s "
                              "without one", {"stalled_s": round(now - hung_since, 3)})

    def reached(self, phase: int) -> None:
        """The training thread reached ``phase`` of the current step (:data:`STEP_STARTED`, :data:`LOSS_RECORDED`,
        :data:`AGREEING`); cheap: a comparison and an assignment."""
        progress = PHASES * self.completed_steps + phase
        if progress > self.progress:
            self.progress = progress

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

    @property
    def is_paused(self) -> bool:
        """Whether a known long phase is under way (:meth:`paused`): its time does not count."""
        return self._pauses > 0

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Stop the thread (waits at most a second; it is a daemon)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(1.0)

    # ------------------------------------------------------------------ watchdog thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._stop.wait(max(0.05, min(1.0, self.timeout_s / 20)))
            with self._lock:
                now = self.clock()  # one read per poll (tests drive the clock by counting reads)
                timeout = self.timeout_s  # as of this reading: steps completed during the wait count
                stalled = now - self._last_beat
                timeouts = int(stalled // timeout) if self._pauses == 0 else 0
                due = timeouts > self._timeouts
                if due:
                    first = self._hung_since is None
                    self._timeouts = timeouts
                    if first:
                        self._hung_since = self._last_beat
            self._publish(now, timeout)
            if not due:
                continue
            abort = self.config.action == "abort" and timeouts >= self.config.abort_after
            if first or abort:
                self._fire(stalled, timeout, first=first, abort=abort)
            if abort:
                self._abort()
                return
        self.leave()  # stopped (the engine closed): the heartbeat ends on purpose, in this thread (bounded by stop)

    def _publish(self, now: float, timeout: float) -> None:
        """Every ``min(5 s, timeout / 4)``, changed or not (the heartbeat :meth:`ProgressBoard.lost_ranks` reads): a
        hang is a state that lasts, so a value a few seconds old is current when the watchdog fires, and thousands
        of ranks stay well under the store's capacity."""
        interval = min(PUBLISH_EVERY_S, timeout / 4)
        if self.board is not None and now - self._published_at >= interval:
            # the next beat comes within the interval and one wake-up of this thread (see _loop)
            self.board.publish(self.rank, self.progress, interval + min(1.0, timeout / 20))
            self._published_at = now

    def beats_within_s(self) -> float:
        """The longest a look for lost ranks waits: two of the longest beat any rank can have (5 s and a wake-up)."""
        return 2 * (PUBLISH_EVERY_S + 1.0)

    def leave(self) -> None:
        """Mark this rank as ended on purpose on the board (its heartbeat stops without it being lost)."""
        if self.board is not None:
            self.board.leave(self.rank)

    def _abort(self) -> None:
        """Flush what can be flushed (bounded: a sink may hang too), then end the process."""
        self.flush()
        self.leave()
        self.exit(EXIT_HANG)

    def flush(self) -> None:
        """Flush the sinks (``on_abort``), waiting at most 10 s: a sink may hang too."""
        if self.on_abort is not None:
            flusher = threading.Thread(target=self._safe_on_abort, name="arc-hang-abort-flush", daemon=True)
            flusher.start()
            flusher.join(10.0)

    def _safe_on_abort(self) -> None:
        try:
            assert self.on_abort is not None
            self.on_abort()
        except Exception as err:
            log.warning("arc_engine watchdog: flushing before the abort failed (%s: %s)", type(err).__name__, err)

    def _fire(self, stalled: float, timeout: float, *, first: bool = True, abort: bool = False) -> None:
        self.fired += int(first)
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
        progress = self.board.read() if self.board is not None else {}
        stuck = stuck_ranks(progress, self.world_size)
        if stuck:
            who = f"; stopped: rank(s) {stuck} (behind the others)"
        elif progress and len(progress) > 1:
            who = "; every rank is at the same point (no rank is ahead: a dead collective, or all stuck alike)"
        else:
            who = ""
        ending = f"; aborting with exit code {EXIT_HANG}" if abort else ""
        message = (f"no step completed on rank {self.rank} for {stalled:.1f} s (timeout {timeout:.1f} s, after "
                   f"{self.completed_steps} steps){who}{where}{ending}")
        log.error("arc_engine: %s", message)
        self._safe_report("hang", message, {"stalled_s": round(stalled, 3), "timeout_s": round(timeout, 3),
                                            "completed_steps": self.completed_steps, "stuck_ranks": stuck,
                                            "progress": {str(k): v for k, v in sorted(progress.items())},
                                            "abort": abort, "exit_code": EXIT_HANG if abort else None,
                                            "stack_dump": str(self.last_dump) if self.last_dump else None})

    def report_safely(self, kind: str, message: str, values: dict) -> None:
        """``report``, never raising (the watchdog must outlive any sink)."""
        self._safe_report(kind, message, values)

    def _safe_report(self, kind: str, message: str, values: dict) -> None:
        try:
            self.report(kind, message, values)
        except Exception as err:  # the watchdog must outlive any sink
            log.warning("arc_engine watchdog: reporting failed (%s: %s)", type(err).__name__, err)


def start_watchdog(config: WatchdogConfig, *, observing: bool, run_id: str, run_dir: Path,
                   report: Callable[[str, str, dict], None], iteration: Callable[[], int],
                   on_abort: Callable[[], None]) -> HangWatchdog:
    """This rank's watchdog, started, publishing its progress to the job's store when there is one. In observe
    mode a hang is alerted and the rank never ended."""
    store = runtime.default_store()
    world = dist.get_world_size() if dist.is_initialized() else 1
    board = ProgressBoard(store, run_id, world) if store is not None else None
    if observing and config.action == "abort":
        config = dataclasses.replace(config, action="alert")
    return HangWatchdog(config, runtime.global_rank(), run_dir, report, iteration, board=board, world_size=world,
                        on_abort=on_abort).start()

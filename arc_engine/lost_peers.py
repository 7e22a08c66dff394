"""Naming the ranks a job lost mid-step (SIGKILL, a node gone).

Under gloo a lost rank does not hang its peers: their next collective with it fails (``Connection reset by peer``)
and the exception ends the training loop; under torchrun the agent sees the dead worker and sends SIGTERM to the
others, usually before that. Either way the survivors' last word should name the rank that is gone, and nothing
in the survivors' own state can tell it (the lost rank may have died at the very point of the step they are at).

:class:`LostPeerWatch` is installed with the hang watchdog (more than one rank). An unhandled exception that is a
failed collective (:func:`is_peer_failure`: a torch distributed error, or a peer-connection error of the
transport; never this rank's own I/O, such as a broken stdout pipe or a data client's reset connection), through
a chained ``sys.excepthook``, or a SIGTERM while the default action is in place, makes the rank look for lost peers
on the job's store (:meth:`~arc_engine.watchdog.ProgressBoard.lost_ranks`): a peer is lost when its heartbeat (its
watchdog thread's writes) stops for two beats and it did not leave on purpose. A healthy peer still training, or
reaching its own failure later, keeps beating; a peer that reported and exited has left. The look is bounded as a
whole (the store's own calls included: its host may be gone). The rank reports a critical ``hang`` event naming
the lost ranks (``lost_ranks``), flushes its sinks (bounded), marks itself as left, and ends: with
:data:`~arc_engine.policy.decision.EXIT_HANG` after a failed collective under ``watchdog.action: abort`` (with
``alert``, as the exception ends it), by the SIGTERM's own default action after a SIGTERM. Without a torchrun agent
rank 0's process holds the store: before it exits it waits (bounded) for the other survivors to leave, so that
their own look still finds the store.

**SIGTERM.** The handler only records the signal and wakes a thread (``arc-sigterm``) through the signal module's
wake-up file descriptor, which the interpreter writes even while the main thread is blocked in C code (a
collective, a device sync). The thread makes the report outside signal context (a sink's lock or a queue the main
thread holds is released when it goes on), then hands the signal back to the main thread, which re-raises it with
the default action; a main thread still blocked in C code 2 s later is ended by the thread (exit code 143).

Under NCCL the survivors block in the collective instead, and the hang watchdog names the rank behind.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from arc_engine.policy.decision import EXIT_HANG
from arc_engine.watchdog import HangWatchdog

log = logging.getLogger("arc_engine.watchdog")

#: text of the errors a collective raises when a peer's connection is gone (gloo; NCCL raises DistBackendError)
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")
#: what names torch.distributed's transport in such an error's text (gloo's messages start with its source file)
_TRANSPORT = ("gloo", "pair.cc", "ProcessGroup")
#: a frame of torch.distributed's Python code in the error's traceback
_DISTRIBUTED_FRAME = f"{os.sep}torch{os.sep}distributed{os.sep}"


def _raised_in_distributed(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None:
        if _DISTRIBUTED_FRAME in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def is_peer_failure(err: BaseException | None) -> bool:
    """Whether ``err`` (or an exception it was raised from) is a failed collective: a torch distributed error, or a
    peer-connection error of torch.distributed's transport (named in its text, or raised through its code). A
    connection error of this rank's own I/O (stdout, a dataset client) is not. Pure."""
    seen = 0
    while err is not None and seen < 8:
        if type(err).__name__ in ("DistBackendError", "DistNetworkError", "DistError"):
            return True
        text = str(err)
        if (isinstance(err, (RuntimeError, ConnectionError)) and any(gone in text for gone in _PEER_GONE)
                and (any(name in text for name in _TRANSPORT) or _raised_in_distributed(err))):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def bounded(call: Callable[[], Any], timeout_s: float) -> Any:
    """``call()`` in a daemon thread, waited for at most ``timeout_s``: its result, or None when it raised or is
    still running (a store call whose host is gone blocks until the store's own timeout)."""
    result: list[Any] = [None]

    def run() -> None:
        with contextlib.suppress(Exception):
            result[0] = call()

    worker = threading.Thread(target=run, name="arc-bounded-call", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return None if worker.is_alive() else result[0]


def hosts_the_store(rank: int) -> bool:
    """Whether this process holds the job's c10d store: rank 0 without a torchrun agent's store."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


class LostPeerWatch:
    """The excepthook and SIGTERM handler of one rank (see the module docstring). ``install`` and ``remove`` are
    local (the main thread's, for the signal parts); both leave alone a hook or handler someone else set after (or
    before, for SIGTERM) this one. ``terminate`` ends the process after a SIGTERM's report (tests replace it)."""

    def __init__(self, watchdog: HangWatchdog, terminate: Callable[[], None] | None = None) -> None:
        self.watchdog = watchdog
        self.terminate = terminate or self._end_by_sigterm
        self._excepthooks: tuple[Any, Any] | None = None
        self._sigterm_installed = False
        self._wakeup: tuple[int, int] | None = None  # the pipe the interpreter writes signal numbers to
        self._signalled = threading.Event()
        self._closed = threading.Event()
        self._reporting = threading.Lock()  # one report per process
        self._handing_back = False  # the SIGTERM's report is done: the main thread's handler re-raises it
        self._thread: threading.Thread | None = None
        self.reported = False

    def install(self) -> LostPeerWatch:
        previous = sys.excepthook

        def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
            previous(kind, value, tb)
            if not self.watchdog.stopped and is_peer_failure(value):
                self.collective_failed(value)

        self._excepthooks = (previous, hook)
        sys.excepthook = hook
        on_main_thread = threading.current_thread() is threading.main_thread()
        if on_main_thread and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm_installed = True
            self._take_wakeup_fd()
            self._thread = threading.Thread(target=self._sigterm_thread, name="arc-sigterm", daemon=True)
            self._thread.start()
        return self

    def _take_wakeup_fd(self) -> None:
        """The interpreter's signal wake-up fd, unless someone else (an event loop) holds it."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous = None
        if previous == -1:
            self._wakeup = (read_fd, write_fd)
            return
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)

    def remove(self) -> None:
        if self._excepthooks is not None and sys.excepthook is self._excepthooks[1]:
            sys.excepthook = self._excepthooks[0]
        self._excepthooks = None
        self._closed.set()
        if self._wakeup is not None:  # wake the thread (it ends), so the pipe is closed only once it is unused
            with contextlib.suppress(OSError):
                os.write(self._wakeup[1], b"\0")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        on_main_thread = threading.current_thread() is threading.main_thread()
        if self._sigterm_installed and on_main_thread and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._sigterm_installed = False
        if self._wakeup is not None and on_main_thread:
            with contextlib.suppress(ValueError, OSError):
                if signal.set_wakeup_fd(-1) != self._wakeup[1]:
                    signal.set_wakeup_fd(self._wakeup[1])  # someone else's since: leave it (and our pipe) be
                    return
            for fd in self._wakeup:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wakeup = None

    def collective_failed(self, err: BaseException) -> None:
        """A collective failed on this rank: report who is lost; with ``action: abort`` flush, leave and exit with
        :data:`EXIT_HANG` (rank 0 holding the store first waits, bounded, for the other survivors to leave)."""
        abort = self.watchdog.config.action == "abort"
        cause = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        with self._reporting:
            if self.reported:
                return
            lost = self._report(f"a collective failed on rank {self.watchdog.rank}", cause, abort)
        if abort:
            with self.watchdog.paused():  # bounded phases of an ending rank: not a hang
                self.watchdog.flush()
                self.watchdog.leave()
                board = self.watchdog.board
                if board is not None and hosts_the_store(self.watchdog.rank):
                    others = [r for r in range(board.world_size) if r != self.watchdog.rank and r not in (lost or ())]
                    wait_s = 2 * self.watchdog.beats_within_s()
                    bounded(lambda: board.wait_left(others, wait_s), wait_s + 5.0)
            self.watchdog.exit(EXIT_HANG)

    # ------------------------------------------------------------------ SIGTERM

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """The main thread's handler: record and wake the ``arc-sigterm`` thread; once that thread has reported,
        the default action (the process ends by the signal)."""
        if self._handing_back or self.watchdog.stopped:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self._signalled.set()

    def _sigterm_thread(self) -> None:
        """Wait for a SIGTERM: its number on the wake-up pipe (written even while the main thread is blocked in C
        code), or the main thread's handler's record; then report."""
        wakeup = self._wakeup  # (remove() may clear the attribute meanwhile)
        while not self._closed.is_set():
            if wakeup is not None:
                try:
                    readable, _, _ = select.select([wakeup[0]], [], [], 0.5)
                    if readable and signal.SIGTERM in os.read(wakeup[0], 512):
                        self._signalled.set()
                except (OSError, ValueError):  # the pipe closed by remove()
                    self._closed.wait(0.5)
            if self._signalled.wait(0 if wakeup is not None else 0.5):
                self._sigterm_received()
                return

    def _sigterm_received(self) -> None:
        """The launcher ends this rank (a peer failed, or the job was cancelled): report who is lost, flush, leave,
        then end the process."""
        if not self.watchdog.stopped:
            with self._reporting:  # a failed collective's report under way: it finishes first
                if not self.reported:
                    self._report(f"rank {self.watchdog.rank} was sent SIGTERM (its launcher ends it)", "SIGTERM",
                                 abort=False)
                    self.watchdog.flush()
        self.watchdog.leave()
        self.terminate()

    def _end_by_sigterm(self) -> None:
        """Hand the signal back to the main thread (its handler re-raises it with the default action); a main
        thread blocked in C code cannot take it: after 2 s, end the process here."""
        self._handing_back = True
        _thread.interrupt_main(signal.SIGTERM)
        time.sleep(2.0)
        os._exit(128 + signal.SIGTERM)

    def _report(self, what: str, cause: str, abort: bool) -> list[int] | None:
        watchdog = self.watchdog
        self.reported = True
        wait_s = watchdog.beats_within_s()
        board = watchdog.board
        with watchdog.paused():  # a bounded look: not a hang of this rank
            lost = None if board is None else bounded(lambda: board.lost_ranks(watchdog.rank, wait_s), wait_s + 5.0)
        if lost:
            who = f"lost: rank(s) {lost} (no heartbeat for two of its beats)"
        elif lost is None:
            who = "the job's store is unreachable (without a torchrun agent rank 0 holds it: rank 0 is likely lost)"
        else:
            who = "every other rank is alive (no rank is lost)"
        ending = f"; aborting with exit code {EXIT_HANG}" if abort else ""
        message = f"{what} after {watchdog.completed_steps} steps; {who}{ending} ({cause})"
        log.error("arc_engine: %s", message)
        # a SIGTERM with every rank alive is a job being stopped (a cancellation, a preemption): not a critical event
        kind = "terminated" if lost == [] and cause == "SIGTERM" else "hang"
        watchdog.report_safely(kind, message, {"lost_ranks": lost, "completed_steps": watchdog.completed_steps,
                                                 "abort": abort, "exit_code": EXIT_HANG if abort else None,
                                                 "error": cause})
        return lost

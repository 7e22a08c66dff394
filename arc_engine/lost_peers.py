"""Naming the ranks a job lost mid-step (SIGKILL, a node gone).

Under gloo a lost rank does not hang its peers: their next collective with it fails (``Connection reset by peer``)
and the exception ends the training loop; under torchrun the agent sees the dead worker and sends SIGTERM to the
others, usually before that. Either way the survivors' last word should name the rank that is gone, and nothing
in the survivors' own state can tell it (the lost rank may have died at the very point of the step they are at).

:class:`LostPeerWatch` is installed with the hang watchdog (more than one rank): an unhandled exception that is a
failed collective (:func:`is_peer_failure`, through a chained ``sys.excepthook``), or a SIGTERM while the default
action is in place, makes the rank answer a roll call in the job's store (:meth:`ProgressBoard.roll_call`: one key
and one counter increment per rank, bounded); the ranks that do not answer are the lost ones. The rank reports a
critical ``hang`` event naming them (``lost_ranks``), flushes its sinks (bounded), and ends: with
:data:`~arc_engine.policy.decision.EXIT_HANG` after a failed collective under ``watchdog.action: abort`` (with
``alert``, as the exception ends it), by the SIGTERM's own default action after a SIGTERM.

Under NCCL the survivors block in the collective instead, and the hang watchdog names the rank behind.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

from arc_engine.policy.decision import EXIT_HANG
from arc_engine.watchdog import HangWatchdog

log = logging.getLogger("arc_engine.watchdog")

#: text of the errors a collective raises when a peer's connection is gone (gloo; NCCL raises DistBackendError)
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")


def is_peer_failure(err: BaseException | None) -> bool:
    """Whether ``err`` (or an exception it was raised from) is a failed collective: a torch distributed error or a
    peer-connection error. Pure."""
    seen = 0
    while err is not None and seen < 8:
        if type(err).__name__ in ("DistBackendError", "DistNetworkError", "DistError"):
            return True
        if isinstance(err, (RuntimeError, ConnectionError)) and any(text in str(err) for text in _PEER_GONE):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


class LostPeerWatch:
    """The excepthook and SIGTERM handler of one rank (see the module docstring). ``install`` and ``remove`` are
    local; both leave alone a hook or handler someone else set after (or before, for SIGTERM) this one."""

    def __init__(self, watchdog: HangWatchdog) -> None:
        self.watchdog = watchdog
        self._excepthooks: tuple[Any, Any] | None = None
        self._sigterm_installed = False
        self.reported = False
        self._reporting = False  # a report in progress: a SIGTERM then waits for it (see _on_sigterm)
        self._terminate = False

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
        return self

    def remove(self) -> None:
        if self._excepthooks is not None and sys.excepthook is self._excepthooks[1]:
            sys.excepthook = self._excepthooks[0]
        self._excepthooks = None
        if self._sigterm_installed and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._sigterm_installed = False

    def collective_failed(self, err: BaseException) -> None:
        """A collective failed on this rank: report who is lost; with ``action: abort`` flush and exit with
        :data:`EXIT_HANG`."""
        abort = self.watchdog.config.action == "abort"
        cause = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        self._report(f"a collective failed on rank {self.watchdog.rank}", cause, abort)
        if abort:
            self.watchdog.flush()
            self.watchdog.exit(EXIT_HANG)
        elif self._terminate:  # a SIGTERM arrived during the report: its default action now
            self._terminate_now()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """The launcher ends this rank (a peer failed, or the job was cancelled): report who is lost, flush, then
        let SIGTERM's default action end the process."""
        if self._reporting:  # the failed collective's report is under way (a roll call): let it finish
            self._terminate = True
            return
        if not self.watchdog.stopped and not self.reported:
            self._report(f"rank {self.watchdog.rank} was sent SIGTERM (its launcher ends it)",
                         "SIGTERM", abort=False)
            self.watchdog.flush()
        self._terminate_now()

    @staticmethod
    def _terminate_now() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def _report(self, what: str, cause: str, abort: bool) -> None:
        watchdog = self.watchdog
        self.reported = self._reporting = True
        wait_s = min(10.0, max(2.0, watchdog.timeout_s / 2))
        lost = watchdog.board.roll_call(watchdog.rank, wait_s) if watchdog.board is not None else None
        if lost:
            who = f"lost: rank(s) {lost} (no answer to the roll call within {wait_s:.0f} s)"
        elif lost is None:
            who = "the job's store is unreachable (without a torchrun agent rank 0 holds it: rank 0 is likely lost)"
        else:
            who = "every rank answered the roll call (no rank is lost)"
        ending = f"; aborting with exit code {EXIT_HANG}" if abort else ""
        message = f"{what} after {watchdog.completed_steps} steps; {who}{ending} ({cause})"
        log.error("arc_engine: %s", message)
        # a SIGTERM every rank answered is a job being stopped (a cancellation, a preemption): not a critical event
        kind = "terminated" if lost == [] and cause == "SIGTERM" else "hang"
        watchdog.report_safely(kind, message, {"lost_ranks": lost, "completed_steps": watchdog.completed_steps,
                                                 "abort": abort, "exit_code": EXIT_HANG if abort else None,
                                                 "error": cause})
        self._reporting = False

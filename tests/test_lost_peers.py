"""Naming lost peers (``arc_engine/lost_peers.py``, the heartbeats of ``arc_engine/watchdog.py``'s board) in one
process: a peer is lost only on evidence about that peer, every store call of the look is bounded, and a SIGTERM is
reported outside signal context. The multi-process cases are in ``tests/test_watchdog_abort_dist.py``."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from arc_engine.lost_peers import LostPeerWatch, bounded, is_peer_failure
from arc_engine.watchdog import ProgressBoard

GLOO_RESET = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:9630: "
                          "Connection reset by peer")


def test_a_peer_is_lost_only_when_its_heartbeat_stops_and_it_did_not_leave() -> None:
    store = torch.distributed.HashStore()
    boards = [ProgressBoard(store, "run", 6) for _ in range(6)]  # each rank's own board, as in its process
    for rank in range(5):  # rank 5 never published: it died before its first beat
        boards[rank].publish(rank, 8, every_s=0.1)
    boards[3].leave(3)  # rank 3 reported and exited on purpose
    stop = threading.Event()

    def beat() -> None:  # ranks 1 and 4 are alive: still training, or late to notice the failure
        while not stop.is_set():
            boards[1].publish(1, 9, every_s=0.1)
            boards[4].publish(4, 8, every_s=0.1)
            time.sleep(0.02)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        assert boards[0].lost_ranks(0, wait_s=30.0, poll_s=0.05) == [2, 5]  # after two beats of 0.1 s, not 30 s
    finally:
        stop.set()
        beating.join()
    # a later incident looks afresh: ranks 1 and 4 have stopped beating since, and no earlier look counts for them
    started = time.monotonic()
    assert boards[0].lost_ranks(0, wait_s=30.0, poll_s=0.05) == [1, 2, 4, 5]
    assert time.monotonic() - started < 25  # two of the peers' beats, not the whole wait
    assert boards[0].read() == {0: 8, 1: 9, 2: 8, 3: 8, 4: 8}  # the progress the hang report reads
    assert boards[0].wait_left([3], wait_s=0.0) == [] and boards[0].wait_left([1, 3], wait_s=0.1, poll_s=0.05) == [1]


def test_every_store_call_of_the_look_is_bounded() -> None:
    class Gone:
        def check(self, keys: list[str]) -> bool:
            raise ConnectionError("store gone")

    released = threading.Event()

    class Blocked:  # a store whose host is gone blocks until its own timeout (minutes)
        def check(self, keys: list[str]) -> bool:
            released.wait(120)
            return True

    with pytest.raises(ConnectionError):
        ProgressBoard(Gone(), "run", 2).lost_ranks(0, wait_s=1.0)
    started = time.monotonic()
    try:
        assert bounded(lambda: ProgressBoard(Blocked(), "run", 2).lost_ranks(0, wait_s=1.0), 0.5) is None
        assert time.monotonic() - started < 60  # bounded by its wait, not by the store's timeout
    finally:
        released.set()


def test_only_a_failure_of_torch_distributed_transport_is_a_peer_failure() -> None:
    assert is_peer_failure(GLOO_RESET)
    assert is_peer_failure(torch.distributed.DistBackendError("NCCL communicator was aborted"))
    try:
        try:
            raise GLOO_RESET
        except RuntimeError as inner:
            raise RuntimeError("the step failed") from inner
    except RuntimeError as outer:
        assert is_peer_failure(outer)
    # this rank's own I/O: its stdout pipe closed, a dataset client's connection reset
    assert not is_peer_failure(BrokenPipeError(32, "Broken pipe"))
    assert not is_peer_failure(ConnectionResetError(104, "Connection reset by peer"))
    assert not is_peer_failure(RuntimeError("fetching shard 12: Connection reset by peer"))
    assert not is_peer_failure(ValueError("Connection reset by peer"))
    assert not is_peer_failure(RuntimeError("CUDA out of memory"))


def _watchdog(board: object, reports: list, report_lock: threading.Lock | None = None) -> SimpleNamespace:
    def report_safely(*report: object) -> None:
        if report_lock is None:
            reports.append(report)
            return
        with report_lock:  # like a sink's lock (queue.Queue's, the W&B sink's): not reentrant
            reports.append(report)

    return SimpleNamespace(rank=0, completed_steps=7, board=board, stopped=False, report_safely=report_safely,
                           beats_within_s=lambda: 1.0, flush=lambda: None, leave=lambda: None,
                           paused=contextlib.nullcontext, config=SimpleNamespace(action="abort"))


def test_a_sigterm_with_every_peer_alive_is_a_stopped_job_and_a_lost_peer_is_critical() -> None:
    reports: list[tuple] = []
    for lost in ([], [1]):
        board = SimpleNamespace(lost_ranks=lambda rank, wait_s, lost=lost: lost, world_size=2)
        LostPeerWatch(_watchdog(board, reports))._report("rank 0 was sent SIGTERM (its launcher ends it)", "SIGTERM",
                                                         abort=False)
    (stopped, message, values), (critical, lost_message, lost_values) = reports
    assert stopped == "terminated" and "every other rank is alive" in message and values["lost_ranks"] == []
    assert critical == "hang" and "lost: rank(s) [1]" in lost_message and lost_values["lost_ranks"] == [1]


def test_a_sigterm_while_the_main_thread_holds_a_sinks_lock_is_reported_once_it_is_released() -> None:
    """Before: the handler reported in signal context, on the main thread that held the (non-reentrant) lock, and
    the rank deadlocked until the launcher's SIGKILL."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    lock, reports, terminated = threading.Lock(), [], threading.Event()
    board = SimpleNamespace(lost_ranks=lambda rank, wait_s: [], world_size=2)
    watch = LostPeerWatch(_watchdog(board, reports, lock), terminate=terminated.set).install()
    try:
        with lock:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)  # the handler has run, here, while this thread holds the lock
            assert reports == [] and not terminated.is_set()
        assert terminated.wait(30), "the SIGTERM was never reported"
        assert [r[0] for r in reports] == ["terminated"] and reports[0][2]["error"] == "SIGTERM"
    finally:
        watch.remove()
        signal.signal(signal.SIGTERM, previous)

"""A hang ends (watchdog.action: abort): one rank of 2 sleeps far past the timeout; both processes exit with the
watchdog's exit code and the hang event names the sleeping rank, not the one that noticed. A rank killed mid-step
(no torchrun agent): the survivor's collective fails, and its last event names the lost rank before it exits with
the same code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from arc_engine.policy.decision import EXIT_HANG
from tests.dist_harness import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


def _two_workers(run_dir: Path, mode: str, world: int = 2,
                 **env_extra: str) -> tuple[list[int | None], list[str]]:
    """tests/hang_worker.py as ``world`` plain processes (no torchrun); their exit codes and outputs."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1", **env_extra}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.hang_worker", str(run_dir), mode], cwd=REPO_ROOT,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    outputs = []
    try:
        for proc in procs:  # returning at all within this bound is the watchdog's doing
            outputs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in procs:
            proc.kill()
    return [proc.returncode for proc in procs], outputs


def _last_report(events: list[dict]) -> dict:
    """The last event before the stop record's (``stop``, written at the exit)."""
    return [e for e in events if e["detector"] != "stop"][-1]


def test_a_rank_asleep_past_the_timeout_ends_the_job_with_exit_6_naming_it(tmp_path: Path) -> None:
    codes, outputs = _two_workers(tmp_path, "stall")  # rank 1 sleeps 600 s
    assert codes == [EXIT_HANG, EXIT_HANG], outputs
    events = [json.loads(line) for line in (tmp_path / "test" / "events.jsonl.rank0").read_text().splitlines()]
    hangs = [e for e in events if e["detector"] == "hang"]
    assert hangs and all(e["values"]["stuck_ranks"] == [1] for e in hangs), hangs
    assert hangs[-1]["values"]["abort"] is True and hangs[-1]["values"]["exit_code"] == EXIT_HANG
    assert hangs[0]["severity"] == "critical" and "stopped: rank(s) [1]" in hangs[0]["message"]
    assert (tmp_path / "test" / "stacks" / "rank1-iter5.txt").exists()  # the sleeper's stack: where it sleeps
    assert "_stall" in (tmp_path / "test" / "stacks" / "rank1-iter5.txt").read_text()


def test_a_rank_killed_mid_step_is_named_by_the_survivor_which_ends_with_exit_6(tmp_path: Path) -> None:
    codes, outputs = _two_workers(tmp_path, "kill")  # rank 1: SIGKILL between its forward and its backward
    assert codes == [EXIT_HANG, -signal.SIGKILL], outputs
    events = [json.loads(line) for line in (tmp_path / "test" / "events.jsonl.rank0").read_text().splitlines()]
    last = _last_report(events)  # the survivor's last word names the rank it lost
    assert last["detector"] == "hang" and last["severity"] == "critical", last
    assert last["values"]["lost_ranks"] == [1] and last["values"]["exit_code"] == EXIT_HANG, last
    assert "lost: rank(s) [1]" in last["message"] and "Connection" in last["values"]["error"], last
    # then why it stopped: stop.json and its event (docs/hardware.md), the lost rank's device blamed
    stop = json.loads((tmp_path / "test" / "stop.json").read_text())
    assert (stop["cause"], stop["exit_code"], stop["ranks"]) == ("hang", EXIT_HANG, [1]), stop
    assert events[-1]["detector"] == "stop" and events[-1]["severity"] == "critical", events[-1]


def test_five_bare_processes_every_survivor_names_the_killed_rank_and_no_other(tmp_path: Path) -> None:
    """Rank 2 of 5 killed mid-step; the survivors notice at different times (rank r waits 0.5 r s before its
    backward, within the watchdog's 3 s timeout). Before: a survivor named every rank that had not yet answered a
    roll call (healthy ones included), and answers persisted across incidents. Now a peer is lost only when its own
    heartbeat stops and it did not leave on purpose; rank 0 (which holds the store without an agent) waits for the
    others' reports."""
    codes, outputs = _two_workers(tmp_path, "kill", world=5, ARC_TEST_KILL_RANK="2", ARC_TEST_STAGGER_S="0.5")
    assert codes[2] == -signal.SIGKILL, outputs
    assert [code for rank, code in enumerate(codes) if rank != 2] == [EXIT_HANG] * 4, outputs
    for rank in (0, 1, 3, 4):
        events = [json.loads(line) for line in
                  (tmp_path / "test" / f"events.jsonl.rank{rank}").read_text().splitlines()]
        last = _last_report(events)
        assert last["detector"] == "hang" and last["severity"] == "critical", (rank, last)
        assert last["values"]["lost_ranks"] == [2], (rank, last, outputs[rank][-3000:])


def test_a_sigterm_ends_a_rank_blocked_in_a_collective_after_its_report(tmp_path: Path) -> None:
    """Rank 1 sleeps at step 5; rank 0 waits for it inside DDP's gradient all-reduce (C code; gloo's timeout is
    600 s, the watchdog's 300 s). Before: arc_engine's handler replaced SIGTERM's default action and could run only
    between Python bytecodes, so rank 0 stayed blocked. Now the signal wakes the ``arc-sigterm`` thread, which
    reports (rank 1 is alive: a stopped job, not a lost rank) and ends the process."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "ARC_TEST_WATCHDOG_TIMEOUT_S": "300"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.hang_worker", str(tmp_path), "stall"], cwd=REPO_ROOT,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    try:
        step_file, deadline = tmp_path / "rank0.step", time.monotonic() + 180
        while not (step_file.exists() and step_file.read_text() == "5"):  # rank 0 enters step 5's backward
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate()[0][-3000:]
            time.sleep(0.2)
        time.sleep(2.0)  # ... and blocks in its all-reduce, waiting for rank 1
        procs[0].send_signal(signal.SIGTERM)
        output = procs[0].communicate(timeout=120)[0]  # ending at all is the change: before, 600 s
    finally:
        for proc in procs:
            proc.kill()
    assert procs[0].returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), output[-3000:]
    events = [json.loads(line) for line in (tmp_path / "test" / "events.jsonl.rank0").read_text().splitlines()]
    last = _last_report(events)
    assert last["detector"] == "hang" and last["severity"] == "info", (last, output[-3000:])  # a stopped job
    assert last["values"]["lost_ranks"] == [] and "every other rank is alive" in last["message"], last
    stop = json.loads((tmp_path / "test" / "stop.json").read_text())  # a cancellation: told, not alerted
    assert (stop["cause"], stop["exit_code"], stop["ranks"]) == ("terminated", 128 + signal.SIGTERM, []), stop
    assert events[-1]["detector"] == "stop" and events[-1]["severity"] == "info", events[-1]


def test_under_torchrun_a_rank_killed_mid_step_is_named_by_the_survivor_the_agent_ends(tmp_path: Path) -> None:
    """torchrun's agent sees the dead worker and sends SIGTERM to the others, often before their collective fails:
    the survivor's SIGTERM handler names the lost rank before the signal's default action ends it."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             str(free_port()), "-m", "tests.hang_worker", str(tmp_path), "kill"], cwd=REPO_ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert result.returncode != 0, result.stderr[-2000:]
    events = [json.loads(line) for line in (tmp_path / "test" / "events.jsonl.rank0").read_text().splitlines()]
    last = _last_report(events)
    assert last["detector"] == "hang" and last["values"]["lost_ranks"] == [1], (last, result.stderr[-2000:])
    assert "lost: rank(s) [1]" in last["message"], last


def test_under_torchrun_a_lost_leader_is_written_to_the_device_ledger_by_its_successor(tmp_path: Path) -> None:
    """Rank 0 (the decision group's leader, which writes the device ledger) killed mid-step under torchrun: the
    survivor names it, and as the lowest surviving rank writes its device to the ledger (``lost``), once, under the
    launch's one name. Before: nobody wrote it, and a host lost twice was never excluded."""
    from arc_engine import device_ledger

    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             str(free_port()), "-m", "tests.hang_worker", str(tmp_path), "kill"], cwd=REPO_ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "ARC_TEST_KILL_RANK": "0"},
                            capture_output=True, text=True, timeout=240)
    assert result.returncode != 0, result.stderr[-2000:]
    events = [json.loads(line) for line in (tmp_path / "test" / "events.jsonl.rank1").read_text().splitlines()]
    last = _last_report(events)
    assert last["detector"] == "hang" and last["values"]["lost_ranks"] == [0], (last, result.stderr[-2000:])
    records, torn = device_ledger.read_devices(tmp_path / device_ledger.DEVICES_FILE)
    assert not torn and [(r["rank"], r["evidence"]) for r in records] == [(0, "lost")], records
    assert records[0]["launch"].startswith("test@")

"""A hang ends (watchdog.action: abort): one rank of 2 sleeps far past the timeout; both processes exit with the
watchdog's exit code and the hang event names the sleeping rank, not the one that noticed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from arc_engine.policy.decision import EXIT_HANG
from tests.dist_harness import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_a_rank_asleep_past_the_timeout_ends_the_job_with_exit_6_naming_it(tmp_path: Path) -> None:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.hang_worker", str(tmp_path)], cwd=REPO_ROOT,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    outputs = []
    try:
        for proc in procs:  # rank 1 sleeps 600 s: returning at all within this bound is the watchdog's doing
            outputs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [EXIT_HANG, EXIT_HANG], outputs
    events = [json.loads(line) for line in (tmp_path / "test" / "events.jsonl").read_text().splitlines()]
    hangs = [e for e in events if e["detector"] == "hang"]
    assert hangs and all(e["values"]["stuck_ranks"] == [1] for e in hangs), hangs
    assert hangs[-1]["values"]["abort"] is True and hangs[-1]["values"]["exit_code"] == EXIT_HANG
    assert hangs[0]["severity"] == "critical" and "stopped: rank(s) [1]" in hangs[0]["message"]
    assert (tmp_path / "test" / "stacks" / "rank1-iter5.txt").exists()  # the sleeper's stack: where it sleeps
    assert "_stall" in (tmp_path / "test" / "stacks" / "rank1-iter5.txt").read_text()

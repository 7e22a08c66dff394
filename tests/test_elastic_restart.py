"""Elastic restart that works: one rank killed mid-run under ``torchrun --max-restarts 1`` (a fresh rendezvous
store per restart, as launch/torchrun.sh sets); torchrun restarts the workers, arc_engine resumes from the newest
committed checkpoint, and the run ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.dist_harness import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


def _torchrun(tmp: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": str(REPO_ROOT)}
    run_dir = tmp / name
    run_dir.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
               "--rdzv-id", f"elastic-{name}", "-m", "tests.elastic_worker", "--run-dir", str(run_dir),
               "--ckpt", str(tmp / f"{name}-ckpt"), "--out", str(tmp / f"{name}.pt"), *extra]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_killed_rank_is_restarted_by_torchrun_and_the_run_resumes_bitwise(tmp_path: Path) -> None:
    killed = _torchrun(tmp_path, "killed", "--die-at", "12")
    assert killed.returncode == 0, killed.stderr[-3000:]
    attempts = (tmp_path / "killed" / "attempts.rank1").read_text().split()
    assert attempts == ["0", "0", "1", "10"], attempts  # first attempt from step 0; the restart resumed at 10
    straight = _torchrun(tmp_path, "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    resumed, uninterrupted = torch.load(tmp_path / "killed.pt"), torch.load(tmp_path / "straight.pt")
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted, strict=True))

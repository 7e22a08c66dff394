"""The main job as a smoke test: the demo (torchrun, 2 gloo ranks) detects and handles every injected fault."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.wandb_records import alerts, history, read_records, transaction_logs

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[1]


def test_demo_detects_every_injected_fault(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "arc_engine.cli", "demo", "--nproc", "2", "--arc-config",
           str(REPO / "configs" / "demo.yaml"), "--steps", "200", "--log-every", "50",
           f"--arc.run.run_dir={tmp_path}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[train] step   50/200" in out  # progress is shown
    assert "non_finite -> SKIP | ranks [1]" in out and "non_finite -> SKIP | ranks [0]" in out
    assert "loss_spike -> SKIP" in out
    assert "MISSED" not in out
    # the LR spike at step 160: skips cannot undo it, the policy escalates, every rank rolls back and heals
    assert "policy -> ROLLBACK" in out
    assert "rollback at step 164: back to the memory snapshot of step 151" in out
    assert "steps 200, skipped 6" in out and "recovery: 1 rollback(s), 0 escape(s)" in out
    assert (tmp_path / "demo" / "checkpoints" / "latest").exists()
    assert (tmp_path / "demo" / "events.jsonl").stat().st_size > 0
    assert (tmp_path / "demo" / "metrics.jsonl").stat().st_size > 0
    # one offline W&B run with the alerts, and a step axis that keeps increasing across the rollback
    (log,) = transaction_logs(tmp_path / "demo")
    records = read_records(log)
    titles = [a["title"] for a in alerts(records)]
    assert any(t.startswith("NaN/Inf values on rank 1 (") for t in titles), titles
    assert "Rolled back" in titles, titles
    rows = [row for row in history(records) if "arc/step" in row]
    assert [row["_step"] for row in rows] == sorted(row["_step"] for row in rows)
    arc_steps = [row["arc/step"] for row in rows]
    assert arc_steps != sorted(arc_steps)  # the training step went back at the rollback


def test_demo_bad_config_exits_2_with_one_message(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "arc_engine.demo.train", "--arc.detectors.loss_spike.factor=-3"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "detectors.loss_spike.factor = -3.0: must be > 0" in proc.stderr
    assert "Traceback" not in proc.stderr

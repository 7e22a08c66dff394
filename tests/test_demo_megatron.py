"""The Megatron demo as a smoke test: `bash scripts/demo_megatron.sh` (torchrun, 4 gloo ranks, megatron-core with
the CPU shims) detects and handles every injected fault in both runs (TP=2 x DP=2 bf16, then EP=2 MoE)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.dist_harness import free_port

pytestmark = pytest.mark.timeout(420)
REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("megatron.core")


def test_megatron_demo_detects_and_handles_every_injected_fault(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    proc = subprocess.run(["bash", "scripts/demo_megatron.sh", f"--arc.run.run_dir={tmp_path}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    dense, moe = out.split("=== ep2_moe")
    for run in (dense, moe):
        # the bf16/fp32 NaN loss on rank 3 reaches its TP peer or stays local: either way every rank skips it
        assert "[arc] step     12 ERROR    non_finite -> SKIP" in run
        assert "loss_spike -> SKIP" in run
        assert "policy -> ROLLBACK" in run and "recovery -> ROLLBACK" in run
        assert "[train] done: 60 steps, 7 skipped" in run
    assert "ranks [2, 3]" in dense  # TP=2: rank 3's NaN loss gives its TP peer NaN gradients too
    assert "dead expert(s) in MoE layer 0: [3] received no token (EP rank(s) [1])" in moe
    assert "router collapse in MoE layer 1: entropy_mean" in moe  # the event names the lowest rank and its EP group
    assert "lowest routing entropy on rank" in moe and "(expert-parallel group [" in moe
    assert "router ->" not in dense  # no routers in the dense run
    events = [json.loads(line) for line in (tmp_path / "megatron_demo_ep2_moe" / "events.jsonl").read_text()
              .splitlines()]
    assert any(e["detector"] == "router" and e["values"].get("dead_expert_ids") == [3] for e in events)

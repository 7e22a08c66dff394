"""Running an example trainer script (``examples/``) under torchrun for the trainer callbacks' tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.dist_harness import free_port, run_script

ROOT = Path(__file__).resolve().parent.parent


def run_example(tmp_path: Path, example: str, name: str, steps: int, *args: str, nproc: int = 2,
                expect: int = 0, torchrun: bool | None = None) -> dict[str, Any]:
    """``examples/<example>`` on ``nproc`` ranks for ``steps`` steps, arc_engine's run under ``tmp_path/name`` with
    every rank's event log; asserts the exit status. Returns each rank's outcome (``--result``; None where a rank
    wrote none), each rank's events and the output.

    A run expected to stop (``expect`` not 0), or with ``torchrun=True``, starts under the real torchrun, whose exit
    status and "Root Cause" report the tests read. The others start their ranks as forks of the test session's fork
    server, which has imported the trainers once (``tests.dist_harness.run_script``: torchrun's environment, the
    same script): a torchrun and two interpreters importing torch, transformers or Lightning cost 25-30 s of CPU
    per run, and these files launch about thirty."""
    out = tmp_path / name
    script = ROOT / "examples" / example
    arguments = ["--steps", str(steps), "--result", str(out / "result"), f"--arc.run.run_dir={out}",
                 "--arc.run.run_id=run", "--arc.stats.interval=1", "--arc.sinks.all_ranks=true",
                 "--arc.sinks.console.enabled=false", *args]
    if example == "hf_trainer.py":
        arguments += ["--output-dir", str(out / "trainer")]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    if torchrun if torchrun is not None else expect != 0:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                   str(free_port()), str(script), *arguments]
        result = subprocess.run(command, capture_output=True, text=True, timeout=500, cwd=tmp_path, env=env,
                                check=False)
        returncode, output = result.returncode, result.stdout + result.stderr
    else:
        forked = run_script(script, arguments, nproc, tmp_path, env)
        returncode, output = forked.returncode, forked.output
    assert returncode == expect, output[-5000:]
    ranks = [torch.load(path) if (path := out / f"result.rank{r}.pt").exists() else None for r in range(nproc)]
    events = [[json.loads(line) for line in path.read_text().splitlines()]
              if (path := out / "run" / f"events.jsonl.rank{r}").exists() else [] for r in range(nproc)]
    return {"ranks": ranks, "events": events, "output": output, "dir": out}


#: NaN losses on rank 1 at steps 2 and 3 with one skip allowed, escalating to an abort: every rank stops at step 3
PERSISTENT_FAULT = ("--arc.faults.injections=[{kind: nan_loss, rank: 1, step: 2}, {kind: nan_loss, rank: 1, step: 3}]",
                    "--arc.policy.max_consecutive_skips=1", "--arc.policy.on_persistent_failure=abort")


def assert_stopped_at_step_3_with_exit_code_3(run: dict[str, Any]) -> None:
    """What :data:`PERSISTENT_FAULT` must end in: the abort on every rank's event log, and the first rank to exit
    exiting with code 3 (torchrun then ends the others and exits 1 itself)."""
    output = run["output"]
    assert "arc_engine stopped training at step 3" in output, output[-3000:]
    assert re.search(r"Root Cause.*?exitcode\s*:\s*3 ", output, re.S), output[-3000:]
    for events in run["events"]:
        assert any(e["action"] == "abort" for e in events if e["kind"] == "action"), events


def decisions(events: list[dict]) -> list[tuple]:
    """(step, detector, action) of every detection and action event, in order."""
    return [(e["step"], e["detector"], e["action"]) for e in events if e["kind"] in ("detection", "action")]

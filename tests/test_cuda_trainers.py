"""The trainer callbacks where only a GPU runs them (``-m cuda``; skipped without CUDA, never required by CI; run by
``scripts/gpu_check.sh``): the Hugging Face Trainer with fp16 through Accelerate's ``GradScaler`` and with FSDP2
through Accelerate (Accelerate uses neither on CPU ranks), and Lightning's ``16-mixed`` and DeepSpeed strategy on
CUDA. One GPU: one rank under torchrun. Each: parameters bitwise identical with and without arc_engine when nothing
is wrong, and a NaN loss skipped with the trainer's step counter counting applied steps only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_harness import free_port

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parent.parent
STEPS, NAN_STEP = 8, 3
NAN = f"--arc.faults.injections=[{{kind: nan_loss, rank: 0, step: {NAN_STEP}}}]"


def _run(tmp_path: Path, example: str, name: str, *args: str) -> dict[str, Any]:
    out = tmp_path / name
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
               str(free_port()), str(ROOT / "examples" / example), "--steps", str(STEPS), "--result",
               str(out / "result"), f"--arc.run.run_dir={out}", "--arc.run.run_id=run", "--arc.stats.interval=1",
               "--arc.sinks.console.enabled=false", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    if example == "hf_trainer.py":
        command += ["--output-dir", str(out / "trainer")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=500, cwd=tmp_path, env=env, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    events = out / "run" / "events.jsonl"
    return {"outcome": torch.load(out / "result.rank0.pt"),
            "events": [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []}


#: one rank: Accelerate and Lightning may leave the model unwrapped or wrap it in a one-rank DDP
ONE_RANK = {"DDP", "a plain (non-DDP) module"}


def _check(tmp_path: Path, example: str, adapters: set[str], *args: str) -> None:
    plain = _run(tmp_path, example, "plain", "--no-arc", *args)
    watched = _run(tmp_path, example, "arc", *args)
    assert watched["outcome"]["adapter"] in adapters
    assert torch.equal(plain["outcome"]["params"], watched["outcome"]["params"])
    assert watched["outcome"]["global_step"] == plain["outcome"]["global_step"] == STEPS
    faulted = _run(tmp_path, example, "faulted", NAN, *args)
    assert faulted["outcome"]["global_step"] == STEPS
    assert torch.isfinite(faulted["outcome"]["params"]).all()
    assert any(e["kind"] == "detection" and e["detector"] == "non_finite" and e["step"] == NAN_STEP
               for e in faulted["events"]), faulted["events"]


@pytest.mark.parametrize("args, adapters", [(("--fp16",), ONE_RANK), (("--bf16", "--fsdp"), {"FSDP2"})],
                         ids=["fp16", "fsdp2-bf16"])
def test_hf_trainer_on_a_gpu(tmp_path: Path, args: tuple[str, ...], adapters: set[str]) -> None:
    pytest.importorskip("transformers")
    _check(tmp_path, "hf_trainer.py", adapters, *args)


@pytest.mark.parametrize("args, adapters", [(("--precision", "16-mixed"), ONE_RANK),
                                            (("--strategy", "deepspeed_stage_2", "--precision", "bf16-mixed"),
                                             {"DeepSpeed ZeRO-2"})], ids=["16-mixed", "deepspeed-zero2"])
def test_lightning_on_a_gpu(tmp_path: Path, args: tuple[str, ...], adapters: set[str]) -> None:
    pytest.importorskip("lightning")
    if "deepspeed_stage_2" in args:
        pytest.importorskip("deepspeed")
    _check(tmp_path, "lightning_trainer.py", adapters, *args)

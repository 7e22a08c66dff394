"""The trainer callbacks where only a GPU runs them (``-m cuda``; skipped without CUDA, never required by CI; run by
``scripts/gpu_check.sh``): the Hugging Face Trainer with fp16 through Accelerate's ``GradScaler`` and with FSDP2
through Accelerate (Accelerate uses neither on CPU ranks), and Lightning's ``16-mixed`` and DeepSpeed strategy on
CUDA. One GPU: one rank under torchrun. Each: parameters bitwise identical with and without arc_engine when nothing
is wrong, and a NaN loss skipped with the trainer's step counter counting applied steps only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer_runs import run_example

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS, NAN_STEP = 8, 3
NAN = f"--arc.faults.injections=[{{kind: nan_loss, rank: 0, step: {NAN_STEP}}}]"


def _run(tmp_path: Path, example: str, name: str, *args: str) -> dict[str, Any]:
    run = run_example(tmp_path, example, name, STEPS, *args, nproc=1)
    return {"outcome": run["ranks"][0], "events": run["events"][0]}


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

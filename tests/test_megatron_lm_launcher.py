"""``launch/megatron/pretrain_gpt_arc.py`` against a real Megatron-LM checkout (``MEGATRON_LM_PATH``; skipped
without one): Megatron-LM's own ``pretrain()``, argument parser, initialization, mock GPT data and training loop,
on 2 CPU ranks over gloo, through ``tests/megatron_lm_cpu_entry.py`` (the CPU shims, then the launcher's
``main()``).

Checked at tag ``core_v0.16.1`` with the installed megatron-core 0.16.1."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_harness import free_port

ROOT = Path(__file__).resolve().parent.parent
ENTRY = ROOT / "tests" / "megatron_lm_cpu_entry.py"
CHECKOUT = os.environ.get("MEGATRON_LM_PATH", "")

pytestmark = [pytest.mark.skipif(not CHECKOUT, reason="no Megatron-LM checkout (set MEGATRON_LM_PATH)"),
              pytest.mark.timeout(300)]

ITERATIONS = 5
# Megatron-LM's pretrain_gpt.py flags for a tiny GPT on CPU: no Transformer Engine, apex or fused kernels.
GPT_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--train-iters", str(ITERATIONS), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "constant",
    "--seed", "1234", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
    "--no-rope-fusion", "--no-persist-layer-norm", "--distributed-backend", "gloo", "--use-distributed-optimizer",
    "--no-check-for-nan-in-loss-and-grad", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
]
# arc_engine steps count from 0: step s is Megatron-LM's iteration s + 1
NAN_LOSS_STEP, NAN_GRAD_STEP = 1, 3
ARC_CONFIG = f"""\
run:
  run_id: megatron_lm
  run_dir: RUN_DIR
stats:
  interval: 1
sinks:
  all_ranks: true             # events.jsonl.rank0, events.jsonl.rank1: what each rank decided
faults:
  injections:
    - {{kind: nan_loss, rank: 0, step: {NAN_LOSS_STEP}}}
    - {{kind: nan_grad, rank: 1, step: {NAN_GRAD_STEP}}}
"""
ITERATION_LOG = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*?)number of skipped iterations:\s+(\d+)")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def test_the_arc_flags_reach_megatron_lm_argument_parsing(tmp_path: Path) -> None:
    """pretrain()'s own parser, with arc_engine's flags added by extra_args_provider, takes a valid ``--arc.*`` key
    and refuses a misspelt one (argparse exits before torch.distributed starts). ``--help`` cannot show this:
    Megatron-LM 0.16.1's ``ft_integration.setup()`` parses first, without the extra provider, and prints its help."""
    result = subprocess.run([sys.executable, str(ENTRY), "--arc.detectors.loss_spike.factor=8",
                             "--arc.detectors.loss_spike.factr=8"], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path, env=_env(), check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    refused = re.search(r"unrecognized arguments: (.*)", result.stderr)
    assert refused and refused.group(1).split() == ["--arc.detectors.loss_spike.factr=8"], result.stderr[-3000:]


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_megatron_lm_trains_and_every_rank_vetoes_the_injected_faults(tmp_path: Path, tp: int) -> None:
    """2 ranks (TP=2 x DP=1, or TP=1 x DP=2 where the distributed optimizer shards), 5 iterations: a NaN loss on
    rank 0 at step 1 and a NaN gradient on rank 1 at step 3 are vetoed on both ranks, Megatron-LM counts both as
    skipped iterations, and the iterations after each are finite."""
    pytest.importorskip("megatron.core")
    run_dir = tmp_path / "arc_runs"
    config = tmp_path / "arc.yaml"
    config.write_text(ARC_CONFIG.replace("RUN_DIR", str(run_dir)))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(ENTRY), *GPT_ARGS, "--tensor-model-parallel-size", str(tp),
               "--arc-config", str(config)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=tmp_path, env=_env(),
                            check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]

    # Megatron-LM's own log (last rank): every iteration ran; the two vetoed ones count as skipped
    logged = {int(it): (fields, int(skipped)) for it, fields, skipped in ITERATION_LOG.findall(output)}
    assert sorted(logged) == list(range(1, ITERATIONS + 1)), output[-4000:]
    vetoed = {NAN_LOSS_STEP + 1, NAN_GRAD_STEP + 1}
    assert {it for it, (_, skipped) in logged.items() if skipped} == vetoed
    for it, (fields, _) in logged.items():
        if it not in vetoed:  # applied steps report a finite grad norm and loss: no NaN reached the weights
            norm = re.search(r"grad norm: (\S+) \|", fields)
            loss = re.search(r"lm loss: (\S+) \|", fields)
            assert norm and loss and math.isfinite(float(norm.group(1))) and math.isfinite(float(loss.group(1)))
        else:
            assert "grad norm" not in fields

    # arc_engine's event log, one per rank: both ranks took both vetoes, and the same summary
    for rank in (0, 1):
        events = [json.loads(line) for line in (run_dir / "megatron_lm" / f"events.jsonl.rank{rank}").read_text()
                  .splitlines()]
        skips = {e["step"]: e for e in events if e["detector"] == "non_finite" and e["action"] == "skip"}
        assert sorted(skips) == [NAN_LOSS_STEP, NAN_GRAD_STEP], events
        assert 0 in skips[NAN_LOSS_STEP]["ranks"] and 1 in skips[NAN_GRAD_STEP]["ranks"]
        assert sorted(e["step"] for e in events if e["detector"] == "engine" and e["action"] == "skip") == \
            [NAN_LOSS_STEP, NAN_GRAD_STEP]
        summary = next(e["values"] for e in events if e["detector"] == "summary")
        assert (summary["steps"], summary["iterations"], summary["skipped_steps"]) == (ITERATIONS, ITERATIONS, 2)
        assert summary["monitored_steps"] == ITERATIONS


def test_megatron_lm_load_resumes_from_arc_engine_checkpoints(tmp_path: Path) -> None:
    """arc_engine's disk tier under the launcher (format ``auto``: megatron-core's dist_checkpointing, with
    Megatron-LM's ``iter_XXXXXXX`` names and tracker file) is what a plain Megatron-LM job's ``--load`` reads: a
    second run without arc_engine's recovery loads the newest commit and continues from its iteration."""
    pytest.importorskip("megatron.core")
    checkpoints = tmp_path / "checkpoints"
    saving = tmp_path / "save.yaml"
    saving.write_text(f"""\
run: {{run_id: save, run_dir: {tmp_path / 'runs'}}}
recovery:
  enabled: true
  checkpoint_freq: 1
  checkpoint: {{dir: {checkpoints}, every_steps: 2}}
""")
    plain = tmp_path / "plain.yaml"
    plain.write_text(f"run: {{run_id: load, run_dir: {tmp_path / 'runs'}}}\n")
    def launch(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(free_port()), str(ENTRY), *args, "--tensor-model-parallel-size", "2"]
        return subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=tmp_path, env=_env(),
                              check=False)

    first = launch(*GPT_ARGS, "--arc-config", str(saving))
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    tracked = int((checkpoints / "latest_checkpointed_iteration.txt").read_text())
    assert (checkpoints / f"iter_{tracked:07d}" / "metadata.json").is_file()

    total = ITERATIONS + 2
    # --no-load-optim: megatron-core 0.16.1's DistributedOptimizer cannot build its state dict before torch Adam's
    # first step (an assert), which a fresh CPU job with torch Adam is at; the same for its own checkpoints
    args = [*GPT_ARGS, "--arc-config", str(plain), "--load", str(checkpoints), "--no-load-rng", "--no-load-optim"]
    args[args.index("--train-iters") + 1] = str(total)
    second = launch(*args)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-4000:]
    assert f"loading distributed checkpoint from {checkpoints} at iteration {tracked}" in output, output[-4000:]
    logged = sorted(int(it) for it, _, _ in ITERATION_LOG.findall(output))
    assert logged == list(range(tracked + 1, total + 1)), output[-4000:]

"""``launch/megatron/pretrain_gpt_arc.py``: Megatron-LM's own ``pretrain()``, argument parser, initialization, mock
GPT data, training loop, evaluation and checkpoint loader, on 2 CPU ranks over gloo, through
``tests/megatron_lm_cpu_entry.py`` (the CPU shims, then the launcher's ``main()``).

Megatron-LM's training code is the ``megatron.training`` package megatron-core 0.19 ships (the Python 3.12 lane:
no checkout, the launcher's own ``gpt_steps.py``), or a Megatron-LM checkout named by ``MEGATRON_LM_PATH`` (its
``pretrain_gpt.py``; checked at tag ``core_v0.16.1`` with megatron-core 0.16.1). Skipped with neither: megatron-core
0.16.1's wheel (the Python 3.11 lane) has no ``megatron.training``."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_harness import free_port, run_script

ROOT = Path(__file__).resolve().parent.parent
ENTRY = ROOT / "tests" / "megatron_lm_cpu_entry.py"
CHECKOUT = os.environ.get("MEGATRON_LM_PATH", "")


def _megatron_training_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ImportError:  # no megatron package at all
        return False


pytestmark = [pytest.mark.skipif(not CHECKOUT and not _megatron_training_installed(),
                                 reason="no megatron.training (megatron-core >= 0.19 ships it) and no Megatron-LM "
                                        "checkout (MEGATRON_LM_PATH)"),
              pytest.mark.timeout(300)]

ITERATIONS = 10
# pretrain_gpt.py flags for a tiny GPT on CPU: no Transformer Engine, apex or fused kernels. Evaluation after
# iterations 3, 6 and 9 (one batch each), so that its losses would show in the training losses if it were recorded.
GPT_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--train-iters", str(ITERATIONS), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "constant",
    "--seed", "1234", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--split", "8,2,0",
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
    "--no-rope-fusion", "--no-persist-layer-norm", "--distributed-backend", "gloo", "--use-distributed-optimizer",
    "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "3",
]
# arc_engine steps count from 0: step s is Megatron-LM's iteration s + 1
NAN_LOSS_STEP, SPIKE_STEP = 4, 7
ARC_CONFIG = f"""\
run:
  run_id: megatron_lm
  run_dir: RUN_DIR
stats:
  interval: 1
detectors:
  loss_spike: {{warmup_steps: 3}}
sinks:
  all_ranks: true             # events.jsonl.rank0, events.jsonl.rank1: what each rank decided
  metrics_interval: 1         # arc_engine's agreed loss of every step, to compare with Megatron-LM's lm loss
faults:
  injections:
    - {{kind: nan_loss, rank: 0, step: {NAN_LOSS_STEP}}}
    - {{kind: loss_scale, rank: -1, step: {SPIKE_STEP}, scale: 30.0}}
"""
ITERATION_LOG = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*?)number of skipped iterations:\s+(\d+)")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _torchrun(tmp_path: Path, *args: str, real: bool = False) -> subprocess.CompletedProcess:
    """The entry on 2 ranks. ``real``: under the real torchrun, for the runs whose exit status and "Root Cause"
    report are asserted; the others start their ranks as forks of the test session's fork server
    (``tests.dist_harness.run_script``: torchrun's environment, the frameworks imported once), their output in
    ``stdout``."""
    if not real:
        forked = run_script(ENTRY, list(args), 2, tmp_path, _env(), timeout_s=280)
        return subprocess.CompletedProcess(args, forked.returncode, forked.output, "")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(ENTRY), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=tmp_path, env=_env(),
                          check=False)


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_arc_flags_reach_megatron_lm_argument_parsing(tmp_path: Path) -> None:
    """Megatron-LM's own parser, with arc_engine's flags added by its extra_args_provider, takes a valid ``--arc.*``
    key and refuses a misspelt one, naming it (exit code 2 before torch.distributed starts): through arc_engine's
    "did you mean" where its parser.error runs, else argparse's own "unrecognized arguments"."""
    result = subprocess.run([sys.executable, str(ENTRY), "--arc.detectors.loss_spike.factor=8",
                             "--arc.detectors.loss_spike.factr=8"], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path, env=_env(), check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    named = re.search(r"invalid config: --arc\.(\S+): unknown key", result.stderr)
    refused = re.search(r"unrecognized arguments: (.*)", result.stderr)
    assert (named and named.group(1) == "detectors.loss_spike.factr") or \
        (refused and refused.group(1).split() == ["--arc.detectors.loss_spike.factr=8"]), result.stderr[-3000:]


def test_megatron_lm_trains_and_every_rank_takes_the_same_decisions(tmp_path: Path) -> None:
    """TP=1 x DP=2 with the distributed optimizer, 10 iterations, evaluation every 3: a NaN loss on rank 0 at step 4
    and a 30x loss spike at step 7 are skipped on both ranks, as each rank's own event log says, Megatron-LM counts
    both as skipped iterations, every other iteration is finite, and arc_engine's loss of each applied step is
    Megatron-LM's ``lm loss`` of that iteration (the evaluation losses were not recorded as training losses)."""
    run_dir = tmp_path / "arc_runs"
    config = tmp_path / "arc.yaml"
    config.write_text(ARC_CONFIG.replace("RUN_DIR", str(run_dir)))
    result = _torchrun(tmp_path, *GPT_ARGS, "--arc-config", str(config))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]

    # Megatron-LM's own log (last rank): every iteration ran; the two skipped ones are counted as skipped
    logged = {int(it): (fields, int(skipped)) for it, fields, skipped in ITERATION_LOG.findall(output)}
    assert sorted(logged) == list(range(1, ITERATIONS + 1)), output[-4000:]
    skipped = {NAN_LOSS_STEP + 1, SPIKE_STEP + 1}
    assert {it for it, (_, count) in logged.items() if count} == skipped, output[-4000:]
    lm_loss: dict[int, float] = {}
    for it, (fields, _) in logged.items():
        if it not in skipped:  # applied steps report a finite grad norm and loss: no NaN reached the weights
            norm = re.search(r"grad norm: (\S+) \|", fields)
            loss = re.search(r"lm loss: (\S+) \|", fields)
            assert norm and loss and math.isfinite(float(norm.group(1))) and math.isfinite(float(loss.group(1)))
            lm_loss[it] = float(loss.group(1))
        else:
            assert "grad norm" not in fields
    assert output.count("validation loss at iteration") >= 3, output[-4000:]  # the evaluations ran
    source = f"checkout {CHECKOUT}" if CHECKOUT else "installed megatron.training"
    assert f"with the GPT steps of {source}" in output, output[-4000:]

    # arc_engine's event log, one per rank: the same decisions on both ranks, and the same summary
    run = run_dir / "megatron_lm"
    decisions = {}
    for rank in (0, 1):
        events = _events(run / f"events.jsonl.rank{rank}")
        decisions[rank] = [(e["step"], e["detector"], e["action"]) for e in events
                           if e["kind"] in ("detection", "action")]
        summary = next(e["values"] for e in events if e["detector"] == "summary")
        assert (summary["steps"], summary["iterations"], summary["steps_not_applied"]) == (ITERATIONS, ITERATIONS, 2)
        assert summary["detections"] == {"non_finite": 1, "loss_spike": 1}, summary
    assert decisions[0] == decisions[1] == [(NAN_LOSS_STEP, "non_finite", "skip"), (NAN_LOSS_STEP, "engine", "skip"),
                                            (SPIKE_STEP, "loss_spike", "skip"), (SPIKE_STEP, "engine", "skip")]
    nan_event = next(e for e in _events(run / "events.jsonl.rank1") if e["detector"] == "non_finite")
    assert nan_event["ranks"] == [0], nan_event  # named on the rank whose loss was NaN

    # the loss arc_engine agreed on is the training loss Megatron-LM logged (one micro-batch per rank and step);
    # Megatron-LM's first two printed losses share one accumulator (its logging), so compare from iteration 3 on
    recorded = {int(m["step"]) + 1: m["arc/loss_spike/loss"] for m in _events(run / "metrics.jsonl.rank0")
                if "arc/loss_spike/loss" in m}
    compared = [it for it in lm_loss if it >= 3]
    assert compared and all(math.isclose(recorded[it], lm_loss[it], rel_tol=1e-5) for it in compared), \
        (recorded, lm_loss)


def test_megatron_lm_load_resumes_from_arc_engine_checkpoints(tmp_path: Path) -> None:
    """arc_engine's disk tier under the launcher (format ``auto``: megatron-core's dist_checkpointing, with
    Megatron-LM's ``iter_XXXXXXX`` names and tracker file) is what a plain Megatron-LM job's ``--load`` reads: a
    second run without arc_engine's recovery loads the newest commit and continues from its iteration."""
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
    iterations = 5
    args = [*GPT_ARGS, "--eval-iters", "0", "--eval-interval", "1000", "--tensor-model-parallel-size", "2"]
    args[args.index("--train-iters") + 1] = str(iterations)
    first = _torchrun(tmp_path, *args, "--arc-config", str(saving))
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    tracked = int((checkpoints / "latest_checkpointed_iteration.txt").read_text())
    assert (checkpoints / f"iter_{tracked:07d}" / "metadata.json").is_file()

    total = iterations + 2
    # --no-load-optim: megatron-core's DistributedOptimizer cannot build its state dict before torch Adam's first
    # step (an assert), which a fresh CPU job with torch Adam is at; the same for its own checkpoints
    args[args.index("--train-iters") + 1] = str(total)
    second = _torchrun(tmp_path, *args, "--arc-config", str(plain), "--load", str(checkpoints), "--no-load-rng",
                       "--no-load-optim")
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-4000:]
    assert f"loading distributed checkpoint from {checkpoints} at iteration {tracked}" in output, output[-4000:]
    logged = sorted(int(it) for it, _, _ in ITERATION_LOG.findall(output))
    assert logged == list(range(tracked + 1, total + 1)), output[-4000:]


def _trained_iterations(output: str) -> dict[int, tuple[str, str]]:
    """Megatron-LM's log of each trained iteration: its learning rate and grad norm, as printed (not its lm loss: the
    first two iterations a job trains share one accumulator there, so it differs after a resume)."""
    trained = {}
    for it, fields, _ in ITERATION_LOG.findall(output):
        values = [re.search(rf"{name}: (\S+) \|", fields) for name in ("learning rate", "grad norm")]
        if all(values):
            trained[int(it)] = tuple(value.group(1) for value in values)
    return trained


#: what arc_engine measured of each step, at full precision: the loss, the gradient, the weights, Adam's update
EXACT_METRICS = ("arc/loss_spike/loss", "arc/grad_norm/norm", "arc/optimizer/weight_norm/dense.decay",
                 "arc/optimizer/update_rms/dense.decay", "arc/optimizer/update_rms/dense.no_decay")


@pytest.mark.timeout(600)  # three runs of the launcher (80-150 s on 2 shared cores) and a refused one
def test_a_rollback_under_pretrain_relaunches_with_the_printed_flags_as_if_uninterrupted(tmp_path: Path) -> None:
    """``pretrain()`` owns the iteration counter and the data, so the launcher rolls back the Megatron way: a 30x loss
    spike at step 7 with ``loss_spike.action: rollback`` stops every rank with exit code 7 once the newest disk
    checkpoint is committed; ``relaunch.json`` and the printed flags name it, the iterations to skip and what
    Megatron-LM's ``--load`` leaves to arc_engine's resume (``--no-load-optim --no-load-rng``). The same command
    relaunched with exactly the printed flags resumes at the checkpoint's iteration, skips the bad iterations' batches
    and trains to the end bit for bit as a run that was never interrupted and skipped the same iterations: the
    learning rate (a warmup, then a decay: the LR scheduler), the loss (hidden dropout: the RNG), the gradient, the
    weights and Adam's update (its moments and step count) of every iteration it trains. Megatron-LM's own saves
    (``--save-interval 4``) never hold the rejected state: iteration 4 is saved, iteration 8 (the spike's) is not.
    Relaunched with ``--load`` of that own checkpoint of iteration 4 while arc_engine's newest is another step,
    every rank stops with exit code 2 naming both steps (two resumes would disagree)."""
    def arc_config(run_id: str, checkpoints: Path, fault: bool) -> Path:
        path = tmp_path / f"{run_id}.yaml"
        path.write_text(f"""\
run: {{run_id: {run_id}, run_dir: {tmp_path / 'runs'}}}
stats: {{interval: 1, optimizer_stats_every: 1}}
sinks: {{metrics_interval: 1}}
recovery:
  enabled: true
  checkpoint_freq: 1
  checkpoint: {{dir: {checkpoints}, every_steps: 2}}
detectors:
  loss_spike: {{warmup_steps: 3, action: rollback}}
""" + (f"faults: {{injections: [{{kind: loss_scale, rank: -1, step: {SPIKE_STEP}, scale: 30.0}}]}}\n" if fault else ""))
        return path

    checkpoints = tmp_path / "checkpoints"
    iterations = 11  # the relaunch trains three iterations after the skipped ones
    # attention dropout off: it draws from megatron-core's RNG tracker (inside the tensor-parallel region), which
    # arc_engine's checkpoints do not carry yet (docs/megatron.md); hidden dropout draws from torch's own RNG
    args = [*GPT_ARGS, "--eval-iters", "0", "--eval-interval", "1000", "--tensor-model-parallel-size", "2",
            "--lr-warmup-iters", "2", "--attention-dropout", "0"]
    args[args.index("--train-iters") + 1] = str(iterations)
    args[args.index("--lr-decay-style") + 1] = "linear"
    own = tmp_path / "megatron"
    first = _torchrun(tmp_path, *args, "--arc-config", str(arc_config("relaunch", checkpoints, fault=True)),
                      "--save", str(own), "--save-interval", "4", real=True)
    output = first.stdout + first.stderr
    assert first.returncode != 0 and re.search(r"Root Cause.*?exitcode\s*:\s*7 ", output, re.S), output[-4000:]
    assert sorted(path.name for path in own.glob("iter_*")) == ["iter_0000004"], output[-4000:]
    plan = json.loads((tmp_path / "runs" / "relaunch" / "relaunch.json").read_text())
    target = plan["checkpoint_step"]
    assert plan["failed_step"] == SPIKE_STEP and 0 < target <= SPIKE_STEP
    assert plan["skip_steps"] == list(range(target, SPIKE_STEP + 1))
    assert int((checkpoints / "latest_checkpointed_iteration.txt").read_text()) == target
    flags = shlex.split(re.search(r"relaunch with: (.*)", output).group(1))
    skipped = [step + 1 for step in plan["skip_steps"]]
    assert flags == plan["megatron_lm_args"] == ["--load", str(checkpoints), "--iterations-to-skip",
                                                 *map(str, skipped), "--no-load-optim", "--no-load-rng"], flags
    before = _trained_iterations(output)

    # the relaunch: the same command plus exactly the printed flags, without the fault (a data-caused spike would
    # be skipped with its batch)
    second = _torchrun(tmp_path, *args, "--arc-config", str(arc_config("relaunch", checkpoints, fault=False)), *flags)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-4000:]
    assert f"at iteration {target}" in output, output[-4000:]
    resumed = _trained_iterations(output)
    assert sorted(resumed) == [it for it in range(target + 1, iterations + 1) if it not in skipped], \
        (sorted(resumed), output[-3000:])

    # the reference: never interrupted, the same iterations skipped from the start
    third = _torchrun(tmp_path, *args, "--arc-config", str(arc_config("reference", tmp_path / "reference", False)),
                      "--iterations-to-skip", *map(str, skipped))
    output = third.stdout + third.stderr
    assert third.returncode == 0, output[-4000:]
    reference = _trained_iterations(output)
    assert all(before[it] == reference[it] for it in range(1, target + 1))  # the first run, up to its checkpoint
    assert {it: reference[it] for it in resumed} == resumed, (resumed, reference)
    steps = {it - 1 for it in resumed}  # the first run stopped before them: these lines are the relaunch's
    measured = {run: {m["step"]: [m[key] for key in EXACT_METRICS]
                      for m in _events(tmp_path / "runs" / run / "metrics.jsonl") if m["step"] in steps}
                for run in ("relaunch", "reference")}
    assert sorted(measured["relaunch"]) == sorted(steps) and measured["relaunch"] == measured["reference"], measured

    # Megatron-LM's own checkpoint of iteration 4 beside arc_engine's newer ones: refused, both steps named
    fourth = _torchrun(tmp_path, *args, "--arc-config", str(arc_config("relaunch", checkpoints, fault=False)),
                       "--load", str(own), "--no-load-optim", real=True)
    output = fourth.stdout + fourth.stderr
    assert re.search(r"Root Cause.*?exitcode\s*:\s*2 ", output, re.S), output[-4000:]
    assert "two resumes disagree" in output and "Megatron-LM (--load) resumed step 4" in output, output[-4000:]
    assert "--arc.recovery.checkpoint.resume=false" in output

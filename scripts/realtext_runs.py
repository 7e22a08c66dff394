"""Long clean runs on real text: arc_engine's false alarms where the loss is heavy-tailed and the data moves.

    .venv/bin/python scripts/realtext_runs.py --seeds 0 1 2 3 --steps 5000 --out arc_runs/realtext

Per seed, one run of the demo GPT (byte-level, ``--layers`` x ``--d-model``) under DDP on 2 CPU ranks, on the
machine's own text (:mod:`arc_engine.demo.realtext`: the Python standard library's source as ``code``; licenses,
copyright files, manual pages and system tables as ``prose``), with what a real pretraining run does to its data
and schedule:

* a learning-rate warm-up over the first 5% of the steps, then a cosine decay to 10% of the peak;
* a batch-size ramp: ``--ramp`` sequences per rank and step, each size from its share of the run on;
* even seeds: both ranks draw prose-heavy batches (80% prose), then from 60% of the run on code-heavy ones (80%
  code), a data-mixture switch; odd seeds: per-rank shards of different kinds, rank 0 all code, rank 1 all prose;
* a resume from a checkpoint in the middle: the job stops after half the steps and is launched again, and
  arc_engine resumes it from its newest committed disk checkpoint (model, optimizer, counters, monitors).

arc_engine runs as users run it: its default configuration with recovery on (``recovery.enabled``, a disk
checkpoint every quarter of the run). Reported: every alarm (a detection of severity warning or above) with its
step and what was going on around it (the learning-rate phase, a batch-size change, the mixture switch, the
resume), every intervention (a skipped, rolled-back, recomputed or stopped step; none is expected on a clean run),
and per detector the alarms per 1,000 steps with a 95% Poisson interval. Written: ``OUT/realtext.json`` and the
markdown table on stdout; each rank's loss at every step in ``OUT/seedN/losses_rankR.jsonl`` (a line per launch),
to replay a detector's rule offline. Figures: docs/results.md#real-text.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import arc_engine
from arc_engine.config import load_config
from arc_engine.demo.gpt import GPT, GPTConfig, param_groups
from arc_engine.demo.realtext import MixedText, Mixture, build_corpus, windows
from arc_engine.demo.train import exit_hard
from arc_engine.sinks import read_jsonl

INTERVENTIONS = ("skip", "rollback", "abort", "recompute", "escape")
SWITCH_AT = 0.6
WARMUP = 0.05
MIN_LR_RATIO = 0.1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=5000, help="optimizer steps per run")
    parser.add_argument("--out", type=Path, default=Path("arc_runs/realtext"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--ramp", type=int, nargs=3, default=[4, 6, 8],
                        help="sequences per rank and step: the first from step 0, the second from 10%% of the run, "
                             "the third from 30%%")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--budget-mb", type=float, default=4.0, help="bytes of each kind of text")
    # one launch of the job (set by the parent)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--stop-at", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first ``WARMUP`` of the run, then a cosine to ``MIN_LR_RATIO``."""
    warmup = max(1, int(WARMUP * steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def batch_size(step: int, steps: int, ramp: list[int]) -> int:
    return ramp[2] if step >= 0.3 * steps else ramp[1] if step >= 0.1 * steps else ramp[0]


def mixture(seed: int, steps: int) -> Mixture:
    """Even seeds: prose-heavy, then code-heavy from ``SWITCH_AT`` of the run; odd seeds: rank 0 code, rank 1
    prose."""
    if seed % 2:
        return lambda step, rank: {"code": 1.0} if rank % 2 == 0 else {"prose": 1.0}
    return lambda step, rank: {"prose": 0.8, "code": 0.2} if step < SWITCH_AT * steps else {"prose": 0.2, "code": 0.8}


def config_for(args: argparse.Namespace, run_dir: Path) -> object:
    return load_config(None, ["run.run_id=run", f"run.run_dir={run_dir}", "sinks.console.enabled=false",
                              "recovery.enabled=true", f"recovery.checkpoint.every_steps={max(1, args.steps // 4)}"])


def worker(args: argparse.Namespace) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    corpus = build_corpus(budget_bytes=int(args.budget_mb * 2**20))
    data = MixedText(corpus.train, args.seq_len, mixture(args.seed, args.steps), seed=args.seed)
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=MixedText.vocab_size, seq_len=args.seq_len, num_layers=args.layers,
                          d_model=args.d_model, num_heads=args.heads))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
    arc = arc_engine.attach(ddp, optimizer, config_for(args, args.out))
    start, first = time.perf_counter(), arc.progress.step
    stop = args.stop_at if args.stop_at is not None else args.steps
    losses: list[tuple[int, float]] = []  # this rank's loss at each step, for replaying the detectors offline
    try:
        while arc.progress.step < stop:
            step = arc.progress.step
            for group in optimizer.param_groups:
                group["lr"] = args.lr * lr_factor(step, args.steps)  # arc_engine's LR cut multiplies this
            inputs, targets = data.batch(arc.progress.data_position, rank,
                                         batch_size(step, args.steps, args.ramp))
            loss = ddp(inputs, targets)
            arc.record_loss(loss)
            losses.append((step, loss.item()))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    except arc_engine.ArcAbort as abort:
        print(f"[realtext] rank {rank}: {abort}", file=sys.stderr, flush=True)
        return abort.exit_code
    elapsed = time.perf_counter() - start
    with open(args.out / f"losses_rank{rank}.jsonl", "a") as log:  # one line per launch
        log.write(json.dumps({"first_step": first, "losses": losses}) + "\n")
    held_out = {}
    with torch.no_grad():
        for kind, tokens in corpus.held_out.items():
            losses = [float(model(x, y)) for x, y in windows(tokens, args.seq_len, 16)]
            held_out[kind] = sum(losses) / len(losses)
    summary = arc.summary()
    arc.close()
    if rank == 0:
        print(f"[realtext] seed {args.seed}: steps {first}..{summary['steps']} in {elapsed:.0f} s "
              f"({elapsed * 1e3 / max(1, summary['steps'] - first):.0f} ms/step); held-out loss "
              + ", ".join(f"{kind} {loss:.3f}" for kind, loss in held_out.items())
              + f"; {corpus.describe()}", flush=True)
        with open(args.out / "launches.jsonl", "a") as log:
            log.write(json.dumps({"first_step": first, "summary": summary, "held_out": held_out,
                                  "corpus": corpus.digest, "seconds": elapsed}) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def context(step: int, steps: int, seed: int, resumed_at: list[int]) -> str:
    """What was going on around ``step`` (within 50 steps): the schedule's and the data's changes."""
    near = []
    warmup = int(WARMUP * steps)
    if step <= warmup + 50:
        near.append("learning-rate warm-up" if step <= warmup else "end of warm-up")
    for share, ramp in ((0.1, "first"), (0.3, "second")):
        if abs(step - share * steps) <= 50:
            near.append(f"{ramp} batch-size increase")
    if seed % 2 == 0 and abs(step - SWITCH_AT * steps) <= 50:
        near.append("mixture switch")
    if any(abs(step - at) <= 50 for at in resumed_at):
        near.append("resume")
    return ", ".join(near) or "-"


def poisson_interval(count: int, level: float = 0.95) -> tuple[float, float]:
    """Exact (Garwood) interval for a Poisson mean given ``count`` events, by bisection on the CDF."""
    def cdf(k: int, mu: float) -> float:
        term = total = math.exp(-mu)
        for i in range(1, k + 1):
            term *= mu / i
            total += term
        return total

    def solve(target: float, k: int) -> float:  # mu with cdf(k, mu) == target (cdf decreases in mu)
        low, high = 0.0, max(10.0, 10.0 * (k + 1))
        for _ in range(200):
            mid = (low + high) / 2
            low, high = (mid, high) if cdf(k, mid) > target else (low, mid)
        return (low + high) / 2

    alpha = 1 - level
    lower = 0.0 if count == 0 else solve(1 - alpha / 2, count - 1)
    return lower, solve(alpha / 2, count)


def analyse(args: argparse.Namespace) -> dict:
    runs, alarms, interventions = [], [], []
    for seed in args.seeds:
        run_dir = args.out / f"seed{seed}"
        launches = [json.loads(line) for line in (run_dir / "launches.jsonl").read_text().splitlines()]
        resumed_at = [launch["first_step"] for launch in launches[1:]]
        events = read_jsonl(Path(launches[-1]["summary"]["run_dir"]) / "events.jsonl")
        for event in events:
            action = str(event.get("action", "")).lower()
            if event["kind"] == "detection" and event["severity"] in ("warning", "error", "critical"):
                alarms.append({"seed": seed, "step": event["step"], "detector": event["detector"],
                               "severity": event["severity"], "action": action, "message": event["message"],
                               "context": context(event["step"], args.steps, seed, resumed_at)})
            if action in INTERVENTIONS:
                interventions.append({"seed": seed, "step": event["step"], "detector": event["detector"],
                                      "action": action, "message": event["message"]})
        last = launches[-1]["summary"]
        runs.append({"seed": seed, "layout": "shards: rank 0 code, rank 1 prose" if seed % 2 else "mixture switch",
                     "steps": last["steps"], "resumed_at": resumed_at, "held_out": launches[-1]["held_out"],
                     "skipped_by_policy": last["skipped_by_policy"], "rolled_back": last["rolled_back"],
                     "corpus": launches[-1]["corpus"]})
    total = sum(run["steps"] for run in runs)
    rates = {}
    for detector, count in sorted(Counter(a["detector"] for a in alarms).items()):
        low, high = poisson_interval(count)
        rates[detector] = {"alarms": count, "per_1000": 1000 * count / total, "low": 1000 * low / total,
                           "high": 1000 * high / total}
    _, none_high = poisson_interval(0)
    return {"steps": total, "runs": runs, "alarms": alarms, "interventions": interventions, "rates": rates,
            "upper_per_1000_for_no_alarm": 1000 * none_high / total}


def report(result: dict) -> None:
    print(f"\n{len(result['runs'])} runs, {result['steps']} steps in all; corpus {result['runs'][0]['corpus'][:12]}")
    print("| seed | data | steps | resumed at | held-out loss (code, prose) | skipped | rolled back |")
    print("|---|---|---:|---|---|---:|---:|")
    for run in result["runs"]:
        held = run["held_out"]
        print(f"| {run['seed']} | {run['layout']} | {run['steps']} | {', '.join(map(str, run['resumed_at']))} | "
              f"{held.get('code', math.nan):.3f}, {held.get('prose', math.nan):.3f} | {run['skipped_by_policy']} | "
              f"{run['rolled_back']} |")
    print(f"\ninterventions: {len(result['interventions'])}")
    for item in result["interventions"]:
        print(f"- seed {item['seed']} step {item['step']}: {item['detector']} -> {item['action']}: {item['message']}")
    print("\n| detector | alarms | per 1,000 steps | 95% interval |")
    print("|---|---:|---:|---|")
    for detector, rate in result["rates"].items():
        print(f"| {detector} | {rate['alarms']} | {rate['per_1000']:.3f} | {rate['low']:.3f}-{rate['high']:.3f} |")
    print(f"(a detector with no alarm: under {result['upper_per_1000_for_no_alarm']:.3f} per 1,000 steps, 95%)")
    print("\n| seed | step | detector | severity | action | around it | message |")
    print("|---|---:|---|---|---|---|---|")
    for alarm in result["alarms"]:
        print(f"| {alarm['seed']} | {alarm['step']} | {alarm['detector']} | {alarm['severity']} | {alarm['action']} "
              f"| {alarm['context']} | {alarm['message'][:160]} |")


def main() -> int:
    args = build_parser().parse_args()
    if args.worker:
        exit_hard(worker(args))
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for seed in args.seeds:
        # past the disk checkpoint due at the middle (every quarter, at the first verified snapshot after it) and its
        # background write: the second launch resumes from the middle
        for stop in (args.steps // 2 + 100, None):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                   *sys.argv[1:], "--worker", "--seed", str(seed), "--out", str(args.out / f"seed{seed}"),
                   *(["--stop-at", str(stop)] if stop is not None else [])]
            code = subprocess.call(cmd, env=env)
            if code != 0:
                print(f"[realtext] seed {seed}: the launch stopped with exit code {code}", file=sys.stderr)
                return code
    result = analyse(args)
    (args.out / "realtext.json").write_text(json.dumps(result, indent=1))
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

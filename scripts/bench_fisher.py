"""What ``detectors.fisher`` costs, and what its recovery shaping does to a run.

    .venv/bin/python scripts/bench_fisher.py cost                      # 4 layers x 256
    .venv/bin/python scripts/bench_fisher.py cost --layers 12 --repeats 50
    .venv/bin/python scripts/bench_fisher.py recovery --seeds 4        # plain rollback vs EWC vs the blend

``cost``: on the demo GPT in one process (DDP's case: the rank's own part is the whole replica), the median over
``--repeats`` calls (after 3 warm-up calls) of the Fisher update (F ← decay g² + (1 − decay) F) and of the agreement
sums (ΣF, ΣF ln F, Σ F (θ − θ*)²), side by side with the AdamW step they sit beside, and the memory of F and θ*.

``recovery``: the tiny demo GPT trained for ``--steps`` steps in one process with recovery on, per seed and
scenario -- a learning-rate spike (x50 at step 20) that a loss spike rolls back; the same plus a corrupt data shard
read right after the rollback (attempts 22-39, ``--corrupt`` of the targets random) -- once per variant: a plain
rollback, EWC-regularised recovery at each ``--ewc`` strength, the importance-weighted rollback. Prints per variant
the held-out loss at the end, the mean training loss after the first rollback, the rollbacks, and how often the
variant ended below the plain rollback.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import arc_engine
from arc_engine.config import load_config
from arc_engine.demo.corpus import CharDataset, generate_corpus
from arc_engine.demo.gpt import GPT, GPTConfig, param_groups
from arc_engine.monitors.family import StepView, section_of
from arc_engine.monitors.fisher import FisherFamily, FisherState

SEQ_LEN, BATCH = 16, 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    cost = sub.add_parser("cost")
    cost.add_argument("--layers", type=int, default=4)
    cost.add_argument("--d-model", type=int, default=256)
    cost.add_argument("--repeats", type=int, default=30)
    recovery = sub.add_parser("recovery")
    recovery.add_argument("--seeds", type=int, default=4)
    recovery.add_argument("--steps", type=int, default=60)
    recovery.add_argument("--ewc", type=float, nargs="+", default=[3e3, 3e4])
    recovery.add_argument("--corrupt", type=float, default=0.6)
    return parser.parse_args(argv)


# ------------------------------------------------------------------ cost

def _median_ms(fn: Any, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def cost(args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, num_layers=args.layers, d_model=args.d_model,
                          num_heads=max(1, args.d_model // 64)))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    config = section_of(load_config(None, ["detectors.fisher.enabled=true"]), FisherFamily())
    state = FisherState(config)
    state.update(params)
    state.set_anchor()
    device = torch.device("cpu")
    results = {
        "params_m": sum(p.numel() for p in params) / 1e6,
        "adamw_ms": _median_ms(optimizer.step, args.repeats),
        "update_ms": _median_ms(lambda: state.update(params), args.repeats),
        "sums_ms": _median_ms(lambda: state.sums(StepView(0, params), device), args.repeats),
        "memory_mb": sum(t.numel() * t.element_size() for t in state.fisher + (state.anchor or [])) / 2**20,
    }
    results["update_ratio"] = results["update_ms"] / results["adamw_ms"]
    results["sums_ratio"] = results["sums_ms"] / results["adamw_ms"]
    print(f"{results['params_m']:.2f} M parameters; AdamW step {results['adamw_ms']:.2f} ms; Fisher update "
          f"{results['update_ms']:.2f} ms ({results['update_ratio']:.2f}x the AdamW step); agreement sums "
          f"{results['sums_ms']:.2f} ms ({results['sums_ratio']:.2f}x); F and θ* {results['memory_mb']:.1f} MB "
          f"(8 bytes per element)")
    return results


# ------------------------------------------------------------------ recovery

class CorruptShard:
    """Attempts [start, stop) read batches with ``fraction`` of the targets random."""

    def __init__(self, data: CharDataset, start: int, stop: int, fraction: float) -> None:
        self.data, self.start, self.stop, self.fraction, self.reads = data, start, stop, fraction, 0

    def batch(self, position: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.data.batch(position, rank, size)
        if self.start <= self.reads < self.stop:
            generator = torch.Generator().manual_seed(self.reads * 7 + rank)
            noisy = torch.rand(targets.shape, generator=generator) < self.fraction
            targets = torch.where(noisy, torch.randint(0, self.data.vocab_size, targets.shape, generator=generator),
                                  targets)
        self.reads += 1
        return inputs, targets


def train_once(seed: int, steps: int, overrides: list[str], corrupt: float | None) -> dict[str, Any]:
    torch.manual_seed(seed)
    data = CharDataset(generate_corpus(400), SEQ_LEN, seed=seed)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, seq_len=SEQ_LEN, num_layers=1, d_model=32, num_heads=2))
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(None, ["run.run_id=bench", f"run.run_dir={run_dir}", "sinks.console.enabled=false",
                                    "recovery.enabled=true", "recovery.checkpoint_freq=5",
                                    "recovery.checkpoint.every_steps=0", "detectors.loss_spike.warmup_steps=5",
                                    "detectors.loss_spike.action=rollback", "stats.optimizer_stats_every=0",
                                    "detectors.fisher.enabled=true", "detectors.fisher.every=1",
                                    "faults.injections=[{kind: lr_scale, rank: -1, step: 20, scale: 50.0}]",
                                    *overrides])
        arc = arc_engine.attach(model, optimizer, config)
        source = CorruptShard(data, 22, 40, corrupt) if corrupt else data
        losses, attempts = [], 0
        try:
            while arc.progress.step < steps and attempts < 4 * steps:
                loss = model(*source.batch(arc.progress.data_position, 0, BATCH))
                loss = arc.faults.on_loss(loss)
                arc.record_loss(loss)
                losses.append(float(loss.detach()))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                attempts += 1
            rollbacks = arc.summary()["recovery"]["rollbacks"]
        except arc_engine.ArcAbort:
            return {"aborted": True}
        finally:
            arc.close()
    with torch.no_grad():
        held_out = statistics.mean(float(model(*data.batch(10_000 + i, 0, BATCH))) for i in range(8))
    return {"aborted": False, "held_out": held_out, "after": statistics.mean(losses[22:]), "rollbacks": rollbacks}


def recovery(args: argparse.Namespace) -> dict[str, dict[str, list[dict[str, Any]]]]:
    variants = {"plain rollback": []}
    for strength in args.ewc:
        variants[f"EWC λ0={strength:g}"] = [f"detectors.fisher.ewc_strength={strength}"]
    variants["importance blend"] = ["detectors.fisher.importance_rollback=true"]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for scenario, corrupt in (("lr spike", None), (f"lr spike + corrupt shard ({args.corrupt:.0%})", args.corrupt)):
        results[scenario] = {name: [train_once(seed, args.steps, overrides, corrupt) for seed in range(args.seeds)]
                             for name, overrides in variants.items()}
        print(f"\n{scenario}, {args.seeds} seeds, {args.steps} steps")
        print(f"{'variant':<22} {'held-out':>9} {'after':>9} {'rollbacks':>9} {'aborted':>8} {'below plain':>12}")
        plain = results[scenario]["plain rollback"]
        for name, runs in results[scenario].items():
            done = [r for r in runs if not r["aborted"]]
            wins = sum(1 for r, p in zip(runs, plain, strict=True) if not r["aborted"] and not p["aborted"]
                       and r["held_out"] < p["held_out"])
            means = {key: statistics.mean(r[key] for r in done) if done else float("nan")
                     for key in ("held_out", "after", "rollbacks")}
            print(f"{name:<22} {means['held_out']:9.4f} {means['after']:9.4f} {means['rollbacks']:9.2f} "
                  f"{len(runs) - len(done):8d} {wins:>7d} of {len(runs)}")
    return results


def main(argv: list[str] | None = None) -> Any:
    args = parse_args(argv)
    return cost(args) if args.mode == "cost" else recovery(args)


if __name__ == "__main__":
    main()

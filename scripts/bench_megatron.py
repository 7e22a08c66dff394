"""Overhead of arc_engine on a megatron-core training step, measured side by side (ratios with repeats).

    .venv/bin/torchrun --nproc-per-node 4 scripts/bench_megatron.py --cpu --tensor-model-parallel-size 2 \\
        --use-distributed-optimizer --bf16 --blocks 20
    # GPUs: the same without --cpu (NCCL)

The reference script's model (``scripts/train_megatron_gpt.py``; any of its flags) is built three times in the
same processes, under the same parallel layout: without arc_engine, with arc_engine's default config (every step
monitored, the QK spectra every 50 steps, the routers every 10), and with the QK spectra and routers measured on
every step (the periodic diagnostics' worst case). The variants alternate in blocks of ``--steps-per-block``
steps, each block timed between two barriers, so machine noise hits all alike. Reported per arc variant: the median
over block pairs of the ratio of its mean step time to the plain variant's in the adjacent block, and the median
step times. Printed by global rank 0 as a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_megatron_gpt as script

VARIANTS = {"plain": None,
            "arc default": [],
            "arc, QK + routers every step": ["detectors.qk_spectra.every=1", "detectors.router.every=1"]}


def parse_args() -> argparse.Namespace:
    parser = script.build_parser()
    parser.add_argument("--blocks", type=int, default=20, help="timed blocks per variant")
    parser.add_argument("--steps-per-block", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    parser.add_argument("--own-work", action="store_true",
                        help="also time arc_engine's own work (stats.own_work) in the arc variants and print the "
                             "default variant's per step, by piece (slowest rank)")
    return parser.parse_args()


def build(args: argparse.Namespace, overrides: list[str] | None) -> script.TrainState:
    variant = argparse.Namespace(**vars(args))
    variant.no_arc = overrides is None
    variant.arc_overrides = [*getattr(args, "arc_overrides", []), "sinks.console.enabled=false",
                             "run.run_dir=/tmp/arc_bench_megatron", *(overrides or []),
                             *(["stats.own_work=true"] if args.own_work else [])]
    return script.build_model_and_optimizer(variant)


def timed_block(state: script.TrainState, args: argparse.Namespace, start: int) -> float:
    torch.distributed.barrier()
    began = time.perf_counter()
    for step in range(start, start + args.steps_per_block):
        script.train_step(state, args, step)
    torch.distributed.barrier()
    return (time.perf_counter() - began) / args.steps_per_block


def own_work_rows(state: script.TrainState, step_s: float) -> str:
    """The default variant's own work per step on the slowest rank (timers' own cost taken out, as
    ``scripts/bench_overhead.py`` does) against its median step, with the pieces over 1% of it. Collective."""
    from bench_overhead import slowest_rank, timer_cost_ns, without_timers

    report = state.arc.engine.own_work.report()
    mine = {"host_ms": report.host_ms, "timed_calls": sum(p["calls"] for p in report.pieces.values()),
            "pieces": {name: p["host_ms"] for name, p in report.pieces.items()}}
    reports: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(reports, mine)
    timer_ms = timer_cost_ns() / 1e6
    for entry in reports:
        entry["untimed_ms"] = without_timers(entry["host_ms"], entry["timed_calls"], timer_ms)
    slowest = slowest_rank(reports)
    pieces = sorted(((name, ms) for name, ms in slowest["pieces"].items() if ms >= 0.01 * slowest["host_ms"]),
                    key=lambda item: -item[1])[:5]
    return (f"\narc default, own work: {slowest['untimed_ms']:.1f} ms per step = "
            f"{100 * slowest['untimed_ms'] / (1000 * step_s):.3f}% of its median step (slowest rank); pieces: "
            + ", ".join(f"{name} {ms:.1f}" for name, ms in pieces))


def main() -> int:
    args = parse_args()
    script.initialize(args)
    states = {name: build(args, overrides) for name, overrides in VARIANTS.items()}
    for state in states.values():
        for step in range(args.warmup):
            script.train_step(state, args, step)
    for state in states.values():
        if state.arc is not None:
            state.arc.engine.own_work.reset()
    times: dict[str, list[float]] = {name: [] for name in states}
    for block in range(args.blocks):
        start = args.warmup + block * args.steps_per_block
        for name, state in states.items():
            times[name].append(timed_block(state, args, start))
    own = own_work_rows(states["arc default"], statistics.median(times["arc default"])) if args.own_work else None
    for state in states.values():
        if state.arc is not None:
            state.arc.close()
    if torch.distributed.get_rank() == 0:
        plain = times["plain"]
        print(f"megatron-core step time, {torch.distributed.get_world_size()} ranks, TP "
              f"{args.tensor_model_parallel_size} PP {args.pipeline_model_parallel_size} EP "
              f"{args.expert_model_parallel_size}, {'bf16' if args.bf16 else 'fp32'}, {args.blocks} blocks of "
              f"{args.steps_per_block} steps\n")
        print("| variant | median step ms | vs plain (pair median) |\n|---|---|---|")
        for name, values in times.items():
            ratio = statistics.median(v / p for v, p in zip(values, plain, strict=True))
            print(f"| {name} | {1000 * statistics.median(values):.1f} | "
                  f"{'' if name == 'plain' else f'{100 * (ratio - 1):+.1f}%'} |")
        if own is not None:
            print(own)
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())

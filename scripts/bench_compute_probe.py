"""What the straggler family's compute probe costs a sampled step: forward + backward of the demo GPT with the probe's
hooks registered (a sampled step) and without (every other step), alternated, medians of the repeats.

    .venv/bin/python scripts/bench_compute_probe.py                        # CPU, 12 layers, 64 modules timed
    .venv/bin/python scripts/bench_compute_probe.py --layers 24 --modules 128 --device cuda

Prints the median step time of each arm, their ratio and the difference (on a busy machine the step's noise is larger
than the probe, so the difference can come out negative). Then the probe's own cost, resolved: the same hooks on a
chain of ``--modules`` one-element Linear layers, whose forward is almost free, so the difference is the hooks'
host work (two marks per module, and reading them); that per-module cost times the modules timed is what a
sampled step pays, spread over the steps of the schedule (one sampled step in ``compute_every`` = 5 monitored
steps). On CUDA each step ends with a synchronize and the probe's events are read after it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from arc_engine.demo.gpt import GPT, GPTConfig
from arc_engine.stats.timing import ComputeProbe, local_compute_modules


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--modules", type=int, default=64, help="detectors.straggler.compute_modules")
    parser.add_argument("--every", type=int, default=5, help="detectors.straggler.compute_every (for the spread)")
    parser.add_argument("--repeats", type=int, default=30, help="steps per arm, alternated")
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, seq_len=args.seq, num_layers=args.layers, d_model=args.d_model,
                          num_heads=8)).to(device)
    tokens = torch.randint(0, 512, (args.batch, args.seq + 1), device=device)
    modules = local_compute_modules([model], args.modules)
    probe = ComputeProbe(modules, device, every=2)  # even steps sampled, odd ones not: the two arms alternate

    def step(index: int) -> float:
        started = time.perf_counter()
        probe.start(index)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        probe.take()
        return time.perf_counter() - started

    for index in range(6):  # warm-up, both arms
        step(index)
    sampled, plain = [], []
    for index in range(2 * args.repeats):
        (sampled if index % 2 == 0 else plain).append(step(index))
    probe.close()
    with_probe, without = statistics.median(sampled), statistics.median(plain)
    per_module = hook_cost(args.modules, device, 20 * args.repeats)
    result = {"modules": float(len(modules)), "sampled_ms": with_probe * 1e3, "plain_ms": without * 1e3,
              "ratio": with_probe / without, "difference_ms": (with_probe - without) * 1e3,
              "per_module_us": per_module * 1e6, "sampled_cost_ms": per_module * len(modules) * 1e3,
              "spread_ms": per_module * len(modules) * 1e3 / args.every}
    print(f"compute probe, {len(modules)} modules timed, {args.device}, {args.layers} layers x {args.d_model}, "
          f"batch {args.batch} x {args.seq}, {args.repeats} steps per arm (medians)")
    print(f"  sampled step {result['sampled_ms']:.2f} ms, plain step {result['plain_ms']:.2f} ms, "
          f"ratio {result['ratio']:.4f} (difference {result['difference_ms']:.3f} ms)")
    print(f"  the probe's own work: {result['per_module_us']:.2f} us per timed module, so "
          f"{result['sampled_cost_ms']:.3f} ms per sampled step and {result['spread_ms']:.3f} ms per step at one "
          f"sampled step in {args.every}")
    return result


def hook_cost(count: int, device: torch.device, repeats: int) -> float:
    """Seconds of probe work per timed module: a forward pass through ``count`` one-element Linear layers with the
    probe's hooks and without, alternated; median difference over the modules."""
    chain = torch.nn.Sequential(*(torch.nn.Linear(1, 1) for _ in range(count))).to(device)
    probe = ComputeProbe(list(chain), device, every=2)
    x = torch.ones(1, 1, device=device)
    times: dict[bool, list[float]] = {True: [], False: []}
    with torch.no_grad():
        for index in range(2 * repeats + 10):
            started = time.perf_counter()
            probe.start(index)
            chain(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            probe.take()
            if index >= 10:
                times[index % 2 == 0].append(time.perf_counter() - started)
    probe.close()
    return (statistics.median(times[True]) - statistics.median(times[False])) / count


if __name__ == "__main__":
    main()

"""What the dynamics family's velocity costs a measured step: the producer's ``write`` (the distance of this rank's
part of the parameters from its copy, and the copy refreshed) on the demo GPT, one process, its own part being
1/``--ranks`` of the parameters as under DDP (the owner dealing of :mod:`arc_engine.stats.partition`).

    .venv/bin/python scripts/bench_dynamics.py                    # 4 layers x 256, as 1 and 4 ranks
    .venv/bin/python scripts/bench_dynamics.py --layers 12 --repeats 50

Prints, per ``--ranks`` value and ``--sketch`` size (0: the velocity only; 128: with the attractor's sketch), the
median over ``--repeats`` measured calls (after 3 warm-up calls) and that time spread over the ``every`` (10)
optimizer steps between measurements, and the memory kept (the copy, and the sketch's int8 signs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from arc_engine.config import load_config
from arc_engine.demo.gpt import GPT, GPTConfig
from arc_engine.monitors.dynamics import SKETCH, VELOCITY, DynamicsFamily, VelocityProducer
from arc_engine.monitors.family import StepView, section_of
from arc_engine.stats import Reduce, StatBuffer, StatLayout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4],
                        help="the decision group's size (owner dealing)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--sketch", type=int, nargs="+", default=[0, 128],
                        help="attractor_sketch sizes to compare (0: velocity only)")
    return parser.parse_args(argv)


def measure(model: torch.nn.Module, ranks: int, repeats: int, sketch: int) -> dict[str, float]:
    config = section_of(load_config(None, ["detectors.dynamics.enabled=true", "detectors.dynamics.every=1",
                                           f"detectors.dynamics.attractor_sketch={sketch}"]), DynamicsFamily())
    producer = VelocityProducer(config)
    producer.set_group(list(range(ranks)), 0)
    layout = StatLayout()
    layout.add(VELOCITY, 2, Reduce.SUM)
    if sketch:
        layout.add(SKETCH, sketch, Reduce.SUM)
    layout.freeze()
    buffer = StatBuffer(layout, torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    times = []
    with torch.no_grad():
        for step in range(repeats + 3):
            for param in params:  # the optimizer moved the parameters
                param.add_(1e-4)
            buffer.reset()
            started = time.perf_counter()
            producer.write(buffer, StepView(step, params))
            if step >= 3:
                times.append(time.perf_counter() - started)
    copied = sum(t.numel() * t.element_size() for t in [*(producer._copy or []), *producer._signs])
    return {"ms": statistics.median(times) * 1e3, "copy_mb": copied / 2**20,
            "owned": sum(t.numel() for t in producer._copy or []) / sum(p.numel() for p in params)}


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    args = parse_args(argv)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, seq_len=128, num_layers=args.layers, d_model=args.d_model, num_heads=8))
    total = sum(p.numel() for p in model.parameters())
    print(f"dynamics velocity producer, demo GPT {args.layers} layers x {args.d_model} ({total / 1e6:.2f}M "
          f"parameters), CPU, median of {args.repeats} calls")
    results: dict[int, dict[str, float]] = {}
    for ranks in args.ranks:
        for sketch in args.sketch:
            result = measure(model, ranks, args.repeats, sketch)
            results.setdefault(ranks, result)[f"ms_sketch{sketch}"] = result["ms"]
            results[ranks][f"mb_sketch{sketch}"] = result["copy_mb"]
            print(f"  as 1 of {ranks} rank(s), attractor_sketch {sketch}: owns {result['owned']:.0%} of the "
                  f"parameters; {result['ms']:.3f} ms per measurement, {result['ms'] / 10:.3f} ms per step at "
                  f"every: 10; kept {result['copy_mb']:.2f} MB (copy{' and signs' if sketch else ''})")
    return results


if __name__ == "__main__":
    main()

"""What one curvature measurement costs, in training steps: ``arc_engine.diagnostics.curvature.measure`` (the
defaults: 8 Hutchinson probes, 10 power iterations, the SAM probe) against one forward + backward of the same
micro-batch, on the demo GPT, CPU, one process; medians of ``--repeats`` alternated runs.

    .venv/bin/python scripts/bench_curvature.py
    .venv/bin/python scripts/bench_curvature.py --layers 12 --batch 8 --repeats 5
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
from arc_engine.diagnostics.curvature import measure


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    config = load_config(None, []).diagnostics.curvature
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, seq_len=args.seq, num_layers=args.layers, d_model=args.d_model,
                          num_heads=8))
    tokens = torch.randint(0, 512, (args.batch, args.seq + 1))
    params = list(model.parameters())

    def loss() -> torch.Tensor:
        return model(tokens[:, :-1], tokens[:, 1:])

    steps, measurements = [], []
    for repeat in range(args.repeats + 1):
        started = time.perf_counter()
        loss().backward()
        model.zero_grad(set_to_none=True)
        step = time.perf_counter() - started
        started = time.perf_counter()
        measure(loss, params, probes=config.probes, iterations=config.power_iterations, rho=config.sam_rho, seed=0)
        if repeat:  # the first of each is a warm-up
            steps.append(step)
            measurements.append(time.perf_counter() - started)
    step, measurement = statistics.median(steps), statistics.median(measurements)
    products = config.probes + config.power_iterations
    print(f"curvature, demo GPT {args.layers} layers x {args.d_model}, batch {args.batch} x {args.seq}, CPU, "
          f"medians of {args.repeats}: forward + backward {step * 1e3:.1f} ms; one measurement ({products} "
          f"Hessian-vector products + SAM) {measurement * 1e3:.1f} ms = {measurement / step:.1f} training steps")
    return {"step_ms": step * 1e3, "measurement_ms": measurement * 1e3, "ratio": measurement / step}


if __name__ == "__main__":
    main()

"""The optimizer statistics' host work against the number of parameter tensors, beside the optimizer step itself.

    .venv/bin/python scripts/bench_optimizer_stats.py                 # 4 .. 104 thin layers, 7 repeats
    .venv/bin/python scripts/bench_optimizer_stats.py --layers 26 --repeats 11

What arc_engine adds to a monitored step under ``torch.optim`` (DDP, FSDP2) and Megatron's inner optimizer, on
one rank's share of the parameters (every other tensor, as DDP's owner split gives each of 2 ranks): the Adam views
of each parameter group, the sampled windows (``detectors.sdc.update_sample``, default 1/32) and the prospective
update Σ U² over them -- :func:`arc_engine.stats.producers.record_group_optimizer_stats`, the production call with
its per-group caches, weight norms off (they run every 10th step). Two gradient kinds:

* **fresh**: a new ``.grad`` tensor per parameter on every step (``zero_grad(set_to_none=True)``, DDP's default):
  each gradient window is a new view;
* **persistent**: the same ``.grad`` tensors on every step (DDP's ``gradient_as_bucket_view=True``, or
  ``zero_grad(set_to_none=False)``): every window is cached.

Beside them, the same rank's ``torch.optim.AdamW`` step (foreach, the default) over all its parameters: the host
work a framework already spends per tensor. Model: ``--layers`` blocks of 12 tensors (a GPT block at width 96, as
``bench_overhead.py --model thin``), one torch thread. Reported per tensor count: medians over ``--repeats`` runs of
``--steps`` steps, ms per step and µs per tensor, and the ratio to the optimizer step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from arc_engine.stats import names
from arc_engine.stats.layout import Reduce, StatBuffer, StatLayout
from arc_engine.stats.optim_stats import adam_views
from arc_engine.stats.producers import record_group_optimizer_stats
from arc_engine.stats.sampling import WindowCache

LAYERS = (4, 13, 26, 52, 104)
#: One block's tensor shapes at width 96 (layer norms, fused QKV, output projection, MLP).
BLOCK_SHAPES = ((96,), (96,), (288, 96), (288,), (96, 96), (96,), (96,), (96,), (384, 96), (384,), (96, 384), (96,))


def build(layers: int, seed: int = 0) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, set[int]]:
    """The parameters, an AdamW that has taken one step (its moments exist), and this rank's share (every other
    tensor)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for _ in range(layers) for shape in BLOCK_SHAPES]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for param in params:
        param.grad = torch.randn(param.shape, generator=gen)
    optimizer.step()
    return params, optimizer, {id(p) for p in params[::2]}


def stats_buffer() -> StatBuffer:
    layout = StatLayout()
    for name in (names.WEIGHT_SQ, names.UPDATE_SQ, names.UPDATE_COUNT):
        layout.add(name, 1, Reduce.SUM)
    layout.freeze()
    return StatBuffer(layout, torch.device("cpu"))


def measure(layers: int, steps: int, repeats: int, sample: float = 1 / 32) -> dict[str, float]:
    """Medians over ``repeats`` of the ms per step of: the statistics with fresh and with persistent gradients,
    and the optimizer step over this rank's share."""
    params, optimizer, owned = build(layers)
    mine = [p for p in params if id(p) in owned]
    grads = [p.grad for p in params]
    buffer, group = stats_buffer(), optimizer.param_groups[0]
    windows, memo = WindowCache(), {}

    def statistics_step(phase: int) -> None:
        views = adam_views(optimizer, group, owned=owned, memo=memo)
        record_group_optimizer_stats(buffer, 0, mine, views, sample, with_weights=False, windows=windows,
                                     phase=phase)

    def timed(fresh: bool) -> float:
        total = 0.0
        for phase in range(steps):
            if fresh:
                for param, grad in zip(params, grads, strict=True):
                    param.grad = grad.view_as(grad)  # a new tensor object over the same memory
            start = time.perf_counter()
            statistics_step(phase)
            total += time.perf_counter() - start
        return total / steps * 1e3

    own_optimizer = torch.optim.AdamW(mine, lr=1e-4)

    def optimizer_step() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            own_optimizer.step()
        return (time.perf_counter() - start) / steps * 1e3

    for fresh in (True, False):  # warm the caches over a full window cycle
        timed(fresh)
    runs = {"fresh": [], "persistent": [], "optimizer": []}
    for _ in range(repeats):  # interleaved, so drift of the machine hits all three alike
        runs["fresh"].append(timed(True))
        runs["persistent"].append(timed(False))
        runs["optimizer"].append(optimizer_step())
    row = {key: statistics.median(values) for key, values in runs.items()}
    row["tensors"] = float(len(mine))
    return row


def table_row(row: dict[str, float]) -> str:
    tensors = row["tensors"]
    return (f"| {tensors:.0f} | {row['fresh']:.3f} | {row['persistent']:.3f} | "
            f"{row['fresh'] / tensors * 1e3:.2f} / {row['persistent'] / tensors * 1e3:.2f} | {row['optimizer']:.3f} | "
            f"{row['fresh'] / row['optimizer']:.2f} / {row['persistent'] / row['optimizer']:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--layers", type=int, nargs="+", default=list(LAYERS), help="blocks of 12 tensors")
    parser.add_argument("--steps", type=int, default=64, help="steps per timed run (two window cycles at 1/32)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per variant (median)")
    args = parser.parse_args()
    if min(args.layers) < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--layers, --steps and --repeats must be >= 1")
    torch.set_num_threads(1)
    print(f"one rank's share (every other tensor), update_sample 1/32, 1 torch thread, median of {args.repeats} "
          f"runs of {args.steps} steps")
    print("| tensors | fresh grads ms | persistent grads ms | µs per tensor (fresh / persistent) | AdamW step ms | "
          "x AdamW step (fresh / persistent) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for layers in args.layers:
        print(table_row(measure(layers, args.steps, args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The gradient sketch's C_dir against the exact mean pairwise cosine, per sketch size.

    .venv/bin/python scripts/bench_direction_sketch.py                  # sizes 64 .. 1024, 4 ranks, 60 steps
    .venv/bin/python scripts/bench_direction_sketch.py --ranks 8 --steps 100

The consistency family (``detectors.consistency``) estimates C_dir, the mean over pairs of ranks of the cosine of
their local gradients, from each rank's signed chunk-sum sketch (:func:`arc_engine.monitors.sdc_local.chunk_sums`,
``sketch_size`` numbers) summed over ranks. Here ``--ranks`` simulated ranks train the demo GPT of the tests (one
layer, d_model 32, 14k parameters) in one process, each on its own data stream (the paper's S1-3), their
gradients averaged as DDP would; at every step each rank's local gradient is sketched as DDP's comm hook does (two
buckets) and the estimate is compared with the exact value from the full gradients. Reported per size: the mean
error (bias), its RMS and its largest absolute value over the steps, and the exact C_dir's range; and, for
comparison, the former unsigned block sums at 256.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from arc_engine.monitors.consistency import direction_consistency, exact_direction_consistency
from arc_engine.monitors.sdc_local import BUCKET_SKETCH_INDEX, add_chunk_sums, chunk_sums
from tests.training import BATCH, make_optimizer, tiny_model_and_data

SIZES = (64, 256, 1024)


def plain_block_sums(flat: torch.Tensor, size: int) -> torch.Tensor:
    """The sketch's former reduction, for comparison: the sums of ``size`` contiguous blocks, unsigned."""
    blocks = min(size, flat.numel())
    usable = flat.numel() // blocks * blocks
    sums = flat[:usable].view(blocks, -1).sum(dim=1)
    sums[-1] += flat[usable:].sum()
    return sums


def sketch_estimate(buckets_by_rank: list[list[torch.Tensor]], size: int, plain: bool = False) -> float:
    """C_dir from the ranks' sketches of their buckets, as the family computes it (``plain``: with unsigned
    block sums in place of :func:`chunk_sums`)."""
    reduce = plain_block_sums if plain else chunk_sums
    units = []
    for buckets in buckets_by_rank:
        sketch = torch.zeros(size, dtype=torch.float64)
        add_chunk_sums(sketch, [reduce(b, size) for b in buckets],
                       [BUCKET_SKETCH_INDEX + i for i in range(len(buckets))], {})
        units.append((sketch / sketch.norm()).numpy())
    return direction_consistency(np.sum(units, axis=0), len(units))


def measure(ranks: int, steps: int, sizes: tuple[int, ...]) -> dict[int, np.ndarray]:
    model, data = tiny_model_and_data(seed=1)
    optimizer = make_optimizer(model)
    params = list(model.parameters())
    errors: dict[int, list[float]] = {size: [] for size in sizes}
    errors[-256] = []  # plain block sums at 256, for comparison
    exact_values = []
    for step in range(steps):
        local = []
        for rank in range(ranks):
            model.zero_grad(set_to_none=True)
            model(*data.batch(step, rank, BATCH)).backward()
            local.append([p.grad.detach().clone() for p in params])
        flat = np.stack([torch.cat([g.flatten() for g in grads]).double().numpy() for grads in local])
        exact = exact_direction_consistency(flat)
        exact_values.append(exact)
        half = len(params) // 2  # two buckets, in reverse parameter order as DDP fills them
        buckets = [[torch.cat([g.flatten() for g in reversed(grads[half:])]),
                    torch.cat([g.flatten() for g in reversed(grads[:half])])] for grads in local]
        for size in sizes:
            errors[size].append(sketch_estimate(buckets, size) - exact)
        errors[-256].append(sketch_estimate(buckets, 256, plain=True) - exact)
        for param, *grads in zip(params, *local, strict=True):  # the averaged gradient, as DDP applies it
            param.grad = torch.stack(grads).mean(dim=0)
        optimizer.step()
    result = {size: np.asarray(values) for size, values in errors.items()}
    result[0] = np.asarray(exact_values)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    args = parser.parse_args()
    if args.ranks < 2 or args.steps < 1 or min(args.sizes) < 2:
        parser.error("--ranks >= 2, --steps >= 1, --sizes >= 2")
    torch.manual_seed(0)
    result = measure(args.ranks, args.steps, tuple(args.sizes))
    exact = result.pop(0)
    print(f"{args.ranks} ranks, {args.steps} steps; exact C_dir from {exact.min():.3f} to {exact.max():.3f} "
          f"(mean {exact.mean():.3f})")
    print("| sketch size | mean error | RMS error | max abs error |")
    print("|---:|---:|---:|---:|")
    for size, errors in result.items():
        label = f"{-size} (plain block sums)" if size < 0 else str(size)
        print(f"| {label} | {errors.mean():+.3f} | {np.sqrt((errors ** 2).mean()):.3f} | {np.abs(errors).max():.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cost of one monitored step's agreement against the number of ranks: the old all-gather and the new fixed-size
all-reduce, side by side.

    .venv/bin/python scripts/bench_agreement.py            # simulated 2 .. 16,384 ranks, then real gloo (2, 4, 8)
    .venv/bin/python scripts/bench_agreement.py --no-real  # simulated only

The statistics layout is the engine's own with the SDC detector on (two parameter groups, a 256-number sketch).

* **bytes**: what each rank receives per monitored step. Old: an all-gather of every rank's whole buffer,
  (N - 1) x L x 8 bytes. New: a ring all-reduce of the reduced block only (S <= L entries: the sketch and the other
  per-rank detail stay home), 2 (N - 1) / N x S x 8 bytes. Both are the textbook volumes of the collective
  (:func:`gather_bytes_per_rank`, :func:`allreduce_bytes_per_rank`), not a trace.
* **host time**: the median over ``--repeats`` of the host work after the collective on a healthy step -- the copy
  to the host and every monitor's evaluation. For N ranks in one process the collective is replaced by its result
  (:class:`SimulatedPipeline`: the SUM of N equal buffers; the all-gather's N copies), so the time measured is the
  host work alone. The old scheme is modelled as the engine did it before this change: one host copy of the N x L
  matrix, column sums over the N rows for every agreed value, the non-finite scan of every rank's row and the SDC
  monitor's per-rank local norms on every step, then the same monitors.
* **real gloo**: 2, 4 and 8 processes on this machine, each step a real collective; median wall time per step of the
  whole agreement (collective included) for both schemes.
* **report step**: the bytes each rank receives on a straggler report step (every ``detectors.straggler.every``
  monitored steps; the consistency detail's MAX slot rides the same reduction when due): the agreement with its MAX
  block, then the report's fixed-size follow-up (:func:`report_step_bytes`). It used to be an all-gather of every
  rank's buffer, the old column.

The last line reads ``agreement scaling 8 -> 16384 ranks: bytes xA, host time xB`` for the new scheme (the bar:
both within 2x). The figures and the command go in docs/agreement.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from arc_engine.config import load_config
from arc_engine.engine import ArcEngine
from arc_engine.monitors.family import section_of
from arc_engine.monitors.non_finite import nonfinite_ranks
from arc_engine.monitors.straggler import StragglerFamily
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, StatLayout, StatsPipeline, names

# torch >= 2.13 names it all_gather_single; older releases only have all_gather_into_tensor.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SIMULATED_RANKS = (2, 8, 64, 512, 4096, 16384)
REAL_RANKS = (2, 4, 8)


def gather_bytes_per_rank(num_ranks: int, layout_size: int) -> int:
    """Bytes each rank receives in an all-gather of ``layout_size`` float64 numbers per rank."""
    return (num_ranks - 1) * layout_size * 8


def allreduce_bytes_per_rank(num_ranks: int, reduced_size: int) -> float:
    """Bytes each rank receives (and sends) in a ring all-reduce of ``reduced_size`` float64 numbers."""
    return 2.0 * (num_ranks - 1) / num_ranks * reduced_size * 8


def reduced_size(layout: StatLayout) -> int:
    """Entries that travel on an ordinary monitored step: the SUM and REPLICATED blocks (the MAX slots of the
    built-in families are due on periodic steps only; the detail stays home)."""
    return layout.block(Reduce.SUM, Reduce.REPLICATED).stop


def scaling_line(rows: dict[int, dict[str, float]], low: int = 8, high: int = 16384) -> str:
    """The summary line: the new scheme's bytes and host time at ``high`` ranks over those at ``low``."""
    bytes_ratio = rows[high]["new_bytes"] / rows[low]["new_bytes"]
    host_ratio = rows[high]["new_host_us"] / rows[low]["new_host_us"]
    return f"agreement scaling {low} -> {high} ranks: bytes x{bytes_ratio:.2f}, host time x{host_ratio:.2f}"


class SimulatedPipeline(StatsPipeline):
    """The real pipeline's host path with the collectives replaced by their result for ``num_ranks`` ranks that
    all hold the same buffer (one process, no process group)."""

    def __init__(self, layout: StatLayout, num_ranks: int) -> None:
        super().__init__(layout, None, torch.device("cpu"))
        self.ranks = tuple(range(num_ranks))
        self.num_ranks = num_ranks
        self.reduced_sizes: list[int] = []  # the size of each all-reduce made, in order

    def start(self) -> StatBuffer:
        self.layout.freeze()
        return StatBuffer(self.layout, self.device)

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        self.reduced_sizes.append(tensor.numel())
        if op == dist.ReduceOp.SUM:
            tensor.mul_(float(self.num_ranks))

    def _all_gather(self, out: torch.Tensor, local: torch.Tensor) -> None:
        out.view(self.num_ranks, -1).copy_(local)


def make_engine() -> ArcEngine:
    """An engine with the layout and monitors of a run with SDC detection (not started: no process group)."""
    config = load_config(None, ["detectors.sdc.enabled=true", "detectors.sdc.sketch_size=256",
                                "sinks.console.enabled=false", "sinks.jsonl.enabled=false"])
    return ArcEngine(config, group_names=["decay", "no_decay"])


def fill_healthy(buffer: StatBuffer, num_ranks: int) -> None:
    """Plausible per-rank statistics of a healthy step (shard sums scaled so the agreed totals are O(1))."""
    buffer.reset()
    for name, value in ((names.LOSS, 2.0), (names.LOSS_COUNT, 1.0), (names.LOSS_RANKS, 1.0),
                        (names.GRAD_SQ_LOCAL, 1.0), (names.GRAD_SQ, 1.0 / num_ranks),
                        (names.WEIGHT_SQ, 4.0 / num_ranks), (names.UPDATE_SQ, 1e-4 / num_ranks),
                        (names.UPDATE_COUNT, 1e6 / num_ranks)):
            buffer.put(name, value)
    buffer.put(names.GRAD_SKETCH_LOCAL, torch.randn(buffer.layout[names.GRAD_SKETCH_LOCAL].size))


def warm_monitors(engine: ArcEngine, stats: AgreedStats, steps: int = 40) -> None:
    """Fill the monitors' baselines (loss window, SDC warm-up) so a timed evaluation does the full work."""
    for step in range(steps):
        for monitor in engine.gathering.assembly.monitors:
            monitor.evaluate(step, stats)
            monitor.commit(step, True)


def evaluate_all(engine: ArcEngine, stats: AgreedStats, step: int = 0) -> int:
    return sum(len(monitor.evaluate(step, stats)) for monitor in engine.gathering.assembly.monitors)


def report_step_bytes(num_ranks: int) -> tuple[float, list[int]]:
    """Bytes each rank receives on a healthy straggler report step of ``num_ranks`` ranks, and the sizes of its
    all-reduces: every rank's report the same (so nobody is slow), the agreement with the MAX block due, then the
    report's follow-up."""
    from arc_engine.monitors.straggler import SECTION_TIMES, STAGE_TIMES, report_due

    engine = make_engine()
    pipeline = SimulatedPipeline(engine.gathering.layout, num_ranks)
    buffer = pipeline.start()
    fill_healthy(buffer, num_ranks)
    section = section_of(engine.config, StragglerFamily())
    step = next(s for s in range(1, 10_000) if report_due(s, engine.config.stats.interval, section.every))
    buffer.put(SECTION_TIMES, torch.tensor([0.1, 0.5, 20.0, np.nan, 0.0, -1.0, 0.0, 0.0, 0.1, np.inf, 0.0]))
    buffer.put(STAGE_TIMES, torch.tensor([-0.1, 0.1, -np.inf, -np.inf, 0.5, 1.0]))
    engine.progress.step = step
    stats = pipeline.agree(buffer, reduce_max=engine.gathering.assembly.max_due(step))
    assert evaluate_all(engine, stats, step) == 0, "the simulated report step must be healthy"
    sizes = list(pipeline.reduced_sizes)
    return sum(allreduce_bytes_per_rank(num_ranks, size) for size in sizes), sizes


def old_host_work(engine: ArcEngine, gathered: torch.Tensor, num_ranks: int) -> int:
    """The old scheme's host work after its all-gather (see the module docstring). Returns the findings."""
    layout = engine.gathering.layout
    matrix_rn = gathered.detach().to("cpu", copy=True).numpy().reshape(num_ranks, -1)
    stats = AgreedStats.from_rows(layout, matrix_rn)  # column sums over N rows for every agreed value
    nonfinite_ranks(stats.per_rank(names.LOSS)[:, 0], stats.per_rank(names.LOSS_COUNT)[:, 0],
                    stats.per_rank(names.GRAD_NONFINITE_LOCAL))
    np.sqrt(stats.per_rank(names.GRAD_SQ_LOCAL).sum(axis=1))
    return evaluate_all(engine, stats)


def median_us(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def simulate(num_ranks: int, repeats: int) -> dict[str, float]:
    """Bytes and host microseconds per monitored step of both schemes for ``num_ranks`` ranks."""
    engine = make_engine()
    pipeline = SimulatedPipeline(engine.gathering.layout, num_ranks)
    buffer = pipeline.start()
    fill_healthy(buffer, num_ranks)
    warm_monitors(engine, pipeline.agree(buffer, reduce_max=False))
    assert evaluate_all(engine, pipeline.agree(buffer, reduce_max=False)) == 0, "the simulated step must be healthy"
    before = pipeline.collectives
    new_us = median_us(lambda: evaluate_all(engine, pipeline.agree(buffer, reduce_max=False)), repeats)
    per_step = (pipeline.collectives - before) / repeats
    gathered = buffer.values.repeat(num_ranks)  # the all-gather's result, as the old scheme received it
    old_us = median_us(lambda: old_host_work(engine, gathered, num_ranks), max(3, repeats // 4))
    return {"old_bytes": gather_bytes_per_rank(num_ranks, engine.gathering.layout.size),
            "new_bytes": allreduce_bytes_per_rank(num_ranks, reduced_size(engine.gathering.layout)),
            "old_host_us": old_us, "new_host_us": new_us, "collectives_per_step": per_step,
            "report_bytes": report_step_bytes(num_ranks)[0]}


# ---------------------------------------------------------------------------------------------- real gloo ranks

def _real_rank(rank: int, world: int, port: int, steps: int, queue: object) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        engine = make_engine()
        pipeline = StatsPipeline(engine.gathering.layout, None, torch.device("cpu"))
        buffer = pipeline.start()
        fill_healthy(buffer, world)
        warm_monitors(engine, pipeline.agree(buffer, reduce_max=False))
        gathered = torch.empty(world * engine.gathering.layout.size, dtype=torch.float64)
        new_times, old_times = [], []
        for _ in range(steps):  # alternate, so machine noise hits both alike
            dist.barrier()
            start = time.perf_counter()
            evaluate_all(engine, pipeline.agree(buffer, reduce_max=False))
            new_times.append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            _all_gather_flat(gathered, buffer.values)
            old_host_work(engine, gathered, world)
            old_times.append(time.perf_counter() - start)
        queue.put((rank, statistics.median(old_times) * 1e6, statistics.median(new_times) * 1e6))  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def run_real(world: int, steps: int) -> tuple[float, float]:
    """Median per-step wall time (µs) of the old and the new agreement on ``world`` real gloo ranks (rank 0's)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_real_rank, args=(r, world, port, steps, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    results = dict((rank, (old, new)) for rank, old, new in (queue.get(timeout=300) for _ in range(world)))
    for proc in procs:
        proc.join(timeout=60)
    return results[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--repeats", type=int, default=200, help="timed evaluations per simulated size")
    parser.add_argument("--real", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the agreement on 2, 4 and 8 real gloo ranks (default on)")
    parser.add_argument("--real-steps", type=int, default=200)
    args = parser.parse_args()
    if args.repeats < 1 or args.real_steps < 1:
        parser.error("--repeats and --real-steps must be >= 1")
    torch.set_num_threads(1)
    engine = make_engine()
    engine.gathering.layout.freeze()
    print(f"layout: {engine.gathering.layout.size} float64 per rank, {reduced_size(engine.gathering.layout)} reduced "
          f"(SDC on, 2 parameter groups, sketch {engine.gathering.layout[names.GRAD_SKETCH_LOCAL].size})")
    print(f"{'ranks':>6} | {'old bytes/rank':>14} | {'new bytes/rank':>14} | {'old host us':>11} | "
          f"{'new host us':>11} | new collectives | report step bytes/rank")
    rows: dict[int, dict[str, float]] = {}
    for num_ranks in SIMULATED_RANKS:
        row = rows[num_ranks] = simulate(num_ranks, args.repeats)
        print(f"{num_ranks:>6} | {row['old_bytes']:>14,.0f} | {row['new_bytes']:>14,.0f} | "
              f"{row['old_host_us']:>11,.1f} | {row['new_host_us']:>11,.1f} | "
              f"{row['collectives_per_step']:.0f} per step     | {row['report_bytes']:>14,.0f}")
    if args.real:
        print("real gloo ranks on this machine, median wall time per step (collective included):")
        for world in REAL_RANKS:
            old_us, new_us = run_real(world, args.real_steps)
            print(f"{world:>6} | old all-gather {old_us:,.1f} us | new all-reduce {new_us:,.1f} us")
    print(scaling_line(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

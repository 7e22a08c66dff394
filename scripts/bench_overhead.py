"""Overhead of arc_engine's always-on monitoring on a training step: its own work, and side by side.

    .venv/bin/python scripts/bench_overhead.py            # re-launches itself under torchrun, 2 ranks (gloo, CPU)
    .venv/bin/python scripts/bench_overhead.py --model thin --backend ddp   # 316 tensors, >= 8 buckets

Three variants -- the same GPT (``--model standard``: 4 layers, d_model 256, 52 tensors; ``thin``: 26 layers,
d_model 96, 316 tensors, 1 MB buckets; seq 256, micro-batch 8 per rank) under DeepSpeed ZeRO-2 (default) or DDP,
AdamW, gradient clipping 1.0: without arc_engine, with it (default config plus any ``--arc`` overrides), and a
second one without it (the A/A control) -- live in the same processes and take turns in blocks of steps, so machine
noise hits them alike. A block spans every periodic schedule of the configuration (its length is their least
common multiple: 20 steps by default, for the straggler report every 20th step), and is timed as a whole
between two barriers (steady-state throughput: the ranks of a data-parallel job wait for each other once per step
anyway, so a wait that only moves where the slower rank is waited for is not counted as overhead, and one that
adds time is).

Reported: arc_engine's *own work* (``stats.own_work``: the CPU time of each of its pieces per step, on the slowest
rank, and as a fraction of the step), then for A/B and A/A the median over block pairs of the ratio of the mean
step times in adjacent blocks, the 10% trimmed mean of those ratios and the ratio of mean step times, and
arc_engine's collectives and host copies per monitored step (from the profiler: c10d ops with minus without
arc_engine). The last two lines are ``arc_engine own work: X% of step`` and ``overhead (A/B, median of block
pairs): +Y%``. The own-work timers run during the A/B blocks (about a microsecond per timed call; their count per
step is printed), so the A/B figure includes them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

import arc_engine
from arc_engine.config import load_config
from arc_engine.demo.corpus import CharDataset, generate_corpus
from arc_engine.demo.gpt import GPT, GPTConfig, param_groups
from arc_engine.monitors.consistency import ConsistencyFamily
from arc_engine.monitors.dynamics import DynamicsFamily
from arc_engine.monitors.family import section_of
from arc_engine.monitors.qk_spectra import QKSpectraFamily
from arc_engine.monitors.router_health import RouterFamily
from arc_engine.monitors.straggler import StragglerFamily
from arc_engine.monitors.weight_health import WeightHealthFamily


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", choices=tuple(MODELS), default="standard",
                        help="standard: 4 layers, d_model 256 (52 tensors); thin: 26 layers, d_model 96 (316 "
                             "tensors) with 1 MB buckets (>= 8 buckets under DDP and ZeRO-2)")
    parser.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    parser.add_argument("--d-model", type=int, default=None, help="override the model's width")
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="DDP bucket_cap_mb / ZeRO-2 reduce_bucket_size and allgather_bucket_size (default: the "
                             "model's: 25 MB DDP and DeepSpeed's own for standard, 1 MB for thin)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's activations in the backward")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=80, help="alternating blocks per variant")
    parser.add_argument("--steps-per-block", type=int, default=None,
                        help="default: the least common multiple of the configuration's periods (a block spans "
                             "every periodic schedule)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--backend", choices=("deepspeed", "ddp"), default="deepspeed",
                        help="deepspeed: ZeRO-2 (the standard configuration); ddp: PyTorch DDP")
    parser.add_argument("--dtype", choices=("float32",), default="float32", help=argparse.SUPPRESS)  # build's
    parser.add_argument("--optimizer-stats-every", type=int, default=None,
                        help="override stats.optimizer_stats_every (default: the config default, 10)")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="pin each rank to its own core (default; --no-pin to let the OS schedule)")
    parser.add_argument("--control", choices=("none", "plain", "torch-hook"), default="none",
                        help="calibration: replace the arc_engine variant by a second plain model (plain: the noise "
                             "floor) or by DDP with torch's default all-reduce as a Python comm hook (torch-hook: "
                             "what any comm-hook-based monitor pays on DDP before computing anything)")
    parser.add_argument("--arc", action="append", default=[], metavar="KEY=VALUE",
                        help="extra arc config override, repeatable (e.g. --arc recovery.enabled=true)")
    parser.add_argument("--method", choices=("models", "steps"), default="models",
                        help="models: two models side by side, without and with arc_engine (the whole overhead, "
                             "comm hook included); steps: one model with arc_engine and stats.interval=2, each "
                             "monitored step timed against its unmonitored neighbours (the monitoring work alone: "
                             "same model, same memory; it leaves out what is paid on every step, e.g. DDP's Python "
                             "comm hook, which --control torch-hook measures)")
    parser.add_argument("--launches", type=int, default=1,
                        help="repeat the whole measurement in this many fresh launches and report the median of "
                             "their headline figures (on a small CPU machine one step's time scatters by several "
                             "percent, so one launch of 80 pairs cannot resolve 1%%: use --blocks 160 and several "
                             "launches)")
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)  # set for each launch by main()
    args = parser.parse_args()
    preset = MODELS[args.model]
    args.layers = args.layers if args.layers is not None else preset["layers"]
    args.d_model = args.d_model if args.d_model is not None else preset["d_model"]
    args.bucket_mb = args.bucket_mb if args.bucket_mb is not None else preset["bucket_mb"]
    return args


#: The benchmark's models: about the same parameter count, 6x the tensors (and buckets) in ``thin``.
MODELS = {"standard": {"layers": 4, "d_model": 256, "bucket_mb": None},
          "thin": {"layers": 26, "d_model": 96, "bucket_mb": 1.0}}


def periodic_block(config, mechanisms: bool = False) -> int:
    """Steps per block so that every block holds the same periodic work: the least common multiple of the
    configuration's periods (optimizer statistics every k-th monitored step, the consistency family's sketch, the
    straggler report and compute samples, weight health and dynamics when on, snapshots every ``checkpoint_freq``
    healthy steps, disk checkpoints; with ``mechanisms``, for a model that has attention or router parts the
    mechanism monitors measure, their periods too). Pure."""
    interval = config.stats.interval
    consistency, straggler = section_of(config, ConsistencyFamily()), section_of(config, StragglerFamily())
    periods = [interval]
    if config.stats.optimizer_stats_every:
        periods.append(interval * config.stats.optimizer_stats_every)
    if consistency.enabled and consistency.direction:
        periods.append(interval * consistency.direction_every)  # the gradient sketch
    if straggler.enabled:
        periods.append(interval * straggler.every)  # the per-rank report
        if straggler.compute_every:
            periods.append(interval * straggler.compute_every)  # the compute probe's sampled steps
    # off by default; periodic when on
    for section in (section_of(config, WeightHealthFamily()), section_of(config, DynamicsFamily())):
        if section.enabled:
            periods.append(section.every)
    if config.recovery.enabled:
        periods.append(config.recovery.checkpoint_freq)
        if config.recovery.checkpoint.every_steps:
            periods.append(config.recovery.checkpoint.every_steps)
    for section in (section_of(config, QKSpectraFamily()), section_of(config, RouterFamily())) if mechanisms else ():
        if section.enabled:
            periods.append(section.every)
    return math.lcm(*periods)


def build(args: argparse.Namespace, data: CharDataset, config, torch_hook: bool = False) -> tuple[Callable, object]:
    """One variant: a ``step(inputs, targets)`` closure and its arc handle (None without arc_engine).
    ``torch_hook``: no arc_engine, but torch's own default all-reduce registered as a DDP comm hook (a control)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, seq_len=args.seq_len, num_layers=args.layers,
                          d_model=args.d_model, num_heads=max(1, args.d_model // 64),
                          activation_checkpointing=args.activation_checkpointing))
    if args.backend == "fsdp2":
        return build_fsdp2(model, args, config)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4)
    if args.backend == "deepspeed":
        import deepspeed

        zero: dict = {"stage": 2}
        if args.bucket_mb is not None:  # in elements of 4 bytes; the post-step all-gather's buckets alike
            zero["reduce_bucket_size"] = zero["allgather_bucket_size"] = int(args.bucket_mb * 2**20 / 4)
        ds_config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_clipping": 1.0,
                     "zero_optimization": zero, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        arc = arc_engine.attach(engine, None, config) if config is not None else None

        def ds_step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
            loss = engine(inputs, targets)
            if arc is not None:
                arc.record_loss(loss)
            engine.backward(loss)
            engine.step()

        return ds_step, arc
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    arc = arc_engine.attach(ddp, optimizer, config) if config is not None else None
    if torch_hook:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return torch_step(ddp, optimizer, arc), arc


def torch_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, arc) -> Callable:
    """A PyTorch loop's ``step(inputs, targets)``: forward, the loss recorded when ``arc`` is given, backward,
    clipping 1.0, the optimizer's step."""

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        loss = model(inputs, targets)
        if arc is not None:
            arc.record_loss(loss)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def build_fsdp2(model: GPT, args: argparse.Namespace, config) -> tuple[Callable, object]:
    """``build``'s FSDP2 variant: ``fully_shard`` on each block, then the root, parameters in ``args.dtype``
    (``bfloat16``: pure bf16, AdamW's moments in bf16 too, 8 bytes of state per parameter sharded over the ranks,
    how 1.3B fits 2 ranks in 24 GB), AdamW, clipping 1.0."""
    from torch.distributed.fsdp import fully_shard

    model.to(getattr(torch, args.dtype))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4)
    arc = arc_engine.attach(model, optimizer, config) if config is not None else None
    return torch_step(model, optimizer, arc), arc


def run_steps(step_fn: Callable, data: CharDataset, rank: int, first_step: int, count: int,
              micro_batch: int) -> tuple[float, float]:
    """Run ``count`` steps between two barriers; returns the mean wall time and the mean CPU time of this process
    (all its threads) per step, in seconds."""
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(first_step, first_step + count):
        inputs, targets = data.batch(step, rank, micro_batch)
        step_fn(inputs, targets)
    dist.barrier()
    return (time.perf_counter() - start) / count, (time.process_time() - cpu_start) / count


def overhead_figures(plain_blocks: list[float], arc_blocks: list[float]) -> dict[str, float]:
    """Overheads (fractions) from per-block mean step times of two variants, block ``b`` of each run next to each
    other: the median of per-pair ratios (the headline: robust to slow phases of the machine, which hit both blocks
    of a pair), the 10% trimmed mean of the ratios (both tails cut), the ratio of medians and the ratio of means
    (which a one-off stall moves). Pure."""
    ratios = sorted(a / p for p, a in zip(plain_blocks, arc_blocks, strict=True))
    cut = len(ratios) // 10
    trimmed = ratios[cut: len(ratios) - cut] or ratios
    return {"pair_median": statistics.median(ratios) - 1, "trimmed_mean": statistics.fmean(trimmed) - 1,
            "median_ratio": statistics.median(arc_blocks) / statistics.median(plain_blocks) - 1,
            "mean_ratio": statistics.fmean(arc_blocks) / statistics.fmean(plain_blocks) - 1}


def block_order(block: int, variants: int = 3) -> list[int]:
    """The order the variants run in block ``block``: their permutations in turn, so over any ``variants!``
    consecutive blocks each one runs right after each other equally often (a variant that warms the caches for
    the next, or leaves it a slow phase, favours none). Pure."""
    orders = list(itertools.permutations(range(variants)))
    return list(orders[block % len(orders)])


def without_timers(host_ms: float, timed_calls: float, timer_ms: float) -> float:
    """Own work per step with the timers' own cost (``timed_calls`` per step, ``timer_ms`` each) taken out, never
    below 0. Pure."""
    return max(0.0, host_ms - timed_calls * timer_ms)


def slowest_rank(reports: list[dict]) -> dict:
    """The own-work report (``OwnWork.report`` as a dict) of the rank with the largest own work. Pure."""
    return max(reports, key=lambda report: report.get("untimed_ms", report["host_ms"]))


def timer_cost_ns(repeats: int = 100_000) -> float:
    """Host time of one timed call of an empty function (``stats.own_work`` on) minus an untimed one, in ns."""
    from arc_engine.own_work import OwnWork

    def empty() -> None:
        return None

    timed = OwnWork(True).wrap("empty", empty)
    best = []
    for function in (empty, timed):
        start = time.perf_counter_ns()
        for _ in range(repeats):
            function()
        best.append((time.perf_counter_ns() - start) / repeats)
    return best[1] - best[0]


def neighbour_ratios(steps: list[tuple[bool, float]]) -> list[float]:
    """For each monitored step whose two neighbours are unmonitored, its time divided by their mean time.
    ``steps``: (monitored, seconds) in the order they ran. Pure."""
    triples = zip(steps[:-2], steps[1:-1], steps[2:], strict=True)
    return [now * 2 / (before + after) for (was, before), (is_monitored, now), (will_be, after) in triples
            if is_monitored and not was and not will_be]


def count_collectives(step_fn: Callable, data: CharDataset, rank: int, steps: int, micro_batch: int) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps(step_fn, data, rank, 10_000, steps, micro_batch)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("c10d::") and "barrier" not in e.key)


def pin_to_core(local_rank: int) -> None:
    """Pin this rank (and the threads it starts later, gloo's included) to one core when there are enough, so the
    ranks do not migrate between cores: it cuts the step-to-step jitter both variants see."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")) and local_rank < len(cores):
        os.sched_setaffinity(0, {cores[local_rank]})


def measure_models(args: argparse.Namespace, data: CharDataset, rank: int, config) -> object:
    """The side-by-side method (see ``--method``): prints the figures on rank 0 and returns the arc handle."""
    plain_step, _ = build(args, data, None)
    arc_step, arc = build(args, data, config)  # built in every mode: the same allocations
    control_step, _ = build(args, data, None)  # A/A: a second plain model
    if args.control != "none":
        arc_step, _ = build(args, data, None, torch_hook=args.control == "torch-hook")
    steps_per_block = args.steps_per_block or periodic_block(config)
    variants = [plain_step, arc_step, control_step]
    for step_fn in variants:
        run_steps(step_fn, data, rank, 0, max(args.warmup, steps_per_block), args.micro_batch)
    arc.engine.own_work.reset()
    times: list[list[tuple[float, float]]] = [[], [], []]
    for block in range(args.blocks):
        first = args.warmup + block * steps_per_block
        for index in block_order(block):
            times[index].append(run_steps(variants[index], data, rank, first, steps_per_block, args.micro_batch))
    own = arc.engine.own_work.report()
    own_dict = {"host_ms": own.host_ms, "step_ms": own.step_ms, "fraction": own.fraction, "lines": own.lines(),
                "timed_calls": sum(piece["calls"] for piece in own.pieces.values())}
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, own_dict)
    copies_before = arc.engine.gathering.pipeline.host_copies
    arc_ops = count_collectives(arc_step, data, rank, 2, args.micro_batch)
    host_copies = (arc.engine.gathering.pipeline.host_copies - copies_before) / 2
    plain_ops = count_collectives(plain_step, data, rank, 2, args.micro_batch)
    if rank == 0:
        plain, arc_times, control = ([t[0] for t in series] for series in times)
        figures = overhead_figures(plain, arc_times)
        control_figures = overhead_figures(plain, control)
        cpu = overhead_figures([t[1] for t in times[0]], [t[1] for t in times[1]])
        if os.environ.get("ARC_BENCH_DEBUG"):
            print([[round(t[0] * 1e3) for t in series] for series in times])
        backend = "DeepSpeed ZeRO-2" if args.backend == "deepspeed" else "DDP"
        tensors = len(arc.engine.gathering.params)
        print(f"model: GPT ({args.model}) {args.layers} layers, d_model {args.d_model}, {tensors} parameter tensors, "
              f"seq {args.seq_len}, micro-batch {args.micro_batch}; buckets "
              f"{'default' if args.bucket_mb is None else f'{args.bucket_mb:g} MB'}; {backend}, AdamW, clip 1.0, "
              f"{dist.get_world_size()} ranks, gloo, CPU")
        print(f"stats.optimizer_stats_every = {config.stats.optimizer_stats_every}; overrides {args.arc or 'none'}")
        if args.control != "none":
            print(f"CONTROL RUN: the arc variant is {args.control}, not arc_engine")
        print(f"blocks per variant: {args.blocks} of {steps_per_block} steps, rotating order "
              f"(plain, arc, plain again)")
        print(f"median step time: plain {statistics.median(plain) * 1e3:.1f} ms, with arc_engine "
              f"{statistics.median(arc_times) * 1e3:.1f} ms")
        # the own-work clock's step time spans the other variants' blocks too: use the arc variant's own (in a
        # control run the arc_engine model did not train in the blocks: its own work is not reported)
        arc_step_ms = statistics.median(arc_times) * 1e3 if args.control == "none" else float("inf")
        # the timers exist only while own work is measured (stats.own_work, off by default): their cost, about
        # timer_ns per timed call, is taken out of the figure the bar is compared with
        timer_ms = timer_cost_ns() / 1e6
        for report in reports:
            report["fraction"] = report["host_ms"] / arc_step_ms
            report["untimed_ms"] = without_timers(report["host_ms"], report["timed_calls"], timer_ms)
        slowest = slowest_rank(reports)
        own_fraction = slowest["untimed_ms"] / arc_step_ms
        for line in slowest["lines"][1:]:
            print(f"  {line}")
        print(f"arc_engine work (slowest rank): {slowest['host_ms']:.3f} ms per step = "
              f"{slowest['fraction'] * 100:.3f}% of the median step with arc_engine ({arc_step_ms:.1f} ms)")
        per_rank = ", ".join(f"{report['fraction'] * 100:.3f}%" for report in reports)
        print(f"own work per rank: {per_rank}; timed calls per "
              f"step {slowest['timed_calls']:.1f} x about {timer_ms * 1e3:.2f} us of timer each")
        print(f"without the timers' own cost (no timers run unless stats.own_work is on): "
              f"{slowest['untimed_ms']:.3f} ms per step")
        for name, figs in (("A/B (arc_engine)", figures), ("A/A (plain again)", control_figures)):
            print(f"{name}: median of block pairs {figs['pair_median'] * 100:+.2f}%, trimmed mean "
                  f"{figs['trimmed_mean'] * 100:+.2f}%, ratio of means {figs['mean_ratio'] * 100:+.2f}%")
        print(f"CPU time per step (rank 0, all threads), A/B median of block pairs: {cpu['pair_median'] * 100:+.2f}%")
        print(f"arc_engine collectives per monitored step: {(arc_ops - plain_ops) / 2:g}; "
              f"host copies per monitored step: {host_copies:g}")
        print(f"arc_engine own work: {own_fraction * 100:.3f}% of step" if args.control == "none"
              else "arc_engine own work: n/a (control run: arc_engine did not train in the blocks)")
        print(f"overhead (A/B, median of block pairs): {figures['pair_median'] * 100:+.2f}%")
        if args.result_file:
            with open(args.result_file, "w") as out:
                json.dump({"pair_median": figures["pair_median"], "cpu_pair_median": cpu["pair_median"],
                           "own_work": own_fraction, "aa_pair_median": control_figures["pair_median"]},
                          out)
    return arc


def measure_steps(args: argparse.Namespace, data: CharDataset, rank: int, config) -> object:
    """The same-model method (see ``--method``): one model with arc_engine, ``stats.interval`` 2, one step per
    block; each monitored step's time is divided by the mean of its two unmonitored neighbours' (so a slow phase of
    the machine, and any cost a monitored step leaves to the next one, hit both sides). Prints on rank 0."""
    arc_step, arc = build(args, data, config)
    run_steps(arc_step, data, rank, 0, args.warmup, args.micro_batch)
    times: list[tuple[bool, tuple[float, float]]] = []
    for block in range(2 * args.blocks + 1):
        monitored = arc.engine.is_monitored()
        times.append((monitored, run_steps(arc_step, data, rank, args.warmup + block, 1, args.micro_batch)))
    ratios = {which: neighbour_ratios([(monitored, t[which]) for monitored, t in times]) for which in (0, 1)}
    copies_before = arc.engine.gathering.pipeline.host_copies
    ops_two_steps = count_collectives(arc_step, data, rank, 2, args.micro_batch)  # one monitored, one not
    host_copies = arc.engine.gathering.pipeline.host_copies - copies_before
    if rank == 0:
        backend = "DeepSpeed ZeRO-2" if args.backend == "deepspeed" else "DDP"
        print(f"model: GPT {args.layers} layers, d_model {args.d_model}, seq {args.seq_len}, micro-batch "
              f"{args.micro_batch}; {backend}, AdamW, clip 1.0, {dist.get_world_size()} ranks, gloo, CPU")
        print(f"method: steps (one model, stats.interval=2); overrides {args.arc or 'none'}")
        idle = [t[1][0] for t in times if not t[0]]
        busy = [t[1][0] for t in times if t[0]]
        print(f"monitored steps: {len(busy)}, unmonitored: {len(idle)}; median step time monitored "
              f"{statistics.median(busy) * 1e3:.1f} ms, unmonitored {statistics.median(idle) * 1e3:.1f} ms")
        wall = statistics.median(ratios[0]) - 1
        cpu = statistics.median(ratios[1]) - 1
        print(f"overhead of monitoring (median over monitored steps of the ratio to their neighbours): "
              f"{wall * 100:+.2f}%")
        print(f"CPU time per step (rank 0, all threads), same median: {cpu * 100:+.2f}%")
        print(f"collectives in one monitored + one unmonitored step (training's included): {ops_two_steps}; "
              f"arc_engine host copies: {host_copies}")
        if args.result_file:
            with open(args.result_file, "w") as out:
                json.dump({"pair_median": wall, "cpu_pair_median": cpu}, out)
    return arc


def worker(args: argparse.Namespace) -> None:
    if args.pin:
        pin_to_core(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    data = CharDataset(generate_corpus(), args.seq_len)
    # one directory for every rank (checkpoints need a shared one): torchrun gives all ranks the same run id
    run_dir = os.path.join(tempfile.gettempdir(), f"arc_bench_{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")
    overrides = ["run.run_id=bench", f"run.run_dir={run_dir}", "sinks.console.enabled=false", "stats.own_work=true"]
    if args.optimizer_stats_every is not None:
        overrides.append(f"stats.optimizer_stats_every={args.optimizer_stats_every}")
    if args.method == "steps":
        if args.control != "none":
            raise SystemExit("--control goes with --method models")
        overrides.append("stats.interval=2")
    config = load_config(None, overrides + args.arc)
    if args.control == "torch-hook" and args.backend != "ddp":
        raise SystemExit("--control torch-hook needs --backend ddp")
    if args.method == "steps":
        arc = measure_steps(args, data, rank, config)
    else:
        arc = measure_models(args, data, rank, config)
    arc.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    dist.destroy_process_group()


def launch(args: argparse.Namespace, extra: list[str]) -> int:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           __file__, *sys.argv[1:], *extra]
    return subprocess.call(cmd, env=env)


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:
        worker(args)
        sys.stdout.flush()
        os._exit(0)  # see arc_engine.demo.train.exit_hard
    if args.launches <= 1:
        sys.exit(launch(args, []))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.launches):
            print(f"--- launch {index + 1} of {args.launches}", flush=True)
            path = os.path.join(tmp, f"launch{index}.json")
            code = launch(args, ["--result-file", path])
            if code != 0:
                sys.exit(code)
            with open(path) as handle:
                results.append(json.load(handle))
    walls = [r["pair_median"] * 100 for r in results]
    cpus = [r["cpu_pair_median"] * 100 for r in results]
    print(f"overhead per launch (pair median): {', '.join(f'{w:+.2f}%' for w in walls)}")
    print(f"CPU time per launch (pair median): {', '.join(f'{c:+.2f}%' for c in cpus)}")
    if all("own_work" in r for r in results):
        controls = [r["aa_pair_median"] * 100 for r in results]
        print(f"A/A per launch (pair median): {', '.join(f'{c:+.2f}%' for c in controls)}")
        print(f"arc_engine own work: {statistics.median(r['own_work'] for r in results) * 100:.3f}% of step")
    print(f"overhead (A/B, median of block pairs): {statistics.median(walls):+.2f}% "
          f"(median over {len(results)} launches; CPU time {statistics.median(cpus):+.2f}%)")


if __name__ == "__main__":
    main()

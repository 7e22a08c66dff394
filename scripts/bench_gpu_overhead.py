"""arc_engine's overhead on one GPU: a GPT of about 1B parameters in bf16 autocast, the default configuration
against no arc_engine, side by side in one process, plus arc_engine's own work (``stats.own_work``).

    python scripts/bench_gpu_overhead.py                   # CUDA: DDP over NCCL at world size 1, ~1.0B parameters
    python scripts/bench_gpu_overhead.py --size 1.3b         # the shapes of scripts/bench_scale.py: 125m, 350m, 1.3b
    python scripts/bench_gpu_overhead.py --tiny --blocks 4  # the same on CPU over gloo, a small model: a dry run

``--size``: OPT / GPT-3's 125M, 350M or 1.3B (layers x hidden x heads as in ``scripts/bench_scale.py``, vocabulary
50,272, sequence 2,048), the sizes whose CPU step the scale bench measures; two copies of the 1.3B model with their
AdamW states and a micro-batch of 8 x 2,048 tokens need about 60 GB of device memory.

Two copies of the model (the same initial weights), each with its own fused AdamW, live in the process; one has
arc_engine attached. They take turns in blocks of ``--steps-per-block`` steps, and each block is timed as a whole
(CUDA synchronised at its ends), so clock drift and machine noise hit both alike. Reported: the median over block
pairs of the ratio of mean step times (with / without), its spread, arc_engine's own work as a fraction of the step,
and its host synchronisations per monitored step as the device reports them (``torch.cuda.set_sync_debug_mode``).
Written as JSON to ``--out`` (``scripts/gpu_check.sh`` puts it under ``$OUT``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_scale import SHAPES  # the scale bench's shapes (this script's folder is on sys.path)
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine.config import load_config
from arc_engine.demo.gpt import GPT, GPTConfig, param_groups
from arc_engine.policy.decision import ArcAbort


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--blocks", type=int, default=8, help="block pairs (one block per variant each)")
    parser.add_argument("--steps-per-block", type=int, default=20, help="a multiple of the periodic schedules")
    parser.add_argument("--warmup", type=int, default=3, help="steps per variant before timing")
    parser.add_argument("--size", choices=sorted(SHAPES), default=None,
                        help="a shape of scripts/bench_scale.py (sets layers, d-model, heads, vocab, seq-len)")
    parser.add_argument("--tiny", action="store_true", help="a small model (a CPU dry run)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    parser.add_argument("--own-work", action=argparse.BooleanOptionalAction, default=True,
                        help="time arc_engine's pieces (stats.own_work; on a GPU, two CUDA events per piece, which the "
                             "ratio then includes); --no-own-work: the ratio alone, as a user's run pays it")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="then profile this many steps with arc_engine under cProfile (host time by function)")
    return parser.parse_args()


def init_world() -> torch.device:
    """World size 1: NCCL on CUDA, gloo on CPU."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def build(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, num_layers=args.layers, d_model=args.d_model,
                       num_heads=args.heads)
    model = GPT(config).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, fused=device.type == "cuda")
    return ddp, optimizer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Batches:
    """Fresh random tokens for every step, drawn on the device from a seed of its own: each variant gets the same
    sequence of batches, and no batch repeats (a model that sees the same few batches again and again memorises
    them, and its falling loss and changing gradients are no clean run)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.shape, self.vocab, self.device = (args.micro_batch, args.seq_len), args.vocab, device
        self.generator = torch.Generator(device=device).manual_seed(0)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.randint(0, self.vocab, self.shape, generator=self.generator, device=self.device)
                     for _ in range(2))  # type: ignore[return-value]


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, arc: arc_engine.Arc | None,
         batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> None:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(*batch)
    if arc is not None:
        arc.record_loss(loss)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed_block(model: torch.nn.Module, optimizer: torch.optim.Optimizer, arc: arc_engine.Arc | None,
                batches: Batches, steps: int, device: torch.device) -> float:
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step(model, optimizer, arc, batches(), device)
    synchronize(device)
    return (time.perf_counter() - started) / steps


def profile(model: torch.nn.Module, optimizer: torch.optim.Optimizer, arc: arc_engine.Arc, batches: Batches,
            steps: int, device: torch.device) -> str:
    """Host time of ``steps`` steps with arc_engine, by function (cProfile): the functions with the most time of
    their own, then arc_engine's by cumulative time; a call that waits for the device shows as its own time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    synchronize(device)
    profiler.enable()
    for _ in range(steps):
        step(model, optimizer, arc, batches(), device)
    synchronize(device)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(r"arc_engine|integrations", 45)
    return text.getvalue()


def op_table(model: torch.nn.Module, optimizer: torch.optim.Optimizer, arc: arc_engine.Arc | None,
             batches: Batches, steps: int, device: torch.device) -> str:
    """torch.profiler's table of ``steps`` steps by operator and runtime call, by their own host time: which
    kernels arc_engine launches, how many, and any runtime call that waits (a copy from pageable memory, say)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            step(model, optimizer, arc, batches(), device)
        synchronize(device)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def shifted(ratio: float | None) -> float | None:
    """A ratio of step times as an overhead (ratio - 1)."""
    return None if ratio is None else ratio - 1.0


def main() -> int:
    args = parse_args()
    if args.size:
        shape = SHAPES[args.size]
        args.layers, args.d_model, args.heads, args.vocab, args.seq_len = \
            shape.layers, shape.hidden, shape.heads, shape.vocab, 2048
    if args.tiny:
        args.layers, args.d_model, args.heads, args.seq_len, args.micro_batch, args.vocab = 2, 64, 4, 64, 4, 256
    device = init_world()
    plain_model, plain_optimizer = build(args, device)
    arc_model, arc_optimizer = build(args, device)
    params = sum(p.numel() for p in plain_model.parameters())
    run_dir = Path(tempfile.mkdtemp(prefix="arc_gpu_bench_"))
    config = load_config(None, [f"run.run_dir={run_dir}", "run.run_id=bench", "sinks.console.enabled=false",
                                f"stats.own_work={str(args.own_work).lower()}"])
    arc = arc_engine.attach(arc_model, arc_optimizer, config)
    plain_batches, arc_batches = Batches(args, device), Batches(args, device)
    ratios, plain_s, arc_s, syncs, stopped = [], [], [], None, None
    try:  # a clean run: arc_engine should never stop it, and if it does, the result says why
        for _ in range(args.warmup):
            step(plain_model, plain_optimizer, None, plain_batches(), device)
            step(arc_model, arc_optimizer, arc, arc_batches(), device)
        for block in range(args.blocks):  # the order alternates: neither variant always runs first
            order = [("plain", plain_model, plain_optimizer, None, plain_batches),
                     ("arc", arc_model, arc_optimizer, arc, arc_batches)]
            times = {}
            for name, model, optimizer, attached, batches in (order if block % 2 == 0 else order[::-1]):
                times[name] = timed_block(model, optimizer, attached, batches, args.steps_per_block, device)
            ratios.append(times["arc"] / times["plain"])
            plain_s.append(times["plain"])
            arc_s.append(times["arc"])
        if device.type == "cuda":
            from arc_engine.testing.host_syncs import CudaSyncCounter

            counter = CudaSyncCounter()
            with counter:
                for index in range(args.steps_per_block):
                    counter.begin(index)
                    step(arc_model, arc_optimizer, arc, arc_batches(), device)
            syncs = {"arc_engine_syncs": sum(counter.count(i) for i in range(args.steps_per_block)),
                     "steps": args.steps_per_block,
                     "sites": sorted(set(counter.report().splitlines()))[:20]}
        if args.profile:
            print(profile(arc_model, arc_optimizer, arc, arc_batches, args.profile, device), flush=True)
            for name, model, optimizer, attached, batches in order:
                print(f"[bench_gpu] operators, {name}:\n"
                      f"{op_table(model, optimizer, attached, batches, args.profile, device)}", flush=True)
    except ArcAbort as error:
        stopped = str(error)
        print(f"[bench_gpu] arc_engine stopped the run: {error}", flush=True)
    summary = arc.summary()
    arc.close()
    shutil.rmtree(run_dir, ignore_errors=True)  # the run's events: nothing the result needs
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "size": args.size, "parameters": params, "layers": args.layers,
              "d_model": args.d_model,
              "seq_len": args.seq_len, "micro_batch": args.micro_batch, "blocks": args.blocks,
              "steps_per_block": args.steps_per_block, "blocks_done": len(ratios), "plain_step_s": median(plain_s),
              "arc_step_s": median(arc_s), "overhead_median": shifted(median(ratios)),
              "overhead_min": shifted(min(ratios, default=None)), "overhead_max": shifted(max(ratios, default=None)),
              "own_work_fraction": summary.get("own_work", {}).get("fraction"),
              "own_work_pieces": summary.get("own_work", {}).get("pieces"), "syncs": syncs,
              "detections": summary.get("detections"), "steps_not_applied": summary.get("steps_not_applied"),
              "stopped": stopped}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    dist.destroy_process_group()
    if not ratios:
        return 1
    print(f"[bench_gpu] {result['device']}: {params / 1e9:.2f}B parameters, step {result['plain_step_s'] * 1e3:.1f} ms "
          f"without arc_engine, {result['arc_step_s'] * 1e3:.1f} ms with; overhead (median of {args.blocks} block "
          f"pairs) {result['overhead_median']:+.2%} [{result['overhead_min']:+.2%}, {result['overhead_max']:+.2%}]; "
          f"own work {result['own_work_fraction']}; syncs {syncs and syncs['arc_engine_syncs']} over "
          f"{syncs and syncs['steps']} steps; steps not applied {result['steps_not_applied']}", flush=True)
    return 0 if stopped is None else 1


if __name__ == "__main__":
    sys.exit(main())

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
                batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    synchronize(device)
    started = time.perf_counter()
    for batch in batches:
        step(model, optimizer, arc, batch, device)
    synchronize(device)
    return (time.perf_counter() - started) / len(batches)


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
                                "stats.own_work=true"])
    arc = arc_engine.attach(arc_model, arc_optimizer, config)
    generator = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), generator=generator).to(device)
                     for _ in range(2)) for _ in range(args.steps_per_block)]
    for _ in range(args.warmup):
        step(plain_model, plain_optimizer, None, batches[0], device)
        step(arc_model, arc_optimizer, arc, batches[0], device)
    ratios, plain_s, arc_s = [], [], []
    for block in range(args.blocks):  # the order alternates: neither variant always runs first
        order = [("plain", plain_model, plain_optimizer, None), ("arc", arc_model, arc_optimizer, arc)]
        times = {}
        for name, model, optimizer, attached in (order if block % 2 == 0 else order[::-1]):
            times[name] = timed_block(model, optimizer, attached, batches, device)
        ratios.append(times["arc"] / times["plain"])
        plain_s.append(times["plain"])
        arc_s.append(times["arc"])
    syncs = None
    if device.type == "cuda":
        from arc_engine.testing.host_syncs import CudaSyncCounter

        counter = CudaSyncCounter()
        with counter:
            for index, batch in enumerate(batches):
                counter.begin(index)
                step(arc_model, arc_optimizer, arc, batch, device)
        syncs = {"arc_engine_syncs": sum(counter.count(i) for i in range(len(batches))), "steps": len(batches),
                 "sites": sorted(set(counter.report().splitlines()))[:20]}
    summary = arc.summary()
    arc.close()
    shutil.rmtree(run_dir, ignore_errors=True)  # the run's events: nothing the result needs
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "size": args.size, "parameters": params, "layers": args.layers,
              "d_model": args.d_model,
              "seq_len": args.seq_len, "micro_batch": args.micro_batch, "blocks": args.blocks,
              "steps_per_block": args.steps_per_block, "plain_step_s": statistics.median(plain_s),
              "arc_step_s": statistics.median(arc_s), "overhead_median": statistics.median(ratios) - 1.0,
              "overhead_min": min(ratios) - 1.0, "overhead_max": max(ratios) - 1.0,
              "own_work_fraction": summary.get("own_work", {}).get("fraction"),
              "own_work_pieces": summary.get("own_work", {}).get("pieces"), "syncs": syncs}
    print(f"[bench_gpu] {result['device']}: {params / 1e9:.2f}B parameters, step {result['plain_step_s'] * 1e3:.1f} ms "
          f"without arc_engine, {result['arc_step_s'] * 1e3:.1f} ms with; overhead (median of {args.blocks} block "
          f"pairs) {result['overhead_median']:+.2%} [{result['overhead_min']:+.2%}, {result['overhead_max']:+.2%}]; "
          f"own work {result['own_work_fraction']}; syncs {syncs and syncs['arc_engine_syncs']} over "
          f"{syncs and syncs['steps']} steps", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

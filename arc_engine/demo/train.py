"""The demo training job (also the reference integration for a plain DDP training script).

Run under torchrun, e.g.::

    torchrun --standalone --nproc_per_node 2 -m arc_engine.demo.train --arc-config configs/demo.yaml

Every rank trains the same small GPT under DDP on its own shard of a generated corpus; arc_engine watches each
step, and the faults listed in the config's ``faults.injections`` are injected at their (rank, step).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine import runtime
from arc_engine.config import ArcConfig
from arc_engine.demo.corpus import CharDataset, generate_corpus
from arc_engine.demo.defaults import DEMO_CONFIG
from arc_engine.demo.gpt import GPT, GPTConfig, param_groups
from arc_engine.sinks import read_jsonl


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="arc_engine demo: small GPT, DDP, injected faults", allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8, help="micro-batch per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="collective timeout")
    parser.add_argument("--no-arc", action="store_true", help="train without arc_engine (reference run)")
    parser.add_argument("--save-params", type=Path, default=None,
                        help="rank 0 saves the final parameters here (torch.save of the state_dict)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="accepted for the deepspeed launcher; the rank comes from the environment")
    arc_engine.add_arc_args(parser)
    return parser


def init_distributed(timeout_s: float) -> tuple[int, int, torch.device]:
    """Join the torchrun job (or run alone). gloo on CPU, NCCL when CUDA is present."""
    if not dist.is_initialized() and "RANK" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(runtime.local_rank())
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = torch.device("cuda", runtime.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    return rank, world, device


def train(args: argparse.Namespace, config: ArcConfig | None) -> dict:
    """Train for ``args.steps`` optimizer steps; arc_engine attached unless ``config`` is None.
    Returns ``{"final_loss", "summary", "run_dir"}`` (rank-local loss). Raises ArcAbort on an abort."""
    rank, world, device = init_distributed(args.timeout_s)
    torch.manual_seed(args.seed)
    data = CharDataset(generate_corpus(), args.seq_len, seed=args.seed)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, seq_len=args.seq_len, num_layers=args.layers,
                          d_model=args.d_model, num_heads=args.heads)).to(device)
    if world > 1:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
    arc: Any = None

    def recompute(module: torch.nn.Module, data_rank: int) -> list[torch.Tensor]:  # detectors.sdc.recompute's
        return [module(*(t.to(device) for t in data.batch(arc.progress.data_position, data_rank, args.batch_size)))]

    arc = arc_engine.attach(model, optimizer, config, recompute_fn=recompute) if config is not None else None
    loss_value = float("nan")
    start = time.perf_counter()
    iteration = 0
    # With recovery, arc owns the step counter and the data position: both go back on a rollback.
    while (arc.progress.step if arc is not None else iteration) < args.steps:
        position = arc.progress.data_position if arc is not None else iteration
        inputs, targets = (t.to(device) for t in data.batch(position, rank, args.batch_size))
        loss = model(inputs, targets)
        if arc is not None:
            loss = arc.faults.on_loss(loss)
            arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iteration += 1
        step = arc.progress.step if arc is not None else iteration
        if rank == 0 and iteration % args.log_every == 0:
            loss_value = float(loss.detach())
            per_step_ms = (time.perf_counter() - start) * 1e3 / iteration
            applied = "" if arc is None or arc.last_step_applied else "  (update not applied)"
            print(f"[train] step {step:>4}/{args.steps}  loss {loss_value:.4f}  {per_step_ms:.1f} ms/step"
                  f"{applied}", flush=True)
    loss_value = float(loss.detach())
    if arc is not None:
        arc.close()  # drains the last disk save: the summary then counts what committed
    summary = arc.summary() if arc is not None else {}
    if args.save_params is not None and rank == 0:
        module = model.module if isinstance(model, DistributedDataParallel) else model
        torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, args.save_params)
    return {"final_loss": loss_value, "summary": summary, "run_dir": summary.get("run_dir")}


def print_report(config: ArcConfig, result: dict) -> None:
    """The end-of-demo table: each injected fault and what arc_engine detected and did at that step."""
    summary = result["summary"]
    events = read_jsonl(Path(summary["run_dir"]) / config.sinks.jsonl.events_file) if config.sinks.jsonl.enabled \
        else []
    detections = [e for e in events if e["kind"] == "detection"]
    print("\n================ arc_engine demo summary ================")
    skipped = summary["skipped_by_policy"] + summary["skipped_by_framework"]
    print(f"steps {summary['steps']}, skipped {skipped}, final loss {result['final_loss']:.4f}")
    print(f"{'injected fault':<34} {'detected by':<24} action")
    for spec in config.faults.injections:
        where = "all ranks" if spec.rank == -1 else f"rank {spec.rank}"
        label = f"{spec.kind} @ step {spec.step} ({where})"
        # faults fire at step attempts (iterations); a bad learning rate shows in the next step's loss
        late = 1 if spec.kind == "lr_scale" else 0
        hits = [e for e in detections if spec.step <= e["iteration"] < spec.step + spec.steps + late]
        found = ", ".join(sorted({f"{e['detector']} {e['ranks'] or ''}".strip() for e in hits})) or "MISSED"
        action = ", ".join(sorted({e["action"] for e in hits})) or "-"
        print(f"{label:<34} {found:<24} {action}")
    for event in (e for e in events if e["kind"] == "action" and e["detector"] == "recovery"):
        values = event["values"]
        print(f"{event['action']} at step {event['step']}: back to the {values['tier']} snapshot of step "
              f"{values['target_step']}, data resumes at batch {values['data_position']}, "
              f"learning rate x {values['lr_factor']:.3g}")
    if "recovery" in summary:
        recovery = summary["recovery"]
        committed = recovery.get("checkpoint_saves", {}).get("committed", 0)
        print(f"recovery: {recovery['rollbacks']} rollback(s), {recovery['escapes']} escape(s), "
              f"{committed} disk checkpoint(s) committed in {Path(summary['run_dir']) / 'checkpoints'}")
    print(f"events: {Path(summary['run_dir']) / config.sinks.jsonl.events_file}")
    print("==========================================================", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = None if args.no_arc else arc_engine.config_from_args(args, default=DEMO_CONFIG)
    try:
        result = train(args, config)
    except arc_engine.ArcAbort as abort:
        print(f"[train] rank {runtime.global_rank()}: {abort}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        return abort.exit_code
    if config is not None and runtime.global_rank() == 0:
        print_report(config, result)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def exit_hard(code: int) -> None:
    """Flush and leave without interpreter finalization: gloo worker threads may still hold Python objects
    (DDP comm-hook futures) whose destruction during finalization aborts the process (SIGABRT) after an
    otherwise clean run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_hard(main())

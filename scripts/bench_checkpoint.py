"""Training stall of an asynchronous checkpoint against a synchronous one, and rollback time from disk vs memory.

    .venv/bin/python scripts/bench_checkpoint.py                      # 2 gloo ranks (spawned), 512 MB per rank
    .venv/bin/python scripts/bench_checkpoint.py --ranks 1 --size-mb 200
    .venv/bin/python scripts/bench_checkpoint.py --ranks 1 --pin --size-mb 1500   # the writer on a spare core

One process tree: ``--ranks`` processes spawned from this one and joined by gloo (``--ranks 1``: a single process,
no torch.distributed). Every rank holds the same state -- a stack of Linear layers plus AdamW's two moments, about
``--size-mb`` MB, replicated as under DDP (DCP writes each replicated tensor once, so the ranks share the writing).

Per repeat, alternating so machine noise hits both alike:

* async stall: the time the caller is blocked to save -- the state dict (``TorchTrainState.dcp_state_dict``:
  ``get_state_dict``'s, built at the first save and reused while it still holds the live tensors) and
  arc_engine's own state as JSON (RNG states, counters: what recovery adds to each save), then
  ``CheckpointManager.save_async`` (staging into reused host buffers, the previous save already drained); the
  write, the checksums and the commit run in the background, not timed here;
* sync save: the same state dict built, then a plain ``dcp.save`` with ``FileSystemWriter(sync_files=True)``,
  the stall a training loop would see without the async tier;
* background slowdown: a training-like step (forward and backward of the layers on a small batch) timed while
  the async save is in flight, against the same step with no save running: what the write costs the steps that
  overlap it;
* with the memory tier: the snapshot recovery takes anyway (``capture`` into the previous snapshot's host
  buffers), then the stall of a save written from it -- the state dict and JSON built, its live tensors swapped for
  the snapshot's copies (``from_snapshot``), ``save_async(stable=...)``: what recovery does when the memory ring
  is on, so the save stages nothing again.

``--pin``: each rank's training thread on a core of its own and the save's threads (arc_engine's commit worker,
DCP's writer) on another, re-pinned after every ``save_async`` (core ``2 r`` and ``2 r + 1`` for rank ``r``, modulo
the machine's cores; one torch thread): on 2 cores, ``--ranks 1 --pin`` is a trainer with a spare core for the
writer, what a node with 8 or more cores per GPU gives every rank.

Rollback: ``load_latest`` from disk (verify checksums, then ``dcp.load`` in place) against the memory tier's
restore, an in-place ``copy_`` of a host clone into the live tensors. Each figure is the slowest rank's, the median
over the repeats. Printed: a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from arc_engine.recovery import portable
from arc_engine.recovery.checkpoint import CheckpointManager
from arc_engine.recovery.snapshot import capture, from_snapshot, rng_state
from arc_engine.recovery.state import TorchTrainState

LAYER_WIDTH = 1024


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--size-mb", type=float, default=512.0, help="state per rank: weights + AdamW moments")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks to spawn; 1 = single process")
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    parser.add_argument("--pin", action="store_true",
                        help="training thread and the save's threads on separate cores (see the module docstring)")
    args = parser.parse_args()
    if args.size_mb <= 0 or args.repeats < 1 or args.ranks < 1:
        parser.error("--size-mb must be > 0, --repeats and --ranks >= 1")
    return args


def build_state(size_mb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Linear layers totalling ``size_mb / 3`` MB of fp32 weights, and AdamW after one step (two moments)."""
    torch.manual_seed(0)
    layer_bytes = (LAYER_WIDTH * LAYER_WIDTH + LAYER_WIDTH) * 4
    num_layers = max(1, round(size_mb * 2**20 / 3 / layer_bytes))
    model = torch.nn.Sequential(*[torch.nn.Linear(LAYER_WIDTH, LAYER_WIDTH) for _ in range(num_layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, LAYER_WIDTH)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def state_dict_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def save_state(state: TorchTrainState, step: int) -> dict[str, Any]:
    """What a save of recovery holds: the training state dict (``dcp_state_dict``: ``get_state_dict``'s, built at
    the first save and reused while it holds the live tensors) and arc_engine's own state as JSON, built now."""
    arc_state = {"rng": rng_state(), "arc": {"data_position": step, "step": step, "iteration": step},
                 "controller": {"rollbacks": 0}, "engine": {"monitored_steps": step}}
    rank = dist.get_rank() if dist.is_initialized() else 0
    return {**state.dcp_state_dict(), "arc_state": portable.dumps(arc_state),
            f"arc_rng/rank{rank}": portable.dumps(rng_state())}


def load_request(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a rollback from disk asks for: every entry a save wrote (the loader refuses a checkpoint holding
    entries nobody asks for), the training state in place, arc_engine's JSON as placeholders."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return {**state_dict_of(model, optimizer), "arc_state": b"", f"arc_rng/rank{rank}": b""}


def training_step(model: torch.nn.Module, batch: torch.Tensor) -> float:
    """Seconds of one forward and backward of ``model`` (the stand-in for a training step; no update)."""
    started = time.perf_counter()
    model(batch).square().mean().backward()
    return time.perf_counter() - started


def slowest(seconds: float, group: dist.ProcessGroup | None) -> float:
    """The maximum over ranks (collective when distributed)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def pin_threads(rank: int) -> None:
    """``--pin``: this rank's main (training) thread on core ``2 rank``, every other Python thread of the process
    (the save's) on core ``2 rank + 1``, modulo the cores. Linux: a thread id pins that thread alone."""
    cores = os.cpu_count() or 1
    os.sched_setaffinity(0, {(2 * rank) % cores})
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and thread.native_id is not None:
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setaffinity(thread.native_id, {(2 * rank + 1) % cores})


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def measure_saves(manager: CheckpointManager, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  root: Path, repeats: int, pin: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Alternate async (stall only) and sync saves, each building its state dict inside the timed region; the first
    async save (cold buffers) is reported apart. Between them, training-like steps with and without a save in
    flight."""
    group = dist.group.WORLD if dist.is_initialized() else None
    state = TorchTrainState(model, optimizer)
    cold_stall = slowest(timed(lambda: manager.save_async(0, save_state(state, 0))), group)
    pin()
    staged_mb = manager.last_staged_bytes / 2**20
    manager.wait()
    batch = torch.randn(64, LAYER_WIDTH)
    stalls, syncs, background, busy_steps, idle_steps = [], [], [], [], []
    snapshots, captures, snapshot_stalls, snapshot_staged = [], [], [], 0
    for repeat in range(1, repeats + 1):
        with torch.no_grad():  # a "training step" in between: the live tensors change
            for param in model.parameters():
                param.add_(1e-3)
        barrier()
        stalls.append(slowest(timed(lambda repeat=repeat: manager.save_async(
            repeat, save_state(state, repeat))), group))
        pin()  # (untimed) the save's threads, some new, off the training core
        started = time.perf_counter()
        overlapped = []
        while manager.in_flight:  # steps that overlap the background write (at least one)
            overlapped.append(training_step(model, batch))
        background.append(slowest(timed(manager.wait) + time.perf_counter() - started, group))
        idle = [training_step(model, batch) for _ in range(max(3, len(overlapped)))]
        busy_steps.append(statistics.median(overlapped) if overlapped else float("nan"))
        idle_steps.append(statistics.median(idle))
        barrier()
        sync_dir = root / f"sync_{repeat}"
        syncs.append(slowest(timed(lambda sync_dir=sync_dir, repeat=repeat: dcp.save(
            save_state(state, repeat), storage_writer=FileSystemWriter(sync_dir, sync_files=True),
            no_dist=group is None)), group))
        barrier()
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(sync_dir, ignore_errors=True)
        # the memory tier's snapshot (taken anyway every checkpoint_freq steps), then a save written from it
        captures.append(slowest(timed(lambda repeat=repeat: snapshots.append(capture(
            repeat, state, into=snapshots.pop().tensors if snapshots else None))), group))
        barrier()
        snapshot_stalls.append(slowest(timed(lambda repeat=repeat: save_from_snapshot(
            manager, state, snapshots[-1], save_state(state, 1000 + repeat))), group))
        snapshot_staged = manager.last_staged_bytes
        manager.wait()
        barrier()
    return {"staged_mb_rank0": staged_mb, "cold_stall_s": cold_stall, "async_stall_s": stalls,
            "async_background_s": background, "sync_save_s": syncs, "step_during_save_s": busy_steps,
            "step_idle_s": idle_steps, "snapshot_capture_s": captures, "snapshot_save_stall_s": snapshot_stalls,
            "snapshot_save_staged_bytes_rank0": snapshot_staged}


def save_from_snapshot(manager: CheckpointManager, state: TorchTrainState, snapshot: Any,
                       state_dict: dict[str, Any]) -> None:
    """What recovery does with the memory tier on: the state dict's live tensors swapped for the verified snapshot's
    host copies, which the save writes without staging them again."""
    swapped, used = from_snapshot(state_dict, state.live_tensors(), snapshot.tensors)
    manager.save_async(snapshot.step + 1000, swapped, stable=used)


def measure_rollback(manager: CheckpointManager, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     repeats: int) -> dict[str, Any]:
    """Disk: load_latest into the live state dict. Memory: copy_ of a host clone into the live tensors."""
    group = dist.group.WORLD if dist.is_initialized() else None
    disk = [slowest(timed(lambda: manager.load_latest(lambda info: load_request(model, optimizer))), group)
            for _ in range(repeats)]
    live = [t for t in state_dict_of(model, optimizer)["model"].values()]
    live += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    host = [t.detach().to("cpu", copy=True) for t in live]

    def copy_back() -> None:
        with torch.no_grad():
            for target, source in zip(live, host, strict=True):
                target.copy_(source)

    memory = [slowest(timed(copy_back), group) for _ in range(repeats)]
    return {"disk_load_s": disk, "memory_restore_s": memory}


def run(rank: int, world: int, port: int, args: argparse.Namespace, root: str, queue: Any) -> None:
    """One rank: build the state, measure, and (rank 0) put the figures on ``queue``."""
    warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")
    torch.set_num_threads(1 if args.pin else max(1, (os.cpu_count() or 1) // world))
    pin = functools.partial(pin_threads, rank) if args.pin else (lambda: None)
    pin()
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
    try:
        model, optimizer = build_state(args.size_mb)
        state_bytes = sum(t.numel() * t.element_size() for t in
                          [*model.parameters(), *[v for s in optimizer.state.values() for v in s.values()]])
        manager = CheckpointManager(Path(root) / "ckpt", keep_last=2)
        figures = measure_saves(manager, model, optimizer, Path(root), args.repeats, pin)
        figures.update(measure_rollback(manager, model, optimizer, args.repeats))
        manager.close()
        if rank == 0:
            queue.put({"ranks": world, "pinned": args.pin, "state_mb_per_rank": state_bytes / 2**20, **figures})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def report(figures: dict[str, Any]) -> None:
    median = {key: statistics.median(value) for key, value in figures.items() if isinstance(value, list)}
    ratio = median["async_stall_s"] / median["sync_save_s"]
    paired = statistics.median(a / s for a, s in zip(figures["async_stall_s"], figures["sync_save_s"], strict=True))
    pinned = ", training and the save's threads on separate cores" if figures.get("pinned") else ""
    print(f"\n{figures['ranks']} rank(s){pinned}, {figures['state_mb_per_rank']:.0f} MB per rank (rank 0 stages "
          f"{figures['staged_mb_rank0']:.0f} MB), median of {len(figures['async_stall_s'])} (slowest rank each time)\n")
    print("| measure | median (ms) |\n|---|---|")
    rows = [("save_async stall (warm buffers)", median["async_stall_s"]),
            ("save_async stall, first save (cold buffers)", figures["cold_stall_s"]),
            ("async write + checksums + commit (background)", median["async_background_s"]),
            ("synchronous dcp.save", median["sync_save_s"]),
            ("rollback from disk: load_latest", median["disk_load_s"]),
            ("rollback from memory: copy_ host -> live", median["memory_restore_s"])]
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.1f} |")
    slowdown = statistics.median(b / i for b, i in zip(figures["step_during_save_s"], figures["step_idle_s"],
                                                       strict=True)) - 1
    print(f"| training-like step with a save in flight (rank 0) | {median['step_during_save_s'] * 1e3:.1f} |")
    print(f"| the same step, no save running (rank 0) | {median['step_idle_s'] * 1e3:.1f} |")
    print(f"| snapshot of the state into reused host buffers (the memory tier) | "
          f"{median['snapshot_capture_s'] * 1e3:.1f} |")
    staged = figures["snapshot_save_staged_bytes_rank0"] / 2**20
    print(f"| save_async stall, written from that snapshot (rank 0 staged {staged:.1f} MB) | "
          f"{median['snapshot_save_stall_s'] * 1e3:.1f} |")
    snap_ratio = median["snapshot_save_stall_s"] / median["sync_save_s"]
    with_capture = (median["snapshot_save_stall_s"] + median["snapshot_capture_s"]) / median["sync_save_s"]
    print(f"\nasync stall / sync save: {ratio:.3f} (ratio of medians), {paired:.3f} (median of per-repeat ratios); "
          f"bar <= 0.05\nwritten from the memory tier's snapshot: {snap_ratio:.3f} (stall of the save), "
          f"{with_capture:.3f} (with the snapshot's copy counted too)\n"
          f"background slowdown of the steps that overlap a save: {slowdown * 100:+.1f}% (rank 0)\n")
    print(json.dumps({"bench": "checkpoint", **figures, "median": median, "stall_ratio": ratio,
                      "stall_ratio_paired": paired, "snapshot_stall_ratio": snap_ratio,
                      "snapshot_with_capture_ratio": with_capture, "background_slowdown": slowdown}))


def spawn_ranks(args: argparse.Namespace, root: str, ctx: Any, queue: Any) -> dict[str, Any]:
    """Run ``run`` on ``args.ranks`` spawned processes; rank 0's figures. Exits with an error if a rank fails."""
    port = free_port()
    procs = [ctx.Process(target=run, args=(r, args.ranks, port, args, root, queue)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    try:
        while queue.empty():
            if any(proc.exitcode not in (None, 0) for proc in procs):
                raise SystemExit(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}")
            time.sleep(0.2)
        return queue.get()
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


def main() -> None:
    args = parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="arc_bench_ckpt_")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    try:
        if args.ranks == 1:
            run(0, 1, 0, args, root, queue)
            report(queue.get(timeout=10))
        else:
            report(spawn_ranks(args, root, ctx, queue))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Where arc_engine's time goes inside a training step: CPU time of each of its entry points, per rank.

    .venv/bin/python scripts/profile_arc_step.py --backend ddp --arc detectors.sdc.enabled=true

Builds the model of ``scripts/bench_overhead.py`` (same arguments) with arc_engine attached, wraps arc_engine's
entry points (the DDP comm hook and its parts, the optimizer statistics, the decision and its gather, the loss
record, the end of step) in timers of the calling thread's CPU time (``time.thread_time``: time the thread was
preempted, e.g. by gloo's worker on a shared core, is not counted), runs ``--blocks`` steps and prints each rank's
mean per step. A diagnostic, not a measurement of the overhead (that is ``bench_overhead.py``): the parts nest (the
hook contains its parts), and what arc_engine costs outside its own functions (cache traffic it causes, a wait in
the gather that moves rather than adds time) is not here. The DDP hook's all-reduce call is listed apart, since
training without arc_engine pays for an all-reduce too; ``mean_allreduce`` minus it is the 1/N multiply that a Python
comm hook pays.
"""

from __future__ import annotations

import collections
import functools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_overhead  # the benchmark's model, arguments and step loop

import arc_engine.engine as engine_module
import arc_engine.integrations.pytorch.ddp as ddp_module
import arc_engine.integrations.pytorch.optim as optim_module
import arc_engine.stats.pipeline as pipeline_module
from arc_engine.config import load_config
from arc_engine.demo.corpus import CharDataset, generate_corpus

CPU_SECONDS: dict[str, float] = collections.defaultdict(float)


def timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with its calling thread's CPU time added to ``CPU_SECONDS[name]``."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            CPU_SECONDS[name] += time.thread_time() - start

    return wrapper


def instrument() -> None:
    ddp_module.stats_allreduce_hook = timed("ddp hook (all of it)", ddp_module.stats_allreduce_hook)
    ddp_module.accumulate_grad_stats = timed("ddp hook: gradient norms, local + reduced",
                                             ddp_module.accumulate_grad_stats)
    ddp_module.add_gradient_sketch = timed("ddp hook: sketch", ddp_module.add_gradient_sketch)
    ddp_module.mean_allreduce = timed("ddp hook: mean_allreduce (1/N multiply + all-reduce call)",
                                      ddp_module.mean_allreduce)
    ddp_module.dist.all_reduce = timed("ddp hook: all-reduce call (training's own)", ddp_module.dist.all_reduce)
    optim_module.optimizer_stats = timed("optimizer statistics", optim_module.optimizer_stats)
    engine_module.ArcEngine.decide = timed("decide (all of it)", engine_module.ArcEngine.decide)
    pipeline_module.StatsPipeline.agree = timed("decide: agree", pipeline_module.StatsPipeline.agree)
    engine_module.ArcEngine.record_loss = timed("record_loss", engine_module.ArcEngine.record_loss)
    engine_module.ArcEngine.finish_step = timed("finish_step", engine_module.ArcEngine.finish_step)


def main() -> None:
    args = bench_overhead.parse_args()
    if "RANK" not in os.environ:
        sys.exit(_launch_self(args.nproc))
    instrument()
    if args.pin:
        bench_overhead.pin_to_core(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    data = CharDataset(generate_corpus(), args.seq_len)
    run_dir = os.path.join(tempfile.gettempdir(), f"arc_profile_{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")
    config = load_config(None, ["run.run_id=profile", f"run.run_dir={run_dir}", "sinks.console.enabled=false",
                                *args.arc])
    step, arc = bench_overhead.build(args, data, config)
    bench_overhead.run_steps(step, data, rank, 0, args.warmup, args.micro_batch)
    CPU_SECONDS.clear()
    wall, _ = bench_overhead.run_steps(step, data, rank, args.warmup, args.blocks, args.micro_batch)
    time.sleep(0.5 * rank)  # ranks print one after the other
    print(f"rank {rank}: mean step {wall * 1e3:.1f} ms (wall), over {args.blocks} steps; CPU time per step:")
    for name, seconds in sorted(CPU_SECONDS.items()):
        print(f"  rank {rank}  {name:48s} {seconds / args.blocks * 1e3:7.3f} ms")
    sys.stdout.flush()
    arc.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as bench_overhead.py: skip interpreter teardown of the attached hooks


def _launch_self(nproc: int) -> int:
    """Re-run this script under torchrun with ``nproc`` ranks (as ``bench_overhead.py`` does)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={nproc}", __file__, *sys.argv[1:]], env=env)


if __name__ == "__main__":
    main()

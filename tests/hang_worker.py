"""One rank of the hang tests (tests/test_watchdog_abort_dist.py), started as a plain process: torch.distributed
from the environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE), DDP over the tiny GPT, arc_engine with the watchdog set
to abort, and at step 5 rank 1 either sleeping far past the timeout (``stall``: the ``stall`` fault) or killed by
SIGKILL between its forward and its backward (``kill``: a node lost mid-step)."""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data


def main(run_dir: str, mode: str) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    model, data = tiny_model_and_data()
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    stall = "faults.injections=[{kind: stall, rank: 1, step: 5, seconds: 600}]" if mode == "stall" else ""
    config = make_config(Path(run_dir), *filter(None, [stall]),
                         "watchdog.warmup_steps=1000", "watchdog.initial_timeout_s=3", "watchdog.action=abort",
                         "watchdog.abort_after=2")
    arc = arc_engine.attach(ddp, optimizer, config)
    for step in range(10):
        loss = ddp(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        if mode == "kill" and rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    arc.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "stall"))

"""One rank of the hang test (tests/test_watchdog_abort_dist.py), started as a plain process: torch.distributed
from the environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE), DDP over the tiny GPT, arc_engine with the watchdog set
to abort, and rank 1 sleeping at step 5 far past the timeout (the ``stall`` fault)."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data


def main(run_dir: str) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    model, data = tiny_model_and_data()
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    config = make_config(Path(run_dir), "faults.injections=[{kind: stall, rank: 1, step: 5, seconds: 600}]",
                         "watchdog.warmup_steps=1000", "watchdog.initial_timeout_s=3", "watchdog.action=abort",
                         "watchdog.abort_after=2")
    arc = arc_engine.attach(ddp, optimizer, config)
    for step in range(10):
        loss = ddp(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    arc.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

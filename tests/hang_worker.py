"""One rank of the hang tests (tests/test_watchdog_abort_dist.py), started as a plain process: torch.distributed
from the environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE), DDP over the tiny GPT, arc_engine with the watchdog set
to abort, and at step 5 rank 1 either sleeping far past the timeout (``stall``: the ``stall`` fault) or killed by
SIGKILL between its forward and its backward (``kill``: a node lost mid-step). ``ARC_TEST_KILL_RANK`` names the rank
killed (default 1); ``ARC_TEST_STAGGER_S``: each survivor of rank r waits r times that long before its step-5
backward, so that the survivors notice the loss, and look for it, at different times;
``ARC_TEST_WATCHDOG_TIMEOUT_S`` the watchdog's timeout (default 3 s). Every rank keeps its own event log
(``events.jsonl.rank<r>``) and writes the step it is at to ``<run_dir>/rank<r>.step`` before each backward."""

from __future__ import annotations

import os
import signal
import sys
import time
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
    killed = int(os.environ.get("ARC_TEST_KILL_RANK", "1"))
    stagger_s = float(os.environ.get("ARC_TEST_STAGGER_S", "0"))
    timeout_s = os.environ.get("ARC_TEST_WATCHDOG_TIMEOUT_S", "3")
    config = make_config(Path(run_dir), *filter(None, [stall]), "sinks.all_ranks=true",
                         "watchdog.warmup_steps=1000", f"watchdog.initial_timeout_s={timeout_s}",
                         "watchdog.action=abort", "watchdog.abort_after=2")
    arc = arc_engine.attach(ddp, optimizer, config)
    for step in range(10):
        loss = ddp(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        if mode == "kill" and step == 5:
            if rank == killed:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(rank * stagger_s)
        (Path(run_dir) / f"rank{rank}.step").write_text(str(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    arc.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "stall"))

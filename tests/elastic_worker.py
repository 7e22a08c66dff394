"""One worker of the elastic-restart test (tests/test_elastic_restart.py), run by torchrun: DDP over the tiny GPT
with recovery and disk checkpoints every 5 steps. With ``--die-at N`` the first attempt's rank 1 exits abruptly at
step N (after the checkpoint of step 10 is committed); torchrun restarts the group and arc_engine resumes from the
newest commit. Rank 0 writes the final parameters to ``<out>``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--die-at", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, data = tiny_model_and_data()
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    config = make_config(args.run_dir, "recovery.enabled=true", "recovery.checkpoint_freq=5",
                         "recovery.checkpoint.every_steps=5", f"recovery.checkpoint.dir={args.ckpt}",
                         "stats.optimizer_stats_every=0", "watchdog.action=alert")
    arc = arc_engine.attach(ddp, optimizer, config)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    with open(args.run_dir / f"attempts.rank{rank}", "a") as log:
        log.write(f"{os.environ.get('TORCHELASTIC_RESTART_COUNT')} {arc.progress.step}\n")
    while arc.progress.step < args.steps:
        if args.die_at is not None and first_attempt and arc.progress.step == args.die_at:
            arc.engine.recovery.checkpoints.wait()  # the checkpoint of step 10 is committed on rank 0 ...
            dist.barrier()                           # ... before rank 1 dies
            if rank == 1:
                os._exit(17)  # abrupt: no close, no flush
        loss = ddp(*data.batch(arc.progress.data_position, rank, BATCH)) * (1 + 1e-3 * torch.rand(()))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    arc.close()
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

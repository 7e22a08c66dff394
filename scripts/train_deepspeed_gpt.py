"""Reference DeepSpeed GPT pretraining script with arc_engine (ZeRO-1/2; runs on CPU in CI, unchanged on GPUs).

    deepspeed --num_gpus 2 scripts/train_deepspeed_gpt.py --deepspeed_config configs/ds_zero2.json \\
        --arc-config configs/demo.yaml
    # or: NUM_GPUS=2 launch/deepspeed.sh scripts/train_deepspeed_gpt.py --deepspeed_config ... --arc-config ...

The optimizer is torch AdamW (two groups: decay / no_decay) unless the DeepSpeed config defines one. The data is
the generated corpus of the demo; the batch of (step, rank) is a pure function of both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import arc_engine
from arc_engine.demo.corpus import CharDataset, generate_corpus
from arc_engine.demo.gpt import GPT, GPTConfig, param_groups


def build_parser() -> argparse.ArgumentParser:
    import deepspeed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    deepspeed.add_config_arguments(parser)
    arc_engine.add_arc_args(parser)
    return parser


def main() -> int:
    import deepspeed

    args = build_parser().parse_args()
    arc_config = arc_engine.config_from_args(args)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    data = CharDataset(generate_corpus(), args.seq_len)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, seq_len=args.seq_len, num_layers=args.layers,
                          d_model=args.d_model, num_heads=4))
    with open(args.deepspeed_config) as handle:
        ds_config = json.load(handle)
    optimizer = None if "optimizer" in ds_config else torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr)
    engine, *_ = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                      model_parameters=None if optimizer else param_groups(model, 0.1))
    arc = arc_engine.attach(engine, None, arc_config)
    micro_batch = engine.train_micro_batch_size_per_gpu()
    try:
        while arc.progress.step < args.steps:  # with recovery, a rollback moves the step and the data position back
            inputs, targets = (t.to(engine.device) for t in data.batch(arc.progress.data_position, rank, micro_batch))
            loss = arc.faults.on_loss(engine(inputs, targets))
            arc.record_loss(loss)
            engine.backward(loss)
            engine.step()
            if rank == 0 and arc.progress.step % args.log_every == 0 and arc.last_step_applied:
                print(f"[train] step {arc.progress.step:>4}/{args.steps}  loss {float(loss.detach()):.4f}", flush=True)
    except arc_engine.ArcAbort as abort:
        print(f"[train] rank {rank}: {abort}", file=sys.stderr, flush=True)
        return abort.exit_code
    summary = arc.summary()
    arc.close()
    if rank == 0:
        skipped = summary["skipped_by_policy"] + summary["skipped_by_framework"]
        print(f"[train] done: {summary['steps']} steps, {skipped} skipped ({summary['skipped_by_framework']} by "
              f"DeepSpeed), detections {summary['detections']}", flush=True)
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # see arc_engine.demo.train.exit_hard

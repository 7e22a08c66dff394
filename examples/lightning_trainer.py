"""A PyTorch Lightning Trainer training a small GPT with arc_engine: one callback added, nothing else changed.

    torchrun --nproc-per-node 2 examples/lightning_trainer.py --arc-config configs/demo.yaml
    torchrun --nproc-per-node 8 examples/lightning_trainer.py --strategy deepspeed_stage_2   # CUDA GPUs only

On CPU ranks (this repository's CI) it runs DDP over gloo (Lightning runs its DeepSpeed strategy on CUDA GPUs only).
The model is arc_engine's demo GPT and the text is generated (no download). ``--no-arc`` runs the same training
without arc_engine; ``--result PATH`` writes what each rank ended with, which the tests compare.
"""

from __future__ import annotations

import argparse
import math
import os

import lightning as L
import torch
from _outcome import add_example_args, run, save_outcome
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from arc_engine.config.cli_args import add_arc_args, config_from_args
from arc_engine.demo.corpus import CharDataset, generate_corpus
from arc_engine.demo.gpt import GPT, GPTConfig, param_groups
from arc_engine.integrations.lightning import ArcCallback

SEQ_LEN = 16


class CharWindows(Dataset):
    """Fixed windows of a generated character corpus: (inputs, next-character targets)."""

    def __init__(self, count: int) -> None:
        self.text = CharDataset(generate_corpus(600), SEQ_LEN)
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (index * 7919) % (self.text.tokens.numel() - SEQ_LEN - 1)
        window = self.text.tokens[start:start + SEQ_LEN + 1]
        return window[:-1], window[1:]


class TinyGPT(L.LightningModule):
    def __init__(self, vocab_size: int, steps: int, lr: float, interval: str = "step") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(vocab_size=vocab_size, seq_len=SEQ_LEN, num_layers=2, d_model=32, num_heads=2))
        self.steps, self.lr, self.interval = steps, lr, interval
        self.lrs: list[float] = []  # the learning rate of every step the optimizer ran

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = self.model(inputs, targets)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val_loss", self.model(inputs, targets), sync_dist=True)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.AdamW(param_groups(self.model, 0.1), lr=self.lr)
        cosine = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, self.steps) / self.steps)))
        if self.interval == "epoch":  # a step decay per epoch
            return {"optimizer": optimizer, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), "interval": "epoch"}}
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}


class Timeline(L.Callback):
    """For the tests (``--result``): the parameters at the end of each batch that moved the global step, by global
    step (a step reached again after a rollback replaces the earlier): what a checkpoint of that step must hold.
    And each step's batch on this rank (``batches``: arc_engine's data position, the global step and the first
    micro-batch's tokens as a fingerprint)."""

    def __init__(self, arc_callback: ArcCallback | None) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}
        self.last = -1
        self.arc_callback = arc_callback
        self.batches: list[tuple[int, int, list[int]]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object,
                             batch_idx: int) -> None:
        if self.arc_callback is not None and batch_idx % trainer.accumulate_grad_batches == 0:
            self.batches.append((self.arc_callback.arc.progress.data_position, trainer.global_step,
                                 batch[0][:, :8].flatten().tolist()))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        if trainer.global_step != self.last:
            self.at[trainer.global_step] = {name: p.detach().clone() for name, p in pl_module.named_parameters()}
        self.last = trainer.global_step


def main() -> None:
    parser = add_example_args(add_arc_args(argparse.ArgumentParser(description=__doc__, allow_abbrev=False)))
    parser.add_argument("--strategy", default="ddp", help="ddp, or deepspeed_stage_1/2/3 (CUDA GPUs only)")
    parser.add_argument("--precision", default="32-true", help="Lightning's precision, e.g. 16-mixed on GPUs")
    parser.add_argument("--csv-log", default=None, help="log every step with Lightning's CSVLogger into this folder")
    parser.add_argument("--val-every", type=int, default=0, help="validate (one batch) every N batches (0: never)")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="ModelCheckpoint every N steps into --checkpoint-dir, every one kept (0: none)")
    parser.add_argument("--checkpoint-dir", default="lightning_checkpoints")
    parser.add_argument("--min-steps", type=int, default=None, help="the Trainer's min_steps")
    parser.add_argument("--ckpt-path", default=None, help="resume from this Lightning checkpoint (fit's ckpt_path)")
    parser.add_argument("--epoch-batches", type=int, default=0, help="batches per epoch and rank (0: enough for all)")
    parser.add_argument("--data-steps", type=int, default=0,
                        help="without --epoch-batches, size the dataset for this many steps (0: --steps); keep it "
                             "across a resume")
    parser.add_argument("--scheduler-interval", default="step", choices=("step", "epoch"),
                        help="step: cosine over --steps; epoch: the LR halves at every epoch end")
    args = parser.parse_args()

    config = None if args.no_arc else config_from_args(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = CharWindows(count=args.epoch_batches * args.batch_size * world if args.epoch_batches
                       else (args.data_steps or args.steps) * args.batch_size * args.grad_accum * 8)
    module = TinyGPT(data.text.vocab_size, args.steps, args.lr, args.scheduler_interval)
    callbacks: list[L.Callback] = [] if config is None else [ArcCallback(config)]
    timeline = Timeline(callbacks[0] if callbacks else None) if args.result else None
    if timeline is not None:
        callbacks.append(timeline)
    if args.checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoint_dir, filename="{step}", save_top_k=-1,
                                         every_n_train_steps=args.checkpoint_every))
    validation = DataLoader(CharWindows(count=args.batch_size), batch_size=args.batch_size) if args.val_every else None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's: Lightning checks devices x nodes against it
    trainer = L.Trainer(accelerator="auto", devices=local, num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local,
                        strategy=args.strategy, precision=args.precision,
                        max_steps=args.steps, min_steps=args.min_steps, accumulate_grad_batches=args.grad_accum,
                        gradient_clip_val=1.0, callbacks=callbacks, enable_checkpointing=bool(args.checkpoint_every),
                        logger=CSVLogger(args.csv_log, name="", version="") if args.csv_log else False,
                        log_every_n_steps=1, val_check_interval=args.val_every or None,
                        check_val_every_n_epoch=None if args.val_every else 1, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=True,
                        deterministic=True)
    trainer.fit(module, DataLoader(data, batch_size=args.batch_size, shuffle=False), validation,
                ckpt_path=args.ckpt_path)
    callback = callbacks[0] if config is not None else None
    timeline_at = timeline.at if timeline is not None and args.checkpoint_every else None

    save_outcome(args.result, trainer.global_rank, module.model.parameters(), callback,
                 global_step=trainer.global_step, lrs=module.lrs, epochs=trainer.current_epoch, timeline=timeline_at,
                 batches=timeline.batches if timeline is not None else None,
                 scheduler_last_epoch=trainer.lr_scheduler_configs[0].scheduler.last_epoch)


if __name__ == "__main__":
    run(main)

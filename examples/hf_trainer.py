"""A Hugging Face Trainer pre-training a small GPT-2 with arc_engine: one callback added, nothing else changed.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --arc-config configs/demo.yaml
    torchrun --nproc-per-node 2 examples/hf_trainer.py --deepspeed examples/ds_zero2.json --arc.recovery.enabled=true

On CPU ranks (this repository's CI) it runs over gloo; on GPUs, over NCCL. The model is built from a config (no
download) and the text is generated (no dataset download). ``--no-arc`` runs the same training without arc_engine;
``--result PATH`` writes what each rank ended with (its parameters, the Trainer's step counter and log history),
which the tests compare.
"""

from __future__ import annotations

import argparse
import json

import torch
from _outcome import add_example_args, run, save_outcome
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from arc_engine.config.cli_args import add_arc_args, config_from_args
from arc_engine.demo.corpus import CharDataset, generate_corpus
from arc_engine.integrations.hf import ArcCallback


class CharWindows(Dataset):
    """Fixed windows of a generated character corpus, as causal-LM examples (labels = inputs)."""

    def __init__(self, seq_len: int, count: int, offset: int = 0) -> None:
        self.text = CharDataset(generate_corpus(600), seq_len)
        self.seq_len, self.count, self.offset = seq_len, count, offset

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = ((self.offset + index) * 7919) % (self.text.tokens.numel() - self.seq_len)
        window = self.text.tokens[start:start + self.seq_len]
        return {"input_ids": window, "labels": window}


class Timeline(TrainerCallback):
    """For the tests (``--result``): the parameters at the end of each step that advanced the global step, by global
    step (a step reached again after a rollback replaces the earlier): what a save at that global step must write.
    And each step's batch on this rank (``batches``: arc_engine's data position, the Trainer's global step and the
    first micro-batch's tokens as a fingerprint), seen at the step's first forward with gradients."""

    def __init__(self, arc_callback: ArcCallback | None) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}
        self.last = -1
        self.arc_callback = arc_callback
        self.batches: list[tuple[int, int, list[int]]] = []
        self.step_open = False

    def on_train_begin(self, args: object, state: object, control: object, model: object = None,
                       **kwargs: object) -> None:
        def first_forward(module: object, inputs: tuple, kwargs: dict) -> None:
            if self.step_open and torch.is_grad_enabled() and self.arc_callback is not None:
                self.step_open = False
                tokens = kwargs.get("input_ids", inputs[0] if inputs else None)
                self.batches.append((self.arc_callback.arc.progress.data_position, state.global_step,
                                     tokens[:, :8].flatten().tolist()))

        model.register_forward_pre_hook(first_forward, with_kwargs=True)

    def on_step_begin(self, args: object, state: object, control: object, **kwargs: object) -> None:
        self.step_open = True

    def on_step_end(self, args: object, state: object, control: object, model: object = None, **kwargs: object) -> None:
        if state.global_step > self.last:
            self.at[state.global_step] = {name: p.detach().float().clone() for name, p in model.named_parameters()}
        self.last = state.global_step


class Rank0Generation(TrainerCallback):
    """``--generate-steps N``: every N global steps, rank 0 alone samples a few tokens from the model (a generation
    callback as users write them: no gradients, on one rank, between steps); counts them for the tests."""

    def __init__(self, every: int) -> None:
        self.every, self.done = every, 0

    def on_step_end(self, args: object, state: object, control: object, model: object = None, **kwargs: object) -> None:
        if state.is_world_process_zero and state.global_step % self.every == 0:
            prompt = torch.zeros(1, 4, dtype=torch.long, device=next(model.parameters()).device)
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=4, do_sample=True, pad_token_id=0)
            self.done += 1


def scheduler_steps(scheduler: object) -> int:
    """How many times the LR scheduler stepped: torch's ``last_epoch``, or a DeepSpeed scheduler's (its config's
    ``"scheduler"``, inside Accelerate's wrapper) ``last_batch_iteration`` + 1."""
    inner = getattr(scheduler, "scheduler", scheduler)
    return inner.last_epoch if hasattr(inner, "last_epoch") else inner.last_batch_iteration + 1


def main() -> None:
    parser = add_example_args(add_arc_args(argparse.ArgumentParser(description=__doc__, allow_abbrev=False)))
    parser.add_argument("--deepspeed", default=None, help="a DeepSpeed JSON config (ZeRO-1/2/3)")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 through Accelerate (GPT2Block units; GPUs only)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--fp16", action="store_true", help="fp16 autocast with Accelerate's GradScaler")
    parser.add_argument("--output-dir", default="hf_trainer_out")
    parser.add_argument("--save-steps", type=int, default=0, help="save a Trainer checkpoint every N steps (0: none)")
    parser.add_argument("--logging-steps", type=int, default=1)
    parser.add_argument("--resume-from", default=None, help="the Trainer's resume_from_checkpoint")
    parser.add_argument("--data-steps", type=int, default=0,
                        help="size the dataset for this many steps (0: --steps); keep it across a resume")
    parser.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (0: never)")
    parser.add_argument("--generate-steps", type=int, default=0,
                        help="rank 0 alone generates from the model every N steps (0: never)")
    args = parser.parse_args()
    if args.fsdp and not torch.cuda.is_available():
        parser.error("--fsdp: Accelerate shards with FSDP on GPUs only (on CPU ranks it would train plain DDP)")

    config = None if args.no_arc else config_from_args(args)
    dataset = CharWindows(seq_len=32, count=(args.data_steps or args.steps) * args.batch_size * args.grad_accum * 4)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=dataset.text.vocab_size, n_positions=32, n_embd=32, n_layer=2,
                                       n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                       eos_token_id=0))
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=0, weight_decay=0.1, max_grad_norm=1.0, logging_steps=args.logging_steps,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, report_to=[],
        eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps or None,
        per_device_eval_batch_size=args.batch_size,
        seed=0, data_seed=0, dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(),
        ddp_backend=None if torch.cuda.is_available() else "gloo", deepspeed=args.deepspeed, bf16=args.bf16,
        fp16=args.fp16,
        ddp_find_unused_parameters=False, disable_tqdm=True,
        fsdp=bool(args.fsdp),
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]} if args.fsdp else None)
    callback = None if config is None else ArcCallback(config)
    timeline = Timeline(callback) if args.result else None
    generation = Rank0Generation(args.generate_steps) if args.generate_steps else None
    callbacks = [c for c in (callback, timeline, generation) if c is not None]
    evaluation = CharWindows(seq_len=32, count=4 * args.batch_size, offset=1_000) if args.eval_steps else None
    trainer = Trainer(model=model, args=training, train_dataset=dataset, eval_dataset=evaluation, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=args.resume_from)

    save_outcome(args.result, training.process_index, trainer.model.parameters(), callback,
                 global_step=trainer.state.global_step, log_history=json.loads(json.dumps(trainer.state.log_history)),
                 scheduler_last_epoch=scheduler_steps(trainer.lr_scheduler),
                 timeline=timeline.at if timeline is not None and args.save_steps else None,
                 batches=timeline.batches if timeline is not None else None,
                 generations=generation.done if generation is not None else 0)


if __name__ == "__main__":
    run(main)

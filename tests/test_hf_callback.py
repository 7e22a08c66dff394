"""The Hugging Face Trainer callback in one process (no torch.distributed): what it records of the Trainer's loss.

The multi-rank runs under torchrun are ``tests/test_hf_trainer_dist.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.training import make_config

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


class VariableLengths(torch.utils.data.Dataset):
    """Token sequences of 4 to 23 tokens: micro-batches padded to their longest, with different token counts."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        length = 4 + (index * 7) % 20
        ids = (torch.arange(length) * (index + 3)) % 50
        return {"input_ids": ids, "labels": ids}


def pad(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    longest = max(len(example["input_ids"]) for example in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    labels = torch.full((len(examples), longest), -100)
    mask = torch.zeros(len(examples), longest, dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = example["input_ids"], example["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _per_token_run(rank: int, world: int, tmp_path: Path) -> dict[str, Any]:
    """3 steps of 2 padded variable-length micro-batches under the Trainer (DDP over ``world`` ranks when > 1): what
    arc_engine recorded of each micro-batch's loss, and the model's mean over the micro-batch's tokens beside it."""
    import os

    if world > 1:  # the harness's process group: the Trainer (Accelerate) finds it through these
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from arc_engine.integrations.hf import ArcCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    # a GPT-2 built from a config names no loss type, and the Trainer then counts unshifted labels for
    # num_items_in_batch (the recorded loss follows the Trainer's count, whatever it is); name it, as hub models do
    model.loss_type = "ForCausalLM"
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), max_steps=3, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, use_cpu=True, report_to=[], save_strategy="no",
                             logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, seed=0,
                             ddp_backend="gloo" if world > 1 else None)
    recorded: list[float] = []

    class Capture(TrainerCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            arc = callback.arc
            record = arc.record_loss
            arc.record_loss = lambda loss: (recorded.append(float(loss)), record(loss))[1]

    callback = ArcCallback(make_config(tmp_path / "arc", "stats.interval=1"))
    trainer = Trainer(model=model, args=args, train_dataset=VariableLengths(), data_collator=pad,
                      callbacks=[callback, Capture()])
    expected: list[float] = []
    tokens: list[int] = []
    compute_loss = trainer.compute_loss

    def beside(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            expected.append(float(model(**inputs).loss))  # the mean over this micro-batch's tokens
        tokens.append(int(inputs["labels"][..., 1:].ne(-100).sum()))
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = beside
    trainer.train()
    return {"recorded": recorded, "expected": expected, "tokens": tokens,
            "normalised": trainer.model_accepts_loss_kwargs and trainer._loss_shifts_labels,
            "world": trainer.accelerator.num_processes}


def test_the_recorded_loss_is_each_micro_batchs_per_token_loss_under_num_items_in_batch(tmp_path: Path) -> None:
    """Padded variable-length batches, 2 accumulation steps: the Trainer normalises each micro-batch's loss by the
    tokens of the whole step (``num_items_in_batch``), so ``loss x accumulation steps`` would follow a micro-batch's
    share of the tokens; what arc_engine records is the micro-batch's own per-token loss, equal to the model's mean
    over its tokens (computed beside it, without gradients)."""
    run = _per_token_run(0, 1, tmp_path)
    assert run["normalised"]  # normalised by num_items_in_batch
    assert len(run["recorded"]) == len(run["expected"]) == 6
    assert run["recorded"] == pytest.approx(run["expected"], rel=1e-5), run


def test_the_recorded_loss_is_per_token_on_every_rank_when_the_ranks_hold_different_token_counts(
        tmp_path: Path) -> None:
    """The same on 2 DDP ranks: the Trainer also averages the tokens across devices (``num_items_in_batch`` counts
    both ranks' tokens, the loss is multiplied by the world size), and the two ranks' micro-batches hold different
    token counts; each rank records its own micro-batches' per-token loss."""
    from tests.dist_harness import run_ranks

    runs = run_ranks(_per_token_run, 2, tmp_path)
    assert all(run["normalised"] and run["world"] == 2 for run in runs)
    assert runs[0]["tokens"] != runs[1]["tokens"], runs  # the ranks' token shares differ
    for run in runs:
        assert len(run["recorded"]) == len(run["expected"]) == 6
        assert run["recorded"] == pytest.approx(run["expected"], rel=1e-5), run


def test_an_evaluation_a_callback_starts_and_the_best_models_load_are_not_counted_as_a_hang(tmp_path: Path) -> None:
    """Before: only the Trainer's own ``_evaluate`` and ``_save_checkpoint`` paused the hang watchdog; an
    ``evaluate()`` a user's callback starts (or ``predict``, ``save_model``, the best model's load) counted toward
    a hang, and a long one ended the job. Every batch the evaluation reads is read with the watchdog paused."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from arc_engine.integrations.hf import ArcCallback
    from arc_engine.integrations.hf.internals import WATCHDOG_PAUSED_METHODS

    paused_at_read: list[bool] = []

    class Watched(VariableLengths):
        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            paused_at_read.append(callback.arc.engine.watchdog.is_paused)
            return super().__getitem__(index)

    class EvaluateAtStep2(TrainerCallback):  # a user's callback evaluating on its own schedule
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:
                trainer.evaluate(eval_dataset=Watched())

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), max_steps=3, per_device_train_batch_size=2,
                             use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0, seed=0)
    callback = ArcCallback(make_config(tmp_path / "arc", "stats.interval=1"))
    trainer = Trainer(model=model, args=args, train_dataset=VariableLengths(), data_collator=pad,
                      callbacks=[callback, EvaluateAtStep2()])
    trainer.train()
    assert len(paused_at_read) == len(Watched()) and all(paused_at_read)
    assert {"evaluate", "predict", "save_model", "_load_best_model"} <= set(WATCHDOG_PAUSED_METHODS)

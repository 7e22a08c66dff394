"""GPT pretraining steps in ``pretrain_gpt.py``'s style, for the ``megatron.training`` package megatron-core ships.

From megatron-core 0.19 the wheel holds Megatron-LM's training loop (``megatron.training``: ``pretrain()``, its
arguments, initialization and checkpointing) but not ``pretrain_gpt.py``, which supplies what ``pretrain()`` calls
back: the forward step with its loss function and the dataset provider. These are that, for a plain GPT, with the
same batch keys, loss and ``lm loss`` report as ``pretrain_gpt.py`` at tag ``core_v0.19.0``. The model itself comes
from Megatron-LM's own builder (``gpt_config_from_args``), as in ``pretrain_gpt.py``.

Every rank builds the datasets and reads its own batches (``train_valid_test_datasets_provider.is_distributed``):
tensor-parallel peers share a data-parallel rank, so they read the same samples, and pipeline stages read the same
micro-batch for each forward call. Not covered (use a Megatron-LM checkout's ``pretrain_gpt.py``): context
parallelism, packed sequences / SFT, FIM data, multi-token prediction, cached-logits distillation, ModelOpt, and
Megatron-LM's spiky-loss check (its NaN check is kept).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator: Any) -> dict[str, torch.Tensor | None]:
    """The next micro-batch, on the device (``None`` for a key the dataset does not produce)."""
    batch = next(data_iterator)
    return {key: batch[key].cuda(non_blocking=True) if batch.get(key) is not None else None for key in BATCH_KEYS}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``pretrain_gpt.loss_func``: the summed per-token loss over the unmasked tokens, their count, and the
    ``lm loss`` report Megatron-LM averages over the data-parallel ranks."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        get_rerun_state_machine().validate_result(result=loss, rejection_func=torch.isnan, tolerance=0.0,
                                                  message="found NaN in local forward loss calculation", fatal=True)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator: Any, model: torch.nn.Module, return_schedule_plan: bool = False) -> tuple:
    """``pretrain_gpt.forward_step`` for a plain GPT: the per-token losses of one micro-batch and the function that
    reduces them."""
    from megatron.training import get_args, get_timers

    if return_schedule_plan:
        raise ValueError("gpt_steps: the combined 1F1B schedule plan is not supported; use a Megatron-LM checkout")
    if get_args().context_parallel_size > 1:
        raise ValueError("gpt_steps: context parallelism is not supported; use a Megatron-LM checkout")
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = get_batch(data_iterator)
    timers("batch-generator").stop()
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"])


def train_valid_test_datasets_provider(train_val_test_num_samples: list[int], vp_stage: int | None = None) -> tuple:
    """The GPT datasets (``--mock-data``, or ``--data-path`` / ``--*-data-path`` blends of indexed datasets), built
    by megatron-core's ``BlendedMegatronDatasetBuilder`` on every rank."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        mmap_bin_files=args.mmap_bin_files)
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(MockGPTDataset if args.mock_data else GPTDataset,
                                            train_val_test_num_samples, lambda: True, config).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True  # type: ignore[attr-defined]

"""Reference GPT pretraining script on megatron-core alone (TP, PP, EP/MoE, DistributedOptimizer, bf16, fp16).

    torchrun --nproc-per-node 4 scripts/train_megatron_gpt.py --cpu \\
        --tensor-model-parallel-size 2 --use-distributed-optimizer --train-iters 5
    # GPUs: the same command without --cpu (NCCL, one GPU per rank).

It follows Megatron-LM's ``pretrain_gpt.py`` without ``megatron.training``: parallel_state and seeds, GPTModel
with the local (no Transformer Engine) layer spec, Float16Module for bf16 and fp16, megatron DDP,
``get_megatron_optimizer`` and ``get_forward_backward_func`` (the no-pipelining schedule at PP=1, 1F1B at PP>1).
The learning rate is constant. ``--cpu`` installs ``arc_engine.testing.megatron_cpu`` (the CUDA-to-CPU shims) and
uses gloo.

The data is the demo's generated corpus: the micro-batch of (iteration, data-parallel rank, micro-batch index) is a
pure function of the three, so any iteration can be skipped or replayed exactly. Tests import the pieces
(``build_parser``, ``initialize``, ``build_model_and_optimizer``, ``train_step``) and drive them in-process.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

import arc_engine
from arc_engine.demo.corpus import CharDataset, generate_corpus
from arc_engine.monitors.family import section_of
from arc_engine.monitors.sdc import SDCFamily


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM-style flags, plus ``--arc-config`` / ``--arc.KEY=VALUE`` (parsed, not used yet)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    group = parser.add_argument_group("parallelism")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--expert-model-parallel-size", type=int, default=1)
    group.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="default: TP size")
    group.add_argument("--sequence-parallel", action="store_true", help="required by TP > 1 with MoE")
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--overlap-grad-reduce", action="store_true")
    group.add_argument("--overlap-param-gather", action="store_true",
                       help="the DistributedOptimizer's parameter all-gather overlapped with the next forward "
                            "(needs --use-distributed-optimizer and --overlap-grad-reduce)")
    group.add_argument("--check-for-nan-in-grad", action="store_true",
                       help="megatron DDP raises on a NaN gradient (Megatron-LM's default; off here)")
    group = parser.add_argument_group("model")
    group.add_argument("--num-layers", type=int, default=2)
    group.add_argument("--hidden-size", type=int, default=64)
    group.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 * hidden size")
    group.add_argument("--num-attention-heads", type=int, default=4)
    group.add_argument("--num-query-groups", type=int, default=None, help="GQA groups (default: one per head)")
    group.add_argument("--seq-length", type=int, default=32)
    group.add_argument("--disable-bias-linear", action="store_true", help="needed by MoE with expert TP > 1")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    group.add_argument("--num-experts", type=int, default=None, help="MoE experts per layer (0 or unset: dense)")
    group.add_argument("--moe-router-topk", type=int, default=2)
    group.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="allgather")
    group.add_argument("--moe-aux-loss-coeff", type=float, default=1e-2)
    group.add_argument("--hidden-dropout", type=float, default=0.0, help="Megatron-LM's default is 0.1")
    group.add_argument("--attention-dropout", type=float, default=0.0, help="Megatron-LM's default is 0.1")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--fp16", action="store_true", help="fp16 with Megatron's dynamic loss scaling")
    group.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="fp16 (Megatron-LM's default)")
    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch-size", type=int, default=2)
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="default: micro batch size * data-parallel size (one micro-batch per step)")
    group.add_argument("--lr", type=float, default=1e-3, help="constant; 3e-3 gives grad-norm spikes here")
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--train-iters", type=int, default=20)
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--log-interval", type=int, default=1)
    group.add_argument("--cpu", action="store_true", help="CPU ranks over gloo (installs the megatron CPU shims)")
    group.add_argument("--no-arc", action="store_true", help="train without arc_engine (the reference run)")
    arc_engine.add_arc_args(parser)
    return parser


@dataclass
class TrainState:
    """What :func:`build_model_and_optimizer` builds and :func:`train_step` uses."""

    model: list[DistributedDataParallel]  # one chunk per virtual pipeline stage (one here)
    optimizer: MegatronOptimizer  # a ChainedOptimizer: one dense member, plus one expert member with MoE
    config: TransformerConfig  # shared by the model, the schedule and finalize_model_grads
    data: CharDataset
    device: torch.device
    num_microbatches: int
    data_parallel_rank: int
    arc: arc_engine.Arc | None = None  # None with --no-arc


def initialize(args: argparse.Namespace) -> None:
    """Process group (reused when already initialized), parallel_state and seeds. Collective: every rank."""
    if args.cpu:
        from arc_engine.testing import megatron_cpu

        megatron_cpu.install()
    if not torch.distributed.is_initialized():
        if not args.cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend="gloo" if args.cpu else "nccl")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    # As Megatron-LM: one seed per pipeline stage; the tracker derives the TP and expert streams from it.
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return math.ceil(vocab_size / multiple) * multiple


def _transformer_config(args: argparse.Namespace) -> TransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    moe = {}
    if args.num_experts:
        moe = {"num_moe_experts": args.num_experts, "moe_router_topk": args.moe_router_topk,
               "moe_token_dispatcher_type": args.moe_token_dispatcher_type,
               "moe_aux_loss_coeff": args.moe_aux_loss_coeff, "moe_router_load_balancing_type": "aux_loss"}
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size, add_bias_linear=not args.disable_bias_linear,
        sequence_parallel=args.sequence_parallel, use_cpu_initialization=args.cpu,
        bf16=args.bf16, fp16=args.fp16, params_dtype=dtype, pipeline_dtype=dtype,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout, **moe,
    )


def build_model_and_optimizer(args: argparse.Namespace) -> TrainState:
    """GPTModel (Float16Module under bf16) in megatron DDP, and the megatron optimizer. Call after
    :func:`initialize`; collective (DDP and the optimizer build process-group state)."""
    data = CharDataset(generate_corpus(), args.seq_length, seed=args.seed)
    config = _transformer_config(args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.num_experts or None),
        vocab_size=_padded_vocab_size(data.vocab_size, args),
        max_sequence_length=args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope",
    )
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    model = model.to(device)
    if args.bf16 or args.fp16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16 or args.fp16,  # Megatron-LM accumulates and reduces them in fp32
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=args.check_for_nan_in_grad,
    )
    model_chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                        bf16=args.bf16, fp16=args.fp16, params_dtype=config.params_dtype,
                        initial_loss_scale=args.initial_loss_scale,
                        use_distributed_optimizer=args.use_distributed_optimizer),
        model_chunks,
    )
    # As Megatron-LM's train(): the schedule reads these hooks from the shared config.
    config.grad_scale_func = optimizer.scale_loss
    if args.overlap_grad_reduce:
        config.no_sync_func = model_chunks[0].no_sync
        config.grad_sync_func = model_chunks[0].start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    data_parallel_size = parallel_state.get_data_parallel_world_size()
    global_batch_size = args.global_batch_size or args.micro_batch_size * data_parallel_size
    num_microbatches, remainder = divmod(global_batch_size, args.micro_batch_size * data_parallel_size)
    if remainder or num_microbatches < 1:
        raise ValueError(f"--global-batch-size {global_batch_size} must be a positive multiple of "
                         f"--micro-batch-size {args.micro_batch_size} x data-parallel size {data_parallel_size}")
    state = TrainState(model=model_chunks, optimizer=optimizer, config=config, data=data, device=device,
                       num_microbatches=num_microbatches,
                       data_parallel_rank=parallel_state.get_data_parallel_rank(), arc=None)
    if not args.no_arc:
        # arc_engine: after the chunks, the optimizer and parallel_state's groups exist (collective)
        arc_config = arc_engine.config_from_args(args)
        sdc = section_of(arc_config, SDCFamily())
        recompute = partial(_recompute, state, args) if sdc.enabled and sdc.recompute.enabled else None
        state.arc = arc_engine.attach(model_chunks, optimizer, arc_config, recompute_fn=recompute)
    return state


def _micro_batches(state: TrainState, args: argparse.Namespace, step_index: int,
                   data_rank: int | None = None) -> Iterator:
    """The micro-batches of iteration ``step_index`` for data-parallel rank ``data_rank`` (default: this rank's):
    every pipeline stage draws the same ones."""
    data_rank = state.data_parallel_rank if data_rank is None else data_rank
    for micro_index in range(state.num_microbatches):
        position = step_index * state.num_microbatches + micro_index
        inputs, targets = state.data.batch(position, data_rank, args.micro_batch_size)
        yield inputs.to(state.device), targets.to(state.device)


def _loss_func(arc: arc_engine.Arc | None, output_tensor: torch.Tensor):  # -> (loss sum, tokens, logged values)
    """Megatron-LM's three-output form: the schedule divides the sum by the token count and micro-batches.
    With arc_engine: injected loss faults apply here, and the micro-batch's mean token loss is recorded."""
    per_token_loss = output_tensor.float()
    loss_sum = per_token_loss.sum()
    num_tokens = torch.tensor(per_token_loss.numel(), dtype=torch.int, device=per_token_loss.device)
    if arc is not None:
        loss_sum = arc.faults.on_loss(loss_sum)
        arc.record_loss(loss_sum / num_tokens)
    report = torch.stack([loss_sum.detach().clone(), num_tokens.float()])  # clone: the schedule divides in place
    return loss_sum, num_tokens, {"lm loss": report}


def _forward_step(arc: arc_engine.Arc | None, data_iterator: Iterator, model: torch.nn.Module):
    inputs, targets = next(data_iterator)
    position_ids = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0).expand_as(inputs)
    output = model(inputs, position_ids, None, labels=targets)  # per-token loss [b, s] on the last stage
    return output, partial(_loss_func, arc)


def _forward_backward(state: TrainState, args: argparse.Namespace, model: list, step_index: int,
                      data_rank: int | None = None) -> list:
    """Megatron's schedule over the micro-batches of (``step_index``, ``data_rank``); returns its loss reports."""
    return get_forward_backward_func()(
        forward_step_func=partial(_forward_step, state.arc),
        data_iterator=_micro_batches(state, args, step_index, data_rank),
        model=model,
        num_microbatches=state.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.seq_length,
        forward_only=False,
    )


def _recompute(state: TrainState, args: argparse.Namespace, model: list, data_rank: int) -> None:
    """arc_engine's ``recompute_fn`` (``detectors.sdc.recompute``): the current step's forward and backward again,
    on data-parallel rank ``data_rank``'s micro-batches."""
    _forward_backward(state, args, model, state.arc.progress.data_position, data_rank)


def train_step(state: TrainState, args: argparse.Namespace,
               step_index: int) -> tuple[float | None, bool, float | None]:
    """One optimizer step over ``state.num_microbatches`` micro-batches. Collective: every rank.

    Returns (loss, update_successful, grad_norm): the token-mean loss over the micro-batches averaged over the
    data-parallel group, as a float on the last pipeline stage and None elsewhere; ``update_successful`` and
    ``grad_norm`` as megatron's ``optimizer.step()`` gives them (grad_norm is None on a skipped step; only fp16's
    loss scaler ever skips: bf16 and fp32 do not check for inf/NaN).
    """
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    reports = _forward_backward(state, args, state.model, step_index)
    update_successful, grad_norm, _num_zeros = state.optimizer.step()
    loss = None
    if parallel_state.is_pipeline_last_stage():
        totals = torch.stack([report["lm loss"] for report in reports]).sum(dim=0)
        torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        loss = float(totals[0] / totals[1])
    return loss, bool(update_successful), None if grad_norm is None else float(grad_norm)


def _is_logging_rank() -> bool:
    """The first rank of the last pipeline stage: the one that prints."""
    return (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0)


def main() -> int:
    args = build_parser().parse_args()
    initialize(args)
    state = build_model_and_optimizer(args)
    logging_rank = _is_logging_rank()
    if logging_rank:
        members = [type(member).__name__ for member in state.optimizer.chained_optimizers]
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        print(f"[train] world {torch.distributed.get_world_size()} = TP {args.tensor_model_parallel_size} x "
              f"PP {args.pipeline_model_parallel_size} x DP {parallel_state.get_data_parallel_world_size()} "
              f"(EP {args.expert_model_parallel_size}) | {state.num_microbatches} micro-batch(es) of "
              f"{args.micro_batch_size} | {precision} | optimizer {members}", flush=True)
    arc = state.arc
    step_index = 0
    try:
        # with arc_engine, a rollback moves arc.progress's step and data position back: draw batches from the latter
        while (arc.progress.step if arc is not None else step_index) < args.train_iters:
            started = time.perf_counter()
            position = arc.progress.data_position if arc is not None else step_index
            loss, update_successful, grad_norm = train_step(state, args, position)
            step_index += 1
            done = arc.progress.step if arc is not None else step_index
            if logging_rank and done % args.log_interval == 0:
                grad_norm_text = "-" if grad_norm is None else f"{grad_norm:.3f}"
                print(f"[train] iteration {done:>4}/{args.train_iters} | lm loss {loss:.4f} | "
                      f"grad norm {grad_norm_text} | update {'ok' if update_successful else 'skipped'} | "
                      f"{(time.perf_counter() - started) * 1000:.0f} ms", flush=True)
    except arc_engine.ArcAbort as abort:
        print(f"[train] rank {torch.distributed.get_rank()}: {abort}", file=sys.stderr, flush=True)
        return abort.exit_code
    if arc is not None:
        summary = arc.summary()
        arc.close()
        if logging_rank:
            skipped = summary["skipped_by_policy"] + summary["skipped_by_framework"]
            print(f"[train] done: {summary['steps']} steps, {skipped} skipped, detections "
                  f"{summary['detections']}", flush=True)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

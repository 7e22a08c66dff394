"""megatron-core: :class:`MegatronAdapter` and :func:`attach_megatron`.

Attaches to megatron ``DistributedDataParallel`` model chunks (dense and MoE, any TP/PP/EP/CP layout) and the
optimizer ``get_megatron_optimizer`` returns (a ``ChainedOptimizer`` of ``DistributedOptimizer``,
``Float16OptimizerWithFloat16Params`` or ``FP32Optimizer`` members, dense and expert). Per monitored step:

* **local, before the data-parallel reduction** (each bucket group, as Megatron starts reducing it): per parameter
  group, this rank's squared gradient norm (``grad_sq_local``, per-rank detail) and its count of tensors holding
  NaN/Inf (``grad_nonfinite_local``), plus the gradient sketch when ``detectors.sdc`` is on. No collective.
* **reduced, on this rank's shard** (in ``prepare_grads``, after Megatron copied and unscaled the gradients): per
  group, the squared norm of the reduced gradient (``grad_sq``), the weight norm and the prospective Adam update
  on the parameters the inner optimizer steps. Each element of the model counts once in the job-wide sum,
  by Megatron's own rule for its gradient norm: the DistributedOptimizer's shards are disjoint, tensor-parallel
  duplicates (layer norms) and shared copies (tied embeddings) are left out, and a non-distributed optimizer's
  replicated parameters are split among the ranks of their data-parallel group (:mod:`arc_engine.stats.partition`).
  The agreed ``grad_sq`` is Megatron's pre-clip ``grad_norm`` squared.
* **the decision**: one all-reduce over the decision group (default: the whole job, every TP/PP/EP/DP rank), then
  the veto through Megatron's own skip path: ``prepare_grads`` returns found_inf=True on every rank, so the step
  is skipped with Adam's step counts unchanged and no parameter all-gather, and ``optimizer.step()`` returns
  ``update_successful=False`` (Megatron-LM counts a skipped iteration and does not step the LR scheduler).

With ``detectors.sdc.recompute`` (and a ``recompute_fn``), each bucket's local gradient is also judged by the SDC gate
as its group starts reducing (a withheld bucket contributes zeros), and the suspect replica's model-parallel group
recomputes the step (:mod:`arc_engine.integrations.megatron.recompute`).

Under bf16 and fp32 stock megatron-core has no non-finite check (found_inf needs a grad scaler): with arc_engine a
NaN loss or gradient on any rank is skipped by all ranks. The prospective Adam update is computed on the unclipped
gradient (the decision comes before Megatron clips). Everything read of Megatron's internals, and the methods
wrapped on instances (``start_grad_sync``, ``prepare_grads``, ``step``, and the routers' ``routing`` with
``detectors.router``), live in :mod:`arc_engine.integrations.megatron.internals`, which checks at attach what the
installed megatron-core holds (tested: 0.16.1 .. 0.19.x): a release outside that range gets a warning, and a feature
whose internals are missing is turned off alone (its detectors off in the engine's copy of the config) and named in
one ``compatibility`` lifecycle event.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from arc_engine import runtime
from arc_engine.adapter import Adapter
from arc_engine.config import ArcConfig
from arc_engine.engine import ArcEngine
from arc_engine.events import Action, Finding, Severity
from arc_engine.faults.bitflip import register_gemm_type
from arc_engine.integrations.megatron import internals as mi
from arc_engine.integrations.megatron.state import MegatronTrainState
from arc_engine.monitors.family import AttentionShard, ModelParts, RouterShard, section_of
from arc_engine.monitors.fisher import FisherFamily
from arc_engine.monitors.sdc import SDCFamily
from arc_engine.monitors.sdc_local import BUCKET_SKETCH_INDEX, LocalGate, add_gradient_sketch, zero_where
from arc_engine.monitors.weight_health import WeightHealthFamily
from arc_engine.recovery.heal import heal_step, restore_learning_rates
from arc_engine.recovery.recompute import RecomputeFn, SDCRecompute
from arc_engine.recovery.state import TrainState
from arc_engine.stats import Reduce, names
from arc_engine.stats.grad_stats import accumulate_grad_stats, host_to_device
from arc_engine.stats.optim_stats import adam_views
from arc_engine.stats.partition import owned_ids
from arc_engine.stats.producers import record_optimizer_stats
from arc_engine.stats.sampling import WindowCache
from arc_engine.stats.timing import local_compute_modules
from arc_engine.wiring import Arc, wire


class _Group:
    """One parameter group of one member's inner optimizer: its job-wide index and the parameters (inner, i.e.
    what the torch optimizer steps) whose reduced statistics this rank takes."""

    def __init__(self, index: int, member: Any, group: dict, counted: set[int]) -> None:
        self.index, self.member, self.group, self.counted = index, member, group, counted
        self._index: torch.Tensor | None = None

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.group["params"] if p.grad is not None and id(p) in self.counted]

    def index_tensor(self, count: int, device: torch.device) -> torch.Tensor:
        """``count`` copies of this group's index on ``device`` (kept between steps while the count holds)."""
        if self._index is None or self._index.numel() != count:
            self._index = torch.full((count,), self.index, dtype=torch.long, device=device)
        return self._index


def _group_names(labels: list[str]) -> list[str]:
    """Unique names from labels, numbering repeats (``dense.decay``, ``dense.decay.1``)."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        count = seen.get(label, 0)
        seen[label] = count + 1
        out.append(label if count == 0 else f"{label}.{count}")
    return out


class MegatronAdapter(Adapter):
    """:class:`arc_engine.adapter.Adapter` for megatron-core DDP chunks and a Megatron optimizer (see module
    docstring). Every method runs on every rank."""

    name = "Megatron"
    shard_reduce = Reduce.SUM
    supports_recompute = True

    def __init__(self, chunks: list[Any], optimizer: Any, lr_scheduler: Any | None = None,
                 checkpoint_args: Callable[[], Any] | None = None) -> None:
        self.engine: ArcEngine | None = None  # at install
        chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        if not chunks or not all(mi.is_megatron_ddp(c) for c in chunks):
            raise ValueError("arc_engine.attach_megatron: pass the megatron DistributedDataParallel model chunks "
                             "(what Megatron's get_model / setup_model_and_optimizer return), got "
                             f"{[type(c).__name__ for c in chunks]}")
        if not mi.is_megatron_optimizer(optimizer):
            raise ValueError("arc_engine.attach_megatron: the optimizer must be a Megatron optimizer "
                             f"(get_megatron_optimizer), got {type(optimizer).__name__}")
        # what this release holds of what the integration reads: warns outside the tested range, raises only when
        # no decision could be taken; the features it turns off are reported at install
        self.capabilities = mi.check_capabilities(chunks, optimizer)
        self.chunks, self.optimizer, self.lr_scheduler = chunks, optimizer, lr_scheduler
        self.checkpoint_args = checkpoint_args
        self.module = mi.unwrap_chunk(chunks[0])
        if self.capabilities.has("gemm_faults"):  # the bitflip fault reaches Megatron's GEMMs too
            for gemm in mi.parallel_linear_types():
                register_gemm_type(gemm)
        self.members = mi.members(optimizer)
        self._param_states = mi.ParamStates(optimizer)  # for the engine's update hooks (heal_step)
        self.params = [p for chunk in chunks for p in mi.unwrap_chunk(chunk).parameters() if p.requires_grad]
        self.groups: list[_Group] = []
        labels: list[str] = []
        self._model_group: dict[int, int] = {}  # id(model param) -> job-wide group index
        #: id(model param) -> the inner (master) parameter this rank counts for it: its DistributedOptimizer shard,
        #: or the whole master on the owner replica; absent where another rank counts it (weight health's parts)
        self._inner_of: dict[int, torch.Tensor] = {}
        self._counted_somewhere: set[int] = set()  # id(model param) whose master counts on its replicas' owners
        for member in self.members:
            inner = mi.inner_optimizer(member)
            if inner is None:
                continue
            model_groups = mi.model_params_per_group(member)
            replicas = mi.replica_group(member)
            for group, model_params in zip(inner.param_groups, model_groups, strict=True):
                counted = [p for p in group["params"] if mi.counts_once(member, p)]
                ids = {id(p) for p in counted}
                if replicas is not None:  # identical copies on every replica: each one owned by one of them
                    ids = owned_ids(counted, dist.get_rank(replicas), dist.get_world_size(replicas))
                index = len(self.groups)
                self.groups.append(_Group(index, member, group, ids))
                labels.append(mi.group_label(group))
                for param in model_params:
                    self._model_group[id(param)] = index
                for param, inner_param in zip(model_params, group["params"], strict=True):
                    if id(inner_param) in ids:
                        self._inner_of[id(param)] = inner_param
                    if mi.counts_once(member, inner_param):
                        self._counted_somewhere.add(id(param))
        self.group_names = _group_names(labels)
        from megatron.core import parallel_state

        self.data_parallel_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        # the recomputation's units and corrections span Megatron's own groups: the decision group is the job
        self.recompute_group = dist.group.WORLD if dist.is_initialized() else None
        self._gate: LocalGate | None = None
        self._recompute_target: Any = None
        self._routing_removers: list[Callable[[], None]] = []
        self._peers: dist.ProcessGroup | None = None
        self.parts = self._model_parts()
        self._windows: dict[int, WindowCache] = {}
        self._views_memo: dict[int, dict] = {}
        self._bucket_index: dict[int, torch.Tensor] = {}
        self._sketch_cache: dict = {}
        self._saved_lrs: list[Any] | None = None
        self._found_inf = False
        #: fp16: Megatron's grad scaler and whether it is dynamic; the loss scale of the step's backward
        self._scaler = mi.loss_scaler(optimizer)
        self._scale_step, self._step_scale = -1, None
        self._overflow: Finding | None = None  # an unmonitored step Megatron skipped itself, to close as such
        self._vetoed = False

    def _model_parts(self) -> ModelParts:
        """Where this rank's attention heads and routers are (:class:`ModelParts`, for ``detectors.qk_spectra`` and
        ``detectors.router``). A layer's attention statistics are taken on one data-parallel copy: the layers are
        dealt round-robin over the data-parallel ranks."""
        from megatron.core import parallel_state

        attention_on = self.capabilities.has("attention_spectra")
        routers_on = self.capabilities.has("router_observation")
        layers = mi.transformer_layers(self.chunks) if attention_on or routers_on else []
        # ranks whose local gradients are different shards of one replica's: tensor, pipeline, context and expert
        # parallel peers (the expert ranks hold different experts)
        sharded = (parallel_state.get_tensor_model_parallel_world_size()
                   * parallel_state.get_pipeline_model_parallel_world_size()
                   * parallel_state.get_context_parallel_world_size()
                   * parallel_state.get_expert_model_parallel_world_size())
        positions = self._shard_positions()
        # who this rank is, for naming a slow one: its replica (data-parallel index; not known under expert
        # parallelism, where the all-to-alls tie ranks of several replicas together), its TP rank and its stage
        where = {"replica": -1 if parallel_state.get_expert_model_parallel_world_size() > 1
                 else parallel_state.get_data_parallel_rank(),
                 "tensor_rank": parallel_state.get_tensor_model_parallel_rank(),
                 "pipeline_stage": parallel_state.get_pipeline_model_parallel_rank(),
                 "pipeline_stages": parallel_state.get_pipeline_model_parallel_world_size()}
        if not layers:
            return ModelParts(model_parallel_size=sharded, shard_positions=positions[0], shard_position=positions[1],
                              **where)
        config = layers[0].config
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        attention: list[AttentionShard] = []
        routers: list[RouterShard] = []
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        for layer in layers:
            index = mi.layer_index(layer)
            layout = mi.attention_layout(layer) if attention_on else None
            if layout is not None:
                weight, groups, per_group, head_dim, span = layout
                core = mi.core_attention(layer)
                if span == 1:
                    attention.append(AttentionShard(index, weight, groups, per_group, head_dim,
                                                    tp_rank * groups * per_group, tp_rank,
                                                    owner=index % dp_size == dp_rank, core_attention=core))
                else:  # a query group spans `span` TP ranks: gather its rows, measure this rank's query heads
                    mine = per_group // span
                    first = (tp_rank % span) * mine
                    attention.append(AttentionShard(index, weight, 1, per_group, head_dim, tp_rank * mine, tp_rank,
                                                    owner=index % dp_size == dp_rank,
                                                    gather=self._query_group_peers(span),
                                                    heads=(first, first + mine), core_attention=core))
            router = mi.router_of(layer) if routers_on else None
            if router is not None:
                own_tokens = tp_size == 1 or bool(config.sequence_parallel) or tp_rank == 0
                routers.append(RouterShard(index, router, router.weight, config.moe_router_topk,
                                           parallel_state.get_expert_model_parallel_rank(),
                                           report_weight=tp_rank == 0 and dp_rank == 0, report_tokens=own_tokens))
        if len(attention) != len(layers) or not attention_on:
            attention = []  # some layer's QKV layout is not one arc_engine reads: no partial picture
        experts = config.num_moe_experts if routers else 0
        ep_groups: dict[int, tuple[int, ...]] = {}
        if routers_on and config.num_moe_experts:  # the same branch on every rank (the model's config)
            mine = tuple(dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group()))
            ep_groups = runtime.gather_by_rank(mine, None)  # collective, once at attach
        return ModelParts(num_layers=config.num_layers, num_heads=config.num_attention_heads if attention else 0,
                          attention=attention, num_experts=experts or 0,
                          experts_per_rank=(experts or 0) // parallel_state.get_expert_model_parallel_world_size(),
                          routers=routers, observe_routing=self._observe_routing if routers else None,
                          ep_groups=ep_groups,
                          model_parallel_size=sharded, shard_positions=positions[0], shard_position=positions[1],
                          **where)

    def _weight_matrices(self) -> list[tuple[str, torch.Tensor | None, bool]]:
        """The whole model's weight matrices for ``detectors.weight_health``, the same list on every rank: every
        rank's names gathered once (collective, at attach). A layer's parameters are named by its global layer
        index, so the pipeline stages' names do not collide; tensor-parallel shards of one matrix share its name
        (their parts add up). Expert matrices under expert parallelism are left out (each EP rank holds other
        experts under the same local names). This rank's effective-rank measurements: the matrices it holds whole
        (not split over tensor-parallel ranks) and counts, on the first data-parallel replica."""
        from megatron.core import parallel_state

        named = mi.layer_parameter_names(self.chunks)
        expert_parallel = parallel_state.get_expert_model_parallel_world_size() > 1
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        first_replica = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
        mine: dict[str, tuple[torch.Tensor, bool]] = {}
        for chunk in self.chunks:
            for name, param in mi.unwrap_chunk(chunk).named_parameters():
                if param.dim() < 2 or id(param) not in self._counted_somewhere or \
                        (expert_parallel and not mi.reduced_across_experts(param)):
                    continue
                whole = tp_size == 1 or not mi.is_tensor_parallel(param)
                mine[named.get(id(param), name)] = (param, whole and first_replica)
        names = sorted({name for ranks in runtime.gather_by_rank(sorted(mine), None).values() for name in ranks},
                       key=_matrix_order)
        return [(name, *mine.get(name, (None, False))) for name in names]

    def partition_parts(self, param: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's part of model parameter ``param`` for statistics that add up over the ranks (weight
        health): its master values and gradient (unscaled, before Megatron's clipping), where this rank counts
        it (its DistributedOptimizer shard, or the owner replica's whole master); empty lists elsewhere."""
        inner = self._inner_of.get(id(param))
        if inner is None:
            return [], []
        return [inner.detach().view(-1)], ([] if inner.grad is None else [inner.grad.view(-1)])

    def compute_modules(self, limit: int) -> list[torch.nn.Module]:
        """What the straggler family's compute probe times: leaf modules of every chunk whose forward makes no
        tensor-parallel collective (:func:`megatron_internals.communicates_in_forward`), so a rank's compute time
        holds no wait on its peers."""
        return local_compute_modules([mi.unwrap_chunk(chunk) for chunk in self.chunks], limit,
                                     mi.communicates_in_forward)

    @staticmethod
    def _shard_positions() -> tuple[int, int]:
        """(tensor x pipeline positions, this rank's): the ranks of one position hold the same parameter shards
        (their data-parallel and context-parallel peers), so their local gradients compare. (0, 0) under expert
        parallelism: expert shards follow other groups than the dense ones."""
        from megatron.core import parallel_state

        if parallel_state.get_expert_model_parallel_world_size() > 1:
            return 0, 0
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        positions = tp_size * parallel_state.get_pipeline_model_parallel_world_size()
        return positions, parallel_state.get_pipeline_model_parallel_rank() * tp_size + \
            parallel_state.get_tensor_model_parallel_rank()

    def _query_group_peers(self, span: int) -> dist.ProcessGroup:
        """The TP ranks sharing this rank's query group (``span`` consecutive TP ranks), as a process group. Built
        once, collectively: every rank of the job creates every such group in the same order (the TP groups are
        gathered first, at attach)."""
        if self._peers is None:
            from megatron.core import parallel_state

            tp_ranks = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
            all_tp = sorted(set(runtime.gather_by_rank(tuple(tp_ranks), None).values()))
            me = dist.get_rank()
            for ranks in all_tp:
                for start in range(0, len(ranks), span):
                    members = list(ranks[start:start + span])
                    group = dist.new_group(members)
                    if me in members:
                        self._peers = group
        assert self._peers is not None
        return self._peers

    def _observe_routing(self, shard: RouterShard, observe: Callable[[torch.Tensor, torch.Tensor], None]) \
            -> Callable[[], None]:
        def observed(logits: torch.Tensor, routing_map: torch.Tensor) -> None:
            if self.engine is None or not self.engine.recomputing:  # a recomputation: seen already
                observe(logits, routing_map)

        remover = mi.observe_routing(shard.module, observed)
        self._routing_removers.append(remover)
        return remover

    # ----------------------------------------------------------------------------------------- contract
    def effective_config(self, config: ArcConfig) -> ArcConfig:
        """``config`` with the detectors whose Megatron internals this release lacks turned off (a copy; the same
        object when every feature is available). Local; :func:`arc_engine.wiring.wire` calls it."""
        return self.capabilities.effective_config(config, CONFIG_OFF)

    def check_config(self, config: ArcConfig) -> None:
        checkpoint = config.recovery.checkpoint
        missing = self.capabilities.off.get("megatron_checkpoint")
        if config.recovery.enabled and checkpoint.format == "megatron" and missing:
            raise ValueError(f"arc_engine.attach_megatron: recovery.checkpoint.format: megatron needs megatron-core "
                             f"internals this release ({self.capabilities.version}) lacks ({', '.join(missing)}); "
                             f"use auto or dcp (tested range {mi.TESTED_MEGATRON_CORE_RANGE.text()})")
        weight_health = section_of(config, WeightHealthFamily())
        if weight_health.enabled and not self.parts.matrices:  # collective, at attach: every rank
            self.parts = dataclasses.replace(self.parts, matrices=self._weight_matrices())
        if config.recovery.enabled and mi.overlaps_param_gather(self.chunks):
            raise ValueError("arc_engine.attach_megatron: recovery.enabled with overlap_param_gather: a snapshot at a "
                             "step's start would read the bf16 parameters while their all-gather from the previous "
                             "update may still be in flight; turn overlap_param_gather off, or recovery.enabled off "
                             "(detection and the agreed skip work with it)")
        sdc = section_of(config, SDCFamily())
        refusal = mi.recompute_refusal(self.chunks, self.optimizer) if sdc.enabled and sdc.recompute.enabled \
            else None
        if refusal is not None:
            raise ValueError(f"arc_engine.attach_megatron: detectors.sdc.recompute does not support {refusal}; set "
                             "detectors.sdc.recompute.enabled: false (detection and the agreed skip still work)")
        fisher = section_of(config, FisherFamily())
        if fisher.enabled and fisher.importance_rollback and any(mi.is_distributed(m) for m in self.members):
            raise ValueError("arc_engine.attach_megatron: detectors.fisher.importance_rollback is not supported with "
                             "Megatron's DistributedOptimizer yet (its blended shards would need a parameter "
                             "all-gather outside a step); set it to false (the Fisher statistics and EWC work)")

    def decision_group(self, requested: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        return requested

    def train_state(self) -> TrainState:
        return MegatronTrainState(self.chunks, self.optimizer, self.lr_scheduler, self.checkpoint_args,
                                  native_format=self.capabilities.has("megatron_checkpoint"))

    def holds_whole_model(self) -> bool:
        return self.parts.model_parallel_size == 1

    def fault_step(self, engine: ArcEngine) -> Callable[[], int]:
        return lambda: engine.progress.iteration

    def install(self, engine: ArcEngine, recompute_fn: RecomputeFn | None) -> list[Callable[[], None]]:
        self.engine = engine
        compatibility = self.capabilities.report()
        if compatibility is not None:  # one event naming every feature that is off (and an untested release)
            message, values = compatibility
            engine.emit_lifecycle("compatibility", message, values)
        engine.gathering.use_partition_parts(self.partition_parts)
        removers = [*self._routing_removers]
        if recompute_fn is not None:
            from arc_engine.integrations.megatron.recompute import MegatronGradientTarget

            sdc = section_of(engine.config, SDCFamily())
            self._gate = LocalGate(sdc.recompute.gate_factor, sdc.warmup_steps, engine.gathering.pipeline.device)
            target = MegatronGradientTarget(engine, self.chunks, self.optimizer, self.params,
                                            [self._model_group.get(id(p), 0) for p in self.params],
                                            self._reduced_stats)
            self._recompute_target = target
            engine.use_recompute(SDCRecompute(engine, sdc.recompute, self._gate, target, recompute_fn),
                                 target.record_stats)
        timed = engine.own_work.wrap
        local_stats = timed("megatron.bucket_stats", self._local_stats)
        if self.capabilities.has("bucket_statistics"):
            removers += [mi.wrap_start_grad_sync(ref, local_stats) for ref in mi.bucket_groups(self.chunks)]
        removers.append(mi.found_inf_skips(self.optimizer)(timed("megatron.decide", self._decide)))
        removers.append(mi.after_step(self.optimizer, timed("megatron.after_step", self._after_step)))
        return removers

    # ------------------------------------------------------------------------------------- per step
    @torch.no_grad()
    def _local_stats(self, ref: mi.BucketGroupRef) -> None:
        """As Megatron starts reducing a bucket group: this rank's own gradient (see module docstring)."""
        engine = self.engine
        if engine.buffer is None or not engine.is_monitored():
            return
        if self._scaler is not None and self._scale_step != engine.progress.step:  # the scale these gradients carry
            self._scale_step, self._step_scale = engine.progress.step, self._scaler[0].scale
        index = self._bucket_index.get(ref.index)
        if index is None:
            index = host_to_device([self._model_group.get(id(p), 0) for p in ref.params()], torch.long,
                                   engine.gathering.pipeline.device)
            self._bucket_index[ref.index] = index
        norms_sq = accumulate_grad_stats(engine.buffer, ref.local_grads(), index, names.GRAD_SQ_LOCAL,
                                         names.GRAD_NONFINITE_LOCAL)
        if engine.wants_sketch():
            buffers = ref.flat_buffers()
            add_gradient_sketch(engine.buffer.view(names.GRAD_SKETCH_LOCAL), buffers,
                                [BUCKET_SKETCH_INDEX + 64 * ref.index + k for k in range(len(buffers))],
                                self._sketch_cache)
        if self._gate is not None and norms_sq is not None:  # detectors.sdc.recompute: withhold a suspicious bucket
            # each bucket's squared norm from the per-tensor ones just taken (no second pass over the gradient)
            bucket_of = self._recompute_target.bucket_of_param(ref.index, norms_sq.device)
            bucket_sq = norms_sq.new_zeros(len(ref.flat_buffers())).index_add_(0, bucket_of, norms_sq)
            first = self._recompute_target.slot_base[ref.index]
            for k, buffer in enumerate(ref.flat_buffers()):
                withheld = self._gate.check(first + k, bucket_sq[k])
                engine.buffer.view(names.SDC_WITHHELD).add_(withheld.double().to(engine.buffer.device))
                zero_where(withheld, buffer)  # contributes zeros to the reduction

    @torch.no_grad()
    def _decide(self, found_inf: bool) -> bool:
        """Inside ``prepare_grads``, after Megatron's own: statistics of the reduced shard, the agreed decision, and
        the value to return (True: skip the step on every rank)."""
        engine = self.engine
        self._found_inf, self._vetoed, self._saved_lrs, self._overflow = found_inf, False, None, None
        overflow = self._overflow_finding() if found_inf else None
        dynamic = self._scaler is not None and self._scaler[1]
        if engine.is_monitored():
            self._unscale_local_stats()
            self._reduced_stats()
            decision = engine.decide(overflow=overflow if dynamic else None,
                                     extra_findings=(overflow,) if overflow is not None and not dynamic else ())
            self._vetoed = not found_inf and not decision.applies_update
        else:
            self._overflow = overflow
        if not (found_inf or self._vetoed):
            self._saved_lrs = heal_step(engine, self.optimizer.param_groups, self._param_states)
        return found_inf or self._vetoed

    def _overflow_finding(self) -> Finding:
        """Megatron's own skip (found_inf: NaN/Inf in the unscaled main gradients), as a finding."""
        scale = float(self._step_scale) if self._step_scale is not None else float("nan")
        kind = "dynamic grad scaler" if self._scaler is not None and self._scaler[1] else "optimizer"
        return Finding("megatron_overflow", Action.SKIP, Severity.WARNING,
                       f"megatron-core's {kind} skipped the step (NaN/Inf in the gradients"
                       + (f" at loss scale {scale:g})" if self._scaler is not None else ")"), (),
                       {"loss_scale": scale}, by_framework=True)

    def _unscale_local_stats(self) -> None:
        """fp16: the local statistics were taken of gradients that carry the step's loss scale; divide it out
        (device-side; Megatron already moved its scale on in ``prepare_grads``, so the backward's is used)."""
        scale = self._step_scale if self._scale_step == self.engine.progress.step else None
        if scale is None:
            return
        buffer = self.engine.buffer
        inverse = scale.detach().double().reciprocal().to(buffer.device)
        buffer.view(names.GRAD_SQ_LOCAL).mul_(inverse.square())
        if names.GRAD_SKETCH_LOCAL in self.engine.gathering.layout:
            buffer.view(names.GRAD_SKETCH_LOCAL).mul_(inverse)

    def _reduced_stats(self) -> None:
        """Statistics of the reduced gradient on this rank's shard (and the prospective update when due)."""
        engine = self.engine
        device = engine.gathering.pipeline.device
        for group in self.groups:
            grads = group.grads()
            if grads:
                accumulate_grad_stats(engine.buffer, grads, group.index_tensor(len(grads), device), names.GRAD_SQ)
        if engine.wants_optimizer_stats():
            self._optimizer_stats()

    def _optimizer_stats(self) -> None:
        for group in self.groups:
            inner = mi.inner_optimizer(group.member)
            views = adam_views(inner, group.group, owned=group.counted,
                               memo=self._views_memo.setdefault(group.index, {}))
            weights = views.params if views is not None else \
                [p for p in group.group["params"] if id(p) in group.counted]
            record_optimizer_stats(self.engine, group.index, weights, views,
                                   self._windows.setdefault(group.index, WindowCache()))

    def _after_step(self, result: tuple) -> None:
        if self._saved_lrs is not None:
            restore_learning_rates(self.optimizer.param_groups, self._saved_lrs)
            self._saved_lrs = None
        if self._overflow is not None:  # an unmonitored step Megatron skipped: through the policy, locally
            dynamic = self._scaler is not None and self._scaler[1]
            self.engine.skip_by_framework(self._overflow, overflow=dynamic)
            self._overflow = None
            return
        self.engine.finish_step(framework_skipped=self._found_inf)


#: what each feature of :data:`megatron_internals.FEATURES` turns off in the config when its internals are missing
CONFIG_OFF: dict[str, tuple[str, ...]] = {
    "bucket_statistics": ("detectors.sdc.enabled", "detectors.consistency.enabled", "detectors.r_metric.enabled"),
    "sdc_recompute": ("detectors.sdc.recompute.enabled",),
    "attention_spectra": ("detectors.qk_spectra.enabled",),
    "router_observation": ("detectors.router.enabled",),
}


def _matrix_order(name: str) -> tuple[int, int, str]:
    """Model order for matrix names: the embeddings, the layers by global index, then the rest (output layer)."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        return (1, int(parts[1]), ".".join(parts[2:]))
    return (0 if "embedding" in name else 2, 0, name)


def attach_megatron(model: Any, optimizer: Any, config: ArcConfig | str | Path | None = None, *,
                    group: dist.ProcessGroup | None = None, lr_scheduler: Any | None = None,
                    recompute_fn: RecomputeFn | None = None, checkpoint_args: Callable[[], Any] | None = None) -> Arc:
    """Attach arc_engine to megatron-core. Collective: call on every rank, once, after ``get_megatron_optimizer``
    and before the first step. ``model``: the megatron ``DistributedDataParallel`` chunk or list of chunks.
    ``optimizer``: what ``get_megatron_optimizer`` returned. ``group``: the decision group (default: the whole
    job; a narrower one must hold every TP/PP/EP peer of its ranks). Record each micro-batch's loss on the last
    pipeline stage with :meth:`Arc.record_loss` (inside the loss function); ``optimizer.step()`` then returns
    ``update_successful=False`` on every rank for a step the job decided to skip.

    ``recompute_fn(model_chunks, data_rank)``: required by ``detectors.sdc.recompute``; runs Megatron's
    ``forward_backward_func`` (``forward_only=False``) over ``model_chunks`` on the micro-batches data-parallel rank
    ``data_rank`` trained on in the current step (at :attr:`Arc.data_position`), as the training loop does, and
    returns nothing (see :mod:`arc_engine.integrations.megatron.recompute`).

    ``checkpoint_args``: returns what disk checkpoints in Megatron's format store as ``args`` (Megatron-LM's own
    arguments: the launcher passes ``megatron.training.get_args``, so a Megatron-LM ``--load`` also restores its data
    position); default: the model's shape and parallel layout.

    Raises :class:`~arc_engine.integrations.megatron.internals.MissingMegatronInternals` where the installed
    megatron-core (or these objects) lack what every decision reads. A release outside the tested range
    (``megatron_internals.TESTED_MEGATRON_CORE_RANGE``) gets a warning; features whose internals it lacks are turned
    off and named in one ``compatibility`` lifecycle event (see ``internals.py``)."""
    return wire(MegatronAdapter(model, optimizer, lr_scheduler, checkpoint_args), config, group=group,
                recompute_fn=recompute_fn)

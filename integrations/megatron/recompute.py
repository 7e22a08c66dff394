"""megatron-core side of the SDC recomputation (:mod:`arc_engine.recovery.recompute`).

* **Gate slots** are megatron DDP buckets (dense, then expert, in every chunk): as a bucket group starts its
  reduction, each bucket's local gradient is judged whole (its norm), and a withheld one contributes zeros
  (:meth:`arc_engine.integrations.megatron.MegatronAdapter._local_stats`).
* **Units.** A forward pass under Megatron is a collective of the ranks holding one copy of the model: a
  data-parallel replica's tensor-, pipeline- and context-parallel peers, and with expert parallelism the replicas
  its expert-parallel peers belong to (the token dispatch crosses them). :meth:`MegatronGradientTarget.units` is the
  closure of those groups (one gather at attach); a suspect's whole unit recomputes, every other unit waits.
* **The recomputation** is the user's ``recompute_fn(model_chunks, data_rank)``: it runs Megatron's
  ``forward_backward_func`` on the micro-batches data-parallel rank ``data_rank`` trained on in the current step
  (at ``arc.progress.data_position``), as the training loop did. It runs inside
  :class:`~arc_engine.integrations.megatron.internals.IsolatedBackward`: the grad buffers are saved and zeroed, no
  bucket starts its reduction and the schedule finalizes nothing, so each ``main_grad`` then holds the pass's local
  gradient, and the step's buffers come back afterwards. The RNG state includes Megatron's model-parallel RNG
  tracker (tensor-parallel dropout).
* **The correction** of a withheld bucket is its recomputed local gradient, summed over the bucket's own
  reduction group (dense: data+context-parallel; expert: expert-data-parallel) and scaled as Megatron's reduction
  scales it; then what ``finalize_model_grads`` does after the reduction (the sequence-parallel layer-norm
  all-reduce over TP, the embedding all-reduce between the first and last pipeline stages) is applied to it with
  Megatron's own functions; finally it is added to what each member's torch optimizer will step (a
  DistributedOptimizer shard's range, a Float16Optimizer's fp32 copy, an FP32Optimizer's gradient). Everything
  runs inside ``prepare_grads`` (arc_engine's veto point), before Megatron clips.

Refused (with the reason, at attach): fp16 loss scaling, ``calculate_per_token_loss``, several distributed-optimizer
instances, megatron FSDP / overlapped parameter gathering, the precision-aware optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from arc_engine import runtime
from arc_engine.engine import ArcEngine
from arc_engine.integrations.megatron import internals as mi
from arc_engine.recovery.recompute import CorrectionGroup, RecomputeFn, Units, rng_state, set_rng_state


def unit_closure(peers_by_rank: dict[int, list[tuple[int, ...]]]) -> dict[int, int]:
    """{rank: unit} where a unit is the closure of the peer groups each rank named (union-find); a unit is numbered
    by its lowest rank's order. Pure."""
    parent = {rank: rank for rank in peers_by_rank}

    def find(rank: int) -> int:
        while parent[rank] != rank:
            parent[rank] = parent[parent[rank]]
            rank = parent[rank]
        return rank

    for groups in peers_by_rank.values():
        for group in groups:
            members = [r for r in group if r in parent]
            for other in members[1:]:
                a, b = find(members[0]), find(other)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    roots = sorted({find(rank) for rank in parent})
    return {rank: roots.index(find(rank)) for rank in parent}


class MegatronGradientTarget:
    """The reduced gradient of megatron-core DDP chunks and a Megatron optimizer, for the SDC recomputation.
    Collective to build (one gather of the parallel coordinates)."""

    per_micro_batch = False
    loss_factor = 1.0
    #: ``post_reduction`` all-reduces some deltas across correction groups (tensor-parallel duplicates, the tied
    #: embedding across pipeline stages): every parameter gets an entry
    dense_corrections = True

    def __init__(self, engine: ArcEngine, chunks: list[Any], optimizer: Any, params: list[torch.nn.Parameter],
                 group_of_p: list[int], record_stats: Callable[[], None]) -> None:
        self.engine = engine
        self.module = chunks
        self.chunks = chunks
        self.params = params
        self.group_of_p = group_of_p
        self._record_stats = record_stats
        self.device = params[0].device if params else torch.device("cpu")
        index_of = {id(p): i for i, p in enumerate(params)}
        self.slots: list[list[int]] = []
        self.slot_base: dict[int, int] = {}  # bucket group index -> its first slot
        self._bucket_sizes: dict[int, list[int]] = {}  # bucket group index -> parameters per bucket
        self._bucket_of: dict[tuple[int, torch.device], torch.Tensor] = {}
        corrections: dict[tuple[int, float], tuple[Any, list[int]]] = {}
        for ref in mi.bucket_groups(chunks):
            self.slot_base[ref.index] = len(self.slots)
            group, scale = mi.reduction_of(ref)
            _, indices = corrections.setdefault((id(group), scale), (group, []))
            for bucket in mi.bucket_params(ref):
                self.slots.append([index_of[id(p)] for p in bucket])
                indices += self.slots[-1]
            self._bucket_sizes[ref.index] = [len(bucket) for bucket in mi.bucket_params(ref)]
        self._corrections = [CorrectionGroup(group, tuple(indices), scale)
                             for (_, scale), (group, indices) in corrections.items()]
        self._views = [(inner, index_of[id(model)], start, end) for member in mi.members(optimizer)
                       for inner, model, start, end in mi.inner_grad_views(member)]
        self._coordinates = mi.parallel_coordinates()

    def bucket_of_param(self, group_index: int, device: torch.device) -> torch.Tensor:
        """For each parameter of bucket group ``group_index`` (in ``BucketGroupRef.local_grads`` order), its bucket
        within the group, as a long tensor on ``device`` (kept between steps)."""
        key = (group_index, device)
        if key not in self._bucket_of:
            sizes = torch.tensor(self._bucket_sizes[group_index])
            self._bucket_of[key] = torch.repeat_interleave(torch.arange(len(sizes)), sizes).to(device)
        return self._bucket_of[key]

    # ------------------------------------------------------------------ GradientTarget
    def slot_params(self, slot: int) -> list[int]:
        return self.slots[slot]

    def units(self, ranks: list[int]) -> Units:
        gathered = runtime.gather_by_rank(self._coordinates, self.engine.group)
        unit_of = unit_closure({rank: value["peers"] for rank, value in gathered.items()})
        return Units(tuple(unit_of[r] for r in ranks), tuple(gathered[r]["data_rank"] for r in ranks),
                     tuple(gathered[r]["position"] for r in ranks))

    def gradients(self, recompute_fn: RecomputeFn, data_rank: int
                  ) -> Iterable[tuple[int, torch.Tensor | None, Sequence[torch.Tensor | None]]]:
        with mi.IsolatedBackward(self.chunks):
            recompute_fn(self.chunks, data_rank)  # the losses: the loss function's record_loss calls
            grads = [grad.detach().clone() for grad in mi.main_grads(self.params)]
        yield 0, None, grads

    def correction_groups(self) -> list[CorrectionGroup]:
        return self._corrections

    def rng_state(self) -> torch.Tensor:
        return torch.cat([rng_state(self.device), *(s.reshape(-1).to(torch.uint8) for s in mi.rng_tracker_states())])

    def set_rng_state(self, state: torch.Tensor) -> None:
        host = rng_state(self.device).numel()
        set_rng_state(state[:host], self.device)
        sizes = [s.numel() for s in mi.rng_tracker_states()]
        mi.set_rng_tracker_states([piece.clone() for piece in state[host:host + sum(sizes)].split(sizes)])

    @torch.no_grad()
    def apply(self, reduced_p: list[torch.Tensor | None], replace: bool) -> None:
        deltas = mi.post_reduction(self.chunks, self.params, reduced_p)
        for inner, index, start, end in self._views:
            delta = deltas[index]
            if delta is None or inner.grad is None:
                continue
            piece = delta.reshape(-1)[start:end].to(inner.grad.dtype)
            target = inner.grad.view(-1)
            target.copy_(piece) if replace else target.add_(piece)

    def record_stats(self) -> None:
        self._record_stats()

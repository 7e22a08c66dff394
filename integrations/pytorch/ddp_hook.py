"""The DDP communication hook of :class:`~arc_engine.integrations.pytorch.ddp.TorchAdapter`: it records each bucket's
local statistics, then all-reduces exactly as DDP's default does.

Per bucket, on monitored steps only:

* before the all-reduce: per-parameter norms of this rank's *local* gradient -> per-group squared norm
  (``grad_sq_local``) and per-group count of tensors holding NaN/Inf (``grad_nonfinite_local``);
* then DDP's default reduction (:func:`mean_allreduce`: scale by 1/N as DDP's reducer does, all-reduce sum);
* when the backward ends (an autograd final callback queued by the step's first bucket, which waits for every
  bucket's reduction), on the reduced buckets, all at once: per-group squared norm (``grad_sq``) -- the pre-clip
  norm of the gradient the optimizer will see. The reduced bucket is the same on every rank, so with an ownership map
  (:mod:`arc_engine.stats.partition`, set by ``attach``) each rank takes only the parameters it owns and the slot is
  ``Reduce.SUM``: 1/N of the pass per rank, the same total.

Each bucket adds one fused norm kernel (``torch._foreach_norm`` over its views) before the reduction; the reduced
buckets' norms are one fused kernel per backward, not one per bucket (on a GPU, a launch fewer per bucket: about 200
per step for a 1.3B model in DDP's 25 MB buckets). The results are queued and folded into the statistics buffer
once per step, right before the agreement
(:meth:`arc_engine.gathering.StepGathering.add_fold`), with a handful of batched kernels, not a handful per bucket.

On the steps a family asks for it (``detectors.sdc.sketch_size`` > 0: every monitored step; the consistency
family's C_dir: every ``direction_every`` monitored steps), each rank also adds its bucket's gradient sketch
(``grad_sketch_local``, taken of the bucket's flat buffer), and with ``detectors.sdc.recompute`` on, its
:class:`~arc_engine.monitors.sdc_local.LocalGate` judges the bucket before the all-reduce: a withheld bucket
contributes zeros (counted in ``sdc_withheld``) and :class:`DDPGradientTarget` lets
:mod:`arc_engine.recovery.recompute` add the recomputed share afterwards.

Otherwise the gradient values are never modified beyond DDP's own reduction: training is bitwise unchanged.
"""

# No "from __future__ import annotations": DDP checks the hook's annotations at runtime.
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from arc_engine.engine import ArcEngine
from arc_engine.integrations.pytorch import internals as torch_internals
from arc_engine.integrations.pytorch.amp import ScalerWatch
from arc_engine.integrations.pytorch.optim import optimizer_stats
from arc_engine.monitors.family import section_of
from arc_engine.monitors.sdc import SDCFamily
from arc_engine.monitors.sdc_local import BUCKET_SKETCH_INDEX, LocalGate, add_chunk_sums, chunk_sums, zero_where
from arc_engine.recovery.recompute import ReplicaTarget
from arc_engine.stats import names
from arc_engine.stats.grad_stats import ParamGroupIndex, accumulate_grad_stats, add_norm_stats, float32_norms


@dataclass
class _BucketPlan:
    """What the hook needs of one DDP bucket, built once per bucket layout (DDP rebuilds its buckets after the first
    iteration): the group index of its parameters, their positions, their sizes, and flat views of its buffer."""

    key: tuple[int, int, int]
    index: torch.Tensor
    positions: list[int]
    sizes: list[int]
    total: int  # sum(sizes): the buffer length the views cover
    owned: list[int] | None = None  # indices (in the bucket) of the parameters whose reduced statistics are ours
    owned_index: torch.Tensor | None = None  # their group ids
    buffer_ptr: int = -1
    views: list[torch.Tensor] = field(default_factory=list)
    exact_index: torch.Tensor | None = None  # each buffer element's place in an exact sketch (built on first use)

    def exact_places(self, offsets: list[int], device: torch.device) -> torch.Tensor | None:
        """Where each element of the bucket's buffer goes in an exact sketch (the flat trainable parameters, in the
        module's order): None when a parameter of the bucket is not one of the module's trainable ones."""
        if self.exact_index is None:
            if min(self.positions, default=-1) < 0:
                return None
            self.exact_index = torch.cat([torch.arange(offsets[position], offsets[position] + size)
                                          for position, size in zip(self.positions, self.sizes, strict=True)]
                                         ).to(device)
        return self.exact_index

    def grads(self, buffer: torch.Tensor, bucket: dist.GradBucket) -> list[torch.Tensor]:
        """The bucket's per-parameter gradients as flat views of ``buffer`` (the bucket's flat buffer, or the reduced
        tensor when it has the same length), cached while ``buffer`` is the same memory: the views keep that memory
        alive, so an equal address is the same buffer. Otherwise ``bucket.gradients()``."""
        if buffer.numel() != self.total:
            return list(bucket.gradients())
        if buffer.data_ptr() != self.buffer_ptr:
            self.views = list(buffer.reshape(-1).split(self.sizes))
            self.buffer_ptr = buffer.data_ptr()
        return self.views

    def reduced_share(self, reduced: torch.Tensor, bucket: dist.GradBucket) -> tuple[list[torch.Tensor],
                                                                                       torch.Tensor]:
        """The reduced gradients this rank takes statistics of (all, or the ones it owns) and their group ids."""
        grads = self.grads(reduced, bucket)
        if self.owned is None:
            return grads, self.index
        assert self.owned_index is not None
        return [grads[i] for i in self.owned], self.owned_index


@dataclass
class _StepQueue:
    """One step's per-bucket results, in the order the buckets came: per-tensor norms (fp32) of the local and of
    the reduced gradient with their group ids, and the block sums of the sketch with their plan indices. The norms
    stay the 0-dim tensors the norm kernel gave, one list per bucket, stacked once at the fold (a stack per bucket
    would be one more kernel launch per bucket: about 200 per step for a 1.3B model in DDP's 25 MB buckets)."""

    step: int = -1
    local_norms: list[list[torch.Tensor]] = field(default_factory=list)
    local_index: list[torch.Tensor] = field(default_factory=list)
    reduced_norms: list[list[torch.Tensor]] = field(default_factory=list)
    reduced_index: list[torch.Tensor] = field(default_factory=list)
    sums: list[torch.Tensor] = field(default_factory=list)
    sum_index: list[int] = field(default_factory=list)
    exact_values: list[torch.Tensor] = field(default_factory=list)  # copies of the buckets' local gradients
    exact_index: list[torch.Tensor] = field(default_factory=list)
    # the reduced buckets' shares (views: their norms are taken once the backward ends) and the buckets' futures
    reduced_shares: list[tuple[list[torch.Tensor], torch.Tensor]] = field(default_factory=list)
    reductions: list[torch.futures.Future] = field(default_factory=list)
    callback_queued: bool = False  # the end-of-backward callback is queued for the current backward
    inverse_scale: torch.Tensor | None = None  # 1 / the loss scale the step's gradients carry (a GradScaler's)
    buckets: set[int] = field(default_factory=set)  # the buckets the current backward has queued
    backward_start: tuple[int, int, int, int] = (0, 0, 0, 0)  # where its entries begin in the four lists

    def note_bucket(self, index: int) -> None:
        """Before queueing bucket ``index``: a bucket seen again means another backward began (each backward
        reduces each bucket once, and DDP waits for every bucket's reduction before its backward returns)."""
        if index in self.buckets:
            self.buckets.clear()
            self.take_reduced_norms()  # the previous backward's, when its end-of-backward callback did not run
            self.callback_queued = False
            self.backward_start = (len(self.local_norms), len(self.reduced_norms), len(self.sums),
                                   len(self.exact_values))
        self.buckets.add(index)

    def take_reduced_norms(self) -> None:
        """The reduced shares' norms so far, in one fused kernel, appended per bucket (after waiting for every
        queued reduction: device-side for CUDA futures, a host wait for others, as DDP's own end of backward)."""
        reductions, self.reductions = self.reductions, []
        for reduction in reductions:
            reduction.wait()
        shares, self.reduced_shares = self.reduced_shares, []
        if not shares:
            return
        norms = float32_norms([grad for share, _ in shares for grad in share])
        start = 0
        for share, index in shares:
            self.reduced_norms.append(norms[start:start + len(share)])
            self.reduced_index.append(index)
            start += len(share)

    def keep_last_backward(self) -> None:
        """Drop what the step's earlier backwards queued (iterations a GradScaler skipped before arc_engine knew
        it: the step stayed open through them)."""
        local, reduced, sums, exact = self.backward_start
        for values, start in ((self.local_norms, local), (self.local_index, local), (self.reduced_norms, reduced),
                              (self.reduced_index, reduced), (self.sums, sums), (self.sum_index, sums),
                              (self.exact_values, exact), (self.exact_index, exact)):
            del values[:start]
        self.backward_start = (0, 0, 0, 0)


@dataclass
class StatsHookState:
    """State handed to DDP with the hook: the engine, the reduction group and a per-bucket plan cache."""

    engine: ArcEngine
    process_group: dist.ProcessGroup | None
    groups: ParamGroupIndex
    inner_hook: object | None = None
    inner_state: object | None = None
    gate: LocalGate | None = None
    position: dict[int, int] = field(default_factory=dict)  # id(param) -> index in the module's trainable params
    offsets: list[int] = field(default_factory=list)  # index -> its first element in the flat trainable parameters
    exact_size: int = 0  # the trainable parameters' element count: a sketch of this size is the gradient itself
    owned: set[int] | None = None  # id() of the parameters whose reduced statistics this rank computes (None: all)
    scaler: ScalerWatch | None = None  # the GradScaler whose scale the bucket gradients carry
    _plans: dict[int, _BucketPlan] = field(default_factory=dict)
    # bucket index -> (buffer, address, length) the plan was last checked against; holding the buffer keeps its
    # memory from being reused, so a rebuilt bucket never shows up at the old address
    _checked: dict[int, tuple[torch.Tensor, int, int]] = field(default_factory=dict)
    _sketch_cache: dict = field(default_factory=dict)
    _queue: _StepQueue = field(default_factory=lambda: _StepQueue())

    def bucket_positions(self, bucket_index: int) -> list[int]:
        """Indices (into the module's trainable parameters) of the parameters in bucket ``bucket_index``."""
        return self._plans[bucket_index].positions

    def plan(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> _BucketPlan:
        """This bucket's plan, rebuilt when its parameters change: checked when the bucket's buffer is not the one
        the plan was last checked against (DDP allocates new buffers when it rebuilds its buckets)."""
        index = bucket.index()
        plan = self._plans.get(index)
        checked = self._checked.get(index)
        if plan is not None and checked is not None and checked[1:] == (buffer.data_ptr(), buffer.numel()):
            return plan
        params = bucket.parameters()
        key = (len(params), id(params[0]), id(params[-1]))
        plan = self._plans.get(bucket.index())
        if plan is None or plan.key != key:
            device = self.engine.gathering.pipeline.device
            sizes = [p.numel() for p in params]
            plan = _BucketPlan(key, self.groups.index_tensor(params, device),
                               [self.position.get(id(p), -1) for p in params], sizes, sum(sizes))
            if self.owned is not None:
                plan.owned = [i for i, p in enumerate(params) if id(p) in self.owned]
                plan.owned_index = self.groups.index_tensor([params[i] for i in plan.owned], device)
            self._plans[bucket.index()] = plan
            if self.gate is not None:
                self.gate.reset_slot(bucket.index())
        self._checked[index] = (buffer, buffer.data_ptr(), buffer.numel())
        return plan

    def adopt_scaler(self, scaler: ScalerWatch) -> None:
        """A GradScaler found at the step (:class:`~arc_engine.integrations.pytorch.amp.ScalerFinder`): divide its
        scale out from now on, this step's queued gradients included, keeping only the step's last backward (the
        one the scaler is stepping)."""
        self.scaler = scaler
        if self._queue.step == self.engine.progress.step:
            self._queue.keep_last_backward()
            self._queue.inverse_scale = scaler.inverse_scale(self.engine.progress.step)

    def queue(self) -> _StepQueue:
        """This step's queue (emptied first when it holds another step's results: a step that never agreed), with
        the loss scale of the step's backward."""
        step = self.engine.progress.step
        if self._queue.step != step:
            self._queue = _StepQueue(step)
            if self.scaler is not None:
                self._queue.inverse_scale = self.scaler.inverse_scale(step)
        return self._queue

    @torch.no_grad()
    def fold(self) -> None:
        """Fold this step's queued bucket results into the engine's buffer (before the agreement): a few batched
        kernels per step instead of per bucket."""
        queue, engine = self._queue, self.engine
        if engine.buffer is None or queue.step != engine.progress.step:
            return
        self._queue = _StepQueue()
        queue.take_reduced_norms()  # what no end-of-backward callback took (a backward whose callbacks did not run)
        buffer = engine.buffer
        inverse = queue.inverse_scale  # the step's gradients were scaled by a GradScaler: unscale what they gave

        def unscaled(values: torch.Tensor) -> torch.Tensor:
            return values if inverse is None else values * inverse.to(values.device)

        if queue.local_norms:
            add_norm_stats(buffer, unscaled(torch.stack(list(itertools.chain.from_iterable(queue.local_norms)))),
                           torch.cat(queue.local_index),
                           names.GRAD_SQ_LOCAL, names.GRAD_NONFINITE_LOCAL)
        if queue.reduced_norms:
            add_norm_stats(buffer, unscaled(torch.stack(list(itertools.chain.from_iterable(queue.reduced_norms)))),
                           torch.cat(queue.reduced_index),
                           names.GRAD_SQ)
        if queue.sums:
            add_chunk_sums(buffer.view(names.GRAD_SKETCH_LOCAL), [unscaled(s) for s in queue.sums], queue.sum_index,
                           self._sketch_cache)
        if queue.exact_values:
            buffer.view(names.GRAD_SKETCH_LOCAL).index_add_(
                0, torch.cat(queue.exact_index),
                unscaled(torch.cat(queue.exact_values).to(buffer.device, torch.float64)))


def stats_allreduce_hook(state: StatsHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP comm hook (see module docstring). Falls through to the plain reduction on unmonitored steps."""
    engine = state.engine
    monitored = engine.buffer is not None and engine.is_monitored()
    if monitored:
        buffer = bucket.buffer()
        plan = state.plan(bucket, buffer)
        queue = state.queue()
        queue.note_bucket(bucket.index())
        if not queue.callback_queued:
            queue.callback_queued = True
            torch_internals.queue_backward_callback(engine.own_work.wrap("ddp.reduced_norms",
                                                                         queue.take_reduced_norms))
        with engine.own_work.section("ddp.local_norms"):  # one fused kernel; folded with the others at the step
            norms = float32_norms(plan.grads(buffer, bucket))
            queue.local_norms.append(norms)
            queue.local_index.append(plan.index)
        if engine.wants_sketch():
            with engine.own_work.section("ddp.sketch"):
                size = engine.gathering.layout[names.GRAD_SKETCH_LOCAL].size
                places = plan.exact_places(state.offsets, engine.buffer.device) if size == state.exact_size \
                    else None
                if places is not None:  # the exact sketch: the local gradient itself (copied: reduced in place next)
                    queue.exact_values.append(buffer.detach().reshape(-1).clone())
                    queue.exact_index.append(places)
                else:  # the bucket's flat buffer (same layout on every rank): one matrix-vector product
                    sums = chunk_sums(buffer, size)
                    if sums is not None:
                        queue.sums.append(sums)
                        queue.sum_index.append(BUCKET_SKETCH_INDEX + bucket.index())
        if state.gate is not None:
            withheld = state.gate.check(bucket.index(),
                                        torch.stack(norms).double().square().sum().to(engine.buffer.device))
            engine.buffer.view(names.SDC_WITHHELD).add_(withheld.double().to(engine.buffer.device))
            zero_where(withheld, buffer)
    if state.inner_hook is not None:
        future = state.inner_hook(state.inner_state, bucket)  # type: ignore[operator]
        if not monitored:
            return future
    else:
        with engine.own_work.section("ddp.mean_allreduce"):  # what any Python comm hook pays: 1/N and the call
            future = mean_allreduce(state.process_group, bucket)

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        """One callback per bucket: unwrap the reduced bucket and, on monitored steps, queue the views of its share
        (their norms are taken with the other buckets' when the backward ends)."""
        reduced = fut.value()
        reduced = reduced[0] if isinstance(reduced, list) else reduced
        if monitored:
            share, share_index = plan.reduced_share(reduced, bucket)
            if share:
                queue.reduced_shares.append((share, share_index))
        return reduced

    finished = future.then(engine.own_work.wrap("ddp.reduced_stats", finish))
    if monitored:
        queue.reductions.append(finished)
    return finished


def mean_allreduce(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[Any]:
    """DDP's default reduction of a bucket: scale by 1/N, then all-reduce (sum) in place; returns the all-reduce's
    future (its value: a list holding the bucket). The scaling is the multiply by 1/N that DDP's C++ reducer applies
    while it copies gradients into a bucket when no hook is registered, so the result is bitwise DDP's own for any N
    (torch's ``default_hooks.allreduce_hook`` divides by N, which can differ in the last bit when N is not a power
    of 2)."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.mul_(1.0 / dist.get_world_size(group))
    return dist.all_reduce(buffer, group=group, async_op=True).get_future()


def register_stats_hook(engine: ArcEngine, model: DistributedDataParallel, groups: ParamGroupIndex,
                        inner_hook: object | None = None, inner_state: object | None = None,
                        owned: set[int] | None = None, scaler: ScalerWatch | None = None) -> StatsHookState:
    """Install the statistics hook on ``model`` (call once, before the first backward, on every rank).

    DDP accepts a single comm hook: to keep a hook of your own (e.g. fp16 compression), pass it as
    ``inner_hook``/``inner_state`` and arc_engine's hook calls it instead of the default all-reduce. ``owned``:
    ``id()`` of the parameters whose reduced-gradient statistics this rank computes (the engine's ``grad_sq`` slot
    must then be ``Reduce.SUM``); None: all of them (``Reduce.REPLICATED``). ``scaler``: the GradScaler whose scale
    the gradients carry during the backward (divided out of every statistic when they are folded).
    """
    state = StatsHookState(engine, model.process_group, groups, inner_hook, inner_state, owned=owned, scaler=scaler)
    trainable = [p for p in model.module.parameters() if p.requires_grad]
    state.position = {id(p): i for i, p in enumerate(trainable)}
    sizes = [p.numel() for p in trainable]
    state.offsets = [0, *itertools.accumulate(sizes)][:-1]
    state.exact_size = sum(sizes)
    sdc = section_of(engine.config, SDCFamily())
    if sdc.enabled and sdc.recompute.enabled:
        state.gate = LocalGate(sdc.recompute.gate_factor, sdc.warmup_steps, engine.gathering.pipeline.device)
    model.register_comm_hook(state, engine.own_work.wrap("ddp.comm_hook", stats_allreduce_hook))
    engine.gathering.add_fold(engine.own_work.wrap("ddp.fold", state.fold))
    return state


class DDPGradientTarget(ReplicaTarget):
    """The reduced gradient of a DDP model for :mod:`arc_engine.recovery.recompute`: ``param.grad`` of the local
    module's trainable parameters (identical on every rank after DDP's all-reduce); gate slots are DDP buckets."""

    per_micro_batch = False
    loss_factor = 1.0

    def __init__(self, model: DistributedDataParallel, hook_state: StatsHookState,
                 optimizer: torch.optim.Optimizer) -> None:
        self.module = model.module
        self.params = [p for p in model.module.parameters() if p.requires_grad]
        self.group_of_p = [hook_state.groups.group_of.get(id(p), 0) for p in self.params]
        self.hook_state = hook_state
        self.engine = hook_state.engine
        self.optimizer = optimizer

    def slot_params(self, slot: int) -> list[int]:
        return [i for i in self.hook_state.bucket_positions(slot) if i >= 0]

    @torch.no_grad()
    def apply(self, reduced_p: list[torch.Tensor | None], replace: bool) -> None:
        for param, reduced in zip(self.params, reduced_p, strict=True):
            if reduced is None or param.grad is None:
                continue
            if replace:
                param.grad.copy_(reduced)
            else:
                param.grad.add_(reduced.to(param.grad.dtype))

    @torch.no_grad()
    def record_stats(self) -> None:
        engine = self.hook_state.engine
        owned = self.hook_state.owned
        with_grad = [p for p in self.params if p.grad is not None and (owned is None or id(p) in owned)]
        if with_grad:
            index = self.hook_state.groups.index_tensor(with_grad, engine.gathering.pipeline.device)
            accumulate_grad_stats(engine.buffer, [p.grad for p in with_grad], index, names.GRAD_SQ)
        if engine.wants_optimizer_stats():
            optimizer_stats(engine, self.optimizer, local_shards=False, owned=owned)

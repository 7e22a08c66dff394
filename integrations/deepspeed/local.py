"""DeepSpeed ZeRO: each rank's own (local) gradient before ZeRO reduces it -- the per-rank statistics that name the
rank a NaN or a corruption came from, and the SDC sketch and gate. See :class:`LocalGradHooks`."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from arc_engine.engine import ArcEngine
from arc_engine.integrations.deepspeed import internals as deepspeed_internals
from arc_engine.monitors.sdc_local import BUCKET_SKETCH_INDEX, LocalGate, add_chunk_sums, chunk_sums, zero_where
from arc_engine.stats import names
from arc_engine.stats.grad_stats import DeviceIndex, float32_norms, host_to_device

log = logging.getLogger("arc_engine")


@dataclass(frozen=True)
class _ZeroBucketPlan:
    """One ZeRO reduction bucket's layout: its parameters' sizes (bucket order) and positions in
    :class:`LocalGradHooks`'s list, the first position (the bucket's sketch index), and whether every parameter is
    one of ours."""

    sizes: list[int]
    total: int
    positions: torch.Tensor
    first: int
    known: bool


def _weak_callback(method: Callable[[], None]) -> Callable[[], None]:
    """A callback that calls the bound ``method`` while its object lives: DeepSpeed keeps post-backward callbacks
    as long as the engine, and offers no way to remove a single one."""
    ref = weakref.WeakMethod(method)

    def callback() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return callback


class LocalGradHooks:
    """Each rank's own gradient before ZeRO reduces it, taken where DeepSpeed lets arc_engine see it whole:

    * ``"buckets"`` (ZeRO-2, or ZeRO-1 with ``overlap_comm``; ``zero`` given -- the adapter gives it where the
      release has what this reads, :data:`deepspeed_internals.FEATURES` ``bucket_local_statistics`` --,
      ``contiguous_gradients`` on, no gate):
      DeepSpeed copies each gradient into a contiguous bucket and reduces the bucket from its gradient hook of the
      parameter that no longer fits in it. A torch tensor hook on every parameter runs just before DeepSpeed's hook
      for it and, on monitored steps, asks :func:`deepspeed_internals.buckets_reduced_before` whether buckets are
      about to be reduced; if so it takes per-parameter norms of the bucket's slices (one fused kernel) and the
      bucket's :func:`chunk_sums` -- a few kernels per bucket, like the DDP comm hook. The last buckets, which the
      engine's backward epilogue reduces, are taken by DeepSpeed's ``register_grad_acc_post_hook`` callback (once
      every gradient hook of the backward has fired). Stage 2 reduces every micro-batch (the same per-micro-batch
      norms as the tensor hooks); stage 1 the accumulated gradient at the accumulation boundary.
    * ``"accumulated"`` (ZeRO-1 without ``overlap_comm``, contiguous gradients, no gate): stage 1 reduces every
      accumulated gradient in the engine's backward epilogue, after that callback; on the accumulation boundary the
      callback takes their norms (one fused kernel) and per-parameter block sums.
    * ``"tensor hooks"`` on every trainable module parameter otherwise (ZeRO-3, a gate, non-contiguous gradients, a
      release without those internals):
      they run on the incoming gradient, before accumulation and so before DeepSpeed's reduction hooks.

    Nothing is assigned to DeepSpeed's objects: the buckets are read (``deepspeed_internals``), the hooks are
    torch's and DeepSpeed's public ones. If a monitored step's gradients did not all pass where they are read (a
    DeepSpeed path that bypasses the buckets, or a plain ``loss.backward()`` whose epilogue reduces before the
    callback runs), the tensor hooks take over from the next step, with a warning. The DeepSpeed callback stays
    registered after :meth:`remove` or that switch, and does nothing.

    Either way the per-call results are queued with no sync; :meth:`flush` folds the queue into per-parameter
    squared norms (summed over micro-batches) and the sketch with a few batched kernels and moves them into the
    local-gradient slots, once per step. The queue is folded early once it holds :data:`MAX_PENDING_PER_PARAM` entries
    per parameter (backward passes without a step), so its memory stays bounded. With a ``gate``
    (``detectors.sdc.recompute``) a parameter's micro-batch gradient the gate withholds is replaced by zeros before
    DeepSpeed sees it; otherwise the gradient is not modified."""

    #: Queued entries per parameter before the queue is folded into the accumulators without waiting for a step.
    MAX_PENDING_PER_PARAM = 8

    def __init__(self, engine: ArcEngine, param_groups: list[tuple[int, list[torch.Tensor]]],
                 gate: LocalGate | None = None, zero: Any = None) -> None:
        self.engine = engine
        self.gate = gate
        params = [(gid, p) for gid, ps in param_groups for p in ps if p.requires_grad]
        self.params = [p for _, p in params]
        device = engine.gathering.pipeline.device
        self.sq_p = torch.zeros(len(params), dtype=torch.float32, device=device)
        self._index = DeviceIndex(device)  # accumulated gradients' positions (ZeRO-1), one copy per distinct list
        self.group_index_p = torch.tensor([gid for gid, _ in params], dtype=torch.long, device=device)
        sketch = names.GRAD_SKETCH_LOCAL in engine.gathering.layout
        self.sketch_k = torch.zeros(engine.gathering.layout[names.GRAD_SKETCH_LOCAL].size if sketch else 0,
                                    dtype=torch.float64, device=device)
        self._sketch_cache: dict = {}
        self._norms: list[torch.Tensor] = []  # queued: gradient norms (one per hook call, or a bucket's)
        self._norm_index: list[torch.Tensor] = []  # ... and the positions (in self.params) they belong to
        self._positions = [torch.tensor([i], dtype=torch.long, device=device) for i in range(len(params))]
        self._sums: list[torch.Tensor] = []  # queued: block sums for the sketch
        self._sum_index: list[int] = []
        self._max_pending = self.MAX_PENDING_PER_PARAM * max(1, len(params))
        self.handles: list[Any] = []
        self.source = "tensor hooks"
        self._zero: Any = None
        self._bucket_plans: dict[tuple[int, ...], _ZeroBucketPlan] = {}
        self._seen_elements = 0  # gradient elements DeepSpeed reduces in the current backward ...
        self._taken_elements = 0  # ... and those read before their reduction
        self._taken_in_step = 0
        self._missed = False  # some backward of this step reduced gradients that were not read
        if gate is None and zero is not None and deepspeed_internals.reduces_contiguous_buckets(zero):
            self._zero = zero
            self._position = {id(p): i for i, p in enumerate(self.params)}
            if deepspeed_internals.reduces_in_gradient_hooks(zero):
                self.source = "buckets"
                timed = engine.own_work.wrap
                self.handles = [param.register_hook(timed("deepspeed.grad_hook", self._bucket_hook(i)))
                                for i, param in enumerate(self.params)]
            else:
                self.source = "accumulated"
            zero.register_grad_acc_post_hook(
                engine.own_work.wrap("deepspeed.after_backward", _weak_callback(self._after_backward)))
        else:
            self._register_tensor_hooks()

    @property
    def by_bucket(self) -> bool:
        """Whether the statistics come from what DeepSpeed is about to reduce (else from tensor hooks)."""
        return self._zero is not None

    def _register_tensor_hooks(self) -> None:
        timed = self.engine.own_work.wrap
        self.handles = [param.register_hook(timed("deepspeed.grad_hook", self._hook(i)))
                        for i, param in enumerate(self.params)]

    def _watching(self) -> bool:
        engine = self.engine
        return self._zero is not None and engine.buffer is not None and engine.is_monitored() \
            and not engine.recomputing

    def _bucket_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        """The tensor hook of parameter ``index``: a counter and one comparison unless a bucket is to be reduced."""
        numel = self.params[index].numel()
        overflows = deepspeed_internals.bucket_overflow_test(self._zero, self.params[index])

        def hook(grad: torch.Tensor) -> None:
            self._seen_elements += numel
            if overflows() and self._watching():
                for tensor, params in deepspeed_internals.buckets_reduced_before(self._zero, self.params[index]):
                    self._record_bucket(tensor, params)

        return hook

    def _after_backward(self) -> None:
        """DeepSpeed's post-backward callback, after every gradient hook of a backward and before the epilogue
        reduces what is left: take it, and check that every gradient DeepSpeed reduced in this backward was read."""
        if self._zero is None:
            return
        if not deepspeed_internals.is_accumulation_boundary(self._zero):
            self._seen_elements = self._taken_elements = 0  # stage 1 between boundaries: nothing is reduced
            return
        if self._watching():
            if self.source == "buckets":
                for tensor, params in deepspeed_internals.pending_buckets(self._zero):
                    self._record_bucket(tensor, params)
            else:
                self._record_accumulated()
            self._missed = self._missed or self._taken_elements != self._seen_elements
            self._taken_in_step += self._taken_elements
        self._seen_elements = self._taken_elements = 0

    @torch.no_grad()
    def _record_bucket(self, tensor: torch.Tensor, params: list[torch.Tensor]) -> None:
        """Queue the norms of a bucket's per-parameter slices and its block sums (``params``: the parameters whose
        gradients fill the flat ``tensor``, in bucket order)."""
        key = tuple(id(p) for p in params)
        plan = self._bucket_plans.get(key)
        if plan is None:
            positions = [self._position.get(id(p), -1) for p in params]
            if len(self._bucket_plans) >= 64:
                self._bucket_plans.clear()
            sizes = [p.numel() for p in params]
            plan = self._bucket_plans[key] = _ZeroBucketPlan(
                sizes, sum(sizes), host_to_device(positions, torch.long, self.sq_p.device),
                positions[0] if positions else -1, bool(positions) and min(positions) >= 0)
        if not plan.known or plan.total != tensor.numel():
            return  # not a bucket of our parameters as we know them: flush() notices the elements not taken
        self._taken_elements += plan.total
        norms = float32_norms(tensor.view(-1).split(plan.sizes))
        self._norms.append(torch.stack(norms))  # folded with the step's other buckets (one index_add)
        self._norm_index.append(plan.positions)
        if len(self._norms) >= self._max_pending:  # backward passes without a step: keep the queue bounded
            self._fold()
        if self.sketch_k.numel() and self.engine.wants_sketch():
            sums = chunk_sums(tensor, self.sketch_k.numel())
            if sums is not None:  # bucket contents are the same on every rank: index it by its first parameter
                self._sums.append(sums)
                self._sum_index.append(BUCKET_SKETCH_INDEX + plan.first)

    @torch.no_grad()
    def _record_accumulated(self) -> None:
        """Queue the norms and block sums of every accumulated gradient ZeRO-1 is about to reduce."""
        grads, index = [], []
        for i, param in enumerate(self.params):
            grad = deepspeed_internals.gradient_for_reduction(self._zero, param)
            if grad is not None:
                grads.append(grad)
                index.append(i)
        if not grads:
            return
        numel = sum(g.numel() for g in grads)
        self._seen_elements += numel
        self._taken_elements += numel
        norms = float32_norms(grads)
        self._norms.append(torch.stack(norms))
        self._norm_index.append(self._index(index))
        if self.sketch_k.numel() and self.engine.wants_sketch():
            for grad, i in zip(grads, index, strict=True):
                sums = chunk_sums(grad, self.sketch_k.numel())
                if sums is not None:
                    self._sums.append(sums)
                    self._sum_index.append(i)

    def _hook(self, index: int) -> Callable[[torch.Tensor], torch.Tensor | None]:
        @torch.no_grad()
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            engine = self.engine
            if engine.buffer is None or not engine.is_monitored() or engine.recomputing:
                return None
            norm = float32_norms([grad])[0]
            self._norms.append(norm.reshape(1))
            self._norm_index.append(self._positions[index])
            if self.sketch_k.numel() and engine.wants_sketch():
                sums = chunk_sums(grad, self.sketch_k.numel())
                if sums is not None:
                    self._sums.append(sums)
                    self._sum_index.append(index)
            if len(self._norms) >= self._max_pending:
                self._fold()
            if self.gate is None:
                return None
            withheld = self.gate.check(index, norm.square(), micro_batch=max(engine.gathering.losses - 1, 0))
            return zero_where(withheld, grad.clone()) if grad.device.type != "cpu" or bool(withheld) else None

        return hook

    @torch.no_grad()
    def _fold(self) -> None:
        """Fold the queue into ``sq_p`` and ``sketch_k`` (batched: a stack, a square and an index_add for the norms;
        a concatenation and an index_add for the sketch) and empty it."""
        if self._norms:
            index = torch.cat(self._norm_index)
            self.sq_p.index_add_(0, index, torch.cat(self._norms).to(self.sq_p.device).square())
            self._norms, self._norm_index = [], []
        if self._sums:
            add_chunk_sums(self.sketch_k, self._sums, self._sum_index, self._sketch_cache)
            self._sums, self._sum_index = [], []

    def _check_coverage(self) -> None:
        """At a monitored step: if some gradient DeepSpeed reduced was not read before its reduction (or none was
        read at all, or the post-backward callback did not run), switch to the tensor hooks from the next step."""
        missed = self._missed or self._taken_in_step == 0 or self._seen_elements != self._taken_elements
        if missed:
            log.warning("arc_engine: DeepSpeed reduced gradients this step that arc_engine did not read before the "
                        "reduction (%s); local gradient statistics switch to tensor hooks from the next step",
                        self.source)
            self.remove()
            self.source = "tensor hooks"
            self._register_tensor_hooks()

    @torch.no_grad()
    def flush(self, stepped: bool = True, loss_scale: float = 1.0) -> None:
        """Move this step's accumulators into the engine's buffer and clear them (local, device-side).
        ``stepped``: called at the optimizer step of a monitored step (not for a step DeepSpeed skipped), where
        DeepSpeed must have reduced this step's gradients. ``loss_scale``: the scale the step's gradients carry
        (fp16), divided out of the norms and the sketch."""
        buffer = self.engine.buffer
        if buffer is None:
            return
        if self._zero is not None and stepped and self.engine.is_monitored():
            self._check_coverage()
        self._seen_elements = self._taken_elements = self._taken_in_step = 0
        self._missed = False
        self._fold()
        if loss_scale != 1.0:
            self.sq_p.div_(loss_scale * loss_scale)
            self.sketch_k.div_(loss_scale)
        buffer.index_add(names.GRAD_SQ_LOCAL, self.group_index_p, self.sq_p)
        buffer.index_add(names.GRAD_NONFINITE_LOCAL, self.group_index_p, (~torch.isfinite(self.sq_p)).double())
        self.sq_p.zero_()
        if self.sketch_k.numel():
            buffer.view(names.GRAD_SKETCH_LOCAL).add_(self.sketch_k)
            self.sketch_k.zero_()
        if self.gate is not None:
            buffer.view(names.SDC_WITHHELD).add_(self.gate.withheld_count.to(buffer.device))

    def remove(self) -> None:
        self._zero = None  # DeepSpeed's post-backward callback now does nothing
        for handle in self.handles:
            handle.remove()
        self.handles = []

"""PyTorch DDP: a communication hook that records each bucket's local statistics, then all-reduces exactly as
DDP's default does.

Per bucket, on monitored steps only:

* before the all-reduce: per-parameter norms of this rank's *local* gradient -> per-group squared norm
  (``grad_sq_local``) and per-group count of tensors holding NaN/Inf (``grad_nonfinite_local``);
* then the default DDP reduction (divide by the group size, all-reduce sum);
* in the future's callback, on the reduced bucket: per-group squared norm (``grad_sq``) -- the pre-clip norm
  of the gradient the optimizer will see.

The gradient values are never modified beyond what the default hook does, so training is bitwise unchanged.
"""

# No "from __future__ import annotations": DDP checks the hook's annotations at runtime.
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from arc_engine.engine import ArcEngine
from arc_engine.stats import names
from arc_engine.stats.grad_stats import ParamGroupIndex, accumulate_grad_stats


@dataclass
class StatsHookState:
    """State handed to DDP with the hook: the engine, the reduction group and a per-bucket index cache."""

    engine: ArcEngine
    process_group: dist.ProcessGroup | None
    groups: ParamGroupIndex
    inner_hook: object | None = None
    inner_state: object | None = None
    _index_cache: dict[int, tuple[tuple[int, int, int], torch.Tensor]] = field(default_factory=dict)

    def group_index(self, bucket: dist.GradBucket, params: list[torch.Tensor]) -> torch.Tensor:
        # DDP rebuilds its buckets after the first iteration: validate the cached entry cheaply.
        key = (len(params), id(params[0]), id(params[-1]))
        cached = self._index_cache.get(bucket.index())
        if cached is None or cached[0] != key:
            device = self.engine.pipeline.device
            cached = (key, self.groups.index_tensor(params, device))
            self._index_cache[bucket.index()] = cached
        return cached[1]


def stats_allreduce_hook(state: StatsHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP comm hook (see module docstring). Falls through to the plain reduction on unmonitored steps."""
    engine = state.engine
    monitored = engine.buffer is not None and engine.is_monitored()
    if monitored:
        grads = list(bucket.gradients())
        index = state.group_index(bucket, list(bucket.parameters()))
        accumulate_grad_stats(engine.buffer, grads, index, names.GRAD_SQ_LOCAL, names.GRAD_NONFINITE_LOCAL)
    if state.inner_hook is not None:
        future = state.inner_hook(state.inner_state, bucket)  # type: ignore[operator]
    else:
        future = default_hooks.allreduce_hook(state.process_group, bucket)
    if not monitored:
        return future

    def record_reduced(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        reduced = fut.value()
        reduced = reduced[0] if isinstance(reduced, list) else reduced
        sizes = [g.numel() for g in grads]
        views = list(reduced.split(sizes)) if sum(sizes) == reduced.numel() else list(bucket.gradients())
        accumulate_grad_stats(engine.buffer, views, index, names.GRAD_SQ)
        return reduced

    return future.then(record_reduced)


def register_stats_hook(engine: ArcEngine, model: DistributedDataParallel, groups: ParamGroupIndex,
                        inner_hook: object | None = None, inner_state: object | None = None) -> StatsHookState:
    """Install the statistics hook on ``model`` (call once, before the first backward, on every rank).

    DDP accepts a single comm hook: to keep a hook of your own (e.g. fp16 compression), pass it as
    ``inner_hook``/``inner_state`` and arc_engine's hook calls it instead of the default all-reduce.
    """
    state = StatsHookState(engine, model.process_group, groups, inner_hook, inner_state)
    model.register_comm_hook(state, stats_allreduce_hook)
    return state

"""Any ``torch.optim`` optimizer: the decision is taken in a step pre-hook, the step is closed in a post-hook.

Skipping a step uses torch.optim's own contract: parameters whose ``.grad`` is ``None`` are not updated (and
their optimizer state, including Adam's step count, is left untouched). So a skipped step sets every gradient
of the optimizer to ``None`` in the pre-hook; the optimizer then applies nothing on any rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from arc_engine.adapter import Adapter
from arc_engine.engine import ArcEngine
from arc_engine.integrations.pytorch import internals as pytorch_internals
from arc_engine.integrations.pytorch.amp import ScalerWatch, fused_grad_scale
from arc_engine.recovery.heal import heal_step, restore_learning_rates
from arc_engine.stats import names
from arc_engine.stats.grad_stats import ParamGroupIndex, accumulate_grad_stats
from arc_engine.stats.optim_stats import adam_views
from arc_engine.stats.producers import record_optimizer_stats
from arc_engine.stats.sampling import WindowCache

if TYPE_CHECKING:
    from arc_engine.recovery.state import TorchTrainState


@dataclass
class OptimizerHooks:
    handles: list[torch.utils.hooks.RemovableHandle]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def local_grad_stats(engine: ArcEngine, optimizer: torch.optim.Optimizer, groups: ParamGroupIndex,
                     cache: dict[str, object], grad_scale: torch.Tensor | None = None) -> None:
    """Write gradient statistics from ``param.grad`` (no DDP hook: the local gradient is the reduced one).
    ``cache`` keeps the group-index tensor while the set of parameters with gradients does not change.
    ``grad_scale``: the loss scale the gradients still carry (a fused optimizer's), divided out."""
    grads: list[torch.Tensor] = []
    params: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                grads.append(param.grad)
                params.append(param)
    if not grads:
        return
    key = tuple(id(p) for p in params)
    if cache.get("key") != key:
        cache["key"], cache["index"] = key, groups.index_tensor(params, engine.gathering.pipeline.device)
    index = cache["index"]
    accumulate_grad_stats(engine.buffer, grads, index, names.GRAD_SQ_LOCAL, names.GRAD_NONFINITE_LOCAL)
    local_sq = engine.buffer.view(names.GRAD_SQ_LOCAL)
    if grad_scale is not None:
        local_sq.div_(grad_scale.to(local_sq.device, torch.float64).square())
    engine.buffer.view(names.GRAD_SQ).copy_(local_sq)


def optimizer_stats(engine: ArcEngine, optimizer: torch.optim.Optimizer, *, local_shards: bool,
                    windows: dict[int, WindowCache] | None = None, owned: set[int] | None = None,
                    memos: dict[int, dict] | None = None, grad_scale: torch.Tensor | None = None) -> None:
    """Per-group weight norms (on the ``stats.optimizer_stats_every`` schedule) and prospective Adam update Σ U²
    (on this step's sampled windows), before the optimizer applies the step. ``windows``:
    per-group caches of the sampled windows, kept by the caller between steps. ``owned``: take only these
    parameters (``id()``; the replicated parameters this rank owns, see :mod:`arc_engine.stats.partition`).
    ``memos``: per-group :func:`adam_views` memos, kept by the caller between steps. ``grad_scale``: the loss
    scale the gradients still carry (a fused optimizer's), divided out."""
    factor: float | torch.Tensor = 1.0 if grad_scale is None else grad_scale.double().reciprocal()
    for group_id, group in enumerate(optimizer.param_groups):
        memo = None if memos is None else memos.setdefault(group_id, {})
        views = adam_views(optimizer, group, local=local_shards, owned=owned, memo=memo)
        if views is not None:
            weights = views.params
        else:
            weights = [p for p in group["params"] if p.grad is not None and (owned is None or id(p) in owned)]
            weights = [p.to_local() if local_shards and isinstance(p, DTensor) else p for p in weights]
        cache = None if windows is None else windows.setdefault(group_id, WindowCache())
        record_optimizer_stats(engine, group_id, weights, views, cache, grad_scale=factor)


def drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.step()`` a no-op for this step (see module docstring)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


def register_optimizer_hooks(engine: ArcEngine, optimizer: torch.optim.Optimizer, groups: ParamGroupIndex,
                             *, grads_from_hook: bool, local_shards: bool = False,
                             owned: set[int] | None = None, scaler: ScalerWatch | None = None) -> OptimizerHooks:
    """Install the pre/post step hooks on every rank.

    ``grads_from_hook``: gradient statistics are produced elsewhere (a DDP comm hook or a sharded adapter);
    otherwise they are computed from ``param.grad`` in the pre-hook. ``local_shards``: parameters are DTensors
    (FSDP2) and statistics are taken on their local shards. ``owned``: optimizer statistics of these parameters
    only (``id()``; replicated parameters split across ranks, slots ``Reduce.SUM``). ``scaler``: the GradScaler
    that calls ``optimizer.step()``: the pre-hook sees unscaled gradients, except under a fused optimizer, whose
    ``grad_scale`` it divides out and whose own skip of a non-finite step it reports as the scaler's.
    """
    index_cache: dict[str, object] = {}
    windows: dict[int, WindowCache] = {}
    memos: dict[int, dict] = {}
    saved_lrs: list[list[object]] = []

    @torch.no_grad()
    def pre_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if engine.is_monitored():
            grad_scale = fused_grad_scale(opt) if scaler is not None else None
            if not grads_from_hook:
                local_grad_stats(engine, opt, groups, index_cache, grad_scale)
            if engine.wants_optimizer_stats():
                optimizer_stats(engine, opt, local_shards=local_shards, windows=windows, owned=owned,
                                memos=memos, grad_scale=grad_scale)
            fused_skip = scaler.overflow_finding if scaler is not None and \
                pytorch_internals.unscales_in_kernel(opt) else None
            if not engine.decide(overflow_if_nonfinite=fused_skip).applies_update:
                drop_gradients(opt)
                return
        saved = heal_step(engine, opt.param_groups, opt.state)
        if saved is not None:
            saved_lrs.append(saved)

    def post_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if saved_lrs:
            restore_learning_rates(opt.param_groups, saved_lrs.pop())
        engine.finish_step()

    timed = engine.own_work.wrap
    handles = [optimizer.register_step_pre_hook(timed("optimizer.pre_step", pre_step)),
               optimizer.register_step_post_hook(timed("optimizer.post_step", post_step))]
    return OptimizerHooks(handles)


#: The monitors that judge a step a loss scaler skipped: its gradients are gone, its loss and local counts are not.
OVERFLOW_MONITORS = ("non_finite", "loss_spike")


class ScalerSkips:
    """Closes the steps a ``GradScaler`` skipped (:mod:`arc_engine.integrations.pytorch.amp`): no optimizer hook runs
    for them, so the next step's first forward (or ``close``) finds the step still open after the scaler moved on.

    Under DDP and FSDP2 every rank's scaler checks the same reduced gradients (FSDP2's ``ShardedGradScaler``
    all-reduces its verdict), so every rank finds the same skip at the same point, and a monitored step is agreed
    like any other: its losses and local gradient statistics name the rank and group that held NaN/Inf."""

    def __init__(self, engine: ArcEngine, watch: ScalerWatch,
                 flushes: tuple[Callable[[], None], ...] = ()) -> None:
        self.engine, self.watch, self.flushes = engine, watch, flushes

    def before_step_start(self) -> None:
        """Forward pre-hook, before the engine opens a step: close a step the scaler skipped, then mark the new one.
        Collective over the decision group when the closed step was monitored."""
        if self.watch.skipped(self.engine.progress.step):
            self.close_skipped(agree=True)
        self.watch.mark_step(self.engine.progress.step)

    def pending(self) -> bool:
        """Whether the scaler skipped the open step (local)."""
        return self.watch.skipped(self.engine.progress.step)

    def close_skipped(self, *, agree: bool) -> None:
        """Close the open step as the scaler's skip: agreed on a monitored step (``agree``), else locally."""
        engine = self.engine
        finding = self.watch.overflow_finding()
        if agree and engine.is_monitored() and engine.buffer is not None:
            for flush in self.flushes:
                flush()
            engine.decide(only=OVERFLOW_MONITORS, overflow=finding)
            engine.finish_step(framework_skipped=True)
        else:
            engine.skip_by_framework(finding, overflow=True)


class ScalerSkipsHooks(Adapter):
    """The adapter hooks (:class:`arc_engine.adapter.Adapter`'s optional ones) that close a GradScaler's skipped
    steps, for adapters holding a :class:`ScalerSkips` as ``scaler_skips`` (None without a scaler)."""

    scaler_skips: ScalerSkips | None = None
    state: TorchTrainState | None = None  # what a rollback restores, the scaler's state included

    def before_step_start(self) -> None:
        """At each forward: close a step the scaler skipped (see :class:`ScalerSkips`)."""
        if self.state is not None:
            self.state.settle_scaler()
        if self.scaler_skips is not None:
            self.scaler_skips.before_step_start()

    def framework_skip_pending(self) -> bool:
        """Whether the scaler skipped the open step (local)."""
        return self.scaler_skips is not None and self.scaler_skips.pending()

    def close_framework_skips(self) -> None:
        """After the loop's ``scaler.step``/``scaler.update``: close a step the scaler skipped now, not at the next
        forward (collective over the decision group when it was monitored). After a rollback the scaler holds the
        snapshot's state again (its ``update()`` ran after the restore, inside the same step)."""
        if self.state is not None:
            self.state.settle_scaler()
        if self.scaler_skips is not None:
            self.scaler_skips.before_step_start()

    def before_close(self) -> None:
        """Close a last step the scaler skipped (local)."""
        if self.scaler_skips is not None and self.scaler_skips.pending():
            self.scaler_skips.close_skipped(agree=False)

"""Any ``torch.optim`` optimizer: the decision is taken in a step pre-hook, the step is closed in a post-hook.

Skipping a step uses torch.optim's own contract: parameters whose ``.grad`` is ``None`` are not updated (and
their optimizer state, including Adam's step count, is left untouched). So a skipped step sets every gradient
of the optimizer to ``None`` in the pre-hook; the optimizer then applies nothing on any rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arc_engine.engine import ArcEngine
from arc_engine.recovery.heal import heal_step, restore_learning_rates
from arc_engine.stats import names
from arc_engine.stats.grad_stats import ParamGroupIndex, accumulate_grad_stats
from arc_engine.stats.optim_stats import adam_views
from arc_engine.stats.producers import record_optimizer_stats
from arc_engine.stats.sampling import WindowCache


@dataclass
class OptimizerHooks:
    handles: list[torch.utils.hooks.RemovableHandle]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def local_grad_stats(engine: ArcEngine, optimizer: torch.optim.Optimizer, groups: ParamGroupIndex,
                     cache: dict[str, object]) -> None:
    """Write gradient statistics from ``param.grad`` (no DDP hook: the local gradient is the reduced one).
    ``cache`` keeps the group-index tensor while the set of parameters with gradients does not change."""
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
        cache["key"], cache["index"] = key, groups.index_tensor(params, engine.pipeline.device)
    index = cache["index"]
    accumulate_grad_stats(engine.buffer, grads, index, names.GRAD_SQ_LOCAL, names.GRAD_NONFINITE_LOCAL)
    engine.buffer.view(names.GRAD_SQ).copy_(engine.buffer.view(names.GRAD_SQ_LOCAL))


def optimizer_stats(engine: ArcEngine, optimizer: torch.optim.Optimizer, *, local_shards: bool,
                    windows: dict[int, WindowCache] | None = None, owned: set[int] | None = None,
                    memos: dict[int, dict] | None = None) -> None:
    """Per-group weight norms (on the ``stats.optimizer_stats_every`` schedule) and prospective Adam update Σ U²
    (on this step's sampled windows), before the optimizer applies the step. ``windows``:
    per-group caches of the sampled windows, kept by the caller between steps. ``owned``: take only these
    parameters (``id()``; the replicated parameters this rank owns, see :mod:`arc_engine.stats.partition`).
    ``memos``: per-group :func:`adam_views` memos, kept by the caller between steps."""
    for group_id, group in enumerate(optimizer.param_groups):
        memo = None if memos is None else memos.setdefault(group_id, {})
        views = adam_views(optimizer, group, local=local_shards, owned=owned, memo=memo)
        if views is not None:
            weights = views.params
        else:
            weights = [p for p in group["params"] if p.grad is not None and (owned is None or id(p) in owned)]
            weights = [p.to_local() if local_shards and hasattr(p, "to_local") else p for p in weights]
        cache = None if windows is None else windows.setdefault(group_id, WindowCache())
        record_optimizer_stats(engine, group_id, weights, views, cache)


def drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.step()`` a no-op for this step (see module docstring)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


def register_optimizer_hooks(engine: ArcEngine, optimizer: torch.optim.Optimizer, groups: ParamGroupIndex,
                             *, grads_from_hook: bool, local_shards: bool = False,
                             owned: set[int] | None = None) -> OptimizerHooks:
    """Install the pre/post step hooks on every rank.

    ``grads_from_hook``: gradient statistics are produced elsewhere (a DDP comm hook or a sharded adapter);
    otherwise they are computed from ``param.grad`` in the pre-hook. ``local_shards``: parameters are DTensors
    (FSDP2) and statistics are taken on their local shards. ``owned``: optimizer statistics of these parameters
    only (``id()``; replicated parameters split across ranks, slots ``Reduce.SUM``).
    """
    index_cache: dict[str, object] = {}
    windows: dict[int, WindowCache] = {}
    memos: dict[int, dict] = {}
    saved_lrs: list[list[object]] = []

    @torch.no_grad()
    def pre_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if engine.is_monitored():
            if not grads_from_hook:
                local_grad_stats(engine, opt, groups, index_cache)
            if engine.wants_optimizer_stats():
                optimizer_stats(engine, opt, local_shards=local_shards, windows=windows, owned=owned,
                                memos=memos)
            if not engine.decide().applies_update:
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

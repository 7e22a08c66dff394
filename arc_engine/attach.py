"""``arc_engine.attach``: the one entry point for plain PyTorch (DDP or single process, any torch.optim).

The training-loop contract, on every rank::

    arc = arc_engine.attach(model, optimizer, config)     # collective, once, after DDP wraps the model
    for batch in loader:
        loss = model(batch)
        arc.record_loss(loss)                              # once per micro-batch, no host sync
        loss.backward()
        optimizer.step()                                   # arc decides here (collective on monitored steps)
        optimizer.zero_grad()
    arc.close()                                            # summary event, flush sinks

``optimizer.step()`` is skipped (no parameter or optimizer-state change) on every rank when the agreed decision
is SKIP, and raises :class:`arc_engine.ArcAbort` on every rank when it is ABORT.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from arc_engine import runtime
from arc_engine.config import ArcConfig, load_config
from arc_engine.engine import ArcEngine
from arc_engine.faults import FaultInjector
from arc_engine.recovery.recompute import RecomputeFn, SDCRecompute, recompute_wanted
from arc_engine.recovery.state import TorchTrainState
from arc_engine.stats import Reduce
from arc_engine.stats.grad_stats import ParamGroupIndex
from arc_engine.stats.partition import owned_ids


@dataclass
class Arc:
    """What :func:`attach` returns: the engine plus the hooks it installed."""

    engine: ArcEngine
    faults: FaultInjector
    _removers: list[Any]

    def record_loss(self, loss: torch.Tensor) -> None:
        """See :meth:`ArcEngine.record_loss`."""
        self.engine.record_loss(loss)

    @property
    def step(self) -> int:
        """Optimizer steps completed (applied or skipped)."""
        return self.engine.step

    @property
    def last_step_applied(self) -> bool:
        return self.engine.last_step_applied

    @property
    def data_position(self) -> int:
        """Index of the next batch to train on (one per optimizer step). It moves past skipped data and goes back
        on a rollback; a resumed job starts from the checkpoint's. Draw batches from it, not from a loop counter."""
        return self.engine.data_position

    def summary(self) -> dict[str, Any]:
        return self.engine.summary()

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state)

    def close(self) -> None:
        """Remove the optimizer hooks and fault hooks, emit the summary, close sinks. Local, idempotent.
        (A DDP comm hook cannot be unregistered; after close it only performs the default all-reduce.)"""
        for remove in self._removers:
            remove()
        self._removers.clear()
        self.faults.remove()
        self.engine.close()

    def __enter__(self) -> Arc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
           config: ArcConfig | str | Path | None = None, *, group: dist.ProcessGroup | None = None,
           lr_scheduler: Any | None = None, recompute_fn: RecomputeFn | None = None,
           ddp_comm_hook: tuple[Callable[..., Any], object] | None = None) -> Arc:
    """Attach arc_engine to a model and its optimizer. Collective: call on every rank, once.

    ``model``: a ``DistributedDataParallel`` module (statistics come from a comm hook on its process group),
    an FSDP2 (``fully_shard``) model (delegates to :func:`arc_engine.integrations.fsdp.attach_fsdp`), a
    ``deepspeed.initialize``-d engine (``optimizer`` may be None; delegates to
    :func:`arc_engine.integrations.deepspeed.attach_deepspeed`), or a plain module (statistics come from
    ``param.grad``). ``config``: an :class:`ArcConfig`, a YAML path,
    or None for defaults. ``group``: the data-parallel group the decision is agreed on (default: DDP's group,
    else the world). ``lr_scheduler``: snapshotted and restored with the training state when ``recovery`` is
    enabled (for DeepSpeed, the engine's own scheduler is used).

    With ``recovery.enabled`` the loop must draw its batches from :attr:`Arc.data_position` and run until
    :attr:`Arc.step` reaches its target (both go back on a rollback and are restored on a resume), and should step
    an LR scheduler only when :attr:`Arc.last_step_applied`.

    ``recompute_fn(module, data_rank)``: required by ``detectors.sdc.recompute`` (DDP and DeepSpeed): yields the
    losses of the micro-batches rank ``data_rank`` trained on in the current step (at :attr:`Arc.data_position`),
    computed with ``module`` (the unwrapped model) and scaled as they were back-propagated; see
    :mod:`arc_engine.recovery.recompute`.

    ``ddp_comm_hook=(hook, state)``: DDP accepts a single comm hook and arc_engine installs one, so a reduction hook
    of your own (e.g. ``default_hooks.fp16_compress_hook`` with its process group as state) goes here instead of
    ``register_comm_hook``: arc_engine's hook takes the local statistics and calls yours for the reduction, and the
    gradients are what your hook alone gives. Its result must be the same on every rank of the group (as every
    all-reduce-based hook's is). Not with ``detectors.sdc.recompute`` (withholding a bucket would reach your hook's
    state, e.g. PowerSGD's error feedback).
    """
    from torch.distributed.fsdp import FSDPModule

    from arc_engine.integrations.ddp import register_stats_hook
    from arc_engine.integrations.torch_optim import register_optimizer_hooks

    if ddp_comm_hook is not None and not isinstance(model, DistributedDataParallel):
        raise ValueError("arc_engine.attach: ddp_comm_hook is for a DistributedDataParallel model, got "
                         f"{type(model).__name__}")
    if type(model).__module__.startswith("deepspeed."):
        from arc_engine.integrations.deepspeed import attach_deepspeed

        return attach_deepspeed(model, config, group=group, recompute_fn=recompute_fn)
    if optimizer is None:
        raise ValueError("arc_engine.attach: an optimizer is required (except for a DeepSpeed engine)")
    if isinstance(model, FSDPModule):
        from arc_engine.integrations.fsdp import attach_fsdp

        if recompute_fn is not None:
            raise ValueError("recompute_fn: the SDC recomputation is not supported on FSDP2 (DDP and DeepSpeed "
                             "ZeRO-1/2 are)")
        return attach_fsdp(model, optimizer, config, group=group, lr_scheduler=lr_scheduler)
    if not isinstance(config, ArcConfig):
        config = load_config(config)
    is_ddp = isinstance(model, DistributedDataParallel)
    check_ddp_comm_hook(model, ddp_comm_hook, config)
    if group is None and is_ddp:
        group = model.process_group
    groups = ParamGroupIndex(optimizer.param_groups)
    owned = ddp_owned_params(model, group) if is_ddp else None
    engine = ArcEngine(config, group=group, group_names=groups.names,
                       shard_reduce=Reduce.REPLICATED if owned is None else Reduce.SUM)
    wants_recompute = recompute_wanted(engine, recompute_fn, "a plain (non-DDP) module", is_ddp)  # before start
    injector = FaultInjector(config.faults.injections, runtime.global_rank(), lambda: engine.iteration)
    injector.install(model.module if is_ddp else model)
    engine.start()
    engine.enable_recovery(TorchTrainState(model, optimizer, lr_scheduler, rank=runtime.global_rank()))
    if is_ddp:
        from arc_engine.integrations.ddp import DDPGradientTarget

        inner_hook, inner_state = ddp_comm_hook if ddp_comm_hook is not None else (None, None)
        hook_state = register_stats_hook(engine, model, groups, inner_hook, inner_state, owned=owned)
        if wants_recompute:
            target = DDPGradientTarget(model, hook_state, optimizer)
            engine.restat = target.record_stats
            engine.sdc_recompute = SDCRecompute(engine, config.detectors.sdc.recompute, hook_state.gate, target,
                                                recompute_fn)
    hooks = register_optimizer_hooks(engine, optimizer, groups, grads_from_hook=is_ddp, owned=owned)
    engine.lr_multipliers.append(injector.lr_multiplier)
    return Arc(engine, injector, [hooks.remove, register_step_start(engine, model)])


def check_ddp_comm_hook(model: torch.nn.Module, ddp_comm_hook: tuple[Callable[..., Any], object] | None,
                        config: ArcConfig) -> None:
    """Refuse, before anything is registered (the same verdict on every rank), a ``ddp_comm_hook`` that cannot be
    honoured, and a DDP model that already has a comm hook (DDP would refuse arc_engine's own with a less helpful
    message)."""
    is_ddp = isinstance(model, DistributedDataParallel)
    if ddp_comm_hook is not None:
        if not (isinstance(ddp_comm_hook, tuple) and len(ddp_comm_hook) == 2 and callable(ddp_comm_hook[0])):
            raise ValueError("arc_engine.attach: ddp_comm_hook must be a (hook, state) pair, as DDP's "
                             "register_comm_hook(state, hook) takes them")
        sdc = config.detectors.sdc
        if sdc.enabled and sdc.recompute.enabled:
            raise ValueError("arc_engine.attach: detectors.sdc.recompute cannot be combined with ddp_comm_hook "
                             "(a withheld bucket would reach your hook's state); turn one of them off")
    if is_ddp and getattr(model, "_comm_hooks", None):
        raise ValueError("arc_engine.attach: this DDP model already has a comm hook and DDP accepts only one; "
                         "register it through arc_engine instead: attach(..., ddp_comm_hook=(hook, state))")


def ddp_owned_params(model: DistributedDataParallel, group: dist.ProcessGroup | None) -> set[int] | None:
    """The parameters (``id()``) whose replicated statistics -- reduced-gradient, weight and update norms -- this
    rank computes (:mod:`arc_engine.stats.partition`), when the decision group is DDP's own (every rank of it holds
    the same replica); None otherwise (every rank computes all of them, ``Reduce.REPLICATED``)."""
    if not dist.is_initialized() or group is not model.process_group:
        return None
    trainable = [p for p in model.module.parameters() if p.requires_grad]
    return owned_ids(trainable, dist.get_rank(group), dist.get_world_size(group))


def register_step_start(engine: ArcEngine, model: torch.nn.Module) -> Any:
    """A forward pre-hook that opens each step (:meth:`ArcEngine.on_step_start`), ahead of any hook a wrapper
    (FSDP2's all-gather) registered. Returns the hook's remover."""
    handle = model.register_forward_pre_hook(lambda module, args: engine.on_step_start(), prepend=True)
    return handle.remove

"""``arc_engine.attach``: the one entry point. It recognises the model and hands it to its framework's adapter in
``integrations/``, which :func:`arc_engine.wiring.wire` wires into the training step.

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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from arc_engine import compat, internals
from arc_engine.config import ArcConfig
from arc_engine.recovery.recompute import RecomputeFn
from arc_engine.wiring import Adapter, Arc, check_optimizer_owns, register_step_start, wire

__all__ = ["Adapter", "Arc", "attach", "register_step_start", "warn_if_untested_torch", "wire"]


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
           config: ArcConfig | str | Path | None = None, *, group: dist.ProcessGroup | None = None,
           lr_scheduler: Any | None = None, recompute_fn: RecomputeFn | None = None,
           ddp_comm_hook: tuple[Callable[..., Any], object] | None = None, grad_scaler: Any | None = None) -> Arc:
    """Attach arc_engine to a model and its optimizer. Collective: call on every rank, once.

    ``model``: a ``DistributedDataParallel`` module (statistics come from a comm hook on its process group),
    megatron-core ``DistributedDataParallel`` chunks, one or a list (delegates to
    :func:`arc_engine.integrations.megatron.attach_megatron`; ``optimizer`` is what ``get_megatron_optimizer``
    returned),
    an FSDP2 (``fully_shard``) model (delegates to :func:`arc_engine.integrations.pytorch.fsdp.attach_fsdp`), a
    ``deepspeed.initialize``-d engine (``optimizer`` may be None; delegates to
    :func:`arc_engine.integrations.deepspeed.attach_deepspeed`), or a plain module (statistics come from
    ``param.grad``). ``config``: an :class:`ArcConfig`, a YAML path,
    or None for defaults. ``group``: the decision group, whose ranks agree on every monitored step and take the
    same action (default: the whole job, the world group; a narrower group must contain every model-parallel peer
    of its ranks). Under DDP, replicated statistics are split among the ranks of DDP's own process group whatever
    the decision group (:mod:`arc_engine.stats.partition`). ``lr_scheduler``: snapshotted and restored with the
    training state when ``recovery`` is enabled (DeepSpeed: a scheduler the loop steps outside the engine; the
    engine's own is always restored; both at once are refused).

    With ``recovery.enabled`` the loop must draw its batches from :attr:`Arc.data_position` and run until
    :attr:`Arc.step` reaches its target (both go back on a rollback and are restored on a resume), and should step
    an LR scheduler only when :attr:`Arc.last_step_applied`.

    ``recompute_fn(module, data_rank)``: required by ``detectors.sdc.recompute`` (DDP and DeepSpeed): yields the
    losses of the micro-batches rank ``data_rank`` trained on in the current step (at :attr:`Arc.data_position`),
    computed with ``module`` (the unwrapped model) and scaled as they were back-propagated; see
    :mod:`arc_engine.recovery.recompute`. Under megatron-core it runs ``forward_backward_func`` itself (see
    :func:`arc_engine.integrations.megatron.attach_megatron`).

    ``ddp_comm_hook=(hook, state)``: DDP accepts a single comm hook and arc_engine installs one, so a reduction hook
    of your own (e.g. ``default_hooks.fp16_compress_hook`` with its process group as state) goes here instead of
    ``register_comm_hook``: arc_engine's hook takes the local statistics and calls yours for the reduction, and the
    gradients are what your hook alone gives. Its result must be the same on every rank of the group (as every
    all-reduce-based hook's is). Not with ``detectors.sdc.recompute`` (withholding a bucket would reach your hook's
    state, e.g. PowerSGD's error feedback).

    ``grad_scaler``: the ``torch.amp.GradScaler`` (FSDP2: ``ShardedGradScaler``) that steps ``optimizer`` under fp16
    mixed precision. Pass it when the loop scales the loss: arc_engine then judges unscaled statistics (the scale
    of each step's backward divided out), reports the steps the scaler skips for overflow as the scaler's
    (``grad_scaler_overflow``, never escalated while the scaler searches its scale: ``policy``), and rolls the
    scaler back with the training state. Any order of ``scale``, ``unscale_``, clipping, ``step``, ``update``
    works. Record the unscaled loss. Not with ``detectors.sdc.recompute``. DeepSpeed and megatron-core scale the
    loss themselves: pass nothing. A scaler that was not passed is found calling the first ``optimizer.step()``
    (on every rank, no communication) and used from there on as if passed, with one ``grad_scaler`` warning event;
    under an optimizer that unscales in its fused kernel, or with ``detectors.sdc.recompute``, that first step
    raises :class:`arc_engine.ArcAbort` (exit code 2) on every rank instead, naming ``grad_scaler=``
    (:class:`arc_engine.integrations.pytorch.amp.ScalerFinder`).
    """
    from torch.nn.parallel import DistributedDataParallel

    warn_if_untested_torch()
    optimizer, grad_scaler = _unwrap_accelerate(optimizer, grad_scaler)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2: no model can be one
        FSDPModule = ()

    if ddp_comm_hook is not None and not isinstance(model, DistributedDataParallel):
        raise ValueError("arc_engine.attach: ddp_comm_hook is for a DistributedDataParallel model, got "
                         f"{type(model).__name__}")
    framework_scaled = isinstance(model, (list, tuple)) or type(model).__module__.startswith(("megatron.",
                                                                                             "deepspeed."))
    if grad_scaler is not None and framework_scaled:
        raise ValueError(f"arc_engine.attach: grad_scaler is for torch.amp loss scaling; {type(model).__name__} "
                         "scales the loss itself (DeepSpeed and megatron-core fp16), pass no grad_scaler")
    if isinstance(model, (list, tuple)) or type(model).__module__.startswith("megatron."):
        from arc_engine.integrations.megatron import attach_megatron

        return attach_megatron(model, optimizer, config, group=group, lr_scheduler=lr_scheduler,
                               recompute_fn=recompute_fn)
    if type(model).__module__.startswith("deepspeed."):
        from arc_engine.integrations.deepspeed import attach_deepspeed

        return attach_deepspeed(model, config, group=group, recompute_fn=recompute_fn, lr_scheduler=lr_scheduler)
    if optimizer is None:
        raise ValueError("arc_engine.attach: an optimizer is required (except for a DeepSpeed engine)")
    check_optimizer_owns(model, optimizer)
    if isinstance(model, FSDPModule):
        from arc_engine.integrations.pytorch.fsdp import attach_fsdp

        return attach_fsdp(model, optimizer, config, group=group, lr_scheduler=lr_scheduler,
                           recompute_fn=recompute_fn, grad_scaler=grad_scaler)
    from arc_engine.integrations.pytorch.ddp import TorchAdapter

    return wire(TorchAdapter(model, optimizer, lr_scheduler, ddp_comm_hook, grad_scaler), config, group=group,
                recompute_fn=recompute_fn)


def _unwrap_accelerate(optimizer: Any, grad_scaler: Any) -> tuple[Any, Any]:
    """What Hugging Face Accelerate's ``accelerator.prepare`` returns for an optimizer: an ``AcceleratedOptimizer``
    around the torch optimizer (the hooks go on the inner one) whose ``scaler`` is the ``GradScaler`` under fp16
    (taken unless ``grad_scaler`` is given). Under DeepSpeed the wrapper's step is the engine's: nothing to take."""
    if optimizer is None or not type(optimizer).__module__.startswith("accelerate."):
        return optimizer, grad_scaler
    inner, scaler = internals.accelerate_unwrapped(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):  # DeepSpeed's ZeRO optimizer: the engine is what attaches
        return optimizer, grad_scaler
    return inner, grad_scaler if grad_scaler is not None else scaler


def warn_if_untested_torch(version: str | None = None) -> bool:
    """Warn (:class:`~arc_engine.compat.UntestedTorchVersion`) when torch is outside :data:`arc_engine.compat.TORCH`;
    True if it is. Nothing is refused: what a feature needs of torch is checked where it is used."""
    return compat.TORCH.check(version or torch.__version__, compat.UntestedTorchVersion) is not None

"""What the PyTorch integration reads of torch's private members (``torch.amp``'s ``GradScaler``, fused optimizers,
DDP): every read of a member a torch release may lack. Local."""

from __future__ import annotations

from typing import Any

import torch

#: the ``GradScaler`` members arc_engine reads to unscale its statistics and see the steps the scaler skips
SCALER_MEMBERS = ("_scale", "_per_optimizer_states", "is_enabled")


def unscales_in_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` unscales in its fused kernel (``_step_supports_amp_scaling``: a scaler then hands it
    ``grad_scale`` and ``found_inf`` for the call)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def kernel_grad_scale(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The ``grad_scale`` a scaler set on a fused optimizer for its step, None outside one."""
    scale = getattr(optimizer, "grad_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


def scaler_missing_members(scaler: Any) -> list[str]:
    """Of :data:`SCALER_MEMBERS`, those this ``GradScaler`` lacks."""
    return [name for name in SCALER_MEMBERS if not hasattr(scaler, name)]


def scaler_optimizer_states(scaler: Any) -> dict | None:
    """A ``GradScaler``'s per-optimizer states (``id(optimizer) -> {"stage": ...}``), None where it keeps none."""
    states = getattr(scaler, "_per_optimizer_states", None)
    return states if isinstance(states, dict) else None


def ddp_has_comm_hook(model: Any) -> bool:
    """Whether a ``DistributedDataParallel`` model has a comm hook registered already."""
    return bool(getattr(model, "_comm_hooks", None))


def queue_backward_callback(callback: Any) -> None:
    """Run ``callback`` (no arguments) when the backward pass under way ends, before ``backward()`` returns: the
    autograd engine's final callbacks, which FSDP2 and DDP queue for the same purpose. Call from a hook that runs
    during the backward; callbacks queued while others run still run."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)

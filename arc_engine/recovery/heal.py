"""Healing around one optimizer step: a learning-rate factor and a gradient scale, applied and undone.

The factor multiplies whatever learning rate the schedule set for this step and is undone right after the step,
so it composes with any LR scheduler (DeepSpeed's, Megatron's, torch's) instead of fighting it.
"""

from __future__ import annotations

from typing import Any

import torch


def scale_learning_rates(param_groups: list[dict[str, Any]], factor: float) -> list[Any]:
    """Multiply every group's ``lr`` by ``factor``; returns the previous values for
    :func:`restore_learning_rates`. A factor of 1 changes nothing (not even the objects)."""
    saved = [group["lr"] for group in param_groups]
    if factor != 1.0:
        for group in param_groups:
            lr = group["lr"]
            group["lr"] = lr * factor if not isinstance(lr, torch.Tensor) else lr.mul(factor)
    return saved


def restore_learning_rates(param_groups: list[dict[str, Any]], saved: list[Any]) -> None:
    for group, lr in zip(param_groups, saved, strict=True):
        group["lr"] = lr


@torch.no_grad()
def scale_gradients(grads: list[torch.Tensor], coefficient: float) -> None:
    """``g *= coefficient`` in place for every gradient (a no-op for 1)."""
    if coefficient != 1.0 and grads:
        torch._foreach_mul_(grads, coefficient)

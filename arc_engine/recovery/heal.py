"""Healing around one optimizer step: a learning-rate factor and a gradient scale, applied and undone.

The factor multiplies whatever learning rate the schedule set for this step and is undone right after the step,
so it composes with any LR scheduler (DeepSpeed's, Megatron's, torch's) instead of fighting it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from arc_engine.engine import ArcEngine


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


def heal_step(engine: ArcEngine, param_groups: list[dict[str, Any]],
              state: Mapping[Any, Any] | None = None) -> list[Any] | None:
    """Before an applied optimizer step (or, for DeepSpeed, one parameter group's call), after the step's checks
    and decision: run the engine's update hooks (:meth:`ArcEngine.add_update_hook`, e.g. injected optimizer-state
    faults) with ``param_groups`` and ``state`` (the optimizer's state, keyed by those groups' parameters), scale the
    gradients of ``param_groups`` by the step's gradient coefficient (recovery's healing clip, a monitor's
    stabilisation: :meth:`ArcEngine.gradient_coefficient`), show them to the shaping monitors
    (:meth:`ArcEngine.before_update`: the Fisher estimate, the EWC penalty) and scale their learning rates by the
    step's factor. Returns the saved learning rates to hand to :func:`restore_learning_rates` after the step, or None
    when nothing was scaled. Local; in normal training without an update hook or a shaping monitor it touches no
    tensor and walks no parameter list."""
    for hook in engine.update_hooks:  # first: an injected wrong reduction precedes anything the step does
        hook(param_groups, state)
    coefficient = engine.gradient_coefficient()
    if coefficient != 1.0:
        scale_gradients([p.grad for group in param_groups for p in group["params"] if p.grad is not None],
                        coefficient)
    if engine.shaping:
        engine.before_update(param_groups)
    factor = engine.step_lr_factor()
    return scale_learning_rates(param_groups, factor) if factor != 1.0 else None

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
    """Before an applied optimizer step (or one DeepSpeed parameter group's call), after the decision: the engine's
    update hooks (e.g. injected optimizer-state faults) see ``param_groups`` and ``state``; the gradients are scaled
    by the step's coefficient (the healing clip, a monitor's factor); the update shapers see them (the Fisher
    estimate, the EWC penalty); the learning rates are scaled by the step's factor. Returns the saved learning rates for
    :func:`restore_learning_rates`, or None when none was scaled. Local; in normal training it walks nothing."""
    for hook in engine.update_hooks:  # first: an injected wrong reduction precedes anything the step does
        hook(param_groups, state)
    coefficient = gradient_coefficient(engine)
    if coefficient != 1.0:
        scale_gradients([p.grad for group in param_groups for p in group["params"] if p.grad is not None],
                        coefficient)
    if engine.hooks.shaping:
        engine.hooks.before_update(param_groups, engine.progress.step)
    factor = step_lr_factor(engine)
    return scale_learning_rates(param_groups, factor) if factor != 1.0 else None


def gradient_coefficient(engine: ArcEngine) -> float:
    """What this step's gradients are multiplied by before the update (1.0 in normal training): recovery's healing
    clip times the monitors' gradient factors, from this step's agreed statistics, so every rank scales alike."""
    coefficient = engine.recovery.clip_coefficient() if engine.recovery is not None else 1.0
    stats, decision = engine.last_stats, engine.last_decision
    if stats is None or decision is None or decision.step != engine.progress.step:
        return coefficient
    return coefficient * engine.hooks.gradient_factor(stats)


def step_lr_factor(engine: ArcEngine) -> float:
    """What this step's learning rate is multiplied by (undone after the step): recovery's healing factor times
    the registered multipliers (e.g. an injected learning-rate fault). 1.0 in normal training."""
    factor = engine.recovery.lr_factor if engine.recovery is not None else 1.0
    for multiplier in engine.lr_multipliers:
        factor *= multiplier()
    return factor

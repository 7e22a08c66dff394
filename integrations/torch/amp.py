"""torch.amp loss scaling: what arc_engine reads of a ``GradScaler`` (``torch.amp.GradScaler``, its
``torch.cuda.amp`` alias, FSDP2's ``ShardedGradScaler``), and the closing of the steps it skips.

A scaler multiplies the loss by its scale S before the backward, so every gradient seen during the backward (a DDP
comm hook, FSDP2's hooks) is S times the true one; ``scaler.step(optimizer)`` unscales the gradients in place
(unless ``unscale_`` already did), checks them for NaN/Inf and calls ``optimizer.step()`` only when they are
finite; ``scaler.update()`` then halves S after an overflow or doubles it after ``growth_interval`` clean steps.
arc_engine therefore takes S at the step's first backward hook and divides what it measured during the backward by
it (S is a power of two by default, so the division is exact), and reads the optimizer's gradients in its step
pre-hook as they are then: unscaled, or, for an optimizer that unscales inside its fused kernel
(``_step_supports_amp_scaling``), scaled by the ``grad_scale`` the scaler hands it.

Why the private reads (torch 2.4 to 2.15 keep them): the public ``get_scale()`` returns a Python float (a host sync
on every call), and a step the scaler skips simply does not call ``optimizer.step()``, so no optimizer hook runs.
:class:`ScalerWatch` reads the scale tensor (``_scale``) and the per-optimizer stage
(``_per_optimizer_states[id(optimizer)]["stage"]``, ``OptState.STEPPED`` once ``step()`` ran, a fresh dict after
``update()``), both checked at attach; nothing of the scaler is written.
"""

from __future__ import annotations

from typing import Any

import torch

from arc_engine.events import Action, Finding, Severity


class ScalerWatch:
    """One ``GradScaler`` and the optimizer it steps, as arc_engine reads them. Local, no communication; the only
    host read is the scale for the message of a step the scaler skipped (which the scaler itself synced on)."""

    def __init__(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        check_scaler(scaler)
        from torch.amp.grad_scaler import OptState

        self.scaler, self.optimizer = scaler, optimizer
        self._stepped = OptState.STEPPED
        self._mark: tuple[int, object] | None = None  # (step, the scaler's per-optimizer states at its start)
        self._scale_step = -1
        self._inverse: torch.Tensor | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.scaler.is_enabled())

    def mark_step(self, step: int) -> None:
        """At the first forward of ``step``: remember the scaler's state object, to tell later whether it finished
        the step without stepping the optimizer."""
        if self._mark is None or self._mark[0] != step:
            self._mark = (step, self.scaler._per_optimizer_states)

    def skipped(self, step: int) -> bool:
        """Whether the scaler finished ``step`` (``step()`` ran, or ``update()`` already did) without calling
        ``optimizer.step()``: arc_engine's step post-hook closes every step the optimizer took, so an open step
        whose scaler moved on was skipped by the scaler."""
        if not self.enabled or self._mark is None or self._mark[0] != step:
            return False
        states = self.scaler._per_optimizer_states
        if states is not self._mark[1]:
            return True
        state = states.get(id(self.optimizer)) if isinstance(states, dict) else None
        return state is not None and state.get("stage") is self._stepped

    def inverse_scale(self, step: int) -> torch.Tensor | None:
        """1 / S for ``step``, on the scale's device (a new tensor, so ``update()`` does not change it): taken at
        the step's first call, during its backward. None while the scaler is disabled or has no scale yet."""
        if self._scale_step != step:
            scale = self.scaler._scale if self.enabled else None
            self._inverse = None if scale is None else scale.detach().double().reciprocal()
            self._scale_step = step
        return self._inverse

    def step_scale(self) -> float:
        """The scale of the step being closed (host read; only for a step the scaler skipped)."""
        return float(1.0 / self._inverse) if self._inverse is not None else float("nan")

    def overflow_finding(self) -> Finding:
        """The scaler's skip, as a finding (the non-finite detector names the rank and group beside it)."""
        scale = self.step_scale()
        return Finding("grad_scaler_overflow", Action.SKIP, Severity.WARNING,
                       f"{type(self.scaler).__name__} skipped the step (NaN/Inf in the gradients at loss scale "
                       f"{scale:g})", (), {"loss_scale": scale}, by_framework=True)


def fused_grad_scale(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """In ``optimizer.step()`` called by a scaler on an optimizer that unscales in its fused kernel: the factor its
    gradients still carry (the scaler sets ``grad_scale`` and ``found_inf`` on it for the call), else None."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    scale = getattr(optimizer, "grad_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


def check_scaler(scaler: Any) -> None:
    """ValueError unless ``scaler`` is a torch.amp ``GradScaler`` (or subclass) with the state arc_engine reads."""
    from torch.amp import GradScaler

    if not isinstance(scaler, GradScaler):
        raise ValueError(f"arc_engine.attach: grad_scaler must be a torch.amp.GradScaler (or ShardedGradScaler); got "
                         f"{type(scaler).__name__}")
    missing = [name for name in ("_scale", "_per_optimizer_states", "is_enabled") if not hasattr(scaler, name)]
    if missing:
        raise ValueError(f"arc_engine.attach: this torch ({torch.__version__}) GradScaler lacks {missing}, which "
                         "arc_engine reads to unscale its statistics and to see the steps the scaler skips")

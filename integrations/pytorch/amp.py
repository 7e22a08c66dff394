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

A scaler the loop uses but did not pass to ``attach`` (``grad_scaler=`` forgotten) would leave the backward's
statistics scaled: a clean run's gradient norm times 65536 reads as an explosion. :class:`ScalerFinder` finds it at
the first ``optimizer.step()``: a ``GradScaler`` registers itself nowhere (not on the optimizer, not in a global),
and a non-fused step gets no argument from it, so the one place it can be found by reference is the call stack --
``scaler.step(optimizer)`` calls ``optimizer.step()`` from its own frames, whose ``self`` is the scaler
(:func:`stepping_scaler`: ``GradScaler.step`` calls it from ``_maybe_opt_step``, or itself for a fused optimizer;
checked with torch 2.13 and 2.15, also through an LR scheduler's wrapper of ``step``). A numeric rule
(the hook's norm against ``.grad``'s, an exact power of two apart) fails as soon as the loop clips after
``unscale_`` and needs a host read on every run; the frame does not, and it yields the scaler itself, so it can be
used as if passed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from arc_engine.config import EXIT_BAD_CONFIG
from arc_engine.events import Action, Finding, Severity
from arc_engine.integrations.pytorch import internals as pytorch_internals
from arc_engine.policy import ArcAbort

if TYPE_CHECKING:
    from arc_engine.engine import ArcEngine


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
    return pytorch_internals.kernel_grad_scale(optimizer) if pytorch_internals.unscales_in_kernel(optimizer) else None


def check_scaler(scaler: Any) -> None:
    """ValueError unless ``scaler`` is a torch.amp ``GradScaler`` (or subclass) with the state arc_engine reads."""
    from torch.amp import GradScaler

    if not isinstance(scaler, GradScaler):
        raise ValueError(f"arc_engine.attach: grad_scaler must be a torch.amp.GradScaler (or ShardedGradScaler); got "
                         f"{type(scaler).__name__}")
    missing = pytorch_internals.scaler_missing_members(scaler)
    if missing:
        raise ValueError(f"arc_engine.attach: this torch ({torch.__version__}) GradScaler lacks {missing}, which "
                         "arc_engine reads to unscale its statistics and to see the steps the scaler skips")


def stepping_scaler(optimizer: torch.optim.Optimizer, max_frames: int = 32) -> Any | None:
    """The enabled ``GradScaler`` whose ``step(optimizer)`` is calling ``optimizer.step()`` right now, else None.
    Call it from a step pre-hook of ``optimizer``: it looks up the call stack for a ``step`` / ``_maybe_opt_step``
    frame whose ``self`` is a GradScaler holding a not yet stepped state for this optimizer (Accelerate's and
    Lightning's wrappers call the same method). Local; no host sync."""
    from torch.amp import GradScaler
    from torch.amp.grad_scaler import OptState

    frame = sys._getframe(1)
    try:
        for _ in range(max_frames):
            if frame is None:
                return None
            if frame.f_code.co_name in ("step", "_maybe_opt_step"):
                scaler = frame.f_locals.get("self")
                states = pytorch_internals.scaler_optimizer_states(scaler) if isinstance(scaler, GradScaler) else None
                state = states.get(id(optimizer)) if states is not None else None
                if state is not None and state.get("stage") is not OptState.STEPPED and scaler.is_enabled():
                    return scaler
            frame = frame.f_back
        return None
    finally:
        del frame  # no reference cycle through the stack


class ScalerFinder:
    """An optimizer step pre-hook, ahead of arc_engine's others, for a loop that attached without ``grad_scaler=``:
    at the first ``optimizer.step()`` it looks for a GradScaler calling it (:func:`stepping_scaler`). None found
    (no loss scaling): nothing more, ever. Found: ``adopt(watch)`` hands it to the adapter, which uses it from this
    step on as if passed, and one warning event names ``grad_scaler=``. What the adapter cannot serve that way
    (``adopt`` raises ValueError, or the optimizer unscales inside its fused kernel, which only a scaler known
    before the first step lets arc_engine divide out) is refused: :class:`ArcAbort` (exit code 2, the message
    naming ``grad_scaler=``) before the step applies anything.

    No communication, so a run without a scaler pays nothing: the verdict rests on what every rank of a
    data-parallel job shares -- under DDP and FSDP2 every rank's scaler judges the same reduced gradients, so every
    rank's scaler calls its first ``optimizer.step()`` at the same iteration, with the same optimizer class and
    config (the fact :class:`~arc_engine.integrations.pytorch.optim.ScalerSkips` rests on too): every rank adopts, or
    every rank refuses, at the same step."""

    def __init__(self, engine: ArcEngine, optimizer: torch.optim.Optimizer,
                 adopt: Callable[[ScalerWatch], None]) -> None:
        self.engine, self.adopt = engine, adopt
        self.pending = True
        # register it before the hooks that read the step's statistics (an FSDP2 flush, the decision): hooks run in
        # the order they were registered
        self.handle = optimizer.register_step_pre_hook(self._pre_step)

    def remove(self) -> None:
        self.handle.remove()

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self.pending:
            return
        self.pending = False
        scaler = stepping_scaler(optimizer)
        if scaler is not None:
            with self.engine.own_work.section("amp.found_scaler"):
                self._take(scaler, optimizer)

    def _take(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        name, engine = type(scaler).__name__, self.engine
        fix = "pass it to attach: arc_engine.attach(model, optimizer, config, grad_scaler=scaler)"
        step = engine.progress.step
        try:
            if pytorch_internals.unscales_in_kernel(optimizer):
                raise ValueError(f"{type(optimizer).__name__} unscales inside its fused kernel, so the gradients "
                                 "arc_engine reads at the step carry the scale, which it divides out only for a "
                                 "scaler it was given at attach")
            self.adopt(ScalerWatch(scaler, optimizer))
        except ValueError as err:
            message = (f"a {name} steps the optimizer but was not passed to arc_engine.attach (grad_scaler=), and "
                       f"arc_engine cannot use it from here on: {err}. Stopped at step {step}, before it "
                       f"applied anything: {fix}")
            engine.emit_action(step, "refused", Severity.ERROR, message, {"exit_code": EXIT_BAD_CONFIG},
                               detector="grad_scaler")
            engine.close()
            raise ArcAbort(f"arc_engine stopped training at step {step}: {message}", step, EXIT_BAD_CONFIG) from None
        scale = float(scaler.get_scale())  # one host read, once
        engine.emit_action(step, "found", Severity.WARNING,
                           f"a {name} steps the optimizer but was not passed to arc_engine.attach (grad_scaler=): "
                           f"found at the first optimizer.step() (step {step}, loss scale {scale:g}) and used "
                           "from there on as if passed (statistics unscaled, its overflow skips reported as its "
                           "own, rolled back with the training state); to have it from the start and in a resume, "
                           f"{fix}", {"loss_scale": scale}, detector="grad_scaler")

"""Inject configured faults into a real training step (see :class:`arc_engine.config.FaultSpec`).

Gradient faults use a tensor hook on the chosen parameter, which runs before the gradient is accumulated and
so before DDP's reduction sees it: the corruption is local to the chosen rank, as a faulty device's would be.
Loss faults are applied by the training loop through :meth:`FaultInjector.on_loss`; they model an event of the
step's training pass, so an SDC recomputation of the step (``recomputing``) does not see them again, while gradient
and bit-flip faults stay active for their whole step, recomputation included, as a faulty device's would.
Learning-rate faults (``lr_scale``) scale the learning rate of the step through the engine
(:meth:`FaultInjector.lr_multiplier`). ``stall`` sleeps in a forward pre-hook at the step's first forward, or, with a
``pattern``, in the forward hook of the first matching module to run in the step (the module's work seems longer).

``current_step`` counts step attempts (the engine's ``iteration``), so a transient fault does not fire again when
a rollback replays its step. ``bitflip`` faults are delegated to :class:`~arc_engine.faults.bitflip.BitFlipInjector`,
the mechanism faults (``attention_lowbit``, ``router_collapse``, ``dead_expert``) to
:class:`~arc_engine.faults.mechanism.MechanismFault`, the state faults (``grad_scale``, ``data_corruption``,
``weight_corruption``, ``memory_leak``, ``optimizer_state``, ``collective_corruption``, ``hardware_events``) to
:mod:`arc_engine.faults.state_faults`; the wiring registers :meth:`FaultInjector.before_update` as an engine update
hook and :meth:`FaultInjector.system_events` as an engine event source only when such a fault is on this rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from arc_engine.config.schema import FaultSpec
from arc_engine.faults.bitflip import BitFlipInjector, BitFlipSpec
from arc_engine.faults.mechanism import MECHANISM_KINDS, MechanismFault, select_modules
from arc_engine.faults.state_faults import STATE_FAULTS


def bitflip_spec(spec: FaultSpec) -> BitFlipSpec:
    """The :class:`BitFlipSpec` of a ``bitflip`` fault from the config (see :class:`FaultSpec`)."""
    timing: dict = {"persistent": True, "start_step": spec.step} if spec.persistent else \
        {"steps": range(spec.step, spec.step + spec.steps), "max_per_step": 1}
    return BitFlipSpec(pattern=spec.pattern or "", where=spec.where, rank=spec.rank, bit=spec.bit, count=spec.count,
                       rate=spec.rate, seed=spec.seed, **timing)


class FaultInjector:
    """Holds this rank's faults; ``current_step`` reports the optimizer step the next gradient belongs to."""

    def __init__(self, specs: list[FaultSpec], rank: int, current_step: Callable[[], int],
                 recomputing: Callable[[], bool] = lambda: False) -> None:
        self.specs = [s for s in specs if s.rank in (rank, -1)]
        self.rank = rank
        self.current_step = current_step
        self.recomputing = recomputing
        self.fired: list[tuple[int, str]] = []
        self.bitflips = [BitFlipInjector(bitflip_spec(s), rank=rank, current_step=current_step)
                         for s in self.specs if s.kind == "bitflip"]
        self.mechanisms = [MechanismFault(s, current_step, self.fired) for s in self.specs if s.kind in MECHANISM_KINDS]
        self.state_faults = [STATE_FAULTS[s.kind](s, current_step, self.fired) for s in self.specs
                             if s.kind in STATE_FAULTS]
        self._update_faults = [fault for fault in self.state_faults if fault.acts_before_update]
        self._event_faults = [fault for fault in self.state_faults if fault.reports_events]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _active(self, spec: FaultSpec) -> bool:
        return spec.step <= self.current_step() < spec.step + spec.steps

    def install(self, model: torch.nn.Module) -> None:
        """Register the fault hooks on ``model`` (raises ValueError on a parameter or module pattern that matches
        nothing here)."""
        named = dict(model.named_parameters())
        for injector in self.bitflips:
            injector.install(model)
        for mechanism in self.mechanisms:
            mechanism.install(model)
        for fault in self.state_faults:
            fault.install(model)
        stalls = [spec for spec in self.specs if spec.kind == "stall" and not spec.pattern]
        if stalls:
            self._handles.append(model.register_forward_pre_hook(lambda module, args: self._stall(stalls)))
        for spec in self.specs:  # a slow device: the matching modules' work takes longer
            if spec.kind == "stall" and spec.pattern:
                for module in select_modules(model, spec.pattern, spec.kind).values():
                    self._handles.append(module.register_forward_hook(
                        lambda module, args, output, spec=spec: self._stall([spec])))
        for spec in self.specs:
            if spec.kind not in ("nan_grad", "inf_grad"):
                continue
            name = spec.param or next(iter(named))
            if name not in named:
                raise ValueError(f"faults: parameter {name!r} not found; known: {sorted(named)[:8]}...")
            self._handles.append(named[name].register_hook(self._grad_hook(spec)))

    def _grad_hook(self, spec: FaultSpec) -> Callable[[torch.Tensor], torch.Tensor | None]:
        value = float("nan") if spec.kind == "nan_grad" else float("inf")

        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            if not self._active(spec):
                return None
            self.fired.append((self.current_step(), spec.kind))
            corrupted = grad.clone()
            corrupted.view(-1)[0] = value
            return corrupted

        return hook

    def _stall(self, specs: list[FaultSpec]) -> None:
        """``stall``: sleep at the step's first forward, or the first matching module's (once per step)."""
        for spec in specs:
            if self._active(spec) and (self.current_step(), spec.kind) not in self.fired:
                self.fired.append((self.current_step(), spec.kind))
                time.sleep(spec.seconds)

    def lr_multiplier(self) -> float:
        """The product of the active ``lr_scale`` faults' scales (1 when none is active). The engine's optimizer
        hooks apply it to the step's learning rate, together with recovery's healing factor, and undo both after
        the step."""
        scale = 1.0
        for spec in self.specs:
            if spec.kind == "lr_scale" and self._active(spec):
                scale *= spec.scale
                if (self.current_step(), spec.kind) not in self.fired:
                    self.fired.append((self.current_step(), spec.kind))
        return scale

    def on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Apply active loss faults (``nan_loss``, ``loss_scale``) to this rank's loss; identity otherwise (and
        while the step is being recomputed)."""
        if self.recomputing():
            return loss
        for spec in self.specs:
            if not self._active(spec):
                continue
            if spec.kind == "nan_loss":
                self.fired.append((self.current_step(), spec.kind))
                loss = loss * float("nan")
            elif spec.kind == "loss_scale":
                self.fired.append((self.current_step(), spec.kind))
                loss = loss * spec.scale
        return loss

    @property
    def acts_before_update(self) -> bool:
        """Whether a fault on this rank acts in :meth:`before_update` (``optimizer_state``,
        ``collective_corruption``): the wiring registers that hook only then."""
        return bool(self._update_faults)

    @property
    def reports_events(self) -> bool:
        """Whether a fault on this rank reports :meth:`system_events` (``hardware_events``)."""
        return bool(self._event_faults)

    def before_update(self, param_groups: list[dict[str, Any]], state: Mapping[Any, Any] | None = None) -> None:
        """The engine's update hook: in an applied optimizer step, after arc_engine's checks of the step and before
        the update, apply the active ``optimizer_state`` / ``collective_corruption`` faults to ``param_groups`` (the
        parameters the optimizer steps) and ``state`` (its state, keyed by those parameters). Local."""
        for fault in self._update_faults:
            fault.before_update(param_groups, state)

    def system_events(self) -> int:
        """The engine's event source, asked once per step attempt: the system events the active
        ``hardware_events`` faults add (0 when none is active)."""
        return sum(fault.system_events() for fault in self._event_faults)

    def bitflips_fired(self) -> list[dict]:
        """Every bit-flip injection so far (``step``, ``module``, ``where``, ``bit``, ``num_flipped``, ...)."""
        return [record for injector in self.bitflips for record in injector.fired]

    def remove(self) -> None:
        """Remove every fault hook and release what the faults hold (``memory_leak``'s memory). Idempotent."""
        for injector in self.bitflips:
            injector.remove()
        for mechanism in self.mechanisms:
            mechanism.remove()
        for fault in self.state_faults:
            fault.remove()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

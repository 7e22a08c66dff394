"""State faults: corruptions of what a training step reads or keeps -- its gradients, its data, its weights, its
optimizer state -- and of the system around it (hardware events, leaked memory). They are the R-Metric paper's fault
library (``shared/papers/r-metric-proactive-reliability.txt``, Appendix F) and ARC's weight and optimizer sabotage,
as kinds of :class:`~arc_engine.config.FaultSpec` (``docs/faults.md`` maps the papers' names to them).

* ``grad_scale`` -- a tensor hook (``register_hook``) on each parameter matching ``pattern``: it runs before the
  gradient is accumulated, so before any reduction sees it, and returns ``scale * g + N(0, (noise * rms(g))^2)`` on
  a ``rate`` fraction of the elements (:func:`perturb`). Every backward of an active step passes through it (each
  micro-batch, a recomputation), with the same draw.
* ``data_corruption`` -- a forward pre-hook on the model replaces a ``rate`` fraction of the token ids of its first
  positional argument by uniform ids below the vocabulary size of its first embedding (:func:`corrupt_tokens`), on
  every forward of an active step: each micro-batch, and a recomputation of the step, which reads the same data.
* ``weight_corruption`` -- at the first forward of each active step attempt, the parameters matching ``pattern``
  become :func:`perturb` of themselves, in place. Where a separate fp32 master copy exists (DeepSpeed ZeRO, Megatron
  mixed precision) this hits the compute copy, which the next update rewrites from the masters, as a memory fault in
  that copy would; ``persistent`` re-applies it every step.
* ``memory_leak`` -- at the first forward of each active step attempt, ``megabytes`` MiB are allocated on the
  model's device and kept until :meth:`StateFault.remove`.
* ``optimizer_state`` / ``collective_corruption`` -- :meth:`StateFault.before_update`, which the engine's update
  hooks call in every applied optimizer step after arc_engine's checks of the step and before the update
  (:func:`arc_engine.recovery.heal.heal_step`): the optimizer state ``state_key`` of every stepped parameter, or
  its reduced gradient, is multiplied by ``scale``; with ``bit`` set, that bit is flipped instead in ``count``
  (None: 1) elements of one of those tensors (drawn with probability proportional to its size): silent data
  corruption in the optimizer's memory or in a collective's result.
* ``hardware_events`` -- :meth:`StateFault.system_events`, an event source of the engine
  (:meth:`arc_engine.engine.ArcEngine.add_event_source`) asked once per step attempt.

Timing: active at step attempts in ``[step, step + steps)``, or at every attempt from ``step`` on with
``persistent`` (``current_step()`` is the engine's iteration). Random choices come from a CPU ``torch.Generator``
(``random.Random`` for a yes/no draw) seeded from ``(seed, step, ...)``, so one step attempt draws the same
corruption on every call. On an inactive step a hook does one step check in Python and nothing else: no draw, no
copy, no allocation.
"""

from __future__ import annotations

import fnmatch
import random
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from arc_engine import internals
from arc_engine.config.schema import FaultSpec

#: ``data_corruption``'s fraction of corrupted token ids when ``rate`` is not given.
DEFAULT_TOKEN_RATE = 0.3
MIB = 1 << 20


def mix_seed(*parts: int) -> int:
    """One 63-bit seed from integers (e.g. ``seed, step, parameter index``); deterministic across processes."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % (1 << 63)
    return seed


def seeded_generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded with :func:`mix_seed` of ``parts``."""
    return torch.Generator().manual_seed(mix_seed(*parts))


def perturb(tensor: torch.Tensor, *, scale: float, noise: float, rate: float | None,
            generator: torch.Generator) -> torch.Tensor:
    """A new tensor equal to ``scale * x + N(0, (noise * rms(x))^2)`` on a ``rate`` fraction of the elements of
    ``x = tensor`` (each chosen independently; None: every element) and to ``x`` elsewhere, in ``tensor``'s dtype and
    on its device. rms is over the whole tensor (in float32). The choice, then the noise, are drawn from
    ``generator`` (on its device) and moved to ``tensor``'s device. Local, no host sync."""
    values = tensor.detach()
    mask = None
    if rate is not None:
        mask = (torch.rand(values.shape, generator=generator, device=generator.device) < rate).to(values.device)
    result = values * scale
    if noise > 0.0 and values.numel():
        rms = values.float().pow(2).mean().sqrt()
        gaussian = torch.randn(values.shape, generator=generator, device=generator.device).to(values.device)
        result = result + (gaussian * (noise * rms)).to(values.dtype)
    return result if mask is None else torch.where(mask, result, values)


def corrupt_tokens(tokens: torch.Tensor, rate: float, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """A copy of the integer ``tokens`` in which each id is, with probability ``rate``, replaced by a uniform id in
    ``[0, vocab_size)`` (which may equal the old one). Drawn from ``generator`` and moved to ``tokens``' device."""
    mask = torch.rand(tokens.shape, generator=generator, device=generator.device) < rate
    random_ids = torch.randint(0, vocab_size, tokens.shape, generator=generator, device=generator.device)
    return torch.where(mask.to(tokens.device), random_ids.to(tokens.device, tokens.dtype), tokens)


def select_parameters(model: nn.Module, pattern: str | None, kind: str, *,
                      trainable: bool) -> list[tuple[int, str, torch.Tensor]]:
    """``(index in named_parameters(), name, parameter)`` of the parameters of ``model`` whose names match the
    fnmatch ``pattern`` (None: every one), trainable ones only with ``trainable``. Raises ValueError naming
    candidates when none does."""
    named = list(model.named_parameters())
    chosen = [(index, name, param) for index, (name, param) in enumerate(named)
              if fnmatch.fnmatchcase(name, pattern or "*") and (param.requires_grad or not trainable)]
    if not chosen:
        candidates = [name for name, param in named if param.requires_grad or not trainable]
        raise ValueError(f"faults: {kind} pattern {pattern!r} matches no {'trainable ' if trainable else ''}"
                         f"parameter; candidates: {candidates[:12]}{'...' if len(candidates) > 12 else ''}")
    return chosen


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``param``: its local shard for a DTensor (FSDP2), the tensor itself otherwise."""
    return param.to_local() if isinstance(param, DTensor) else param


def vocab_size(model: nn.Module) -> int:
    """``num_embeddings`` of the first module in ``named_modules()`` that has one (``nn.Embedding``; megatron-core's
    ``VocabParallelEmbedding`` holds the whole vocabulary's there). Raises ValueError when none does."""
    for module in model.modules():
        size = internals.embedding_size(module)
        if size is not None:
            return size
    raise ValueError(f"faults: data_corruption needs a token embedding (an nn.Embedding or a module with "
                     f"`num_embeddings`) in {type(model).__name__}; found none")


class StateFault:
    """One configured state fault on this rank (see the module docstring); a subclass per kind. The caller
    (:class:`~arc_engine.faults.FaultInjector`) has already dropped specs for other ranks. ``fired`` receives
    ``(step, kind)`` once per step attempt that the fault acted on."""

    #: the fault acts in :meth:`before_update` (the engine's update hook)
    acts_before_update = False
    #: the fault reports :meth:`system_events` (an engine event source)
    reports_events = False

    def __init__(self, spec: FaultSpec, current_step: Callable[[], int], fired: list[tuple[int, str]]) -> None:
        self.spec = spec
        self.current_step = current_step
        self.fired = fired
        self._last_fired: int | None = None
        self._applied_step: int | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def window_step(self) -> int | None:
        """The current step attempt when it lies in the fault's window, else None (pure Python, no sync)."""
        step = self.current_step()
        if step < self.spec.step or (not self.spec.persistent and step >= self.spec.step + self.spec.steps):
            return None
        return step

    def record(self, step: int) -> None:
        """Note in ``fired`` that the fault acted at ``step`` (once per step)."""
        if self._last_fired != step:
            self._last_fired = step
            self.fired.append((step, self.spec.kind))

    def active_step(self) -> int | None:
        """:meth:`window_step`, recorded in ``fired`` when not None."""
        step = self.window_step()
        if step is not None:
            self.record(step)
        return step

    def first_active_call(self) -> int | None:
        """:meth:`active_step` at the first call of a step attempt, None at its later calls (once per attempt)."""
        step = self.active_step()
        if step is None or step == self._applied_step:
            return None
        self._applied_step = step
        return step

    def install(self, model: nn.Module) -> None:
        """Hook ``model`` where the kind needs it (raises ValueError when it cannot act on this model). Local."""

    def before_update(self, param_groups: list[dict[str, Any]], state: Mapping[Any, Any] | None) -> None:
        """In an applied optimizer step, before the update (see :func:`arc_engine.recovery.heal.heal_step`)."""

    def system_events(self) -> int:
        """System events this step attempt adds (asked once per attempt)."""
        return 0

    def remove(self) -> None:
        """Remove every hook and release what the fault holds (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class GradScaleFault(StateFault):
    """``grad_scale``: the local gradient of the matching parameters, through tensor hooks."""

    def install(self, model: nn.Module) -> None:
        for index, _name, param in select_parameters(model, self.spec.pattern, self.spec.kind, trainable=True):
            self._handles.append(param.register_hook(self._hook(index)))

    def _hook(self, index: int) -> Callable[[torch.Tensor], torch.Tensor | None]:
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            step = self.active_step()
            if step is None:
                return None
            return perturb(grad, scale=self.spec.scale, noise=self.spec.noise, rate=self.spec.rate,
                           generator=seeded_generator(self.spec.seed, step, index))

        return hook


class DataCorruptionFault(StateFault):
    """``data_corruption``: the token ids of the model's first positional argument, in a forward pre-hook."""

    def install(self, model: nn.Module) -> None:
        self.vocab_size = vocab_size(model)
        self._handles.append(model.register_forward_pre_hook(self._corrupt))

    def _corrupt(self, module: nn.Module, args: tuple) -> tuple | None:
        step = self.active_step()
        if step is None:
            return None
        tokens = args[0] if args else None
        if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.is_complex() or \
                tokens.dtype == torch.bool:
            found = type(tokens).__name__ if not isinstance(tokens, torch.Tensor) else f"a {tokens.dtype} tensor"
            raise TypeError(f"faults: data_corruption expects the token ids (an integer tensor) as the first "
                            f"positional argument of {type(module).__name__}'s forward; got {found}")
        rate = DEFAULT_TOKEN_RATE if self.spec.rate is None else self.spec.rate
        return (corrupt_tokens(tokens, rate, self.vocab_size, seeded_generator(self.spec.seed, step)), *args[1:])


class WeightCorruptionFault(StateFault):
    """``weight_corruption``: the matching parameters, in place, at the first forward of each active step."""

    def install(self, model: nn.Module) -> None:
        self._params = select_parameters(model, self.spec.pattern, self.spec.kind, trainable=False)
        partitioned = [name for _, name, param in self._params if internals.is_zero3_param(param)]
        if partitioned:
            raise ValueError(f"faults: weight_corruption cannot reach DeepSpeed ZeRO-3's partitioned parameters "
                             f"({partitioned[:4]}...): they are gathered only inside each module's forward")
        self._handles.append(model.register_forward_pre_hook(self._corrupt))

    @torch.no_grad()
    def _corrupt(self, module: nn.Module, args: tuple) -> None:
        step = self.first_active_call()
        if step is None:
            return
        spec = self.spec
        for index, _name, param in self._params:
            weights = local_tensor(param)
            if spec.rate is None and spec.noise == 0.0:
                weights.mul_(spec.scale)
            else:
                weights.copy_(perturb(weights, scale=spec.scale, noise=spec.noise, rate=spec.rate,
                                      generator=seeded_generator(spec.seed, step, index)))


class MemoryLeakFault(StateFault):
    """``memory_leak``: ``megabytes`` MiB more held on the model's device at each active step attempt."""

    def __init__(self, spec: FaultSpec, current_step: Callable[[], int], fired: list[tuple[int, str]]) -> None:
        super().__init__(spec, current_step, fired)
        self.blocks: list[torch.Tensor] = []
        self.device = torch.device("cpu")

    def install(self, model: nn.Module) -> None:
        first = next(iter(model.parameters()), None)
        if first is None:
            raise ValueError(f"faults: memory_leak allocates on the device of the model's first parameter; "
                             f"{type(model).__name__} has none")
        self.device = local_tensor(first).device
        self._handles.append(model.register_forward_pre_hook(self._leak))

    def _leak(self, module: nn.Module, args: tuple) -> None:
        if self.first_active_call() is None:
            return
        # zeros, not empty: the pages are written, so the memory is really taken (host memory included)
        self.blocks.append(torch.zeros(round(self.spec.megabytes * MIB), dtype=torch.uint8, device=self.device))

    @property
    def held_bytes(self) -> int:
        """Bytes the fault holds now."""
        return sum(block.numel() for block in self.blocks)

    def remove(self) -> None:
        super().remove()
        self.blocks.clear()


def flip_in_one(tensors: list[torch.Tensor], spec: FaultSpec, step: int) -> None:
    """Flip bit ``spec.bit`` in ``spec.count`` (None: 1) elements of one tensor of ``tensors``, drawn with probability
    proportional to its size, in place; seeded by ``(seed, step)``. Local, no host sync."""
    from arc_engine.faults.bitflip import choose_elements, flip_bits

    sizes = torch.tensor([float(t.numel()) for t in tensors])
    generator = seeded_generator(spec.seed, step)
    target = tensors[int(torch.multinomial(sizes, 1, generator=generator))]
    mask = choose_elements(target.shape, None, spec.count or 1, generator, target.device)
    target.copy_(flip_bits(target, spec.bit, mask))  # spec.bit is set by the caller


class OptimizerStateFault(StateFault):
    """``optimizer_state``: the optimizer state ``state_key`` of every stepped parameter, times ``scale`` (or, with
    ``bit``, that bit flipped in ``count`` elements of one of them, once per step)."""

    acts_before_update = True

    @torch.no_grad()
    def before_update(self, param_groups: list[dict[str, Any]], state: Mapping[Any, Any] | None) -> None:
        step = self.window_step()
        if step is None:
            return
        if state is None:
            raise ValueError("faults: optimizer_state needs the optimizer's state, which this integration does not "
                             "pass to heal_step")
        values = []
        for group in param_groups:
            for param in group["params"]:
                entry = state.get(param)  # (not state[param]: that would add an entry to a defaultdict)
                value = entry.get(self.spec.state_key) if entry else None
                if isinstance(value, torch.Tensor):
                    values.append(value)
        if not values or (self.spec.bit is not None and self._last_fired == step):
            return  # parameters without state yet (the first step) are skipped; one flip per step
        if self.spec.bit is not None:
            flip_in_one(values, self.spec, step)
        else:
            for value in values:
                value.mul_(self.spec.scale)
        self.record(step)


class CollectiveCorruptionFault(StateFault):
    """``collective_corruption``: the reduced gradient of every stepped parameter, times ``scale`` (or, with ``bit``,
    that bit flipped in ``count`` elements of one of them, once per step), with probability ``rate`` per step."""

    acts_before_update = True

    def fires_at(self, step: int) -> bool:
        """Whether the step's draw (``random.Random`` seeded by ``(seed, step)``) corrupts it; the same answer for
        every call in the step (DeepSpeed steps once per parameter group)."""
        rate = 1.0 if self.spec.rate is None else self.spec.rate
        return rate >= 1.0 or random.Random(mix_seed(self.spec.seed, step)).random() < rate

    @torch.no_grad()
    def before_update(self, param_groups: list[dict[str, Any]], state: Mapping[Any, Any] | None) -> None:
        step = self.window_step()
        if step is None or not self.fires_at(step):
            return
        grads = [param.grad for group in param_groups for param in group["params"] if param.grad is not None]
        if self.spec.bit is not None:
            if grads and self._last_fired != step:
                flip_in_one(grads, self.spec, step)
                self.record(step)
            return
        self.record(step)
        for grad in grads:
            grad.mul_(self.spec.scale)


class HardwareEventsFault(StateFault):
    """``hardware_events``: ``count`` system events per active step attempt (an ECC error burst)."""

    reports_events = True

    def system_events(self) -> int:
        step = self.active_step()
        return 0 if step is None else (self.spec.count or 1)


#: the class of each state-fault kind
STATE_FAULTS: dict[str, type[StateFault]] = {
    "grad_scale": GradScaleFault,
    "data_corruption": DataCorruptionFault,
    "weight_corruption": WeightCorruptionFault,
    "memory_leak": MemoryLeakFault,
    "optimizer_state": OptimizerStateFault,
    "collective_corruption": CollectiveCorruptionFault,
    "hardware_events": HardwareEventsFault,
}

"""Per-rank section times of the step, measured locally and without a host sync: the forward section and the
iteration (:class:`SectionClock`, every step) and the local compute (:class:`ComputeProbe`, sampled steps).

Two marks per step: the step's start (the first forward pre-hook, :meth:`ArcEngine.on_step_start`) and its first
recorded loss (:meth:`ArcEngine.record_loss`). Between them lies the step's first forward pass: under DDP and
ZeRO-1/2 local compute before any wait on a peer, so a slow rank shows there and nowhere else (its peers absorb its
delay waiting in the gradient reduction, which makes every rank's whole step equally long). The iteration time is
the time between two step starts.

On CPU the marks are host clock readings. On CUDA the host runs ahead of the device, so the marks are CUDA events
on the current stream, read one step later: by then the previous agreement's device-to-host copy has waited for
them, :meth:`torch.cuda.Event.query` is True and reading costs no sync (an event not yet complete reads NaN).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from arc_engine import internals


def mark(cuda: bool) -> object:
    """A time mark: the host clock, or on CUDA an event recorded on the current stream (no sync)."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class SectionClock:
    """Marks of the current step and the section times of the latest step whose marks can be read. Local to the
    rank, no collective; a few microseconds per mark."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start: object | None = None       # this step's start mark
        self._loss: object | None = None        # this step's first-loss mark
        self._previous: tuple[object | None, object | None] = (None, None)  # the last step's (start, loss)
        self._before: object | None = None      # the start mark of the step before the last

    def _mark(self) -> object:
        return mark(self.cuda)

    def start(self) -> None:
        """The step starts (first forward of the step)."""
        self._before = self._previous[0]
        self._previous = (self._start, self._loss)
        self._start, self._loss = self._mark(), None

    def loss(self) -> None:
        """The step's first loss is recorded (later calls in the step are ignored)."""
        if self._start is not None and self._loss is None:
            self._loss = self._mark()

    def times(self) -> tuple[float, float]:
        """(forward seconds, iteration seconds): on CPU of the current step (its forward; its start minus the
        previous step's); on CUDA of the previous step (read a step late). NaN where a mark is missing or its
        event has not completed."""
        if not self.cuda:
            return (_seconds(self._start, self._loss), _seconds(self._previous[0], self._start))
        start, loss = self._previous
        return (_elapsed(start, loss), _elapsed(self._before, start))


def _seconds(first: object | None, second: object | None) -> float:
    if first is None or second is None:
        return math.nan
    return float(second) - float(first)  # type: ignore[arg-type]


def _elapsed(first: object | None, second: object | None) -> float:
    if first is None or second is None or not (first.query() and second.query()):  # type: ignore[attr-defined]
        return math.nan
    return first.elapsed_time(second) / 1000.0  # type: ignore[attr-defined]


class ComputeProbe:
    """This rank's local compute time in a step's forward pass: the summed forward time of a bounded set of modules
    that make no collective (:func:`local_compute_modules`), each timed at its first call of the step.

    A rank's forward section includes its waits on peers wherever the forward pass communicates (tensor-parallel
    all-reduces, ZeRO-3 and FSDP2 gathers, pipeline receives): a slow tensor-parallel rank makes its peers' forward
    sections as long as its own. Its compute time is long on it alone, which tells the slow rank from those that
    wait for it. The probe's hooks come after the framework's own forward pre-hooks (parameter gathers, which may
    wait) and after its forward hooks, so the time is the module's work.

    Sampled: the hooks are registered at the start of every ``every``-th optimizer step and removed at the next
    step start, so other steps pay nothing. On CPU the marks are host clock readings; on CUDA events read when they
    have completed (:meth:`take`, no sync)."""

    def __init__(self, modules: list[torch.nn.Module], device: torch.device, every: int) -> None:
        self.modules = modules
        self.cuda = device.type == "cuda"
        self.every = every
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._open: list[list[list[object | None]]] = []  # sampled steps not read yet: per module [begin, end]

    def _mark(self) -> object:
        return mark(self.cuda)

    def start(self, step: int) -> None:
        """A step starts: stop timing the last one; time this one if it is a sampled step."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.every <= 0 or not self.modules or step % self.every:
            return
        marks: list[list[object | None]] = [[None, None] for _ in self.modules]
        for module, pair in zip(self.modules, marks, strict=True):
            self._handles.append(module.register_forward_pre_hook(self._begin(pair)))
            self._handles.append(module.register_forward_hook(self._end(pair)))
        self._open = [*self._open[-3:], marks]  # at most 4 unread samples (CUDA: a few steps late)

    def _begin(self, pair: list[object | None]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if pair[0] is None:
                pair[0] = self._mark()
        return hook

    def _end(self, pair: list[object | None]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if pair[0] is not None and pair[1] is None:
                pair[1] = self._mark()
        return hook

    def on_step_start(self, step: int) -> None:
        """The step-hook form of :meth:`start` (:class:`arc_engine.step_hooks.StepHooks`)."""
        self.start(step)

    def take(self) -> list[float]:
        """The compute seconds of the sampled steps whose marks can be read, oldest first; each is returned once.
        On CPU the current step's sample is readable once its forward pass ran; on CUDA a sample is read when all its
        events have completed (a step or more later). Modules that did not run in the step are left out."""
        done, still_open = [], []
        for marks in self._open:
            pairs = [(begin, end) for begin, end in marks if begin is not None and end is not None]
            if not pairs:
                still_open.append(marks)
            elif not self.cuda:
                done.append(sum(float(end) - float(begin) for begin, end in pairs))  # type: ignore[arg-type]
            elif all(begin.query() and end.query() for begin, end in pairs):  # type: ignore[attr-defined]
                done.append(sum(begin.elapsed_time(end) for begin, end in pairs) / 1000.0)  # type: ignore
            else:
                still_open.append(marks)
        self._open = still_open
        return done

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def is_compiled(roots: list[torch.nn.Module]) -> bool:
    """Whether any module under ``roots`` runs through ``torch.compile`` (a compiled wrapper, or ``Module.compile()``):
    hooks added to its modules after compilation may be ignored (dynamo does not guard on them by default)."""
    return any(internals.is_compiled(module) for root in roots for module in root.modules())


def local_compute_modules(roots: list[torch.nn.Module], limit: int,
                          communicates: Callable[[torch.nn.Module], bool] = lambda module: False
                          ) -> list[torch.nn.Module]:
    """The modules :class:`ComputeProbe` times: leaf modules with parameters of their own whose forward makes no
    collective (``communicates`` says which do: the adapter knows its framework's layers), at most ``limit``,
    spread evenly over the model in module order."""
    leaves = [module for root in roots for module in root.modules()
              if not any(True for _ in module.children()) and any(True for _ in module.parameters(recurse=False))
              and not communicates(module)]
    if len(leaves) <= limit:
        return leaves
    return [leaves[(index * len(leaves)) // limit] for index in range(limit)]

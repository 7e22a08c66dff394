"""Per-rank section times of the step, measured locally and without a host sync.

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

import torch


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
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

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

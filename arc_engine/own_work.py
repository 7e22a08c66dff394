"""arc_engine's own work per training step, piece by piece (``stats.own_work``).

Every place where a framework hands control to arc_engine (a forward pre-hook, a gradient or comm hook, an
optimizer step hook, ``record_loss``) and the larger parts inside them (the decision, a snapshot, a checkpoint's
staging) is a named *piece*. With ``stats.own_work: true`` each call of a piece is timed in the CPU time of the
thread that runs it (``time.thread_time_ns``: time the thread spends preempted or blocked in a collective is not
counted), and on CUDA also by a pair of events around the kernels it enqueues (read back without a sync, once they
completed). Periodic pieces (optimizer statistics every k-th step, snapshots, QK spectra) are amortized by dividing
every total by the steps timed.

Pieces nest (the decision runs inside the optimizer's pre-step hook); the *own work* of a step is the time of the
calls made outside any other piece, so nothing is counted twice, and the nested ones show where it goes (a piece's
depth is where it was first seen). The step time it is compared with is the mean wall time between two step ends
on this rank.

Off (the default), :meth:`OwnWork.wrap` returns the function itself and :meth:`OwnWork.section` a shared no-op
context: nothing is added to the hot path. On, a timed call costs about a microsecond of host time.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])
_NULL = contextlib.nullcontext()


class _Depth(threading.local):
    """Each thread's nesting depth of timed sections."""

    depth = 0


@dataclass
class Piece:
    """One named piece's totals since the start (or the last :meth:`OwnWork.reset`)."""

    depth: int
    calls: int = 0
    cpu_ns: int = 0
    device_ms: float = 0.0


@dataclass
class OwnWorkReport:
    """Per-step figures of one rank: each piece's host CPU time and device time (ms per step, amortized), calls
    per step, and the total over the outermost pieces against the mean step time."""

    steps: int
    step_ms: float
    host_ms: float = 0.0
    device_ms: float = 0.0
    pieces: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        """Own host work as a fraction of the step (0 when no step time was measured)."""
        return self.host_ms / self.step_ms if self.step_ms > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The figures for the run summary's ``own_work``."""
        return {"host_ms": self.host_ms, "device_ms": self.device_ms, "step_ms": self.step_ms,
                "fraction": self.fraction, "pieces": self.pieces}

    def lines(self) -> list[str]:
        """A human-readable table: the total, then every piece by depth (nested ones indented), costliest first."""
        out = [f"arc_engine work: {self.host_ms:.3f} ms per step = {self.fraction * 100:.3f}% of the step "
               f"({self.step_ms:.1f} ms, mean of {self.steps} steps)"
               + (f"; device {self.device_ms:.3f} ms" if self.device_ms else "")]
        for name, piece in self.pieces.items():
            indent = "  " * (int(piece["depth"]) + 1)
            device = f", device {piece['device_ms']:.3f} ms" if piece["device_ms"] else ""
            out.append(f"{indent}{name}: {piece['host_ms']:.3f} ms, {piece['calls']:.2f} calls per step{device}")
        return out


class OwnWork:
    """Times arc_engine's pieces on this rank (see the module docstring). ``device``: the statistics' device (CUDA
    events are used only when it is a CUDA device)."""

    def __init__(self, enabled: bool, device: torch.device | None = None) -> None:
        self.enabled = enabled
        self.use_events = enabled and device is not None and device.type == "cuda"
        self.pieces: dict[str, Piece] = {}
        self._local = _Depth()
        self._lock = threading.Lock()
        self._pending_events: list[tuple[Piece, Any, Any]] = []
        self._top_ns = 0          # CPU time of calls made outside any other piece: the own work
        self._top_device_ms = 0.0
        self._step_ends = 0       # steps the totals cover
        self._intervals = 0       # wall-clock intervals between two step ends, and their sum
        self._step_wall_s = 0.0
        self._last_step_end: float | None = None

    def wrap(self, name: str, function: F) -> F:
        """``function`` timed as piece ``name`` (``function`` itself when off)."""
        if not self.enabled:
            return function

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self._timed(name):
                return function(*args, **kwargs)

        return timed  # type: ignore[return-value]

    def section(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """A ``with`` block timed as piece ``name`` (a shared no-op context when off)."""
        return self._timed(name) if self.enabled else _NULL

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        depth = self._local.depth
        piece = self.pieces.get(name)
        if piece is None:
            with self._lock:
                piece = self.pieces.setdefault(name, Piece(depth))
        events = None
        if self.use_events:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        self._local.depth = depth + 1
        start = time.thread_time_ns()
        try:
            yield
        finally:
            elapsed = time.thread_time_ns() - start
            self._local.depth = depth
            with self._lock:
                piece.calls += 1
                piece.cpu_ns += elapsed
                if depth == 0:
                    self._top_ns += elapsed
                if events is not None:
                    events[1].record()
                    self._pending_events.append((piece, depth == 0, *events))

    def end_step(self) -> None:
        """At each step's end (the engine calls it): count the step and its wall time, and collect the device times
        of completed events (never waits for the device)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        self._step_ends += 1
        if self._last_step_end is not None:
            self._intervals += 1
            self._step_wall_s += now - self._last_step_end
        self._last_step_end = now
        if self._pending_events:
            self._collect_events(wait=False)

    def _collect_events(self, *, wait: bool) -> None:
        with self._lock:
            pending, self._pending_events = self._pending_events, []
        keep = []
        for piece, outermost, start, end in pending:
            if wait:
                end.synchronize()
            if end.query():
                elapsed = start.elapsed_time(end)
                piece.device_ms += elapsed
                self._top_device_ms += elapsed if outermost else 0.0
            else:
                keep.append((piece, outermost, start, end))
        with self._lock:
            self._pending_events = keep + self._pending_events

    def reset(self) -> None:
        """Forget the totals (e.g. after warm-up); the next step end starts the step clock again."""
        with self._lock:
            self.pieces = {name: Piece(piece.depth) for name, piece in self.pieces.items()}
            self._pending_events = []
            self._top_ns, self._top_device_ms = 0, 0.0
        self._step_ends, self._intervals, self._step_wall_s, self._last_step_end = 0, 0, 0.0, None

    def report(self) -> OwnWorkReport:
        """The per-step figures so far (waits for the device's pending events, if any: call it off the hot path)."""
        if self._pending_events:
            self._collect_events(wait=True)
        steps = max(self._step_ends, 1)
        step_ms = self._step_wall_s * 1e3 / self._intervals if self._intervals else 0.0
        report = OwnWorkReport(self._step_ends, step_ms, host_ms=self._top_ns / 1e6 / steps,
                               device_ms=self._top_device_ms / steps)
        for name, piece in sorted(self.pieces.items(), key=lambda item: (item[1].depth, -item[1].cpu_ns)):
            report.pieces[name] = {"host_ms": piece.cpu_ns / 1e6 / steps, "device_ms": piece.device_ms / steps,
                                   "calls": piece.calls / steps, "depth": piece.depth}
        return report

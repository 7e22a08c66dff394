"""Count arc_engine's host synchronisations on CPU, where no device would stall for them.

On a GPU, reading a device tensor's value on the host (``item``, ``tolist``, ``bool(t)``, ``.cpu()``, a boolean
mask, ``nonzero``...) waits for every kernel queued before it. On CPU nothing waits, so a sync costs nothing and a
regression would go unseen; :class:`HostSyncCounter` makes them visible. It is a torch function mode that records
each call of a host-reading operation whose innermost caller outside torch is arc_engine's own code (the test's
loop, the framework's code and the harness itself are not counted), keyed by the step the loop says it is in.

``.numpy()`` is not counted: it refuses a CUDA tensor, so it only ever follows a counted copy. A call arc_engine makes
into a framework's function is attributed to the framework (the innermost caller decides).

On CUDA, :class:`CudaSyncCounter` checks the same claim with ``torch.cuda.set_sync_debug_mode``: the device itself
reports each synchronising operation, attributed the same way.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import arc_engine

_PACKAGE_DIR = os.path.dirname(os.path.abspath(arc_engine.__file__))


def _integrations_dir() -> str:
    """Where ``arc_engine.integrations`` lives: inside the package when installed, the repository's top-level
    ``integrations/`` in a development checkout (the adapters' code is arc_engine's code either way)."""
    import importlib.util

    spec = importlib.util.find_spec("arc_engine.integrations")
    if spec is None or not spec.submodule_search_locations:
        return os.path.join(_PACKAGE_DIR, "integrations")
    return os.path.abspath(next(iter(spec.submodule_search_locations)))


#: the folders whose code is arc_engine's
_COUNTED = tuple(dict.fromkeys((_PACKAGE_DIR + os.sep, _integrations_dir() + os.sep)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
#: arc_engine folders whose code is not part of a training step (tests' helpers, the demo's own model and loop)
_NOT_COUNTED = tuple(os.path.join(_PACKAGE_DIR, sub) + os.sep for sub in ("testing", "demo"))

#: operations that read a tensor's values on the host (a device sync on CUDA)
_HOST_READS: frozenset[Callable[..., Any]] = frozenset({
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
    torch.Tensor.__index__, torch.Tensor.cpu,
    torch.Tensor.nonzero, torch.nonzero, torch.Tensor.bincount, torch.bincount, torch.Tensor.unique, torch.unique,
    torch.Tensor.masked_select, torch.masked_select, torch.Tensor.any, torch.Tensor.all,
})

#: (file, function) of arc_engine code that reads only tensors torch itself keeps on the host: no device sync there
_HOST_RESIDENT_READS = {
    ("arc_engine/stats/optim_stats.py", "step_count"):
        "Adam's step count, a CPU tensor unless the optimizer is capturable or fused (then it is not read)",
}


#: constructors that copy host data onto the device they are given: on CUDA a copy from pageable memory, made with
#: the stream synchronised (a wait for every queued kernel, like a host read)
_FROM_HOST: frozenset[Callable[..., Any]] = frozenset({torch.tensor, torch.as_tensor})


def _is_host_to_device(func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> bool:
    """A tensor built from host data (a list, a number, an array) on a device given as a ``torch.device``: the
    statistics device, an accelerator on a GPU job (as for ``.to``, a device object stands for it on CPU)."""
    if func not in _FROM_HOST:
        return False
    data = args[0] if args else kwargs.get("data")
    return isinstance(kwargs.get("device"), torch.device) and not isinstance(data, torch.Tensor)


def _is_host_read(func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> bool:
    if func in (torch.Tensor.any, torch.Tensor.all):
        return False  # device reductions; only their ``bool()`` reads the host, and that is counted
    if func in _HOST_READS:
        return True
    if func is torch.Tensor.to:
        # .to("cpu"): a copy to the host. A torch.device argument is not counted: on CPU every device is the host,
        # and arc_engine passes devices as objects only to move values onto the statistics device (on a GPU job,
        # the accelerator).
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        return isinstance(target, str) and torch.device(target).type == "cpu"
    if func is torch.Tensor.__getitem__ and len(args) > 1:  # boolean-mask indexing sizes its output on the host
        index = args[1]
        return isinstance(index, torch.Tensor) and index.dtype == torch.bool
    return False


def _arc_caller(frame: Any = None) -> str | None:
    """``path:line (function)`` of the innermost non-torch frame (from ``frame``, default: the caller's caller)
    when it is arc_engine's code, else None."""
    frame = frame or sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_TORCH_DIR + os.sep) or path == __file__ or path == os.path.abspath(warnings.__file__):
            frame = frame.f_back
            continue
        if not path.startswith(_COUNTED) or path.startswith(_NOT_COUNTED):
            return None
        relative = os.path.relpath(path, os.path.dirname(_PACKAGE_DIR))
        if (relative, frame.f_code.co_name) in _HOST_RESIDENT_READS:
            return None
        return f"{relative}:{frame.f_lineno} ({frame.f_code.co_name})"
    return None


class _PerStep:
    """Call sites recorded per step (:meth:`begin` names the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.step: int | None = None
        self.by_step: dict[int | None, list[str]] = defaultdict(list)

    def begin(self, step: int) -> None:
        self.step = step

    def count(self, step: int) -> int:
        return len(self.by_step.get(step, ()))

    def report(self, steps: list[int] | None = None) -> str:
        """The call sites of the given (default: all) steps, one line each, for an assertion message."""
        lines = []
        for step in sorted(self.by_step, key=lambda s: -1 if s is None else s):
            if steps is None or step in steps:
                lines.extend(f"step {step}: {site}" for site in self.by_step[step])
        return "\n".join(lines) or "(none)"


class HostSyncCounter(_PerStep, TorchFunctionMode):
    """Counts arc_engine's host reads per step, on any device. Use as a context manager around the training loop
    and call :meth:`begin` at the start of each step; :attr:`by_step` maps the step to the call sites.
    :attr:`copies_by_step`: the tensors arc_engine built from host data on a device (a synchronising copy on CUDA;
    fine once, while a cache fills, never step after step)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies_by_step: dict[int | None, list[str]] = defaultdict(list)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if _is_host_read(func, args, kwargs):
            site = _arc_caller()
            if site is not None:
                self.by_step[self.step].append(site)
        elif _is_host_to_device(func, args, kwargs):
            site = _arc_caller()
            if site is not None:
                self.copies_by_step[self.step].append(site)
        return func(*args, **kwargs)


class CudaSyncCounter(_PerStep):
    """Counts the CUDA synchronisations arc_engine's code causes, per step, as the device reports them
    (``torch.cuda.set_sync_debug_mode("warn")``). A context manager, like :class:`HostSyncCounter`."""

    def __enter__(self) -> CudaSyncCounter:
        self._previous_mode = torch.cuda.get_sync_debug_mode()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        original = warnings.showwarning

        def show(message: Any, category: type[Warning], *rest: Any, **kwargs: Any) -> None:
            if "synchroniz" in str(message):
                site = _arc_caller(sys._getframe(1))
                if site is not None:
                    self.by_step[self.step].append(site)
                return
            original(message, category, *rest, **kwargs)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_sync_debug_mode(self._previous_mode)
        self._warnings.__exit__(*exc)

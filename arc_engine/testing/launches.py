"""Count the operators arc_engine's own code dispatches per step, on CPU, as a stand-in for kernel launches.

On a GPU every operator that does work launches at least one kernel, and each launch costs host time (5-20 us of
Python and driver calls) whether the kernel is large or tiny: host work that grows with the number of tensors or
buckets makes a model of many small tensors host-bound (the first H200 run measured arc_engine adding about 680
launches to a 125M GPT's step, most of them a dozen per large tensor in the update RMS). On CPU the same operators
are dispatched, so :class:`KernelCounter` counts them where CI runs: a ``TorchDispatchMode`` that records each
operator (views aside: they launch nothing) whose innermost caller outside torch is arc_engine's code, keyed by the
step the loop says it is in (attribution as in :mod:`arc_engine.testing.host_syncs`).
"""

from __future__ import annotations

import sys
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from arc_engine.testing.host_syncs import _arc_caller, _PerStep


class KernelCounter(_PerStep, TorchDispatchMode):
    """Counts the operators (views aside) arc_engine's code dispatches, per step. A context manager around the
    training loop; call :meth:`begin` at the start of each step; :attr:`by_step` maps the step to the call sites."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None) -> Any:
        if not func.is_view:
            site = _arc_caller(sys._getframe(1))
            if site is not None:
                self.by_step[self.step].append(site)
        return func(*args, **(kwargs or {}))

"""The disk tier's state dict, built once and reused while it still is the live state.

``torch.distributed.checkpoint.state_dict.get_state_dict`` walks the module and the optimizer and maps every
parameter to its fully-qualified name on each call: O(tensors) of host work, the largest part of what a save
from the memory snapshot stalls the training loop for (docs/performance.md#checkpoint-stall). Between two saves
the structure does not change: the same tensors, updated in place, under the same names; only the parameter
groups' settings move (the learning rate a scheduler writes).

:class:`StateDictCache` keeps ``get_state_dict``'s result when every tensor in it *is* one of the live tensors (the
same memory, shape, strides and dtype) and it holds nothing else but the parameter groups' settings; a later call
checks that the live tensors are still the ones the result holds (a pass over their layouts, no copy) and returns
the result again with the groups' current settings. Anything else -- a module whose state dict computes tensors
or carries extra state, an optimizer state with Python values, a parameter swapped for another tensor, state
created since -- calls ``get_state_dict`` again, as if there were no cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

Layout = tuple[torch.device, int, torch.Size, tuple[int, ...], torch.dtype]


def layout(tensor: torch.Tensor) -> Layout:
    """Where a tensor's elements are: device, address, shape, strides, dtype (a DTensor's local shard's)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.device, local.data_ptr(), local.shape, local.stride(), local.dtype


def _tensor_leaves(obj: Any) -> Iterable[torch.Tensor | None]:
    """Every leaf of nested dicts and lists: the tensors, and None for each leaf that is not a tensor."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensor_leaves(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensor_leaves(value)
    else:
        yield None


class StateDictCache:
    """``get_state_dict(model, optimizer)`` of one rank's module and optimizer, reused while valid (see the module
    docstring). ``build``: the function that builds it (``get_state_dict``; injectable for tests). Local."""

    def __init__(self, build: Callable[[torch.nn.Module, torch.optim.Optimizer], tuple[dict, dict]]) -> None:
        self.build = build
        self.builds = 0  # calls of ``build``: one per save when the state dict cannot be reused
        self._live: tuple[Layout, ...] | None = None
        self._groups: tuple[tuple[str, ...], ...] = ()
        self._model: dict[str, Any] = {}
        self._optim: dict[str, Any] = {}

    def get(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            live: list[torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and the optimizer's state dicts. ``live``: every tensor of the state (parameters, buffers,
        optimizer state), as :meth:`TrainState.live_tensors` lists them."""
        layouts = tuple(layout(t) for t in live)
        groups = tuple(tuple(sorted(k for k in group if k != "params")) for group in optimizer.param_groups)
        if self._live is not None and layouts == self._live and groups == self._groups:
            return dict(self._model), self._optim_now(optimizer)
        model_sd, optim_sd = self.build(model, optimizer)
        self.builds += 1
        reusable = self._reusable(model_sd, optim_sd, set(layouts), groups)
        self._live, self._groups = (layouts, groups) if reusable else (None, ())
        self._model, self._optim = (model_sd, optim_sd) if reusable else ({}, {})
        return model_sd, optim_sd

    @staticmethod
    def _reusable(model_sd: dict[str, Any], optim_sd: dict[str, Any], live: set[Layout],
                  groups: tuple[tuple[str, ...], ...]) -> bool:
        """Whether every leaf of the state dicts is a live tensor, apart from the parameter groups' settings."""
        if set(optim_sd) != {"state", "param_groups"} or len(optim_sd["param_groups"]) != len(groups):
            return False
        saved_groups = tuple(tuple(sorted(k for k in group if k != "params")) for group in optim_sd["param_groups"])
        if saved_groups != groups:
            return False
        return all(leaf is not None and layout(leaf) in live
                   for part in (model_sd, optim_sd["state"]) for leaf in _tensor_leaves(part))

    def _optim_now(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The kept optimizer state dict with each group's current settings (the tensors are the live ones)."""
        state = {name: dict(entry) if isinstance(entry, dict) else entry
                 for name, entry in self._optim["state"].items()}
        groups = [{**{k: v for k, v in live.items() if k != "params"}, "params": list(kept["params"])}
                  for kept, live in zip(self._optim["param_groups"], optimizer.param_groups, strict=True)]
        return {"state": state, "param_groups": groups}

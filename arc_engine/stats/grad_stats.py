"""Gradient statistics computed on device, fused per list of tensors (no host sync, no per-tensor loop of
kernels on CUDA: ``torch._foreach_norm`` launches one kernel per dtype/device)."""

from __future__ import annotations

import torch

from arc_engine.stats.layout import StatBuffer


@torch.no_grad()
def param_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of each tensor as a float32 vector ``[len(tensors)]`` (NaN/Inf propagate)."""
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))


@torch.no_grad()
def accumulate_grad_stats(buffer: StatBuffer, grads: list[torch.Tensor], group_index: torch.Tensor,
                          sq_slot: str, nonfinite_slot: str | None = None) -> torch.Tensor | None:
    """Add per-group squared norms of ``grads`` to ``sq_slot`` and, if given, per-group counts of tensors
    with a non-finite norm to ``nonfinite_slot``. ``group_index[i]`` is the parameter group of ``grads[i]``
    (a long tensor on the buffer's device). Returns the per-tensor squared norms (float64, buffer device)."""
    if not grads:
        return None
    return add_norm_stats(buffer, param_norms(grads), group_index, sq_slot, nonfinite_slot)


@torch.no_grad()
def add_norm_stats(buffer: StatBuffer, norms: torch.Tensor, group_index: torch.Tensor, sq_slot: str,
                   nonfinite_slot: str | None = None) -> torch.Tensor:
    """:func:`accumulate_grad_stats` from norms already taken (``norms[i]`` of a tensor of group
    ``group_index[i]``, e.g. a step's queued per-bucket norms, concatenated). Returns the squared norms (float64)."""
    norms_sq = norms.to(buffer.device).double().square()
    buffer.index_add(sq_slot, group_index, norms_sq)
    if nonfinite_slot is not None:
        buffer.index_add(nonfinite_slot, group_index, (~torch.isfinite(norms_sq)).double())
    return norms_sq


class ParamGroupIndex:
    """Maps parameters to their optimizer parameter group (by identity) and names the groups."""

    def __init__(self, param_groups: list[dict]) -> None:
        self.group_of: dict[int, int] = {}
        self.names: list[str] = []
        for gid, group in enumerate(param_groups):
            self.names.append(str(group.get("name") or f"group{gid}"))
            for param in group["params"]:
                self.group_of.setdefault(id(param), gid)

    @property
    def num_groups(self) -> int:
        return len(self.names)

    def index_tensor(self, params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Group ids of ``params`` as a long tensor; parameters outside the optimizer count in group 0."""
        return torch.tensor([self.group_of.get(id(p), 0) for p in params], dtype=torch.long, device=device)

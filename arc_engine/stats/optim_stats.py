"""Optimizer-side statistics on whatever slice of the parameters a rank holds (full tensors under DDP, flat
partitions under ZeRO, DTensor local shards under FSDP2): weight squared norms and the Adam update RMS of the
SDC paper, U = m̂ / (√v̂ + ε), computed *prospectively* -- from the gradient about to be applied and the current
moments -- so a verdict can stop the update before the optimizer applies it.

All functions return device tensors (fused ``torch._foreach_*`` kernels, no host sync). Sums over a rank's
elements are partial sums: added over ranks they give the exact global value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class AdamHyper:
    """What the update RMS needs from an Adam-family parameter group.

    ``l2_weight_decay``: weight decay folded into the gradient (torch ``Adam``, apex/DeepSpeed ``adam_w_mode
    =False``); 0 for decoupled decay (``AdamW``), which does not enter the moments.
    """

    beta1: float
    beta2: float
    eps: float
    l2_weight_decay: float = 0.0

    @classmethod
    def from_group(cls, group: dict, decoupled_weight_decay: bool) -> AdamHyper:
        beta1, beta2 = group["betas"]
        decay = 0.0 if decoupled_weight_decay else float(group.get("weight_decay", 0.0))
        return cls(float(beta1), float(beta2), float(group["eps"]), decay)


@torch.no_grad()
def weight_sq_sums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[n]`` float64: squared L2 norm of each tensor."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float32)).double().square()


#: Elements processed at once by :func:`update_sq_sums`: bounds its temporaries to a few x 64 MiB (fp32).
CHUNK_ELEMENTS = 1 << 24


@torch.no_grad()
def update_sq_sums(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   exp_avgs: Sequence[torch.Tensor | None], exp_avg_sqs: Sequence[torch.Tensor | None],
                   step: int, hyper: AdamHyper, chunk_elements: int = CHUNK_ELEMENTS,
                   grad_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``[n]`` float64: Σ U² per tensor for the Adam update the optimizer is *about to* apply.

    ``grads`` are the final gradients the optimizer will see (after unscaling and clipping); ``exp_avgs`` /
    ``exp_avg_sqs`` the moments *before* this step (None when the state is not created yet); ``step`` the
    number of updates already applied (0 before the first). Inputs are not modified; tensors are processed in
    slices of at most ``chunk_elements`` so the temporaries stay small whatever the model size.
    ``grad_scale`` multiplies the gradients first (e.g. DeepSpeed's 1/(loss scale x clip factor) for gradients
    it has not unscaled yet); a 0-dim tensor avoids a host sync.
    """
    if not grads:
        return torch.zeros(0, dtype=torch.float64)
    sums = torch.zeros(len(grads), dtype=torch.float64, device=grads[0].device)
    batch: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
    batch_elements = 0
    for index, (param, grad, mean, sq) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        pieces = [t.reshape(-1).split(chunk_elements) if t is not None else None for t in (param, grad, mean, sq)]
        for k, grad_piece in enumerate(pieces[1]):
            batch.append((index, pieces[0][k], grad_piece, *(p[k] if p is not None else None for p in pieces[2:])))
            batch_elements += grad_piece.numel()
            if batch_elements >= chunk_elements:
                _add_batch(sums, batch, step, hyper, grad_scale)
                batch, batch_elements = [], 0
    if batch:
        _add_batch(sums, batch, step, hyper, grad_scale)
    return sums


def _add_batch(sums: torch.Tensor, batch: list, step: int, hyper: AdamHyper,
               grad_scale: float | torch.Tensor = 1.0) -> None:
    """Fused (``torch._foreach_*``) Σ U² of a batch of slices, added to ``sums`` at each slice's tensor index."""
    index = torch.tensor([item[0] for item in batch], device=sums.device)
    grads = [item[2].float() for item in batch]
    if not (isinstance(grad_scale, float) and grad_scale == 1.0):
        grads = torch._foreach_mul(grads, grad_scale)
    if hyper.l2_weight_decay:
        grads = torch._foreach_add(grads, [item[1].float() for item in batch], alpha=hyper.l2_weight_decay)
    means = [torch.zeros_like(g) if item[3] is None else item[3].float() for g, item in zip(grads, batch, strict=True)]
    sqs = [torch.zeros_like(g) if item[4] is None else item[4].float() for g, item in zip(grads, batch, strict=True)]
    new_means = torch._foreach_lerp(means, grads, 1.0 - hyper.beta1)
    new_sqs = torch._foreach_mul(sqs, hyper.beta2)
    torch._foreach_addcmul_(new_sqs, grads, grads, value=1.0 - hyper.beta2)
    # U = (m'/bc1) / (sqrt(v'/bc2) + eps) = (sqrt(bc2)/bc1) * m' / (sqrt(v') + eps*sqrt(bc2)): the bias
    # corrections become one scalar applied to the final sum, saving two passes over the slices.
    t = step + 1
    bias1, sqrt_bias2 = 1.0 - hyper.beta1 ** t, math.sqrt(1.0 - hyper.beta2 ** t)
    torch._foreach_sqrt_(new_sqs)
    torch._foreach_add_(new_sqs, hyper.eps * sqrt_bias2)
    torch._foreach_div_(new_means, new_sqs)
    norms = torch.stack(torch._foreach_norm(new_means, 2, dtype=torch.float32)).double() * (sqrt_bias2 / bias1)
    sums.index_add_(0, index, norms.square())


def numel_counts(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[n]`` float64 element counts (the denominators of the RMS)."""
    return torch.tensor([float(t.numel()) for t in tensors], dtype=torch.float64)


def rms_per_group(update_sq_g: torch.Tensor | Sequence[float], count_g: torch.Tensor | Sequence[float]) -> list[float]:
    """RMS per group from gathered sums (groups with no elements give 0)."""
    return [math.sqrt(s / c) if c > 0 else 0.0 for s, c in zip(update_sq_g, count_g, strict=True)]


@dataclass
class AdamViews:
    """One parameter group's tensors as the optimizer holds them on this rank, ready for the functions above."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor | None]
    exp_avg_sqs: list[torch.Tensor | None]
    step: int
    hyper: AdamHyper


def sample_window(tensor: torch.Tensor | None, fraction: float, index: int) -> torch.Tensor | None:
    """A fixed contiguous window of ``fraction`` of ``tensor``'s elements (a view; at least one element), placed
    by ``index`` alone, so the same window is taken of a parameter, its gradient and its moments at every step."""
    if tensor is None or fraction >= 1.0:
        return tensor
    flat = tensor.reshape(-1)
    length = max(1, min(flat.numel(), math.ceil(fraction * flat.numel())))
    start = (index * 2654435761) % (flat.numel() - length + 1)
    return flat[start:start + length]


def sampled(views: AdamViews, fraction: float) -> AdamViews:
    """``views`` cut to one fixed window per tensor (:func:`sample_window`): Σ U² over the windows divided by their
    element count estimates the update's mean square at ``fraction`` of the cost. ``fraction`` 1: unchanged."""
    if fraction >= 1.0:
        return views

    def cut(tensors: list[torch.Tensor | None]) -> list[Any]:
        return [sample_window(t, fraction, i) for i, t in enumerate(tensors)]

    return AdamViews(cut(views.params), cut(views.grads), cut(views.exp_avgs), cut(views.exp_avg_sqs), views.step,
                     views.hyper)


def is_decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool | None:
    """Whether ``optimizer`` applies decoupled weight decay; None when it is not an Adam-family optimizer we
    know how to read (torch Adam/AdamW; apex and DeepSpeed FusedAdam / DeepSpeedCPUAdam via ``adam_w_mode``)."""
    if isinstance(optimizer, torch.optim.AdamW):
        return True
    if isinstance(optimizer, torch.optim.Adam):
        return bool(group.get("decoupled_weight_decay", False))
    if hasattr(optimizer, "adam_w_mode") and "betas" in group:
        return bool(optimizer.adam_w_mode)
    return None


def adam_views(optimizer: torch.optim.Optimizer, group: dict, local: bool = False) -> AdamViews | None:
    """The Adam tensors of ``group`` for parameters that have a gradient; None for a non-Adam optimizer.

    ``local``: take ``.to_local()`` of DTensor parameters, gradients and moments (FSDP2 shards).
    The step count is read from the optimizer state (``state['step']``, or apex's ``group['step']``).
    """
    decoupled = is_decoupled(optimizer, group)
    if decoupled is None:
        return None
    params, grads, means, sqs, steps = [], [], [], [], []
    for param in group["params"]:
        if param.grad is None:
            continue
        state = optimizer.state.get(param, {})
        params.append(param)
        grads.append(param.grad)
        means.append(state.get("exp_avg"))
        sqs.append(state.get("exp_avg_sq"))
        steps.append(state.get("step", group.get("step", 0)))
    if local:
        params, grads, means, sqs = ([_local(t) for t in ts] for ts in (params, grads, means, sqs))
    step = steps[0] if steps else 0
    step = int(step.item()) if isinstance(step, torch.Tensor) else int(step)
    return AdamViews(params, grads, means, sqs, step, AdamHyper.from_group(group, decoupled))


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor

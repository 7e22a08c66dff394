"""Optimizer-side statistics on whatever slice of the parameters a rank holds (full tensors under DDP, flat
partitions under ZeRO, DTensor local shards under FSDP2): weight squared norms and the Adam update RMS of the
SDC paper, U = m̂ / (√v̂ + ε), computed *prospectively* -- from the gradient about to be applied and the current
moments -- so a verdict can stop the update before the optimizer applies it.

All functions return device tensors (a few element-wise passes, no host sync). Sums over a rank's
elements are partial sums: added over ranks they give the exact global value. Which elements the update RMS is
sampled on (``detectors.sdc.update_sample``) is decided in :mod:`arc_engine.stats.sampling`.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Container, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from arc_engine import internals
from arc_engine.stats.grad_stats import float32_norms


def none_free(items: Sequence[object]) -> bool:
    """Whether no item is None, in a C-level loop (these lists hold one entry per tensor, on every monitored
    step)."""
    return all(map(operator.is_not, items, itertools.repeat(None)))


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
    return torch.stack(float32_norms(tensors)).double().square()


#: Elements processed at once by :func:`update_sq_total`: bounds its temporaries to a few x 64 MiB (fp32).
CHUNK_ELEMENTS = 1 << 24
#: Slices at least this large are processed on their own; smaller ones are concatenated into shared batches.
OWN_BATCH_ELEMENTS = 1 << 16


@torch.no_grad()
def update_sq_total(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    exp_avgs: Sequence[torch.Tensor | None], exp_avg_sqs: Sequence[torch.Tensor | None],
                    step: int | torch.Tensor, hyper: AdamHyper, chunk_elements: int = CHUNK_ELEMENTS,
                    grad_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """0-dim float64: Σ U² over every element of ``grads`` for the Adam update the optimizer is *about to* apply.

    ``grads`` are the final gradients the optimizer will see (after unscaling and clipping); ``exp_avgs`` /
    ``exp_avg_sqs`` the moments *before* this step (None when the state is not created yet); ``step`` the number of
    updates already applied (0 before the first). Inputs are not modified. Tensors are cut into slices of at most
    ``chunk_elements`` elements; slices smaller than :data:`OWN_BATCH_ELEMENTS` are concatenated into shared batches
    (one flat tensor per operand), larger ones are taken as they are, by multi-tensor (``_foreach``) kernels over
    up to ``chunk_elements`` elements at a time. Either way the cost is a handful of kernels per batch whatever the
    number of tensors: many windows cost no more launches than one (on a GPU, where each launch costs host time,
    that is what keeps this O(1) in the number of tensors). ``grad_scale`` multiplies the gradients first (e.g.
    DeepSpeed's 1/(loss scale x clip factor) for gradients it has not unscaled yet); a 0-dim tensor avoids a host
    sync.
    """
    corrections = _scales(step, hyper)  # once per call: a device step count costs kernels
    if _one_batch(grads, chunk_elements):  # e.g. sampled windows: one batch, no per-tensor slicing
        return _batch_update_sq(list(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)), corrections, hyper,
                                grad_scale)
    device = grads[0].device if grads else None
    total = torch.zeros((), dtype=torch.float64, device=device)
    small: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
    large: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
    small_elements = large_elements = 0
    for param, grad, mean, sq in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        numel = grad.numel()
        for start in range(0, numel, chunk_elements):
            length = min(chunk_elements, numel - start)
            piece = tuple(flat_piece(t, start, length, numel) for t in (param, grad, mean, sq))  # type: ignore[arg-type]
            if length >= OWN_BATCH_ELEMENTS:  # large: no concatenation copy, a multi-tensor batch of its own kind
                if large_elements + length > chunk_elements:
                    total += _foreach_update_sq(large, corrections, hyper, grad_scale)
                    large, large_elements = [], 0
                large.append(piece)
                large_elements += length
                continue
            small.append(piece)
            small_elements += length
            if small_elements >= chunk_elements:
                total += _batch_update_sq(small, corrections, hyper, grad_scale)
                small, small_elements = [], 0
    if large:
        total += _foreach_update_sq(large, corrections, hyper, grad_scale)
    if small:
        total += _batch_update_sq(small, corrections, hyper, grad_scale)
    return total


def _one_batch(grads: Sequence[torch.Tensor], chunk_elements: int) -> bool:
    """Whether every gradient is a flat tensor smaller than :data:`OWN_BATCH_ELEMENTS` and all fit in one chunk: then
    :func:`update_sq_total` concatenates them at once (the moments and parameters that go with flat gradients are
    flat too: :func:`arc_engine.stats.sampling.sample_window` cuts all four alike). C-level loops: this runs on
    every monitored step over every sampled window."""
    if not grads or not all(map(operator.eq, map(torch.Tensor.dim, grads), itertools.repeat(1))):
        return False
    numels = list(map(torch.Tensor.numel, grads))
    return max(numels) < OWN_BATCH_ELEMENTS and sum(numels) <= chunk_elements


@torch.no_grad()
def update_sq_sums(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   exp_avgs: Sequence[torch.Tensor | None], exp_avg_sqs: Sequence[torch.Tensor | None],
                   step: int | torch.Tensor, hyper: AdamHyper, chunk_elements: int = CHUNK_ELEMENTS,
                   grad_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``[n]`` float64: :func:`update_sq_total` of each tensor on its own (diagnostics and tests; the hot path
    takes the total)."""
    if not grads:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack([update_sq_total([p], [g], [m], [v], step, hyper, chunk_elements, grad_scale)
                        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)])


def flat_piece(tensor: torch.Tensor | None, start: int, length: int, numel: int) -> torch.Tensor | None:
    """Elements ``start:start+length`` of ``tensor`` (``numel`` elements) as a flat view (the cheapest call that
    gives one; a copy only for a non-contiguous tensor)."""
    if tensor is None:
        return None
    if tensor.is_contiguous():
        if length == numel:
            return tensor if tensor.dim() == 1 else tensor.view(-1)
        return tensor.as_strided((length,), (1,), tensor.storage_offset() + start)
    flat = tensor.reshape(-1)
    return flat if length == numel else flat[start:start + length]


def leading(pieces: Sequence[torch.Tensor | None], sizes: Sequence[int], numel: int) -> list[torch.Tensor | None]:
    """The first ``numel`` elements of the concatenation of the flat ``pieces`` (of ``sizes`` elements; a None piece
    stays None): pieces past ``numel`` are dropped, the one across it is narrowed. E.g. a ZeRO partition without
    the padding at its end."""
    out: list[torch.Tensor | None] = []
    for piece, size in zip(pieces, sizes, strict=True):
        if numel <= 0:
            break
        keep = min(size, numel)
        out.append(piece if piece is None or keep == size else piece.narrow(0, 0, keep))
        numel -= keep
    return out


def _flat(pieces: list[torch.Tensor | None], like: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat fp32 tensor of ``pieces`` (zeros where a piece is None; None when all are); the piece itself (no
    copy) when there is just one."""
    if len(pieces) == 1:
        return None if pieces[0] is None else pieces[0].float()
    if none_free(pieces) \
            and all(map(operator.eq, map(torch.Tensor.dim, pieces), itertools.repeat(1))):  # type: ignore[arg-type]
        return torch.cat(pieces).float()  # type: ignore[arg-type]  # the common case (windows), no Python loop
    if all(piece is None for piece in pieces):
        return None
    return torch.cat([torch.zeros_like(ref) if piece is None else piece if piece.dim() == 1 else piece.reshape(-1)
                      for piece, ref in zip(pieces, like, strict=True)]).float()


def _batch_update_sq(batch: list, corrections: _Scales, hyper: AdamHyper,
                     grad_scale: float | torch.Tensor) -> torch.Tensor:
    """Σ U² of a batch of (param, grad, exp_avg, exp_avg_sq) slices, concatenated, as a 0-dim float64 tensor. Never
    writes to a slice: the first operation on the gradient is out of place."""
    grad_pieces = [item[1] for item in batch]
    grads = _flat(grad_pieces, grad_pieces)
    assert grads is not None
    if not (isinstance(grad_scale, float) and grad_scale == 1.0):
        grads = grads * grad_scale
    if hyper.l2_weight_decay:
        grads = grads + hyper.l2_weight_decay * _flat([item[0] for item in batch], grad_pieces)
    means = _flat([item[2] for item in batch], grad_pieces)
    sqs = _flat([item[3] for item in batch], grad_pieces)
    new_means = grads * (1.0 - hyper.beta1) if means is None else torch.lerp(means, grads, 1.0 - hyper.beta1)
    scale, eps = corrections.with_moments if sqs is not None and hyper.beta2 > 0.0 else corrections.without
    if sqs is None:
        new_sqs = grads.square().mul_(1.0 - hyper.beta2)
    elif hyper.beta2 > 0.0:
        new_sqs = torch.addcmul(sqs, grads, grads, value=(1.0 - hyper.beta2) / hyper.beta2)
    else:
        new_sqs = grads.square()
    new_means.div_(new_sqs.sqrt_().add_(eps))
    norm = torch.linalg.vector_norm(new_means, dtype=torch.float32).double() * scale
    return norm.square()


def _foreach_update_sq(batch: list, corrections: _Scales, hyper: AdamHyper,
                       grad_scale: float | torch.Tensor) -> torch.Tensor:
    """:func:`_batch_update_sq` of large slices, left where they are: the same element-wise steps as multi-tensor
    kernels over the list (a few launches for the whole batch; out of place, so no slice is written), then Σ of
    the slices' squared norms. A slice without moments (the first step) takes the concatenating path."""
    if not none_free([item[2] for item in batch]) or not none_free([item[3] for item in batch]):
        return _batch_update_sq(batch, corrections, hyper, grad_scale)
    grads = [item[1].float() for item in batch]
    if isinstance(grad_scale, torch.Tensor) and grad_scale.device.type == "cpu" and grads[0].device.type != "cpu":
        grad_scale = float(grad_scale)  # a host scalar (no device sync), as the concatenating path takes it
    if not (isinstance(grad_scale, float) and grad_scale == 1.0):
        grads = torch._foreach_mul(grads, grad_scale)
    if hyper.l2_weight_decay:
        grads = torch._foreach_add(grads, [item[0].float() for item in batch], alpha=hyper.l2_weight_decay)
    means = [item[2].float() for item in batch]
    sqs = [item[3].float() for item in batch]
    new_means = torch._foreach_lerp(means, grads, 1.0 - hyper.beta1)
    if hyper.beta2 > 0.0:
        new_sqs = torch._foreach_addcmul(sqs, grads, grads, value=(1.0 - hyper.beta2) / hyper.beta2)
        scale, eps = corrections.with_moments
    else:
        new_sqs = torch._foreach_mul(grads, grads)
        scale, eps = corrections.without
    torch._foreach_sqrt_(new_sqs)
    torch._foreach_add_(new_sqs, eps)
    torch._foreach_div_(new_means, new_sqs)
    norms = torch.stack(torch._foreach_norm(new_means)).double()
    return norms.square().sum() * (scale * scale)


@dataclass(frozen=True)
class _Scales:
    """The scalars U² needs for one step (:func:`_scales`): (scale, eps) with moments (β2 > 0, a state) and without
    (no state yet, or β2 = 0)."""

    with_moments: tuple[Any, Any]
    without: tuple[Any, Any]


def _scales(step: int | torch.Tensor, hyper: AdamHyper) -> _Scales:
    """U = (m'/bc1) / (sqrt(v'/bc2) + eps) = (sqrt(bc2)/bc1) * m' / (sqrt(v') + eps*sqrt(bc2)): the bias
    corrections become one scalar applied to the final sum, saving two passes. With v' = β2 w,
    w = v + g²(1-β2)/β2 (one addcmul, no pass for β2 v): sqrt(v') = sqrt(β2) sqrt(w), and sqrt(β2) joins the
    scalar. Floats, or 0-dim tensors on the step's device (:func:`_bias_corrections`)."""
    bias1, sqrt_bias2 = _bias_corrections(step, hyper)
    scale, eps = sqrt_bias2 / bias1, hyper.eps * sqrt_bias2
    if hyper.beta2 > 0.0:
        root_beta2 = math.sqrt(hyper.beta2)
        return _Scales((scale / root_beta2, eps / root_beta2), (scale, eps))
    return _Scales((scale, eps), (scale, eps))


def _bias_corrections(step: int | torch.Tensor, hyper: AdamHyper) -> tuple[Any, Any]:
    """Adam's 1 - β1^t and sqrt(1 - β2^t) for the step about to be taken (t = step + 1): floats, or 0-dim tensors on
    the step tensor's device when the optimizer keeps its step count on an accelerator (no host sync)."""
    if isinstance(step, torch.Tensor):
        t = step.detach().double() + 1.0
        return 1.0 - torch.pow(hyper.beta1, t), (1.0 - torch.pow(hyper.beta2, t)).sqrt()
    t = step + 1
    return 1.0 - hyper.beta1 ** t, math.sqrt(1.0 - hyper.beta2 ** t)


def step_count(step: object) -> int | torch.Tensor:
    """An optimizer state's step count for the functions above: an int, or the 0-dim tensor itself when it lives on
    an accelerator (fused/capturable Adam), so reading it costs no host sync."""
    if isinstance(step, torch.Tensor):
        return int(step.item()) if step.device.type == "cpu" else step.detach()
    return int(step)  # type: ignore[call-overload]


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
    step: int | torch.Tensor  # updates already applied (see step_count)
    hyper: AdamHyper
    #: each tensor's position in its parameter group (None: its position in these lists): with the step's phase,
    #: what places its sampled window (:mod:`arc_engine.stats.sampling`), so the window does not depend on which
    #: rank owns which part of the group (see :func:`adam_views`)
    positions: list[int] | None = None


def is_decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool | None:
    """Whether ``optimizer`` applies decoupled weight decay; None when it is not an Adam-family optimizer we
    know how to read (torch Adam/AdamW; apex and DeepSpeed FusedAdam / DeepSpeedCPUAdam via ``adam_w_mode``)."""
    if isinstance(optimizer, torch.optim.AdamW):
        return True
    if isinstance(optimizer, torch.optim.Adam):
        return bool(group.get("decoupled_weight_decay", False))
    decoupled = internals.deepspeed_adam_w_mode(optimizer)
    return decoupled if decoupled is not None and "betas" in group else None


def adam_views(optimizer: torch.optim.Optimizer, group: dict, local: bool = False,
               owned: Container[int] | None = None, memo: dict | None = None) -> AdamViews | None:
    """The Adam tensors of ``group`` for parameters that have a gradient; None for a non-Adam optimizer.

    ``local``: take ``.to_local()`` of DTensor parameters, gradients and moments (FSDP2 shards). ``owned``: only
    the parameters whose ``id()`` is in it; each keeps its position in the group (``positions``), so its sampled
    window is the same whichever rank owns it.
    The step count is read from the optimizer state (``state['step']``, or apex's ``group['step']``).
    ``memo``: a dict the caller keeps per group between steps; it holds the ``owned`` selection of the group's
    parameters, so a step where every selected parameter has a gradient and an Adam state reads them with C-level
    maps instead of a Python loop per parameter (the same result either way).
    """
    decoupled = is_decoupled(optimizer, group)
    if decoupled is None:
        return None
    hyper = AdamHyper.from_group(group, decoupled)
    if memo is not None and not local:
        views = _adam_views_selected(optimizer, group, owned, memo, hyper)
        if views is not None:
            return views
    params, grads, means, sqs, steps, positions = [], [], [], [], [], []
    for position, param in enumerate(group["params"]):
        if param.grad is None or (owned is not None and id(param) not in owned):
            continue
        state = optimizer.state.get(param, {})
        positions.append(position)
        params.append(param)
        grads.append(param.grad)
        means.append(state.get("exp_avg"))
        sqs.append(state.get("exp_avg_sq"))
        steps.append(state.get("step", group.get("step", 0)))
    if local:
        params, grads, means, sqs = ([_local(t) for t in ts] for ts in (params, grads, means, sqs))
    return AdamViews(params, grads, means, sqs, step_count(steps[0] if steps else 0), hyper, positions)


_grad_of = operator.attrgetter("grad")
_exp_avg_of = operator.itemgetter("exp_avg")
_exp_avg_sq_of = operator.itemgetter("exp_avg_sq")


def _adam_views_selected(optimizer: torch.optim.Optimizer, group: dict, owned: Container[int] | None, memo: dict,
                         hyper: AdamHyper) -> AdamViews | None:
    """:func:`adam_views` when every selected parameter has a gradient and a full Adam state (the steady state of
    a run), else None (the caller takes the general loop). The selection -- the group's parameters in ``owned``
    and their positions -- is kept in ``memo`` while the group's parameter list is the same object of the same
    length and ``owned`` the same object of the same size."""
    group_params = group["params"]
    key = (id(group_params), len(group_params), id(owned), len(owned) if isinstance(owned, Sized) else 0)
    if memo.get("key") != key or memo.get("owned") is not owned:
        selected = [(i, p) for i, p in enumerate(group_params) if owned is None or id(p) in owned]
        memo.update(key=key, owned=owned, params=[p for _, p in selected], positions=[i for i, _ in selected])
    params = memo["params"]
    if not params:
        return None
    grads = list(map(_grad_of, params))
    if not none_free(grads):
        return None
    states = list(map(optimizer.state.get, params))
    try:
        means = list(map(_exp_avg_of, states))
        sqs = list(map(_exp_avg_sq_of, states))
        step = states[0]["step"] if "step" in states[0] else group["step"]
    except (KeyError, TypeError):  # a parameter without state yet (None), or a state without moments
        return None
    return AdamViews(list(params), grads, means, sqs, step_count(step), hyper, memo["positions"])


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor

"""The math of ``detectors.weight_health`` (ARC paper §3.2.1, §3.2.3) as plain functions over tensors and arrays.

Device side (the producer; no host sync except where a docstring says so): the per-tensor partial sums that travel
through the agreement -- Σw², #|w| < ε, Σg, Σg², element counts -- a gradient histogram over fixed log-magnitude
bins (fixed edges, so the ranks' counts add up exactly), and the effective rank of one whole matrix.

Host side (the monitor, on agreed sums): the gradient CV σ/|μ| from (Σg, Σg², n), the histogram's normalized
entropy H/log(n_bins), and the weight-health score.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch


def tracked_indices(num_matrices: int, max_tensors: int) -> list[int]:
    """Which of ``num_matrices`` weight matrices (in parameter order) are tracked: all of them when they fit,
    else ``max_tensors`` spread evenly over the order (first and last included), so every depth of the model is
    represented. Depends only on its arguments (the same on every rank). Pure."""
    if num_matrices <= max_tensors:
        return list(range(num_matrices))
    if max_tensors == 1:
        return [0]
    step = (num_matrices - 1) / (max_tensors - 1)
    return [round(i * step) for i in range(max_tensors)]


def rank_sample(num_tracked: int, measurement: int, samples: int) -> list[int]:
    """The tracked matrices whose effective rank is computed at measurement number ``measurement``: ``samples``
    consecutive ones, rotating through all of them over successive measurements. Pure."""
    if num_tracked == 0 or samples <= 0:
        return []
    start = (measurement * samples) % num_tracked
    return sorted({(start + i) % num_tracked for i in range(min(samples, num_tracked))})


def weight_sums(weight: torch.Tensor, small: float) -> torch.Tensor:
    """``[Σw², #(|w| < small)]`` of ``weight`` (any shape, any float dtype) as float64 on its device. Device-side."""
    sq = torch.linalg.vector_norm(weight, dtype=torch.float64).square()
    return torch.stack([sq, (weight.abs() < small).sum().to(torch.float64)])


def grad_sums(grad: torch.Tensor) -> torch.Tensor:
    """``[Σg, Σg²]`` of ``grad`` as float64 on its device (float64 accumulation: the mean of a gradient is a small
    difference of large sums). Device-side."""
    return torch.stack([grad.sum(dtype=torch.float64),
                        torch.linalg.vector_norm(grad, dtype=torch.float64).square()])


def log_magnitude_histogram(values: torch.Tensor, bins: int, min_log2: float, max_log2: float) -> torch.Tensor:
    """Counts (int64, ``[bins]``, on ``values``' device) of ``values`` by log2|v| in ``bins`` equal bins over
    [``min_log2``, ``max_log2``): smaller magnitudes (zeros included) land in the first bin, larger ones (and
    ±Inf) in the last, NaN in the first. The edges are fixed, so the counts of disjoint shards add up to the
    whole tensor's. Device-side (``index_add_``: no host sync, unlike ``bincount`` on CUDA)."""
    width = (max_log2 - min_log2) / bins
    position = (torch.log2(values.detach().abs().float()) - min_log2) / width
    position = torch.nan_to_num(position, nan=0.0, posinf=float(bins - 1), neginf=0.0)
    index = position.floor_().clamp_(0, bins - 1).long().reshape(-1)
    counts = torch.zeros(bins, dtype=torch.long, device=values.device)
    return counts.index_add_(0, index, torch.ones_like(index))


def effective_rank(matrix: torch.Tensor) -> torch.Tensor:
    """exp(H(p)), p_i = σ_i / Σ_j σ_j over the singular values of ``matrix`` (reshaped to ``[rows, -1]`` when it has
    more than 2 dimensions; non-finite entries read as 0); 0 for a zero matrix. A 0-d float64 tensor on the matrix's
    device. ``torch.linalg.svdvals`` synchronizes a CUDA device with the host."""
    rows = matrix.detach().reshape(matrix.shape[0], -1).float()
    sigma = torch.linalg.svdvals(torch.nan_to_num(rows, nan=0.0, posinf=0.0, neginf=0.0)).double()
    total = sigma.sum()
    p = sigma / torch.where(total > 0, total, torch.ones_like(total))
    entropy = -torch.special.xlogy(p, p).sum()
    return torch.where(total > 0, entropy.exp(), torch.zeros_like(entropy))


def effective_rank_reference(matrix: np.ndarray) -> float:
    """The definition with numpy, for tests: exp(-Σ p log p), p = σ / Σσ (0 for a zero matrix). Pure."""
    sigma = np.linalg.svd(np.asarray(matrix, dtype=np.float64).reshape(matrix.shape[0], -1), compute_uv=False)
    if sigma.sum() <= 0:
        return 0.0
    p = sigma[sigma > 0] / sigma.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


def normalized_entropy(counts: Sequence[float] | np.ndarray) -> float:
    """H(p) / log(n_bins) of a histogram (p = counts / Σ counts; 0 log 0 = 0): 1 for a uniform histogram, 0 for
    one full bin. NaN when it is empty. Pure."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total <= 0 or counts.size < 2:
        return math.nan
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum() / math.log(counts.size))


def gradient_cv(grad_sum: np.ndarray, grad_sq_sum: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Per tensor, the coefficient of variation σ/|μ| of its gradient's elements from Σg, Σg² and n (population
    variance); NaN where n is 0 or the sums are not finite, +Inf where μ is exactly 0 and σ is not. Pure."""
    grad_sum, grad_sq_sum, count = (np.asarray(a, dtype=np.float64) for a in (grad_sum, grad_sq_sum, count))
    with np.errstate(all="ignore"):
        mean = grad_sum / count
        std = np.sqrt(np.maximum(grad_sq_sum / count - mean * mean, 0.0))
        cv = std / np.abs(mean)
    cv = np.where(std == 0.0, 0.0, cv)
    return np.where((count > 0) & np.isfinite(grad_sum) & np.isfinite(grad_sq_sum), cv, np.nan)


def health_score(components: dict[str, float], weights: dict[str, float]) -> float:
    """The ARC weight-health score Σ_k w_k S_k / Σ_k w_k over the components S_k ∈ [0, 1] that are available
    (finite) and weighted; NaN when none is. Pure."""
    used = [(weights[k], v) for k, v in components.items() if math.isfinite(v) and weights.get(k, 0.0) > 0]
    total = sum(w for w, _ in used)
    return sum(w * min(max(v, 0.0), 1.0) for w, v in used) / total if total > 0 else math.nan


__all__ = ["effective_rank", "effective_rank_reference", "grad_sums", "gradient_cv", "health_score",
           "log_magnitude_histogram", "normalized_entropy", "rank_sample", "tracked_indices", "weight_sums"]

"""MoE router monitoring: weight similarity, conditioning, routing entropy and expert load (mechanism-driven
monitors, router section).

Pure functions over tensors; the Megatron wiring (which routers to read, when, the baseline and the alarm) builds
on them.

The paper writes the router as W_R = [w_1 .. w_n] ∈ R^{d x n}, one column per expert. Megatron stores its
transpose: ``TopKRouter.weight`` is ``[num_experts, hidden]``. Every function here takes that stored layout,
``weight_nd`` with row i = w_i, so no caller transposes anything. The statistics:

* weight similarity sim(W_R) = mean_{i≠j} cos(w_i, w_j), in O(nd) as (n‖r‖² − 1)/(n − 1) with
  r = mean_i w_i/‖w_i‖ (:func:`router_similarity`; :func:`router_similarity_pairwise` is the O(n²d) reference);
* the conditioning ratio ε = max_i ‖w_i − w̄‖ / ‖w̄‖, w̄ = mean_i w_i, which bounds sim ≥ 1 − n ε²/(n − 1)
  (Proposition 3): ε → 0 means the experts' columns collapse onto their common mode;
* per-token routing entropy H(p(x)) = −Σ_i p_i log p_i of the full softmax over the router logits -- it moves before
  top-k counts do. The softmax is taken whatever score function the router dispatches with;
* tokens per expert from the top-k routing map, MaxVio = (max_i load_i − mean load) / mean load and dead experts
  (zero tokens).

Across ranks, arc_engine agrees on statistics with one all-reduce SUM of a fixed-size vector. So each rank packs
additive partials (:func:`pack_router_partials`): counts, sums and a fixed histogram of entropies on [0, log n], from
which :func:`unpack_router_sums` recovers the union's mean, its low percentiles (to one histogram bin) and its load.
The vector's layout, float64, size ``6 + num_experts + num_bins``:

====================  ==========================================================================================
``[0]``               weight reports: 1 on a rank that packed its router weight, else 0
``[1]``               Σ sim(W_R) over the reports
``[2]``               Σ max_i ‖w_i − w̄‖ over the reports
``[3]``               Σ ‖w̄‖ over the reports
``[4]``               tokens whose entropy was measured
``[5]``               Σ H over those tokens
``[6 : 6+n]``         tokens routed to each expert (top-k assignments)
``[6+n : 6+n+B]``     token count per entropy bin; bin b covers [b, b+1) · log n / B, the last bin includes log n
====================  ==========================================================================================

The router weight is replicated on the ranks that hold a layer (data, tensor and expert parallel alike), so the
weight slots are averages over the ranks that report: any subset may, and a replicated router reads the same
whatever the subset. ε is kept as its numerator and denominator, which keeps the vector finite when w̄ = 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

#: Bins of the entropy histogram on [0, log n]: percentiles of the union are recovered to log n / 128 nats.
NUM_ENTROPY_BINS = 128
#: The low percentiles of per-token entropy reported (the collapsing tail).
ENTROPY_QUANTILES = (0.01, 0.05, 0.10)

_WEIGHT_SLOTS = 4  # reports, Σ sim, Σ max centered norm, Σ mean norm
_HEADER = _WEIGHT_SLOTS + 2  # + tokens, Σ H


def _unit_rows(weight_nd: torch.Tensor) -> torch.Tensor:
    """The rows of a ``[n, d]`` router weight normalised to unit length, in float64. An all-zero row has no
    direction: its row is NaN, and so is every similarity it enters (checking on the host would be a device sync
    in every measurement)."""
    if weight_nd.dim() != 2 or weight_nd.shape[0] < 2:
        raise ValueError(f"router weight must be [num_experts, hidden] with num_experts >= 2, got "
                         f"{tuple(weight_nd.shape)}")
    weight = weight_nd.detach().double()
    norms_n = weight.norm(dim=1, keepdim=True)
    return weight / torch.where(norms_n == 0, torch.nan, norms_n)


def router_similarity(weight_nd: torch.Tensor) -> float:
    """sim(W_R) = mean over ordered pairs i ≠ j of cos(w_i, w_j), for a router weight ``[num_experts, hidden]`` as
    Megatron stores it (row i = w_i). O(nd) through (n‖r‖² − 1)/(n − 1), r = mean_i w_i/‖w_i‖, in float64.

    Lies in [−1/(n − 1), 1]: 1 when all rows point the same way, −1/(n − 1) for a regular simplex, 0 for orthogonal
    rows. Raises ``ValueError`` for fewer than two experts or an all-zero row. Local, no communication."""
    return float(_similarity(weight_nd))


def _similarity(weight_nd: torch.Tensor) -> torch.Tensor:
    """:func:`router_similarity` as a 0-dim float64 tensor on the weight's device (no host synchronisation)."""
    unit_nd = _unit_rows(weight_nd)
    n = unit_nd.shape[0]
    mean_direction_d = unit_nd.mean(dim=0)
    return (n * mean_direction_d.dot(mean_direction_d) - 1.0) / (n - 1)


def router_similarity_pairwise(weight_nd: torch.Tensor) -> float:
    """The O(n²d) reference for :func:`router_similarity`: the mean of the off-diagonal entries of the n x n
    cosine matrix (``weight_nd`` ``[num_experts, hidden]``, float64)."""
    unit_nd = _unit_rows(weight_nd)
    n = unit_nd.shape[0]
    cosines_nn = unit_nd @ unit_nd.T
    return float((cosines_nn.sum() - cosines_nn.diagonal().sum()) / (n * (n - 1)))


def conditioning_parts(weight_nd: torch.Tensor) -> torch.Tensor:
    """``[2]`` float64 on the weight's device: max_i ‖w_i − w̄‖ and ‖w̄‖, with w̄ = mean_i w_i, for a router weight
    ``[num_experts, hidden]``. Their ratio is ε (:func:`conditioning_ratio`); kept apart so that w̄ = 0 packs as
    finite numbers."""
    if weight_nd.dim() != 2 or weight_nd.shape[0] < 2:
        raise ValueError(f"router weight must be [num_experts, hidden] with num_experts >= 2, got "
                         f"{tuple(weight_nd.shape)}")
    weight = weight_nd.detach().double()
    mean_d = weight.mean(dim=0)
    return torch.stack([(weight - mean_d).norm(dim=1).max(), mean_d.norm()])


def conditioning_ratio(weight_nd: torch.Tensor) -> float:
    """ε = max_i ‖w_i − w̄‖ / ‖w̄‖ for a router weight ``[num_experts, hidden]``: the discriminative part of the
    router against the common mode that softmax discards. ``inf`` when w̄ = 0 (the paper defines ε for w̄ ≠ 0).
    sim(W_R) ≥ 1 − n ε²/(n − 1) whenever no row is zero."""
    max_centered_norm, mean_norm = conditioning_parts(weight_nd).tolist()
    return max_centered_norm / mean_norm if mean_norm > 0 else math.inf


def per_token_entropy(logits_tn: torch.Tensor) -> torch.Tensor:
    """H(p(x)) = −Σ_i p_i log p_i in nats for each token, p = softmax of its row of router logits ``[tokens,
    num_experts]``; returns ``[tokens]`` float64 on the logits' device, each in [0, log n] up to rounding.
    ``-inf`` logits (experts masked out) contribute 0. Computed in float32 (float64 logits: in float64): a token's
    entropy is a sum over its experts, within about 1e-6 nats of the float64 one, far inside the histogram's bins
    (log n / 128), and the float64 passes over ``[tokens, experts]`` cost about 5 times as much (4,096 tokens and 256
    experts on a CPU core)."""
    if logits_tn.dim() != 2 or logits_tn.shape[1] < 2:
        raise ValueError(f"router logits must be [tokens, num_experts] with num_experts >= 2, got "
                         f"{tuple(logits_tn.shape)}")
    logits_tn = logits_tn.detach()
    log_p_tn = torch.log_softmax(logits_tn if logits_tn.dtype == torch.float64 else logits_tn.float(), dim=1)
    # 0 · log 0 = 0: a masked expert's p = 0 and log p = -inf make NaN, taken as 0 (as a row of NaN logits is)
    return -(log_p_tn.exp() * log_p_tn).nan_to_num_(nan=0.0).sum(dim=1).double()


def routing_entropy_summary(logits_tn: torch.Tensor, quantiles: Sequence[float] = ENTROPY_QUANTILES
                            ) -> dict[str, float]:
    """The exact per-token entropy summary of one rank's tokens (logits ``[tokens, num_experts]``): ``entropy_mean``
    and ``entropy_p<100 q>`` for each q (e.g. ``entropy_p1``, linear interpolation between order statistics). NaN
    for no tokens. The cross-rank version is :func:`routing_entropy_sums` + :func:`unpack_router_sums`."""
    entropy_t = per_token_entropy(logits_tn)
    if entropy_t.numel() == 0:
        return {"entropy_mean": math.nan, **{_quantile_key(q): math.nan for q in quantiles}}
    values = torch.quantile(entropy_t, torch.tensor(list(quantiles), dtype=torch.float64, device=entropy_t.device))
    return {"entropy_mean": float(entropy_t.mean()),
            **{_quantile_key(q): float(v) for q, v in zip(quantiles, values.tolist(), strict=True)}}


def routing_entropy_sums(logits_tn: torch.Tensor, num_bins: int = NUM_ENTROPY_BINS) -> torch.Tensor:
    """Additive entropy partials of one rank's tokens (logits ``[tokens, num_experts]``): ``[2 + num_bins]``
    float64 on the logits' device = (token count, Σ H, histogram of H over ``num_bins`` equal bins of [0, log n]).
    Summing these over ranks (or micro-batches) gives the partials of the union of their tokens exactly; read
    percentiles back with :func:`histogram_quantiles`. No host synchronisation."""
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    entropy_t = per_token_entropy(logits_tn)
    max_entropy = math.log(logits_tn.shape[1])
    bins_t = (entropy_t * (num_bins / max_entropy)).floor().clamp_(0, num_bins - 1).long()
    # scatter_add, not bincount: bincount sizes its output from the data, a device sync on CUDA
    histogram_b = torch.zeros(num_bins, dtype=torch.float64, device=logits_tn.device)
    histogram_b.scatter_add_(0, bins_t, torch.ones_like(entropy_t, dtype=torch.float64))
    header = torch.stack([entropy_t.new_tensor(float(entropy_t.numel())), entropy_t.sum()])
    return torch.cat([header, histogram_b])


def histogram_quantiles(histogram_b: torch.Tensor | np.ndarray, max_entropy: float, quantiles: Sequence[float]
                        ) -> list[float]:
    """Quantiles of the values counted in ``histogram_b`` (``[num_bins]`` equal bins of [0, max_entropy]).

    For each q the answer lies in the same bin as the order statistic x_(⌊qN⌋) (0-based, at most N − 1) of the N
    counted values, so it is within one bin width, max_entropy / num_bins, of it; inside that bin it interpolates
    linearly in rank. NaN when the histogram is empty."""
    counts_b = _host_float64(histogram_b)
    total = float(counts_b.sum())
    if total <= 0:
        return [math.nan for _ in quantiles]
    width = max_entropy / counts_b.size
    cumulative_b = np.cumsum(counts_b)
    out = []
    for q in quantiles:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        rank = min(math.floor(q * total), total - 1)
        b = int(np.searchsorted(cumulative_b, rank, side="right"))  # first bin whose cumulative count exceeds rank
        below = cumulative_b[b - 1] if b > 0 else 0.0
        fraction = min(max((q * total - below) / counts_b[b], 0.0), 1.0)
        out.append(float((b + fraction) * width))
    return out


def topk_routing_map(logits_tn: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``[tokens, num_experts]`` bool map of each token's ``topk`` highest logits: the shape and meaning of
    Megatron's ``routing_map`` (without capacity dropping)."""
    if not 1 <= topk <= logits_tn.shape[-1]:
        raise ValueError(f"topk must be in [1, num_experts={logits_tn.shape[-1]}], got {topk}")
    indices_tk = logits_tn.detach().topk(topk, dim=1).indices
    return torch.zeros_like(logits_tn, dtype=torch.bool).scatter_(1, indices_tk, True)


def tokens_per_expert(routing_map_tn: torch.Tensor) -> torch.Tensor:
    """Tokens routed to each expert, ``[num_experts]`` float64 on the map's device, from a routing map ``[tokens,
    num_experts]`` (bool, or 0/1). Additive across ranks and micro-batches."""
    if routing_map_tn.dim() != 2:
        raise ValueError(f"routing map must be [tokens, num_experts], got {tuple(routing_map_tn.shape)}")
    return (routing_map_tn.detach() != 0).sum(dim=0).double()


def load_summary(tokens_per_expert_n: torch.Tensor | np.ndarray) -> dict[str, object]:
    """Load statistics from (summed) tokens per expert ``[num_experts]``: ``max_vio`` = (max load − mean load) /
    mean load (NaN when no token was routed), ``dead_experts`` (how many got zero tokens), ``dead_expert_ids``
    and ``tokens_per_expert`` as a list."""
    counts_n = _host_float64(tokens_per_expert_n)
    mean_load = float(counts_n.mean())
    dead = np.flatnonzero(counts_n == 0)
    return {"max_vio": (float(counts_n.max()) - mean_load) / mean_load if mean_load > 0 else math.nan,
            "dead_experts": int(dead.size), "dead_expert_ids": dead.tolist(), "tokens_per_expert": counts_n.tolist()}


def router_partials_size(num_experts: int, num_bins: int = NUM_ENTROPY_BINS) -> int:
    """Length of the vector :func:`pack_router_partials` writes; a rank with nothing to report for this router
    contributes ``torch.zeros(router_partials_size(...), dtype=torch.float64)``."""
    return _HEADER + num_experts + num_bins


def pack_router_partials(logits_tn: torch.Tensor, routing_map_tn: torch.Tensor, weight_nd: torch.Tensor | None = None,
                         num_bins: int = NUM_ENTROPY_BINS) -> torch.Tensor:
    """One rank's additive partials for one router as a flat float64 vector of
    :func:`router_partials_size` ``(num_experts, num_bins)`` entries, on the logits' device (layout in the module
    docstring). ``logits_tn`` and ``routing_map_tn`` are ``[tokens, num_experts]`` for this rank's tokens;
    ``weight_nd`` is the router weight ``[num_experts, hidden]``, or None on a rank that leaves the weight to
    others. Local and without host synchronisation; SUM the vectors over ranks, then :func:`unpack_router_sums`."""
    num_experts = logits_tn.shape[-1]
    if routing_map_tn.shape != logits_tn.shape:
        raise ValueError(f"routing map {tuple(routing_map_tn.shape)} and logits {tuple(logits_tn.shape)} must both be "
                         f"[tokens, num_experts]")
    weight_slots = torch.zeros(_WEIGHT_SLOTS, dtype=torch.float64, device=logits_tn.device)
    if weight_nd is not None:
        if weight_nd.shape[0] != num_experts:
            raise ValueError(f"router weight has {weight_nd.shape[0]} expert rows, the logits {num_experts} experts")
        report = torch.ones(1, dtype=torch.float64, device=weight_nd.device)
        weight_slots = torch.cat([report, _similarity(weight_nd).reshape(1),
                                  conditioning_parts(weight_nd)]).to(logits_tn.device)
    entropy_sums = routing_entropy_sums(logits_tn, num_bins)
    counts_n = tokens_per_expert(routing_map_tn).to(logits_tn.device)
    return torch.cat([weight_slots, entropy_sums[:2], counts_n, entropy_sums[2:]])


def partial_entropy_mean(partial: torch.Tensor) -> torch.Tensor:
    """The mean per-token routing entropy of one :func:`pack_router_partials` vector (or a sum of them), as a
    ``[1]`` tensor on its device: NaN without tokens. No host synchronisation."""
    tokens, total = partial[_WEIGHT_SLOTS:_WEIGHT_SLOTS + 1], partial[_WEIGHT_SLOTS + 1:_WEIGHT_SLOTS + 2]
    return torch.where(tokens > 0, total / tokens.clamp_min(1), torch.full_like(total, math.nan))


def unpack_router_sums(summed: torch.Tensor | np.ndarray, num_experts: int, num_bins: int = NUM_ENTROPY_BINS,
                       quantiles: Sequence[float] = ENTROPY_QUANTILES) -> dict[str, object]:
    """The router summary from the SUM over ranks of :func:`pack_router_partials` vectors: ``similarity``,
    ``conditioning_ratio`` (NaN when no rank reported the weight; ``inf`` when w̄ = 0), ``tokens``,
    ``entropy_mean``, ``entropy_p<100 q>`` per quantile (within one bin, log n / num_bins, of the union's order
    statistic; NaN without tokens), and :func:`load_summary`'s ``max_vio``, ``dead_experts``, ``dead_expert_ids``,
    ``tokens_per_expert``. Host-side; call it on every rank with the same reduced vector to get the same dict."""
    vector = _host_float64(summed)
    expected = router_partials_size(num_experts, num_bins)
    if vector.shape != (expected,):
        raise ValueError(f"router sums must have {expected} entries for num_experts={num_experts}, "
                         f"num_bins={num_bins}, got shape {vector.shape}")
    reports, sim_sum, max_centered_sum, mean_norm_sum, tokens, entropy_sum = vector[:_HEADER].tolist()
    if reports > 0:
        similarity = sim_sum / reports
        epsilon = max_centered_sum / mean_norm_sum if mean_norm_sum > 0 else math.inf
    else:
        similarity = epsilon = math.nan
    histogram_b = vector[_HEADER + num_experts:]
    percentiles = histogram_quantiles(histogram_b, math.log(num_experts), quantiles)
    return {"similarity": similarity, "conditioning_ratio": epsilon, "tokens": tokens,
            "entropy_mean": entropy_sum / tokens if tokens > 0 else math.nan,
            **{_quantile_key(q): value for q, value in zip(quantiles, percentiles, strict=True)},
            **load_summary(vector[_HEADER:_HEADER + num_experts])}


def _quantile_key(q: float) -> str:
    """``entropy_p1`` for q = 0.01, ``entropy_p0.5`` for q = 0.005."""
    return f"entropy_p{q * 100:g}"


def _host_float64(values: torch.Tensor | np.ndarray) -> np.ndarray:
    """A host float64 numpy copy of a tensor (any device) or array."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64)

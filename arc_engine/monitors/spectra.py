"""Weight-update and QK-product spectra for attention (mechanism-driven monitors, ΔW and QK sections).

Pure functions over tensors; the Megatron wiring (which rows of ``linear_qkv`` a tensor-parallel rank holds, the
δ-step schedule, the baseline and the alarm) builds on them.

For one attention head with query and key projections W_q, W_k ∈ R^{d x d_k} (the transposed head rows of a
``Linear`` weight) at steps t and t - δ:

* ΔW = W_t − W_{t−δ}; its spectrum summarised by the spectral entropy H = −Σ p_i log p_i with p_i = σ_i^α / Σ σ_j^α
  (α = 2), the effective rank exp(H), the stable rank ‖ΔW‖_F² / ‖ΔW‖_2², and the Frobenius norm;
* the QK-product increments Δ₁ = W_{q,t} W_{k,t}ᵀ − W_{q,t−δ} W_{k,t−δ}ᵀ = Δ₂ + Δ₃, with Δ₂ = ΔW_q W_kᵀ + W_q ΔW_kᵀ
  (first order) and Δ₃ = ΔW_q ΔW_kᵀ. Each is a product A Bᵀ of d x r factors (r = d_k or 2 d_k), and with thin
  QR factorisations A = Q_A R_A, B = Q_B R_B its nonzero singular values are those of the r x r core R_A R_Bᵀ --
  never the d x d product (:func:`core_singular_values`). ``scripts/bench_qk_cores.py`` measures the saving.

Which W_q / W_k the first-order term uses (t or t − δ) is the paper's choice of linearisation point; here Δ₂ is
taken at t − δ, so that Δ₁ = Δ₂ + Δ₃ holds exactly.
"""

from __future__ import annotations

import torch

#: The Rényi order of the spectral distribution p_i = σ_i^α / Σ σ_j^α (the paper's α = 2: energy fractions).
ALPHA = 2.0


#: The summaries of :func:`spectral_summary`, in the order of :func:`spectral_summary_t`'s values.
SUMMARIES = ("entropy", "effective_rank", "stable_rank", "norm")
#: The spectra of :func:`head_spectra`, in the order of :func:`head_spectra_t`'s rows.
HEAD_QUANTITIES = ("dwq", "dwk", "delta1", "delta2", "delta3")


def spectral_summary_t(sigma: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """:func:`spectral_summary` as a float64 tensor on ``sigma``'s device, in :data:`SUMMARIES` order, with no host
    synchronisation. Batched: ``sigma`` ``[..., n]`` gives ``[..., 4]`` (one spectrum per leading index)."""
    sigma = sigma.detach().double().abs()
    energy = sigma.square().sum(-1)
    weights = sigma.pow(alpha)
    p = weights / weights.sum(-1, keepdim=True)
    entropy = -torch.special.xlogy(p, p).sum(-1)  # 0 log 0 = 0
    values = torch.stack([entropy, entropy.exp(), energy / sigma.amax(-1).square(), energy.sqrt()], dim=-1)
    return torch.where((energy == 0).unsqueeze(-1), torch.zeros_like(values), values)


def spectral_summary(sigma: torch.Tensor, alpha: float = ALPHA) -> dict[str, float]:
    """Summaries of a singular spectrum ``sigma`` (any order, non-negative): ``entropy`` H of p_i = σ_i^α / Σ σ^α,
    ``effective_rank`` exp(H), ``stable_rank`` Σσ² / max σ², ``norm`` (Frobenius, sqrt Σσ²). A zero spectrum gives
    entropy 0, effective and stable rank 0, norm 0."""
    return dict(zip(SUMMARIES, spectral_summary_t(sigma, alpha).tolist(), strict=True))


def core_singular_values(a_dr: torch.Tensor, b_dr: torch.Tensor) -> torch.Tensor:
    """The singular values of A Bᵀ that can be nonzero (``[d, r]`` factors) from the core R_A R_Bᵀ of thin QR
    factorisations (min(d, r) square), largest first; trailing values are ~0 when the product has lower rank.
    Computed in float64. Cost O(d r² + r³) instead of the O(d³) of the d x d product's decomposition. Batched:
    ``[..., d, r]`` factors give ``[..., min(d, r)]``, in one QR and one SVD call each."""
    a = a_dr.detach().double()
    b = b_dr.detach().double()
    if a.shape != b.shape or a.dim() < 2:
        raise ValueError(f"core_singular_values: A and B must be [..., d, r] of the same shape, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    _, r_a = torch.linalg.qr(a, mode="r")  # R alone: Q is never formed
    _, r_b = torch.linalg.qr(b, mode="r")
    return torch.linalg.svdvals(r_a @ r_b.mT)


def dense_singular_values(a_dr: torch.Tensor, b_dr: torch.Tensor) -> torch.Tensor:
    """The reference: singular values of the materialised d x d product A Bᵀ (float64), largest first."""
    return torch.linalg.svdvals(a_dr.detach().double() @ b_dr.detach().double().T)


def qk_increment_factors(wq_t: torch.Tensor, wk_t: torch.Tensor, wq_prev: torch.Tensor, wk_prev: torch.Tensor
                         ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The (A, B) factors with Δ = A Bᵀ for ``delta1``, ``delta2`` and ``delta3`` of one head (all inputs
    ``[d, d_k]``: W_q, W_k at t and at t − δ; or ``[..., d, d_k]``, a batch of heads)."""
    dq, dk = wq_t - wq_prev, wk_t - wk_prev
    return {"delta1": (torch.cat([wq_t, wq_prev], dim=-1), torch.cat([wk_t, -wk_prev], dim=-1)),
            "delta2": (torch.cat([dq, wq_prev], dim=-1), torch.cat([wk_prev, dk], dim=-1)),
            "delta3": (dq, dk)}


def head_spectra_t(wq_t: torch.Tensor, wk_t: torch.Tensor, wq_prev: torch.Tensor, wk_prev: torch.Tensor,
                   alpha: float = ALPHA) -> torch.Tensor:
    """:func:`head_spectra` as a ``[5, 4]`` float64 tensor on the weights' device (rows :data:`HEAD_QUANTITIES`,
    columns :data:`SUMMARIES`); no host read of its own (on CUDA the SVDs check their convergence). Batched: inputs
    ``[..., d, d_k]`` (heads of every layer) give ``[..., 5, 4]`` in a fixed number of calls, whatever the number
    of heads. See :func:`head_spectra_and_bound_t`."""
    return head_spectra_and_bound_t(wq_t, wk_t, wq_prev, wk_prev, alpha)[1]


def head_spectra_and_bound_t(wq_t: torch.Tensor, wk_t: torch.Tensor, wq_prev: torch.Tensor, wk_prev: torch.Tensor,
                             alpha: float = ALPHA) -> tuple[torch.Tensor, torch.Tensor]:
    """(σ_max(W_q W_kᵀ) at t, ``[..., 5, 4]`` :func:`head_spectra_t`) of each head from two thin QRs: every factor
    of ΔW_q, Δ₁, Δ₂, Δ₃ and W_q itself is [W_q,t−δ, ΔW_q] times a constant block matrix (W_q,t = W_q,t−δ + ΔW_q),
    so with [W_q,t−δ, ΔW_q] = Q_q R_q (and the same for the keys) each is Q_q times columns of R_q, and a product
    A Bᵀ = Q_q (R_q M_A)(R_k M_B)ᵀ Q_kᵀ has the singular values of the 2 d_k x 2 d_k core (R_q M_A)(R_k M_B)ᵀ. Two
    QRs of d x 2 d_k per head instead of eight (one pair per product), the same spectra up to rounding."""
    n = wq_t.shape[-1]
    _, r_q = torch.linalg.qr(torch.cat([wq_prev.detach().double(), (wq_t - wq_prev).detach().double()], dim=-1),
                             mode="r")
    _, r_k = torch.linalg.qr(torch.cat([wk_prev.detach().double(), (wk_t - wk_prev).detach().double()], dim=-1),
                             mode="r")
    prev_q, delta_q, prev_k, delta_k = r_q[..., :n], r_q[..., n:], r_k[..., :n], r_k[..., n:]
    now_q, now_k = prev_q + delta_q, prev_k + delta_k
    bound = torch.linalg.svdvals(now_q @ now_k.mT)[..., 0]
    spectra = torch.stack([
        spectral_summary_t(torch.linalg.svdvals(delta_q), alpha),
        spectral_summary_t(torch.linalg.svdvals(delta_k), alpha),
        spectral_summary_t(torch.linalg.svdvals(torch.cat([now_q, prev_q], -1) @ torch.cat([now_k, -prev_k], -1).mT),
                           alpha),
        spectral_summary_t(torch.linalg.svdvals(torch.cat([delta_q, prev_q], -1) @ torch.cat([prev_k, delta_k], -1).mT),
                           alpha),
        spectral_summary_t(torch.linalg.svdvals(delta_q @ delta_k.mT), alpha)], dim=-2)
    return bound, spectra


def head_spectra(wq_t: torch.Tensor, wk_t: torch.Tensor, wq_prev: torch.Tensor, wk_prev: torch.Tensor,
                 alpha: float = ALPHA) -> dict[str, dict[str, float]]:
    """Spectral summaries of one head's ΔW_q, ΔW_k and Δ₁, Δ₂, Δ₃ (inputs ``[d, d_k]``), each from at most a
    2 d_k x 2 d_k core."""
    rows = head_spectra_t(wq_t, wk_t, wq_prev, wk_prev, alpha).tolist()
    return {name: dict(zip(SUMMARIES, row, strict=True)) for name, row in zip(HEAD_QUANTITIES, rows, strict=True)}


def split_qkv_rows(weight: torch.Tensor, num_query_groups: int, heads_per_group: int, head_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head query and key projections from a tensor-parallel shard of Megatron's fused ``linear_qkv`` weight
    (``[num_query_groups * (heads_per_group + 2) * head_dim, hidden]``: per query group, its query heads, then its
    key, then its value -- whole groups on this shard). Returns ``q_hdk`` ``[groups * heads_per_group, hidden,
    head_dim]`` and ``k_gdk`` ``[groups, hidden, head_dim]`` (each head as a d x d_k factor); query head h uses key
    group h // heads_per_group (GQA)."""
    rows_per_group = (heads_per_group + 2) * head_dim
    if weight.dim() != 2 or weight.shape[0] != num_query_groups * rows_per_group:
        raise ValueError(f"split_qkv_rows: expected {num_query_groups * rows_per_group} rows "
                         f"({num_query_groups} groups x ({heads_per_group} + 2) heads x {head_dim}), got "
                         f"{tuple(weight.shape)}")
    grouped = weight.view(num_query_groups, heads_per_group + 2, head_dim, weight.shape[1])
    q = grouped[:, :heads_per_group].reshape(num_query_groups * heads_per_group, head_dim, -1).transpose(1, 2)
    k = grouped[:, heads_per_group].transpose(1, 2)
    return q, k


def layer_spectra(weight_t: torch.Tensor, weight_prev: torch.Tensor, num_query_groups: int, heads_per_group: int,
                  head_dim: int, alpha: float = ALPHA) -> list[dict[str, dict[str, float]]]:
    """:func:`head_spectra` of every query head held in a ``linear_qkv`` shard at t and t − δ (GQA: each query head
    pairs with its group's key)."""
    q_t, k_t = split_qkv_rows(weight_t, num_query_groups, heads_per_group, head_dim)
    q_prev, k_prev = split_qkv_rows(weight_prev, num_query_groups, heads_per_group, head_dim)
    return [head_spectra(q_t[h], k_t[h // heads_per_group], q_prev[h], k_prev[h // heads_per_group], alpha)
            for h in range(q_t.shape[0])]


def summarise_heads(per_head: list[dict[str, dict[str, float]]], key: str = "entropy"
                    ) -> dict[str, tuple[float, float, float]]:
    """Per quantity (``dwq``, ``dwk``, ``delta1`` ...): (min, median, max) over heads of ``key`` -- the fixed-size
    per-layer summary that travels through the agreement."""
    out = {}
    for name in per_head[0]:
        values = torch.tensor([head[name][key] for head in per_head], dtype=torch.float64)
        out[name] = (float(values.min()), float(values.median()), float(values.max()))
    return out

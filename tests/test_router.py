"""MoE router statistics (arc_engine/monitors/router.py): the O(nd) similarity identity, the conditioning bound,
routing entropy, expert load, and the fixed-size SUM-reducible partials checked against one computation over the
union of the ranks' tokens."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from arc_engine.monitors.router import (
    ENTROPY_QUANTILES,
    NUM_ENTROPY_BINS,
    conditioning_ratio,
    histogram_quantiles,
    load_summary,
    pack_router_partials,
    per_token_entropy,
    router_partials_size,
    router_similarity,
    router_similarity_pairwise,
    routing_entropy_summary,
    routing_entropy_sums,
    tokens_per_expert,
    topk_routing_map,
    unpack_router_sums,
)


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def random_router(num_experts: int, hidden: int, *, offset: float, seed: int) -> torch.Tensor:
    """``[num_experts, hidden]`` float64 rows = offset * (a shared direction) + standard normal noise."""
    gen = torch.Generator().manual_seed(seed)
    common_d = torch.randn(hidden, generator=gen, dtype=torch.float64)
    return offset * common_d + torch.randn(num_experts, hidden, generator=gen, dtype=torch.float64)


def random_orthogonal(size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(size, size, generator=gen, dtype=torch.float64))
    return q


# --- weight similarity -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_experts", "hidden", "offset"),
                         [(8, 32, 0.0), (64, 128, 0.0), (16, 64, 1.0), (128, 96, 3.0), (2, 5, 0.5)])
def test_identity_matches_pairwise_mean_on_random_routers(num_experts, hidden, offset):
    weight_nd = random_router(num_experts, hidden, offset=offset, seed=num_experts + hidden)
    fast, reference = router_similarity(weight_nd), router_similarity_pairwise(weight_nd)
    assert relative_difference(fast, reference) <= 1e-10
    if offset >= 1.0:  # a shared direction makes the rows similar
        assert fast > 0.3


def test_identity_matches_a_loop_over_pairs_of_rows():
    """Independent of the module's normalisation: cos over ordered pairs of *rows* (Megatron's [n, d] layout)."""
    weight_nd = random_router(6, 4, offset=0.7, seed=3)
    cosines = [float(torch.nn.functional.cosine_similarity(weight_nd[i], weight_nd[j], dim=0))
               for i, j in itertools.permutations(range(6), 2)]
    assert relative_difference(router_similarity(weight_nd), sum(cosines) / len(cosines)) <= 1e-10
    # the columns would give another number: the layout matters
    assert abs(router_similarity(weight_nd.T.contiguous()) - router_similarity(weight_nd)) > 1e-3


def test_collapsed_router_has_similarity_one_and_zero_conditioning():
    direction_d = torch.randn(48, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    scales_n = torch.linspace(0.5, 4.0, 16, dtype=torch.float64)
    scaled_nd = scales_n[:, None] * direction_d
    assert abs(router_similarity(scaled_nd) - 1.0) <= 1e-12
    assert abs(router_similarity_pairwise(scaled_nd) - 1.0) <= 1e-12
    assert conditioning_ratio(direction_d.repeat(16, 1)) <= 1e-12


@pytest.mark.parametrize("num_experts", [2, 3, 8, 32])
def test_simplex_router_has_similarity_minus_one_over_n_minus_one(num_experts):
    """Centred basis vectors e_i − 1/n (rotated in a larger space) are a regular simplex."""
    hidden = num_experts + 5
    simplex_nd = torch.zeros(num_experts, hidden, dtype=torch.float64)
    simplex_nd[:, :num_experts] = torch.eye(num_experts, dtype=torch.float64) - 1.0 / num_experts
    rotated_nd = simplex_nd @ random_orthogonal(hidden, seed=num_experts)
    expected = -1.0 / (num_experts - 1)
    assert relative_difference(router_similarity(rotated_nd), expected) <= 1e-10
    assert relative_difference(router_similarity_pairwise(rotated_nd), expected) <= 1e-10


def test_orthogonal_router_has_similarity_zero():
    scales_n = torch.linspace(0.1, 10.0, 24, dtype=torch.float64)
    orthogonal_nd = scales_n[:, None] * random_orthogonal(40, seed=1)[:24]
    assert abs(router_similarity(orthogonal_nd)) <= 1e-12
    assert abs(router_similarity_pairwise(orthogonal_nd)) <= 1e-12


def test_similarity_of_a_zero_row_is_nan_and_single_experts_are_rejected():
    weight_nd = random_router(4, 8, offset=0.0, seed=0)
    weight_nd[2] = 0.0
    assert math.isnan(router_similarity(weight_nd)) and math.isnan(router_similarity_pairwise(weight_nd))
    with pytest.raises(ValueError, match="num_experts >= 2"):
        router_similarity(torch.ones(1, 8))


def test_similarity_reads_low_precision_weights_in_float64():
    weight_nd = random_router(32, 64, offset=2.0, seed=5)
    low = weight_nd.to(torch.bfloat16)
    assert relative_difference(router_similarity(low), router_similarity_pairwise(low.double())) <= 1e-10


# --- conditioning ratio ------------------------------------------------------------------------------------------


def test_conditioning_ratio_on_a_hand_made_router():
    # w̄ = (2, 0); deviations (−1, 0) and (1, 0): ε = 1 / 2
    assert conditioning_ratio(torch.tensor([[1.0, 0.0], [3.0, 0.0]])) == pytest.approx(0.5, rel=1e-15)
    # w̄ = 0: undefined, reported as inf
    assert conditioning_ratio(torch.tensor([[1.0, 2.0], [-1.0, -2.0]])) == math.inf


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("offset", [0.0, 0.3, 2.0, 30.0])
def test_similarity_is_bounded_below_by_conditioning(seed, offset):
    weight_nd = random_router(4 + 7 * seed, 16, offset=offset, seed=seed)
    n, epsilon = weight_nd.shape[0], conditioning_ratio(weight_nd)
    assert router_similarity(weight_nd) >= 1.0 - n * epsilon**2 / (n - 1) - 1e-12


@pytest.mark.parametrize("noise", [1e-1, 1e-2, 1e-4])
def test_conditioning_bound_is_tight_near_collapse(noise):
    gen = torch.Generator().manual_seed(11)
    mean_d = torch.randn(64, generator=gen, dtype=torch.float64)
    weight_nd = mean_d + noise * torch.randn(32, 64, generator=gen, dtype=torch.float64)
    n, epsilon = 32, conditioning_ratio(weight_nd)
    bound = 1.0 - n * epsilon**2 / (n - 1)
    sim = router_similarity(weight_nd)
    assert bound > 0.9  # a non-trivial bound: the rows are nearly collapsed
    assert sim >= bound - 1e-12
    assert 1.0 - sim <= 1.0 - bound  # the gap to 1 is at most the bound's


# --- routing entropy ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_experts", [2, 8, 64])
def test_uniform_router_has_entropy_log_n(num_experts):
    tokens_td = torch.randn(50, 16)
    logits_tn = tokens_td @ torch.zeros(num_experts, 16).T  # a zero router scores every expert alike
    entropy_t = per_token_entropy(logits_tn)  # float32 logits: a float32 entropy, returned as float64
    assert entropy_t.dtype == torch.float64
    assert torch.allclose(entropy_t, torch.full_like(entropy_t, math.log(num_experts)), rtol=0, atol=1e-6)
    assert routing_entropy_summary(logits_tn)["entropy_p1"] == pytest.approx(math.log(num_experts), abs=1e-6)
    exact_t = per_token_entropy(logits_tn.double())  # float64 logits: computed in float64
    assert torch.allclose(exact_t, torch.full_like(exact_t, math.log(num_experts)), rtol=0, atol=1e-12)


def test_float32_entropy_is_within_1e_5_nats_of_the_float64_one_at_256_experts():
    logits_tn = 2.0 * torch.randn(4096, 256, generator=torch.Generator().manual_seed(4))
    logits_tn[:, :8] = -math.inf  # masked experts still contribute 0
    fast_t, exact_t = per_token_entropy(logits_tn), per_token_entropy(logits_tn.double())
    assert torch.isfinite(fast_t).all()
    assert float((fast_t - exact_t).abs().max()) < 1e-5


def test_one_hot_collapsed_router_has_entropy_near_zero():
    logits_tn = torch.zeros(40, 16)
    logits_tn[torch.arange(40), torch.arange(40) % 16] = 60.0  # each token's winner leads by 60 nats
    entropy_t = per_token_entropy(logits_tn)
    assert float(entropy_t.max()) < 1e-20
    assert float(entropy_t.min()) >= 0.0


def test_entropy_matches_categorical_and_ignores_masked_experts():
    logits_tn = 3.0 * torch.randn(200, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    reference_t = torch.distributions.Categorical(logits=logits_tn).entropy()
    assert torch.allclose(per_token_entropy(logits_tn), reference_t, rtol=1e-12, atol=1e-14)
    masked_tn = torch.tensor([[0.0, 0.0, -math.inf, -math.inf]])
    assert float(per_token_entropy(masked_tn)[0]) == pytest.approx(math.log(2), rel=1e-6)  # float32 logits


def test_entropy_summary_sees_a_collapsing_tail_the_mean_hides():
    num_experts = 16
    logits_tn = torch.zeros(1000, num_experts)
    logits_tn[:80, 0] = 60.0  # 8% of the tokens are routed to one expert with certainty
    summary = routing_entropy_summary(logits_tn)
    assert summary["entropy_mean"] == pytest.approx(0.92 * math.log(num_experts), rel=1e-6)  # float32 entropies
    assert summary["entropy_p1"] < 1e-12 and summary["entropy_p5"] < 1e-12
    assert summary["entropy_p10"] == pytest.approx(math.log(num_experts), rel=1e-6)


def test_histogram_quantiles_are_within_one_bin_of_the_order_statistic():
    num_bins, max_entropy = 32, math.log(64)
    gen = torch.Generator().manual_seed(4)
    values_t = max_entropy * torch.rand(777, generator=gen, dtype=torch.float64) ** 3  # skewed toward 0
    histogram_b = torch.bincount((values_t * num_bins / max_entropy).floor().long(), minlength=num_bins)
    quantiles = [0.0, 0.001, 0.01, 0.05, 0.1, 0.5, 0.9, 1.0]
    estimates = histogram_quantiles(histogram_b, max_entropy, quantiles)
    sorted_t = values_t.sort().values
    for q, estimate in zip(quantiles, estimates, strict=True):
        order_statistic = float(sorted_t[min(math.floor(q * 777), 776)])
        assert abs(estimate - order_statistic) <= max_entropy / num_bins
    assert estimates == sorted(estimates)
    assert all(math.isnan(v) for v in histogram_quantiles(np.zeros(num_bins), max_entropy, [0.1]))


def test_histogram_quantiles_on_a_hand_made_histogram():
    """Bins of width 1 on [0, 5] holding 4 values in [2, 3) and 4 in [4, 5): empty bins are skipped, and inside a
    bin the answer interpolates in rank."""
    counts_b = torch.tensor([0.0, 0.0, 4.0, 0.0, 4.0])
    assert histogram_quantiles(counts_b, 5.0, [0.0, 0.25, 0.5, 0.75, 1.0]) == [2.0, 2.5, 4.0, 4.5, 5.0]
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantiles(counts_b, 5.0, [1.5])


def test_entropy_sums_count_tokens_and_bin_the_extremes():
    num_experts, num_bins = 8, 10
    logits_tn = torch.zeros(6, num_experts)
    logits_tn[:2, 3] = 80.0  # two collapsed tokens -> bin 0; four uniform tokens (H = log n) -> the last bin
    sums = routing_entropy_sums(logits_tn, num_bins)
    assert sums.shape == (2 + num_bins,) and sums.dtype == torch.float64
    assert float(sums[0]) == 6.0
    assert float(sums[1]) == pytest.approx(4 * math.log(num_experts), rel=1e-6)  # float32 entropies
    assert sums[2:].tolist() == [2.0] + [0.0] * (num_bins - 2) + [4.0]


# --- expert load -------------------------------------------------------------------------------------------------


def test_topk_routing_map_marks_each_tokens_k_best_experts():
    logits_tn = torch.tensor([[0.1, 0.9, 0.5, 0.0], [2.0, -1.0, 0.0, 3.0]])
    assert topk_routing_map(logits_tn, 2).tolist() == [[False, True, True, False], [True, False, False, True]]
    with pytest.raises(ValueError, match="topk"):
        topk_routing_map(logits_tn, 5)


def test_max_vio_and_dead_experts_on_a_hand_made_map():
    routing_map_tn = torch.tensor([[1, 1, 0, 0, 0],
                                   [1, 0, 1, 0, 0],
                                   [1, 1, 0, 0, 0],
                                   [1, 0, 1, 0, 0]], dtype=torch.bool)
    counts_n = tokens_per_expert(routing_map_tn)
    assert counts_n.tolist() == [4.0, 2.0, 2.0, 0.0, 0.0]
    summary = load_summary(counts_n)
    assert summary["max_vio"] == pytest.approx((4.0 - 1.6) / 1.6, rel=1e-15)  # mean load 8 / 5
    assert summary["dead_experts"] == 2 and summary["dead_expert_ids"] == [3, 4]


def test_balanced_map_has_no_violation_and_no_dead_experts():
    routing_map_tn = torch.eye(4, dtype=torch.bool).repeat(3, 1)  # 12 tokens, top-1, 3 per expert
    summary = load_summary(tokens_per_expert(routing_map_tn))
    assert summary["max_vio"] == 0.0 and summary["dead_experts"] == 0
    assert summary["tokens_per_expert"] == [3.0, 3.0, 3.0, 3.0]
    assert math.isnan(load_summary(torch.zeros(4))["max_vio"])


# --- fixed-size partials: split across ranks, SUM, unpack --------------------------------------------------------


def union_batch(num_tokens: int, num_experts: int, hidden: int, seed: int):
    """Router weight ``[n, d]`` and token logits ``[T, n]`` with entropies spread from collapsed to near-uniform,
    and two experts that no token ever picks."""
    gen = torch.Generator().manual_seed(seed)
    weight_nd = random_router(num_experts, hidden, offset=0.5, seed=seed)
    tokens_td = torch.randn(num_tokens, hidden, generator=gen, dtype=torch.float64)
    sharpness_t1 = 10 ** (2 * torch.rand(num_tokens, 1, generator=gen, dtype=torch.float64) - 1.5)
    logits_tn = sharpness_t1 * (tokens_td @ weight_nd.T)
    logits_tn[:, -2:] = -1e4
    return weight_nd, logits_tn.float()


@pytest.mark.parametrize(("num_ranks", "weight_on_every_rank"), [(2, True), (4, False), (4, True)])
def test_split_pack_sum_unpack_equals_the_union(num_ranks, weight_on_every_rank):
    num_tokens, num_experts, topk = 3000, 16, 2
    weight_nd, logits_tn = union_batch(num_tokens, num_experts, hidden=24, seed=num_ranks)
    routing_map_tn = topk_routing_map(logits_tn, topk)
    cuts = [*[0, 400, 1900, 2600][:num_ranks], num_tokens]  # unequal shares
    size = router_partials_size(num_experts)

    summed = torch.zeros(size, dtype=torch.float64)
    for rank, (start, stop) in enumerate(itertools.pairwise(cuts)):
        weight = weight_nd if weight_on_every_rank or rank == 0 else None
        packed = pack_router_partials(logits_tn[start:stop], routing_map_tn[start:stop], weight)
        assert packed.shape == (size,) and packed.dtype == torch.float64
        summed += packed
    merged = unpack_router_sums(summed, num_experts)
    union = unpack_router_sums(pack_router_partials(logits_tn, routing_map_tn, weight_nd), num_experts)

    # counts exact; means and weight statistics up to float64 rounding
    assert merged["tokens"] == union["tokens"] == num_tokens
    assert merged["tokens_per_expert"] == union["tokens_per_expert"]
    assert sum(merged["tokens_per_expert"]) == topk * num_tokens
    assert merged["dead_experts"] == 2 and merged["dead_expert_ids"] == [14, 15]
    assert merged["max_vio"] == union["max_vio"] == load_summary(tokens_per_expert(routing_map_tn))["max_vio"]
    entropy_t = per_token_entropy(logits_tn)
    assert relative_difference(merged["entropy_mean"], float(entropy_t.mean())) <= 1e-12
    assert relative_difference(merged["similarity"], router_similarity_pairwise(weight_nd)) <= 1e-10
    assert relative_difference(merged["conditioning_ratio"], conditioning_ratio(weight_nd)) <= 1e-12

    # percentiles of the union to one bin, from the summed histogram alone
    bin_width = math.log(num_experts) / NUM_ENTROPY_BINS
    sorted_t = entropy_t.sort().values
    for q in ENTROPY_QUANTILES:
        key = f"entropy_p{q * 100:g}"
        assert merged[key] == union[key]
        assert abs(merged[key] - float(sorted_t[math.floor(q * num_tokens)])) <= bin_width
    assert merged["entropy_p1"] < merged["entropy_p10"] < merged["entropy_mean"]


def test_packed_size_depends_only_on_experts_and_bins():
    weight_nd, logits_tn = union_batch(64, 8, hidden=12, seed=0)
    sizes = {pack_router_partials(logits_tn[:t], topk_routing_map(logits_tn[:t], 2), weight_nd, num_bins=20).numel()
             for t in (0, 1, 64)}
    assert sizes == {router_partials_size(8, num_bins=20)} == {6 + 8 + 20}


def test_ranks_with_nothing_to_report_leave_the_summary_undefined():
    summary = unpack_router_sums(torch.zeros(router_partials_size(8)), 8)
    assert summary["tokens"] == 0.0 and summary["dead_experts"] == 8
    for key in ("similarity", "conditioning_ratio", "entropy_mean", "entropy_p1", "max_vio"):
        assert math.isnan(summary[key]), key


def test_pack_and_unpack_reject_mismatched_shapes():
    weight_nd, logits_tn = union_batch(10, 8, hidden=12, seed=1)
    with pytest.raises(ValueError, match="routing map"):
        pack_router_partials(logits_tn, topk_routing_map(logits_tn, 2)[:5], weight_nd)
    with pytest.raises(ValueError, match="expert rows"):
        pack_router_partials(logits_tn, topk_routing_map(logits_tn, 2), weight_nd[:4])
    with pytest.raises(ValueError, match="num_experts=16"):
        unpack_router_sums(torch.zeros(router_partials_size(8)), 16)

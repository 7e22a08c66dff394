"""QK-product and weight-update spectra (mechanism-driven monitors): the core computation against the dense SVD of
the materialised products, the identities it relies on, the spectral summaries, and the per-head split of a
Megatron ``linear_qkv`` shard (GQA, tensor-parallel shards)."""

from __future__ import annotations

import math

import pytest
import torch

from arc_engine.monitors.spectra import (
    core_singular_values,
    dense_singular_values,
    head_spectra,
    head_spectra_and_bound_t,
    head_spectra_t,
    layer_spectra,
    qk_increment_factors,
    spectral_summary,
    split_qkv_rows,
    summarise_heads,
)


def rel_diff(core: torch.Tensor, dense: torch.Tensor) -> float:
    top = dense[: core.numel()]
    return float((core - top).abs().max() / top.max())


def heads(d: int = 96, d_k: int = 8, seed: int = 0, step: float = 1e-2) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    wq_prev, wk_prev = torch.randn(d, d_k, generator=gen), torch.randn(d, d_k, generator=gen)
    wq_t = wq_prev + step * torch.randn(d, d_k, generator=gen)
    wk_t = wk_prev + step * torch.randn(d, d_k, generator=gen)
    return wq_t, wk_t, wq_prev, wk_prev


@pytest.mark.parametrize(("d", "r"), [(64, 8), (200, 32), (50, 80)])
def test_core_spectrum_equals_the_dense_svd_of_the_product(d: int, r: int) -> None:
    gen = torch.Generator().manual_seed(d + r)
    a, b = torch.randn(d, r, generator=gen), torch.randn(d, r, generator=gen)
    assert rel_diff(core_singular_values(a, b), dense_singular_values(a, b)) <= 1e-5
    dense = dense_singular_values(a, b)
    rest = dense[min(d, r):]
    assert rest.numel() == 0 or float(rest.max()) <= 1e-9 * float(dense[0])  # rank <= r: nothing is missed


def test_the_three_increments_are_exact_factorisations_and_delta1_is_delta2_plus_delta3() -> None:
    wq_t, wk_t, wq_prev, wk_prev = (w.double() for w in heads())
    factors = qk_increment_factors(wq_t, wk_t, wq_prev, wk_prev)
    dense = {name: a @ b.T for name, (a, b) in factors.items()}
    torch.testing.assert_close(dense["delta1"], wq_t @ wk_t.T - wq_prev @ wk_prev.T)
    torch.testing.assert_close(dense["delta3"], (wq_t - wq_prev) @ (wk_t - wk_prev).T)
    torch.testing.assert_close(dense["delta1"], dense["delta2"] + dense["delta3"])
    for name, (a, b) in factors.items():
        assert rel_diff(core_singular_values(a, b), torch.linalg.svdvals(dense[name])) <= 1e-5, name


def test_head_spectra_match_summaries_of_the_materialised_products() -> None:
    wq_t, wk_t, wq_prev, wk_prev = heads(seed=3)
    spectra = head_spectra(wq_t, wk_t, wq_prev, wk_prev)
    for name, (a, b) in qk_increment_factors(wq_t, wk_t, wq_prev, wk_prev).items():
        reference = spectral_summary(dense_singular_values(a, b))
        for key, value in spectra[name].items():
            assert value == pytest.approx(reference[key], rel=1e-5), (name, key)
    reference = spectral_summary(torch.linalg.svdvals((wq_t - wq_prev).double()))
    assert spectra["dwq"] == pytest.approx(reference)


def test_spectral_summary_of_flat_single_and_zero_spectra() -> None:
    flat = spectral_summary(torch.ones(8))
    assert flat["entropy"] == pytest.approx(math.log(8)) and flat["effective_rank"] == pytest.approx(8.0)
    assert flat["stable_rank"] == pytest.approx(8.0) and flat["norm"] == pytest.approx(math.sqrt(8))
    single = spectral_summary(torch.tensor([3.0, 0.0, 0.0]))
    assert single["entropy"] == 0.0 and single["effective_rank"] == 1.0 and single["stable_rank"] == 1.0
    assert spectral_summary(torch.zeros(4)) == {"entropy": 0.0, "effective_rank": 0.0, "stable_rank": 0.0,
                                                "norm": 0.0}
    concentrated = spectral_summary(torch.tensor([10.0, 1.0, 1.0, 1.0]))
    assert concentrated["entropy"] < flat["entropy"] and concentrated["stable_rank"] < 1.1


def qkv_weight(groups: int, heads_per_group: int, head_dim: int, hidden: int) -> torch.Tensor:
    """A global linear_qkv weight whose every row says what it is: 1000 g + 100 slot + row (slot < heads_per_group:
    query head, = heads_per_group: key, + 1: value)."""
    rows = []
    for group in range(groups):
        for slot in range(heads_per_group + 2):
            for row in range(head_dim):
                rows.append(torch.full((hidden,), 1000.0 * group + 100.0 * slot + row))
    return torch.stack(rows)


def test_split_qkv_rows_takes_each_groups_queries_and_its_key() -> None:
    weight = qkv_weight(groups=2, heads_per_group=3, head_dim=4, hidden=5)
    q, k = split_qkv_rows(weight, num_query_groups=2, heads_per_group=3, head_dim=4)
    assert q.shape == (6, 5, 4) and k.shape == (2, 5, 4)  # heads as d x d_k factors
    assert q[4, 0].tolist() == [1100.0, 1101.0, 1102.0, 1103.0]  # query head 4 = group 1, slot 1
    assert k[1, 0].tolist() == [1300.0, 1301.0, 1302.0, 1303.0]  # group 1's key follows its 3 queries
    with pytest.raises(ValueError, match="expected 40 rows"):
        split_qkv_rows(weight[:-1], 2, 3, 4)


def test_tensor_parallel_shards_give_the_per_head_spectra_of_the_whole_layer() -> None:
    """TP=2 with 4 query groups: each rank's contiguous block of rows holds 2 whole groups, and its heads' spectra
    are the global run's heads 0-3 and 4-7."""
    gen = torch.Generator().manual_seed(11)
    groups, per_group, head_dim, hidden = 4, 2, 4, 32
    rows = groups * (per_group + 2) * head_dim
    before = torch.randn(rows, hidden, generator=gen)
    after = before + 0.05 * torch.randn(rows, hidden, generator=gen)
    whole = layer_spectra(after, before, groups, per_group, head_dim)
    shards = [layer_spectra(a, b, groups // 2, per_group, head_dim)
              for a, b in zip(after.chunk(2), before.chunk(2), strict=True)]
    assert len(whole) == 8 and [len(s) for s in shards] == [4, 4]
    assert shards[0] + shards[1] == whole
    summary = summarise_heads(whole)
    low, median, high = summary["delta2"]
    assert low <= median <= high and set(summary) == {"dwq", "dwk", "delta1", "delta2", "delta3"}


def test_batched_spectra_equal_each_heads_own() -> None:
    """The heads of every layer go through one call per quantity: batched over ``[heads, d, d_k]``, each head's
    summaries and core spectrum are the ones computed for that head alone (bitwise on CPU)."""
    batch = [heads(seed=seed) for seed in range(6)]
    stacked = [torch.stack(parts) for parts in zip(*batch, strict=True)]
    together = head_spectra_t(*stacked)
    assert together.shape == (6, 5, 4)
    for index, one in enumerate(batch):
        assert torch.equal(together[index], head_spectra_t(*one)), index
    cores = core_singular_values(stacked[0], stacked[1])
    assert all(torch.equal(cores[i], core_singular_values(q, k)) for i, (q, k, _, _) in enumerate(batch))


def test_the_logit_bound_from_the_two_shared_qrs_is_the_dense_products_largest_singular_value() -> None:
    """σ_max(W_q,t W_k,tᵀ) taken from the same two QRs as the spectra (W_q,t = W_q,t−δ + ΔW_q) equals the dense
    product's, and equals the bound from the head's own core at t."""
    for seed in range(3):
        wq_t, wk_t, wq_prev, wk_prev = heads(seed=seed, step=0.3)
        bound, _ = head_spectra_and_bound_t(wq_t, wk_t, wq_prev, wk_prev)
        dense = dense_singular_values(wq_t, wk_t)[0]
        assert abs(float(bound) - float(dense)) <= 1e-9 * float(dense)
        assert abs(float(bound) - float(core_singular_values(wq_t, wk_t)[0])) <= 1e-9 * float(dense)

"""Sampled update-RMS windows (``detectors.sdc.update_sample``) as pure functions: every element is covered within
⌈1/update_sample⌉ consecutive steps, the windows depend on the step and the tensor's place in its group only (the same
on every rank, whatever it owns, and again after a rollback), and the window cache gives the uncached result."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from arc_engine.stats.optim_stats import CHUNK_ELEMENTS, _one_batch, adam_views, leading, update_sq_total
from arc_engine.stats.sampling import (
    MIN_WINDOW_ELEMENTS,
    WindowCache,
    sample_phase,
    sample_window,
    sampled,
    window_bounds,
    window_slots,
)


@pytest.mark.parametrize("fraction", [1 / 32, 1 / 7, 0.1, 0.3, 0.5, 0.75])
@pytest.mark.parametrize("numel", [1, 5, 256, 257, 1000, 6864, 13731, 1_000_003])
def test_every_element_is_covered_within_ceil_one_over_sample_steps(fraction: float, numel: int) -> None:
    slots = math.ceil(1 / fraction)
    assert window_slots(fraction) == slots
    for position in (0, 1, 17):
        for first_phase in (0, 5, 1001):  # any run of consecutive phases, not only from phase 0
            covered = torch.zeros(numel, dtype=torch.bool)
            for phase in range(first_phase, first_phase + slots):
                start, length = window_bounds(numel, fraction, position, phase)
                assert start >= 0 and start + length <= numel
                assert length >= min(numel, max(MIN_WINDOW_ELEMENTS, math.ceil(fraction * numel)))
                covered[start:start + length] = True
            assert bool(covered.all()), (position, first_phase)


def test_windows_move_every_step_and_repeat_after_a_cycle() -> None:
    numel, fraction = 100_000, 1 / 32
    starts = [window_bounds(numel, fraction, 3, phase)[0] for phase in range(64)]
    assert len(set(starts[:32])) == 32  # a new place on each of the 32 steps of a cycle
    assert starts[32:] == starts[:32]  # the next cycle repeats it: step t and step t + 32 see the same elements
    assert window_bounds(numel, 1.0, 3, 7) == (0, numel)  # no sampling: the whole tensor


def test_one_groups_tensors_are_staggered() -> None:
    """At one step, the tensors of a group sit at different places (K = 32: all 32 positions are taken)."""
    numel = 32 * 1000
    starts = {window_bounds(numel, 1 / 32, position, 9)[0] for position in range(32)}
    assert len(starts) == 32


def test_the_phase_is_the_count_of_monitored_steps() -> None:
    """The phase comes from the step counter alone: the same on every rank, consecutive on consecutive monitored
    steps, and a step replayed after a rollback (the counter goes back) takes the window it took the first time."""
    assert [sample_phase(step, 1) for step in range(4)] == [0, 1, 2, 3]
    assert [sample_phase(step, 3) for step in (0, 3, 6, 9)] == [0, 1, 2, 3]
    tensor = torch.randn(50_000)
    first = sample_window(tensor, 1 / 32, 2, sample_phase(41, 1))
    replayed = sample_window(tensor.clone(), 1 / 32, 2, sample_phase(41, 1))
    assert torch.equal(first, replayed)


def make_adam(seed: int = 0) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(300)),
              torch.nn.Parameter(torch.randn(40, 128)), torch.nn.Parameter(torch.randn(7))]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    for param in params:
        param.grad = torch.randn_like(param)
    return optimizer, params


def test_a_tensors_window_does_not_depend_on_which_rank_owns_it() -> None:
    """Under DDP the replicated parameters are split across ranks by owner: each rank windows its own share, placed
    by the position in the group, so the union over ranks is the single-rank sample, at every phase."""
    optimizer, params = make_adam()
    group = optimizer.param_groups[0]
    full = adam_views(optimizer, group)
    rank0 = adam_views(optimizer, group, owned={id(params[0]), id(params[3])})
    rank1 = adam_views(optimizer, group, owned={id(params[1]), id(params[2])})
    assert full is not None and rank0 is not None and rank1 is not None
    for phase in range(40):
        whole = sampled(full, 1 / 32, phase=phase)
        for part in (rank0, rank1):
            cut = sampled(part, 1 / 32, phase=phase)
            for position, grad in zip(part.positions or [], cut.grads, strict=True):
                assert torch.equal(grad, whole.grads[position])
                assert grad.data_ptr() == whole.grads[position].data_ptr()
        sum_sq = [update_sq_total(v.params, v.grads, v.exp_avgs, v.exp_avg_sqs, v.step, v.hyper)
                  for v in (whole, sampled(rank0, 1 / 32, phase=phase), sampled(rank1, 1 / 32, phase=phase))]
        torch.testing.assert_close(sum_sq[1] + sum_sq[2], sum_sq[0], rtol=1e-6, atol=0.0)  # fp32 norms


def _same_views(a: object, b: object) -> bool:
    """Two AdamViews hold the very same tensors (identity), positions and step."""
    return all(len(x) == len(y) and all(s is t for s, t in zip(x, y, strict=True))
               for x, y in ((a.params, b.params), (a.grads, b.grads), (a.exp_avgs, b.exp_avgs),  # type: ignore[attr-defined]
                            (a.exp_avg_sqs, b.exp_avg_sqs))) \
        and list(a.positions) == list(b.positions) and a.step == b.step and a.hyper == b.hyper  # type: ignore[attr-defined]


def test_adam_views_memo_gives_the_loop_result_in_every_state() -> None:
    """The memo's C-level path gives what the per-parameter loop gives: before the first step (no state), with a
    parameter whose gradient is None, for an ``owned`` set that changes, and in the steady state."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(20, 8)), torch.nn.Parameter(torch.randn(30)),
              torch.nn.Parameter(torch.randn(5))]
    optimizer = torch.optim.Adam(params, lr=1e-2, weight_decay=0.1)
    group, memo = optimizer.param_groups[0], {}
    owned = {id(params[0]), id(params[2])}
    for param in params:
        param.grad = torch.randn_like(param)
    assert _same_views(adam_views(optimizer, group, owned=owned, memo=memo), adam_views(optimizer, group, owned=owned))
    optimizer.step()
    for step in range(4):
        for param in params:
            param.grad = torch.randn_like(param)
        if step == 1:
            params[2].grad = None  # e.g. an unused parameter: the loop's filter
        if step == 2:
            owned.discard(id(params[2]))  # the same set object, now smaller
        with_memo = adam_views(optimizer, group, owned=owned, memo=memo)
        plain = adam_views(optimizer, group, owned=owned)
        assert with_memo is not None and plain is not None and _same_views(with_memo, plain)
        assert with_memo.positions == ([0, 2] if step in (0, 3) and id(params[2]) in owned else [0])
        optimizer.step()
    assert memo["params"] == [params[0]]  # the memo followed the set's change


def test_fresh_gradients_are_cut_like_sample_window_and_persistent_ones_cached() -> None:
    """A list of fresh tensors on every call (``zero_grad(set_to_none=True)``) is cut from kept bounds into the
    :func:`sample_window` views; a list of the same tensors (DDP's ``gradient_as_bucket_view``) is cached from its
    third call on, and a changed list is cut anew."""
    cache = WindowCache()
    shapes = [(64, 80), (300,), (7,), (40, 128)]
    positions = [0, 2, 5, 6]
    for phase in range(12):
        grads = [torch.randn(shape) for shape in shapes]
        windows = cache.windows("grads", grads, 1 / 8, positions, phase)
        expected = [sample_window(g, 1 / 8, i, phase) for i, g in zip(positions, grads, strict=True)]
        assert [(w.data_ptr(), w.numel()) for w in windows] == [(w.data_ptr(), w.numel()) for w in expected]
        assert "grads" not in cache._entries or not cache._entries["grads"].by_slot  # never held
    persistent = [torch.randn(shape) for shape in shapes]
    first = [cache.windows("grads", persistent, 1 / 8, positions, phase=3) for _ in range(3)]
    assert first[2] is not first[1]  # seen twice: now checked by weak references, cut once more
    assert cache.windows("grads", persistent, 1 / 8, positions, phase=3) is first[2]  # then reused
    persistent[1] = torch.randn(300)
    assert cache.windows("grads", persistent, 1 / 8, positions, phase=3) is not first[2]


def test_windows_keep_the_one_batch_path() -> None:
    optimizer, _ = make_adam()
    views = adam_views(optimizer, optimizer.param_groups[0])
    assert views is not None
    windows = sampled(views, 1 / 32, phase=3)
    assert all(w.dim() == 1 for w in windows.grads)
    assert _one_batch(windows.grads, CHUNK_ELEMENTS)


def sampled_update_sq(optimizer: torch.optim.Optimizer, cache: WindowCache | None, phase: int) -> float:
    views = adam_views(optimizer, optimizer.param_groups[0])
    assert views is not None
    views = sampled(views, 1 / 8, cache, phase)
    return float(update_sq_total(views.params, views.grads, views.exp_avgs, views.exp_avg_sqs, views.step,
                                 views.hyper))


def test_the_cache_gives_the_uncached_windows_at_every_phase() -> None:
    optimizer, params = make_adam(1)
    cache = WindowCache()
    for step in range(20):
        for param in params:
            param.grad = torch.randn_like(param)  # fresh gradients, as with zero_grad(set_to_none=True)
        if step == 11:
            optimizer.load_state_dict(optimizer.state_dict())  # the moments replaced by new tensors
        assert sampled_update_sq(optimizer, cache, step) == sampled_update_sq(optimizer, None, step)
        optimizer.step()
    moments = [optimizer.state[p]["exp_avg"] for p in params]
    windows = cache.windows("exp_avgs", moments, 1 / 8, None, phase=3)
    assert cache.windows("exp_avgs", moments, 1 / 8, None, phase=3 + 8) is windows  # same slot: reused
    assert cache.windows("exp_avgs", moments, 1 / 8, None, phase=4) is not windows


def test_the_cache_never_keeps_a_transient_gradient_alive() -> None:
    cache = WindowCache()
    grad = torch.randn(10_000)
    alive = weakref.ref(grad)
    cache.windows("grads", [grad], 1 / 32, None, phase=0)
    del grad
    gc.collect()
    assert alive() is None


def test_the_cache_keeps_at_most_max_views() -> None:
    tensors = [torch.randn(5000) for _ in range(10)]
    cache = WindowCache(max_views=30)
    for phase in range(64):
        windows = cache.windows("params", tensors, 1 / 32, None, phase)
        assert [w.data_ptr() for w in windows] == [w.data_ptr() for w in
                                                    (sample_window(t, 1 / 32, i, phase) for i, t in enumerate(tensors))]
    assert sum(len(ws) for ws in cache._entries["params"].by_slot.values()) <= 30


def test_leading_cuts_pieces_to_the_real_elements() -> None:
    pieces = [torch.arange(4.0), torch.arange(4.0, 10.0), torch.arange(10.0, 12.0)]
    cut = leading(pieces, [4, 6, 2], 7)
    assert [t.tolist() for t in cut] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert leading([None, None], [3, 3], 4) == [None, None]
    assert len(leading(pieces, [4, 6, 2], 12)) == 3 and leading(pieces, [4, 6, 2], 12)[2] is pieces[2]


def test_a_flat_partition_is_sampled_in_staggered_segments() -> None:
    """A ZeRO-1/2 flat partition is cut into segments (views), each with its own window: at every step the sample
    is spread over the whole partition, and every element is still covered within ⌈1/update_sample⌉ steps."""
    from arc_engine.stats.optim_stats import AdamHyper, AdamViews
    from arc_engine.stats.sampling import MAX_SEGMENTS, segment_count, segmented

    numel, fraction = 1_000_003, 1 / 32
    flat = torch.arange(float(numel))
    views = AdamViews([flat], [flat], [None], [None], 0, AdamHyper(0.9, 0.999, 1e-8))
    segments = segmented(views, fraction)
    assert len(segments.grads) == segment_count(numel, fraction) == MAX_SEGMENTS
    assert sum(g.numel() for g in segments.grads) == numel and segments.exp_avgs == [None] * MAX_SEGMENTS
    assert all(g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for g in segments.grads)
    covered = torch.zeros(numel, dtype=torch.bool)
    for phase in range(32):
        windows = sampled(segments, fraction, phase=phase).grads
        for window, segment in zip(windows, segments.grads, strict=True):  # one window inside each segment
            assert segment[0] <= window[0] and window[-1] <= segment[-1]
            covered[window.long()] = True
    assert bool(covered.all())
    small = AdamViews([flat[:6864]], [flat[:6864]], [None], [None], 0, AdamHyper(0.9, 0.999, 1e-8))
    assert segmented(small, fraction) is small  # too small to cut: its window stays one run
    assert segmented(views, 1.0) is views


def test_segment_windows_cut_from_the_partition_equal_the_segments_windows_and_are_cached() -> None:
    """``sampled_segments`` (the hot path of ZeRO-1/2) takes the very elements ``sampled(segmented(...))`` takes,
    with ``segmented``'s positions, cut straight from the flat partitions; with a cache, a partition that persists
    (the master weights, the moments) gets the same window objects at the same window position, a fresh gradient
    never does."""
    from arc_engine.stats.optim_stats import AdamHyper, AdamViews
    from arc_engine.stats.sampling import WindowCache, sampled_segments, segmented

    fraction = 1 / 32
    partitions = [torch.randn(300_007), torch.randn(70_000), torch.randn(5_000)]  # 16, 8 and 1 segments
    moments = [torch.rand(p.numel()) for p in partitions]
    cache = WindowCache()
    for phase in range(40):
        grads = [torch.randn(p.numel()) for p in partitions]
        views = AdamViews(partitions, grads, moments, [None, None, None], 3, AdamHyper(0.9, 0.999, 1e-8), [0, 1, 2])
        reference = sampled(segmented(views, fraction), fraction, phase=phase)
        fast = sampled_segments(views, fraction, cache, phase)
        assert fast.positions == reference.positions
        for name in ("params", "grads", "exp_avgs", "exp_avg_sqs"):
            got, want = getattr(fast, name), getattr(reference, name)
            assert len(got) == len(want)
            for a, b in zip(got, want, strict=True):
                assert (a is None and b is None) or (a.data_ptr() == b.data_ptr() and torch.equal(a, b))
        if phase >= 33:  # every window position was seen once: the persistent partitions' windows are reused
            again = sampled_segments(views, fraction, cache, phase)
            assert all(a is b for a, b in zip(again.params, fast.params, strict=True))
            assert all(a is b for a, b in zip(again.exp_avgs, fast.exp_avgs, strict=True))
    fresh = AdamViews(partitions, [torch.randn(p.numel()) for p in partitions], moments, [None] * 3, 3,
                      AdamHyper(0.9, 0.999, 1e-8), [0, 1, 2])
    first, second = (sampled_segments(fresh, fraction, cache, 7) for _ in range(2))
    assert first.grads[0] is not second.grads[0]  # a gradient list seen once is never held

"""The optimizer statistics math: prospective Adam update RMS (SDC paper) and weight norms."""

from __future__ import annotations

import pytest
import torch

from arc_engine.stats.optim_stats import (
    OWN_BATCH_ELEMENTS,
    AdamHyper,
    adam_views,
    rms_per_group,
    step_count,
    update_sq_sums,
    update_sq_total,
    weight_sq_sums,
)
from arc_engine.stats.sampling import WindowCache, sampled
from arc_engine.testing.launches import KernelCounter


def applied_update_sq(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[float]:
    """Σ U² per tensor from the optimizer state *after* its step: U = m̂/(√v̂+ε) (the definition)."""
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    out = []
    for param in params:
        state = optimizer.state[param]
        t = int(state["step"])
        update = (state["exp_avg"] / (1 - beta1**t)) / ((state["exp_avg_sq"] / (1 - beta2**t)).sqrt() + group["eps"])
        out.append(float(update.double().square().sum()))
    return out


@pytest.mark.parametrize(("optimizer_cls", "kwargs"), [
    (torch.optim.AdamW, {"weight_decay": 0.1}),
    (torch.optim.Adam, {"weight_decay": 0.1}),  # L2 decay enters the moments
    (torch.optim.Adam, {"weight_decay": 0.1, "decoupled_weight_decay": True}),
    (torch.optim.Adam, {"betas": (0.8, 0.9), "eps": 1e-6}),
])
@pytest.mark.parametrize("chunk_elements", [1 << 24, 16])
def test_prospective_update_equals_the_applied_one(optimizer_cls, kwargs, chunk_elements) -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(50, 3)), torch.nn.Parameter(torch.randn(7))]
    optimizer = optimizer_cls(params, lr=1e-3, **kwargs)
    for _ in range(4):
        for param in params:
            param.grad = torch.randn_like(param)
        views = adam_views(optimizer, optimizer.param_groups[0])
        assert views is not None
        predicted = update_sq_sums(views.params, views.grads, views.exp_avgs, views.exp_avg_sqs, views.step,
                                   views.hyper, chunk_elements=chunk_elements)
        optimizer.step()
        torch.testing.assert_close(predicted.tolist(), applied_update_sq(optimizer, params), rtol=2e-6, atol=1e-9)


def test_inputs_are_not_modified() -> None:
    torch.manual_seed(1)
    param, grad = torch.randn(100), torch.randn(100)
    mean, sq = torch.randn(100), torch.rand(100)
    copies = [t.clone() for t in (param, grad, mean, sq)]
    update_sq_sums([param], [grad], [mean], [sq], 3, AdamHyper(0.9, 0.95, 1e-8, l2_weight_decay=0.1), 7)
    assert all(torch.equal(a, b) for a, b in zip((param, grad, mean, sq), copies, strict=True))


def test_nan_gradient_gives_nan_update() -> None:
    grad = torch.ones(10)
    grad[3] = float("nan")
    result = update_sq_sums([torch.zeros(10)], [grad], [None], [None], 0, AdamHyper(0.9, 0.999, 1e-8))
    assert torch.isnan(result).all()


def test_first_step_update_rms_is_one_for_large_gradients() -> None:
    # at t=1: m̂ = g, v̂ = g², so U = g/(|g|+ε) = ±1 when |g| >> ε
    grad = torch.tensor([3.0, -2.0, 5.0, -0.5])
    total = update_sq_sums([torch.zeros(4)], [grad], [None], [None], 0, AdamHyper(0.9, 0.999, 1e-12))
    assert float(total[0]) == pytest.approx(4.0, rel=1e-6)
    assert rms_per_group([float(total[0])], [4.0]) == [pytest.approx(1.0, rel=1e-6)]


def test_weight_sq_sums_per_tensor_and_non_adam_optimizers_have_no_adam_views() -> None:
    tensors = [torch.full((2, 2), 2.0), torch.tensor([3.0])]
    assert weight_sq_sums(tensors).tolist() == [16.0, 9.0]
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    assert adam_views(sgd, sgd.param_groups[0]) is None
    assert rms_per_group([0.0], [0.0]) == [0.0]


def sampled_update_sq(optimizer: torch.optim.Optimizer, cache: WindowCache | None) -> float:
    views = adam_views(optimizer, optimizer.param_groups[0])
    assert views is not None
    views = sampled(views, 0.25, cache)
    return float(update_sq_total(views.params, views.grads, views.exp_avgs, views.exp_avg_sqs, views.step,
                                 views.hyper))


def test_cached_windows_follow_the_tensors_they_were_cut_from() -> None:
    """The window cache gives the uncached result at every step: moments updated in place are seen through the
    cached views, and a fresh gradient, a replaced optimizer state or a swapped ``param.data`` gets new windows."""
    torch.manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(64, 5)), torch.nn.Parameter(torch.randn(33))]
    optimizer = torch.optim.Adam(params, lr=1e-2, weight_decay=0.1)  # L2 decay: the parameter enters U
    cache = WindowCache()
    for step in range(6):
        for param in params:
            param.grad = torch.randn_like(param)  # a new tensor every step, as with zero_grad(set_to_none=True)
        if step == 3:  # optimizer state replaced by new tensors (as by load_state_dict)
            optimizer.load_state_dict(optimizer.state_dict())
        if step == 4:  # the parameter's storage swapped under the same Parameter object
            params[0].data = params[0].data.clone() * 2.0
        assert sampled_update_sq(optimizer, cache) == sampled_update_sq(optimizer, None)
        optimizer.step()
    exp_avg = optimizer.state[params[0]]["exp_avg"]
    entry = cache.windows("exp_avgs", [exp_avg, optimizer.state[params[1]]["exp_avg"]], 0.25)
    assert entry is cache.windows("exp_avgs", [exp_avg, optimizer.state[params[1]]["exp_avg"]], 0.25)  # reused
    assert entry[0].data_ptr() >= exp_avg.data_ptr()  # a view into the live moment
    assert cache.windows("exp_avgs", [exp_avg.clone(), optimizer.state[params[1]]["exp_avg"]], 0.25) is not entry


def test_step_count_on_a_tensor_gives_the_same_update() -> None:
    """A step count kept as a tensor (fused/capturable Adam keep it on the accelerator: no ``.item()`` there) gives
    the update an int step gives."""
    torch.manual_seed(3)
    param, grad, mean, sq = torch.randn(40), torch.randn(40), torch.randn(40) * 0.1, torch.rand(40) * 0.01
    hyper = AdamHyper(0.9, 0.95, 1e-8)
    as_int = update_sq_total([param], [grad], [mean], [sq], 7, hyper)
    as_tensor = update_sq_total([param], [grad], [mean], [sq], torch.tensor(7.0), hyper)
    torch.testing.assert_close(as_tensor, as_int, rtol=1e-12, atol=0.0)
    assert step_count(torch.tensor(7.0)) == 7 and isinstance(step_count(torch.tensor(7.0)), int)  # CPU: an int
    assert step_count(5) == 5


def test_apex_fused_adam_state_is_read_like_torch_adam() -> None:
    """apex's FusedAdam keeps exp_avg/exp_avg_sq per parameter and the step in the group (GPU only)."""
    apex_optimizers = pytest.importorskip("apex.optimizers", reason="apex is not installed (GPU-only package)")
    if not torch.cuda.is_available():
        pytest.skip("apex FusedAdam needs CUDA")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 8, device="cuda")), torch.nn.Parameter(torch.randn(8, device="cuda"))]
    optimizer = apex_optimizers.FusedAdam(params, lr=1e-3, weight_decay=0.1, adam_w_mode=True)
    for _ in range(3):
        for param in params:
            param.grad = torch.randn_like(param)
        views = adam_views(optimizer, optimizer.param_groups[0])
        assert views is not None and views.hyper.l2_weight_decay == 0.0
        predicted = update_sq_sums(views.params, views.grads, views.exp_avgs, views.exp_avg_sqs, views.step,
                                   views.hyper)
        optimizer.step()
        group = optimizer.param_groups[0]
        beta1, beta2 = group["betas"]
        t = int(group["step"])
        applied = [float(((optimizer.state[p]["exp_avg"] / (1 - beta1**t)) /
                          ((optimizer.state[p]["exp_avg_sq"] / (1 - beta2**t)).sqrt() + group["eps"]))
                         .double().square().sum()) for p in params]
        torch.testing.assert_close(predicted.tolist(), applied, rtol=1e-5, atol=1e-9)


LARGE = OWN_BATCH_ELEMENTS + 5  # a slice this large is not concatenated: the multi-tensor (_foreach) path


@pytest.mark.parametrize(("optimizer_cls", "kwargs"), [
    (torch.optim.AdamW, {"weight_decay": 0.1}),
    (torch.optim.Adam, {"weight_decay": 0.1}),  # L2 decay enters the moments
    (torch.optim.Adam, {"betas": (0.8, 0.9), "eps": 1e-6}),
])
def test_large_slices_give_the_applied_update_in_the_multi_tensor_path(optimizer_cls, kwargs) -> None:
    """Large slices, mixed with small ones and cut into several batches (chunk of 2.5 large slices): Σ U² is the
    sum of what the optimizer applies, with a gradient scale as a tensor, and no input is written."""
    torch.manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(LARGE)), torch.nn.Parameter(torch.randn(30)),
              torch.nn.Parameter(torch.randn(2, LARGE)), torch.nn.Parameter(torch.randn(LARGE))]
    optimizer = optimizer_cls(params, lr=1e-3, **kwargs)
    for _ in range(3):
        for param in params:
            param.grad = torch.randn_like(param) * 4.0
        views = adam_views(optimizer, optimizer.param_groups[0])
        assert views is not None
        inputs = [*views.params, *views.grads, *(t for t in views.exp_avgs if t is not None)]
        before = [t.clone() for t in inputs]
        predicted = update_sq_total(views.params, views.grads, views.exp_avgs, views.exp_avg_sqs, views.step,
                                    views.hyper, chunk_elements=LARGE * 5 // 2, grad_scale=torch.tensor(0.25))
        assert all(torch.equal(a, b) for a, b in zip(before, inputs, strict=True))
        for param in params:
            param.grad.mul_(0.25)
        optimizer.step()
        # rtol: torch's float32 norm on the CPU accumulates a long tensor in a few float32 lanes (about 1e-4 off at
        # 2^17 elements, whichever path); the applied update is summed in float64
        torch.testing.assert_close(float(predicted), sum(applied_update_sq(optimizer, params)), rtol=1e-3, atol=0.0)


@pytest.mark.parametrize("step", [7, torch.tensor(7.0)])
def test_the_update_of_many_large_tensors_costs_the_kernels_of_a_few(step) -> None:
    """O(1) launches in the number of tensors: 12 large tensors dispatch as many operators as 3 (each one would
    launch its own dozen kernels on a GPU otherwise), with the step count as an int or as a device tensor."""
    hyper = AdamHyper(0.9, 0.95, 1e-8)

    def kernels(n: int) -> int:
        tensors = [[torch.rand(LARGE) for _ in range(n)] for _ in range(4)]
        with KernelCounter() as counter:  # arc_engine's operators, views aside
            update_sq_total(*tensors, step, hyper)
        return counter.count(None)

    assert kernels(12) == kernels(3)

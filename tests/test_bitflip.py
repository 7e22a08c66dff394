"""Bit-flip fault injection: the word-level flips against struct references, element choice, and the injector on a
bare Linear and on the demo GPT (what changes at the due step, and what stays bitwise identical elsewhere)."""

from __future__ import annotations

import copy
import struct

import pytest
import torch
from torch import nn

from arc_engine.demo.gpt import GPT, GPTConfig
from arc_engine.faults.bitflip import (
    DEFAULT_BIT,
    EXPONENT_BITS,
    BitFlipInjector,
    BitFlipSpec,
    choose_elements,
    flip_bits,
    signed_bit_constant,
)

INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def words(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().view(INT_VIEW[tensor.dtype])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(words(a), words(b))


def fp32_word(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def fp16_word(value: float) -> int:
    return struct.unpack("<H", struct.pack("<e", value))[0]


def as_unsigned(tensor: torch.Tensor, width: int) -> list[int]:
    return [w & ((1 << width) - 1) for w in words(tensor).tolist()]


def full_mask(tensor: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(tensor, dtype=torch.bool)


# Exactly representable in fp32, bf16 and fp16, so bf16's word is the top half of the fp32 word.
VALUES = [1.0, 0.5, -3.0, 0.15625, 0.0, -0.0]


# ---------------------------------------------------------------------------------------------------- flip_bits


@pytest.mark.parametrize("bit", [0, 22, 23, 28, 30, 31])
def test_flip_fp32_matches_struct_reference(bit):
    values = torch.tensor(VALUES, dtype=torch.float32)
    flipped = flip_bits(values, bit, full_mask(values))
    assert as_unsigned(flipped, 32) == [fp32_word(v) ^ (1 << bit) for v in VALUES]


def test_flipping_fp32_bits_30_31_28_gives_inf_negation_and_tiny_values():
    one = torch.tensor([1.0, 0.5])
    assert flip_bits(one, 30, full_mask(one)).tolist() == [float("inf"), 2.0**127]
    assert flip_bits(one, 31, full_mask(one)).tolist() == [-1.0, -0.5]
    assert flip_bits(one, 28, full_mask(one)).tolist() == [2.0**-32, 2.0**-33]


@pytest.mark.parametrize("bit", list(range(16)))
def test_flip_bf16_matches_struct_reference(bit):
    values = torch.tensor(VALUES, dtype=torch.bfloat16)
    flipped = flip_bits(values, bit, full_mask(values))
    assert as_unsigned(flipped, 16) == [(fp32_word(v) >> 16) ^ (1 << bit) for v in VALUES]


def test_flipping_bf16_bits_14_12_15_gives_inf_tiny_and_negation():
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    assert flip_bits(one, 14, full_mask(one)).item() == float("inf")
    assert flip_bits(one, 12, full_mask(one)).item() == 2.0**-32
    assert flip_bits(one, 15, full_mask(one)).item() == -1.0


@pytest.mark.parametrize("bit", list(range(16)))
def test_flip_fp16_matches_struct_reference(bit):
    values = torch.tensor(VALUES, dtype=torch.float16)
    flipped = flip_bits(values, bit, full_mask(values))
    assert as_unsigned(flipped, 16) == [fp16_word(v) ^ (1 << bit) for v in VALUES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_flip_respects_mask_and_twice_restores(dtype):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, generator=gen).to(dtype).t()  # non-contiguous on purpose
    mask = torch.rand(values.shape, generator=gen) < 0.4
    bit = EXPONENT_BITS[dtype][-1]
    flipped = flip_bits(values, bit, mask)
    assert same_bits(flipped[~mask], values[~mask])
    xor = torch.bitwise_xor(words(flipped), words(values))
    assert torch.all(xor[mask] == 1 << bit) and torch.all(xor[~mask] == 0)
    assert same_bits(flip_bits(flipped, bit, mask), values)
    assert flip_bits(values, bit, torch.zeros_like(mask)).data_ptr() != values.data_ptr()


def test_signed_bit_constant_fits_the_word():
    # torch's tensor-scalar ops silently wrap an out-of-range scalar; building the constant as a tensor does not.
    assert torch.full((1,), signed_bit_constant(15, 16), dtype=torch.int16).item() == -(2**15)
    assert torch.full((1,), signed_bit_constant(31, 32), dtype=torch.int32).item() == -(2**31)
    assert signed_bit_constant(14, 16) == 2**14


def test_flip_bits_rejects_bad_input():
    bf16 = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bit must be in"):
        flip_bits(bf16, 16, full_mask(bf16))
    with pytest.raises(ValueError, match="support"):
        flip_bits(torch.ones(3, dtype=torch.float64), 3, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        flip_bits(bf16, 3, torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        flip_bits(bf16, 3, torch.ones(3, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------- choose_elements


def test_choose_elements_count_is_exact_and_clamped():
    gen = torch.Generator().manual_seed(0)
    mask = choose_elements((7, 9), None, 5, gen, "cpu")
    assert mask.shape == (7, 9) and mask.dtype == torch.bool and int(mask.sum()) == 5
    assert int(choose_elements((2, 3), None, 50, gen, "cpu").sum()) == 6


def test_choose_elements_rate_selects_about_rate_times_numel():
    mask = choose_elements((100, 100), 0.1, None, torch.Generator().manual_seed(0), "cpu")
    assert abs(int(mask.sum()) - 1000) < 150  # 5 standard deviations (30 each)


def test_choose_elements_is_deterministic_per_seed():
    def draw(seed: int, **kw) -> torch.Tensor:
        return choose_elements((64, 64), generator=torch.Generator().manual_seed(seed), device="cpu", **kw)

    assert torch.equal(draw(3, rate=None, count=10), draw(3, rate=None, count=10))
    assert torch.equal(draw(3, rate=0.2, count=None), draw(3, rate=0.2, count=None))
    assert not torch.equal(draw(3, rate=None, count=10), draw(4, rate=None, count=10))


def test_choose_elements_rejects_bad_arguments():
    gen = torch.Generator()
    for rate, count in [(None, None), (0.1, 3), (1.5, None), (None, -1)]:
        with pytest.raises(ValueError):
            choose_elements((4,), rate, count, gen, "cpu")


# ---------------------------------------------------------------------------------------- injector: bare Linear


class StepCounter:
    """The ``current_step`` callable the engine would pass: the step attempt being run."""

    def __init__(self) -> None:
        self.step = 0

    def __call__(self) -> int:
        return self.step


def linear_pass(linear: nn.Linear, seed: int = 0) -> dict[str, torch.Tensor]:
    """One forward + backward through ``linear`` (input requiring grad, fixed ``dL/dY``); the three GEMM results."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, linear.in_features, generator=gen).requires_grad_()
    grad_y = torch.randn(4, linear.out_features, generator=gen)  # a fixed dL/dY, whatever Y turns out to be
    linear.zero_grad(set_to_none=True)
    y = linear(x)
    y.backward(grad_y)
    return {"forward": y.detach(), "backward": x.grad, "weight_grad": linear.weight.grad}


@pytest.mark.parametrize("where", ["forward", "backward", "weight_grad"])
def test_linear_injection_hits_exactly_one_gemm_result(where):
    torch.manual_seed(0)
    linear = nn.Linear(8, 6)
    baseline = linear_pass(linear)
    steps = StepCounter()
    injector = BitFlipInjector(BitFlipSpec(pattern="*", where=where, steps={0}, count=3), rank=0, current_step=steps)
    assert injector.install(linear) == [""]
    corrupted = linear_pass(linear)

    xor = torch.bitwise_xor(words(corrupted[where]), words(baseline[where]))
    assert int((xor != 0).sum()) == 3 and torch.all(xor[xor != 0] == 1 << DEFAULT_BIT[torch.float32])
    for other in {"forward", "backward", "weight_grad"} - {where}:  # forward: dL/dY passes the corruption unchanged
        assert same_bits(corrupted[other], baseline[other]), other
    assert injector.fired == [{"step": 0, "module": "", "where": where, "bit": 28, "dtype": "float32",
                               "num_flipped": 3}]
    steps.step = 1
    after = linear_pass(linear)
    assert all(same_bits(after[k], baseline[k]) for k in baseline) and len(injector.fired) == 1


def test_forward_default_bit_follows_output_dtype_and_rate_counts_flips():
    torch.manual_seed(0)
    linear = nn.Linear(16, 16).to(torch.bfloat16)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    baseline = linear(x)
    injector = BitFlipInjector(BitFlipSpec(pattern="", steps=[0], rate=0.25, seed=1), rank=0, current_step=lambda: 0)
    injector.install(linear)
    corrupted = linear(x)
    record = injector.fired[0]
    assert record["bit"] == 12 and record["dtype"] == "bfloat16"
    assert record["num_flipped"] == int((words(corrupted) != words(baseline)).sum()) > 0


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_max_per_step_limits_micro_batches(where):
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    steps = StepCounter()
    counts = {}
    for max_per_step in (None, 1):
        injector = BitFlipInjector(BitFlipSpec(pattern="*", where=where, persistent=True, max_per_step=max_per_step),
                                   rank=0, current_step=steps)
        injector.install(linear)
        for steps.step in range(3):
            for micro_batch in range(2):
                linear_pass(linear, seed=micro_batch)
        injector.remove()
        counts[max_per_step] = [r["step"] for r in injector.fired]
    assert counts[None] == [0, 0, 1, 1, 2, 2]
    assert counts[1] == [0, 1, 2]


def test_backward_injection_needs_an_input_gradient():
    linear = nn.Linear(4, 4)
    injector = BitFlipInjector(BitFlipSpec(pattern="", where="backward", persistent=True), rank=0,
                               current_step=lambda: 0)
    injector.install(linear)
    linear(torch.randn(2, 4)).sum().backward()  # data input: torch runs no data-gradient GEMM
    with torch.no_grad():
        linear(torch.randn(2, 4, requires_grad=True))
    assert injector.fired == [] and linear.weight.grad is not None


def test_backward_injection_corrupts_only_the_linears_share_of_a_shared_input():
    linear = nn.Linear(4, 4)
    nn.init.zeros_(linear.weight)  # the Linear's dL/dX is exactly 0; flipping bit 30 of 0.0 gives 2.0
    injector = BitFlipInjector(BitFlipSpec(pattern="", where="backward", steps={0}, bit=30, count=2), rank=0,
                               current_step=lambda: 0)
    injector.install(linear)
    x = torch.randn(3, 4, requires_grad=True)
    (linear(x).sum() + x.sum()).backward()  # the residual branch adds 1.0 to every element of x.grad
    assert sorted(x.grad.flatten().tolist()) == [1.0] * 10 + [3.0] * 2


def test_remove_restores_the_module():
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    baseline = linear_pass(linear)
    injector = BitFlipInjector(BitFlipSpec(pattern="*", persistent=True), rank=0, current_step=lambda: 5)
    injector.install(linear)
    assert not same_bits(linear_pass(linear)["forward"], baseline["forward"])
    injector.remove()
    assert same_bits(linear_pass(linear)["forward"], baseline["forward"])
    assert len(injector.fired) == 1 and not linear._forward_hooks


# ----------------------------------------------------------------------------------------------- injector: GPT


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, num_layers=2, d_model=16, num_heads=2))


def run_steps(model: GPT, num_steps: int, steps: StepCounter) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Loss and gradients per step on a fresh batch each step; parameters stay fixed so steps are comparable."""
    gen = torch.Generator().manual_seed(1)
    results = []
    for steps.step in range(num_steps):
        tokens = torch.randint(0, 32, (2, 9), generator=gen)
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return results


def changed_grads(result, baseline) -> set[str]:
    return {name for name, grad in result[1].items() if not same_bits(grad, baseline[1][name])}


def inject_gpt(num_steps: int, process_rank: int = 0, **spec) -> tuple[list, list, BitFlipInjector]:
    model = tiny_gpt()
    baseline = run_steps(copy.deepcopy(model), num_steps, StepCounter())
    steps = StepCounter()
    injector = BitFlipInjector(BitFlipSpec(**spec), rank=process_rank, current_step=steps)
    injector.install(model)
    return baseline, run_steps(model, num_steps, steps), injector


def test_gpt_forward_injection_changes_loss_only_at_its_step():
    baseline, injected, injector = inject_gpt(4, pattern="blocks.0.mlp.0", where="forward", steps={2}, count=8)
    for step in (0, 1, 3):
        assert same_bits(injected[step][0], baseline[step][0]) and not changed_grads(injected[step], baseline[step])
    assert not same_bits(injected[2][0], baseline[2][0])
    assert [(r["step"], r["module"], r["num_flipped"]) for r in injector.fired] == [(2, "blocks.0.mlp.0", 8)]


def test_gpt_backward_injection_changes_upstream_gradients_not_loss():
    baseline, injected, injector = inject_gpt(3, pattern="blocks.1.mlp.0", where="backward", steps={1}, count=8)
    assert all(same_bits(injected[s][0], baseline[s][0]) for s in range(3))
    assert not changed_grads(injected[0], baseline[0]) and not changed_grads(injected[2], baseline[2])
    changed = changed_grads(injected[1], baseline[1])
    # dL/dX of blocks.1.mlp.0 flows into ln2 and everything before it; the Linear's own and later grads are intact.
    assert {"blocks.1.ln2.weight", "blocks.0.attn.qkv.weight", "pos_emb.weight"} <= changed
    assert not changed & {"blocks.1.mlp.0.weight", "blocks.1.mlp.0.bias", "blocks.1.mlp.2.weight", "ln_f.weight"}
    assert [(r["step"], r["where"]) for r in injector.fired] == [(1, "backward")]


def test_gpt_persistent_fires_every_step_from_start():
    _, _, injector = inject_gpt(5, pattern="blocks.*.mlp.0", persistent=True, start_step=2)
    assert [(r["step"], r["module"]) for r in injector.fired] == [
        (step, f"blocks.{layer}.mlp.0") for step in (2, 3, 4) for layer in (0, 1)]


def test_gpt_injector_for_another_rank_never_fires():
    baseline, injected, injector = inject_gpt(3, process_rank=0, rank=1, pattern="blocks.*", persistent=True)
    assert injector.fired == [] and not injector.armed and not injector._handles
    assert all(same_bits(i[0], b[0]) and not changed_grads(i, b) for i, b in zip(injected, baseline, strict=True))


def test_bad_pattern_lists_linear_modules():
    injector = BitFlipInjector(BitFlipSpec(pattern="blocks.*.ln1", steps={0}), rank=0, current_step=lambda: 0)
    with pytest.raises(ValueError, match=r"matches no nn\.Linear") as excinfo:
        injector.install(tiny_gpt())
    listed = str(excinfo.value).split("Linear modules:")[1]
    assert "'blocks.0.attn.qkv'" in listed and "'blocks.1.mlp.2'" in listed and "ln" not in listed


@pytest.mark.parametrize("kwargs", [
    {"where": "logits", "steps": {0}},
    {"steps": None},
    {"steps": {0}, "persistent": True},
    {"steps": {0}, "rate": 0.1, "count": 2},
    {"steps": {0}, "rate": 0.0},
    {"steps": {0}, "bit": 32},
    {"steps": {0}, "max_per_step": 0},
])
def test_spec_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        BitFlipSpec(pattern="*", **kwargs)


class _TupleGemm(torch.nn.Module):
    """A GEMM module returning ``(output, bias)``, as megatron-core's parallel linears do."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 6))
        self.bias = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ self.weight.t(), self.bias


def test_registered_gemm_types_are_hooked_and_their_tuple_output_flipped_in_place() -> None:
    from arc_engine.faults.bitflip import _GEMM_TYPES, register_gemm_type

    model = torch.nn.Sequential(_TupleGemm())
    spec = BitFlipSpec(pattern="0", where="forward", steps={0}, count=2)
    with pytest.raises(ValueError, match=r"matches no nn\.Linear"):
        BitFlipInjector(spec, rank=0, current_step=lambda: 0).install(model)
    register_gemm_type(_TupleGemm)
    try:
        x = torch.randn(3, 6)
        clean, bias = model[0](x)
        injector = BitFlipInjector(spec, rank=0, current_step=lambda: 0)
        assert injector.install(model) == ["0"]
        flipped, same_bias = model[0](x)
        xor = torch.bitwise_xor(words(flipped), words(clean))
        assert int((xor != 0).sum()) == 2 and same_bias is bias
        injector.remove()
    finally:
        del _GEMM_TYPES[_TupleGemm]

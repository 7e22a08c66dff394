"""Mechanism faults (``attention_lowbit``, ``router_collapse``, ``dead_expert``) in process: the low-bit masking
against the paper's word-level rule over every BF16 word, forward and backward masking on the active steps only
(bitwise untouched elsewhere), the gradients of an unfused attention against flash attention's backward written
out by hand (δ̂ from the rounded O), router faults acting on the logits before ``routing`` sees them, and
``remove()`` restoring the modules."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from arc_engine.config.schema import ConfigError, FaultSpec
from arc_engine.faults import FaultInjector
from arc_engine.faults.mechanism import mask_low_bits
from arc_engine.integrations.megatron.internals import observe_routing
from arc_engine.monitors.router import per_token_entropy

NUM_EXPERTS = 4


def words(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[tensor.dtype])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(words(a), words(b))


class Clock:
    """The step attempt the injector reads."""

    def __init__(self) -> None:
        self.step = 0

    def __call__(self) -> int:
        return self.step


def injector(clock: Clock, this_rank: int = 0, **spec: object) -> FaultInjector:
    """An injector on global rank ``this_rank`` holding one fault ``spec``."""
    return FaultInjector([FaultSpec(**spec)], rank=this_rank, current_step=clock)


# ------------------------------------------------------------------------------------------------- the masking


def test_paper_example_loses_exactly_its_low_bits() -> None:
    # Appendix B, n = 3: 1.1015625 = 0x3f8d -> 1.0625 = 0x3f88; the sign is kept, magnitudes truncate toward zero
    value = torch.tensor([0x3F8D, 0x3F8D | -0x8000], dtype=torch.int16).view(torch.bfloat16)
    masked = mask_low_bits(value, 3)
    assert [w & 0xFFFF for w in words(masked).tolist()] == [0x3F88, 0xBF88]
    assert masked.tolist() == [1.0625, -1.0625]


@pytest.mark.parametrize("bits", range(1, 8))
def test_every_bf16_word_matches_the_shift_rule(bits: int) -> None:
    unsigned = torch.arange(1 << 16, dtype=torch.int32)
    words_bf16 = (unsigned - (unsigned >= 1 << 15).int() * (1 << 16)).to(torch.int16).view(torch.bfloat16)
    masked = mask_low_bits(words_bf16, bits)
    expected = (unsigned >> bits) << bits  # ũ = (u >> n) << n on the unsigned storage word
    assert torch.equal(words(masked).int() & 0xFFFF, expected)


def test_fp32_is_rounded_to_bf16_then_masked_and_returned_in_fp32() -> None:
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    masked = mask_low_bits(values, 6)
    assert masked.dtype == torch.float32
    assert same_bits(masked, mask_low_bits(values.to(torch.bfloat16), 6).float())
    assert (masked.abs() <= values.to(torch.bfloat16).float().abs()).all()  # biased: never away from zero
    assert (masked != values).any()


@pytest.mark.parametrize("bits", [0, 8, -1])
def test_bits_outside_the_mantissa_are_refused(bits: int) -> None:
    with pytest.raises(ValueError, match="bits"):
        mask_low_bits(torch.ones(2), bits)
    with pytest.raises(ConfigError, match="bits"):
        FaultSpec(kind="attention_lowbit", rank=0, step=0, bits=bits)


def test_expert_must_be_an_index() -> None:
    with pytest.raises(ConfigError, match="expert"):
        FaultSpec(kind="dead_expert", rank=0, step=0, expert=-1)


# --------------------------------------------------------------------------------------------- attention_lowbit


class Block(nn.Module):
    """Megatron's naming: the attention block whose output is O (no softmax child: O and dO rounding only)."""

    def __init__(self) -> None:
        super().__init__()
        self.core_attention = nn.Identity()
        self.linear_proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_proj(self.core_attention(x))


def _forward_backward(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(O, dO as it reached the attention's input, the input, the upstream dO) for fixed data; the attention is
    the identity, so the input's gradient is the dO the fault let through."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 8, generator=generator).requires_grad_()
    upstream = torch.randn(5, 8, generator=generator)
    output = model.core_attention(x)
    (output * upstream).sum().backward()
    return output, x.grad, x.detach(), upstream


@pytest.mark.parametrize("persistent", [False, True])
def test_attention_output_and_its_gradient_are_masked_on_active_steps_only(persistent: bool) -> None:
    torch.manual_seed(0)
    model, clock = Block(), Clock()
    faults = injector(clock, kind="attention_lowbit", rank=-1, step=2, steps=2, bits=5, persistent=persistent)
    with pytest.warns(UserWarning, match="only O and dO are rounded"):
        faults.install(model)
    for step in range(7):
        clock.step = step
        output, grad, x, upstream = _forward_backward(model)
        active = step >= 2 and (persistent or step < 4)
        if active:
            assert same_bits(output, mask_low_bits(x, 5)), step
            assert same_bits(grad, mask_low_bits(upstream, 5)), step
            assert not torch.equal(output, x) and not torch.equal(grad, upstream)
        else:
            assert same_bits(output, x) and same_bits(grad, upstream), step
    assert faults.fired == [(s, "attention_lowbit") for s in ([2, 3, 4, 5, 6] if persistent else [2, 3])]
    faults.remove()
    clock.step = 3
    output, grad, x, upstream = _forward_backward(model)
    assert same_bits(output, x) and same_bits(grad, upstream)
    assert not model.core_attention._forward_hooks


def test_attention_fault_on_another_rank_installs_nothing_and_a_bad_pattern_is_refused() -> None:
    model, clock = Block(), Clock()
    faults = injector(clock, rank=1, kind="attention_lowbit", step=0, persistent=True)
    faults.install(model)  # nothing for this rank: no hook, no warning
    output, _, x, _ = _forward_backward(model)
    assert same_bits(output, x) and faults.fired == []
    with pytest.raises(ValueError, match="matches no module"):
        injector(clock, kind="attention_lowbit", rank=0, step=0, pattern="*flash_attention").install(model)


class MaskedSoftmax(nn.Module):
    """Megatron's ``FusedScaleMaskSoftmax`` on CPU: optional input ``scale``, the causal mask written in place."""

    def __init__(self, scale: float | None) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            scores = scores * self.scale
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        return torch.softmax(scores.masked_fill_(causal, -10000.0), dim=-1)


class UnfusedAttention(nn.Module):
    """Megatron's ``DotProductAttention`` layout: q, k, v ``[s, b, heads, d]`` -> output ``[sq, b, heads x d]``."""

    def __init__(self, scale: float | None) -> None:
        super().__init__()
        self.scale_mask_softmax = MaskedSoftmax(scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        probs = self.scale_mask_softmax(scores)
        context = torch.einsum("bhqk,kbhd->bhqd", probs, v)
        return context.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def _flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, upstream: torch.Tensor, bits: int,
                    scale: float | None, delta_from_rounded_output: bool) -> list[torch.Tensor]:
    """dq, dk, dv of flash attention's backward by hand, with the rounded dO everywhere and δ = rowsum(dO ∘ O) from
    the rounded O (flash attention's stored output) or from the exact one (what plain autograd would compute)."""
    seq, batch, heads, dim = q.shape
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(dim)
    probs = MaskedSoftmax(scale)(scores.clone())
    output = torch.einsum("bhqk,kbhd->bhqd", probs, v)  # [b, h, sq, d]

    def per_head(x: torch.Tensor) -> torch.Tensor:  # [sq, b, h*d] -> [b, h, sq, d]
        return x.view(seq, batch, heads, dim).permute(1, 2, 0, 3)

    grad_output = per_head(mask_low_bits(upstream, bits))
    stored = per_head(mask_low_bits(output.permute(2, 0, 1, 3).reshape(seq, batch, -1), bits))
    delta = (grad_output * (stored if delta_from_rounded_output else output)).sum(-1, keepdim=True)
    grad_probs = torch.einsum("bhqd,kbhd->bhqk", grad_output, v)
    grad_scores = probs * (grad_probs - delta) * (scale or 1.0) / math.sqrt(dim)
    return [torch.einsum("bhqk,kbhd->qbhd", grad_scores, k), torch.einsum("bhqk,qbhd->kbhd", grad_scores, q),
            torch.einsum("bhqk,bhqd->kbhd", probs, grad_output)]


def _attention_grads(attention: nn.Module, qkv: list[torch.Tensor], upstream: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in qkv]
    (attention(*leaves) * upstream).sum().backward()
    return [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("scale", [None, 0.5])
def test_unfused_attention_gets_flash_attentions_gradient_with_delta_from_the_rounded_output(scale: float | None
                                                                                            ) -> None:
    generator = torch.Generator().manual_seed(4)
    qkv = [torch.randn(6, 2, 3, 8, generator=generator, dtype=torch.float64) for _ in range(3)]
    upstream = torch.randn(6, 2, 24, generator=generator, dtype=torch.float64)
    model, clock = nn.Sequential(), Clock()
    model.core_attention = UnfusedAttention(scale)
    clean = _attention_grads(model.core_attention, qkv, upstream)
    later = injector(clock, kind="attention_lowbit", rank=0, step=5, bits=7)
    later.install(model)
    # an inactive step: bitwise the unfaulted module
    assert all(torch.equal(a.view(torch.int64), b.view(torch.int64))
               for a, b in zip(_attention_grads(model.core_attention, qkv, upstream), clean, strict=True))
    later.remove()

    faults = injector(clock, kind="attention_lowbit", rank=0, step=0, bits=7)
    faults.install(model)
    faulted = _attention_grads(model.core_attention, qkv, upstream)
    flash = _flash_backward(*qkv, upstream, 7, scale, delta_from_rounded_output=True)
    plain = _flash_backward(*qkv, upstream, 7, scale, delta_from_rounded_output=False)
    for grad, expected in zip(faulted, flash, strict=True):
        assert torch.allclose(grad, expected, rtol=1e-10, atol=1e-12)
    # the δ error is what moves dq and dk (dv never sees δ): rounding O and dO alone would give `plain`
    for grad, without_delta_error in zip(faulted[:2], plain[:2], strict=True):
        assert (grad - without_delta_error).abs().max() > 1e-3 * without_delta_error.abs().max()
    faults.remove()
    assert not model.core_attention._forward_hooks and not model.core_attention.scale_mask_softmax._forward_hooks


# ---------------------------------------------------------------------------------------- router faults


class FakeRouter(nn.Module):
    """Megatron ``TopKRouter``'s shape: ``gating(input)`` gives logits ``[s, b, experts]``, ``forward`` passes them
    to ``routing(logits)``, which decides (here: softmax, top-2)."""

    def __init__(self) -> None:
        super().__init__()
        # a fresh router's scale: near-uniform routing
        self.weight = nn.Parameter(0.1 * torch.randn(NUM_EXPERTS, 8, generator=torch.Generator().manual_seed(2)))

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        return input @ self.weight.t()

    def routing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.view(-1, NUM_EXPERTS)
        probs = torch.softmax(logits, dim=-1)
        top = probs.topk(2, dim=-1).indices
        routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, top, True)
        return probs * routing_map, routing_map

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.routing(self.gating(input))


class MoELayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = FakeRouter()


def _route(layer: MoELayer, seen: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    seen.clear()
    tokens = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(3))
    return layer.router(tokens)


def _observed_layer() -> tuple[MoELayer, list[torch.Tensor], torch.Tensor]:
    """A layer whose routing is observed as arc_engine observes it (a wrapper on the instance's ``routing``), and
    its clean logits."""
    layer, seen = MoELayer(), []
    observe_routing(layer.router, lambda logits, routing_map: seen.append(logits.detach().clone()))
    _route(layer, seen)
    return layer, seen, seen[0]


def test_router_collapse_biases_the_logits_routing_sees_and_remove_restores() -> None:
    layer, seen, clean = _observed_layer()
    clock = Clock()
    faults = injector(clock, kind="router_collapse", rank=0, step=1, steps=1, scale=4.0, expert=2)
    faults.install(layer)
    _route(layer, seen)
    assert same_bits(seen[0], clean)  # step 0: not active
    clock.step = 1
    _, routing_map = _route(layer, seen)
    expected = clean.clone()
    expected[:, 2] += 4.0
    assert torch.equal(seen[0], expected)  # the observer of routing saw the biased logits
    assert routing_map[:, 2].all()  # every token now routes to expert 2
    assert per_token_entropy(seen[0]).mean() < 0.5 * per_token_entropy(clean).mean()
    assert faults.fired == [(1, "router_collapse")]
    faults.remove()
    assert "gating" not in vars(layer.router)
    _route(layer, seen)
    assert same_bits(seen[0], clean)


def test_dead_expert_gets_no_token_and_training_through_it_stays_finite() -> None:
    layer, seen, clean = _observed_layer()
    clock = Clock()
    faults = injector(clock, kind="dead_expert", rank=-1, step=0, persistent=True, expert=1)
    faults.install(layer)
    probs, routing_map = _route(layer, seen)
    assert seen[0][:, 1].eq(-math.inf).all() and torch.equal(seen[0][:, [0, 2, 3]], clean[:, [0, 2, 3]])
    assert not routing_map[:, 1].any() and routing_map.sum(dim=1).eq(2).all()
    probs.sum().backward()  # softmax through a -inf logit: zero probability, zero gradient, nothing non-finite
    grad = layer.router.weight.grad
    assert torch.isfinite(grad).all() and not grad[1].any()
    assert torch.isfinite(per_token_entropy(seen[0])).all()
    faults.remove()
    _route(layer, seen)
    assert same_bits(seen[0], clean)


def test_router_faults_refuse_a_missing_expert_and_modules_that_are_not_routers() -> None:
    layer, clock = MoELayer(), Clock()
    with pytest.raises(ValueError, match="expert 4 does not exist"):
        injector(clock, kind="dead_expert", rank=0, step=0, expert=NUM_EXPERTS).install(layer)
    with pytest.raises(ValueError, match="matches no module"):
        injector(clock, kind="router_collapse", rank=0, step=0, pattern="*").install(Block())
    assert "gating" not in vars(layer.router)

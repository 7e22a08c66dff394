"""Mechanism faults: the failures the mechanism-driven monitors (``detectors.qk_spectra``, ``detectors.router``) are
built to attribute, injected where the paper places them (``shared/papers/mechanism-driven-monitors.txt``).

* ``attention_lowbit`` -- biased low-precision rounding in flash attention's backward (the paper's Appendix B, after
  Qiu & Yao): on the modules matching ``pattern`` (Megatron: ``*core_attention``, the softmax(QKᵀ)V block), the
  output O in forward and its incoming gradient dO in backward are rounded to BF16 with the lowest ``bits`` bits of
  each BF16 word zeroed, ũ = (u >> n) << n, then converted back to the tensor's dtype. Zeroing low bits of a
  sign-magnitude word truncates every magnitude toward zero: a deterministic *biased* error, not noise.

  Masking O and dO alone does not reproduce the failure in an unfused attention: autograd's softmax backward
  computes δ = rowsum(P ∘ dP) = rowsum(dÕ ∘ O) from the exact O, consistently with dP = dÕ Vᵀ, so the rounding acts
  on dS as a rescaling plus zero-mean noise, which Adam's normalisation absorbs (on the reference Megatron model the
  Δ₂ entropies stayed on their healthy trajectory). Flash attention computes δ̂ = rowsum(dÕ ∘ Õ) from the *stored*,
  rounded output instead; the mismatch e = δ̂ − δ = rowsum(dÕ ∘ (Õ − O)) per query row is the biased scalar of the
  paper's Eq. (19), and it enters dS = P ∘ (dP − δ̂) as −e_j P_j, i.e. dW_q and dW_k receive e_j-weighted copies of
  the coherent rank-one atoms X_jᵀ(PK)_j. When the attention module has Megatron's unfused softmax child
  (``scale_mask_softmax``, probabilities ``[b, heads, sq, sk]``, output ``[sq, b, heads x head_dim]``) the fault
  adds exactly that term to the gradient of the softmax input; without one (a fused kernel) only O and dO are
  rounded, with a warning at install.
* ``router_collapse`` -- expert-use collapse of an MoE router: ``scale`` is added to expert ``expert``'s logit of
  every token before routing. By the paper's local expansion (Appendix D), H(softmax(δ)) ≈ log n − ‖δ‖²/(2n) for
  centered logits δ: a coherent margin toward one expert lowers every token's routing entropy, the decision-side
  signature the router monitor reads, and piles the top-k load on that expert.
* ``dead_expert`` -- expert ``expert`` never receives a token: its logit is ``-inf`` before routing (its softmax
  probability and gradient are exactly 0).

The router faults wrap the router instance's ``gating`` (Megatron ``TopKRouter.gating(input)`` returns the logits
that ``forward`` then passes to ``routing``), so they act before anything that observes ``routing`` -- arc_engine's
router monitor included -- sees the logits. :meth:`remove` restores the instance.

Timing: active at step attempts in ``[step, step + steps)``, or at every attempt from ``step`` on with
``persistent`` (``current_step()`` is the engine's iteration). When inactive, each hook runs one step check in
Python and returns the tensors untouched: no copy, no change to the autograd graph.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from arc_engine import internals
from arc_engine.config.schema import FaultSpec

MECHANISM_KINDS = ("attention_lowbit", "router_collapse", "dead_expert")
DEFAULT_PATTERNS = {"attention_lowbit": "*core_attention", "router_collapse": "*router", "dead_expert": "*router"}
#: Mantissa bits of a BF16 word: masking more would truncate the exponent, which is no longer a rounding error.
BF16_MANTISSA_BITS = 7


def mask_low_bits(tensor: torch.Tensor, bits: int) -> torch.Tensor:
    """A copy of ``tensor`` rounded to BF16 with the lowest ``bits`` (1-7) bits of each BF16 word zeroed, in
    ``tensor``'s dtype (for a bf16 tensor, exactly ũ = (u >> bits) << bits). Detached, elementwise on the tensor's
    device, deterministic. Raises ValueError for ``bits`` outside [1, 7]."""
    if not 1 <= bits <= BF16_MANTISSA_BITS:
        raise ValueError(f"bits must be in [1, {BF16_MANTISSA_BITS}] (BF16 mantissa bits); got {bits}")
    words = tensor.detach().to(torch.bfloat16).view(torch.int16)
    masked = torch.bitwise_and(words, -(1 << bits))  # ~(2**bits - 1) as a signed 16-bit constant
    return masked.view(torch.bfloat16).to(tensor.dtype)


#: The softmax child of Megatron's unfused ``DotProductAttention``, through which the δ error is applied.
SOFTMAX_CHILD = "scale_mask_softmax"


@dataclass
class _FlashDeltaLink:
    """What one faulted attention call passes between its hooks: P from the softmax's forward, and the δ error
    from the output's backward to the softmax input's backward (which autograd runs after it)."""

    probs: torch.Tensor | None = None  # P [b, heads, sq, sk]
    scale: float = 1.0  # the softmax's own input scaling (Megatron's ``scale``; None there = 1)
    delta_error: torch.Tensor | None = None  # e = rowsum(dÕ ∘ (Õ − O)) [b, heads, sq]


class _LowBitOutput(torch.autograd.Function):
    """Forward: Õ = O with its low BF16 bits masked. Backward: dÕ = dO with its low BF16 bits masked; with a link
    that holds P, also the δ error e = rowsum(dÕ ∘ (Õ − O)) per head and query row, for :class:`_FlashDelta`."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, bits: int, link: _FlashDeltaLink) -> torch.Tensor:
        masked = mask_low_bits(output, bits)
        ctx.bits, ctx.link = bits, link
        if link.probs is not None:
            ctx.save_for_backward(masked - output.detach())
        return masked

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad_masked = mask_low_bits(grad_output, ctx.bits)
        link: _FlashDeltaLink = ctx.link
        if link.probs is not None:
            (rounding_error,) = ctx.saved_tensors
            batch, heads, seq_q, _ = link.probs.shape
            per_head = (grad_masked * rounding_error).view(seq_q, batch, heads, -1).sum(dim=-1)  # [sq, b, heads]
            link.delta_error = per_head.permute(1, 2, 0)
        return grad_masked, None, None


class _FlashDelta(torch.autograd.Function):
    """On the softmax input S: identity forward (a copy: Megatron masks the scores in place); backward adds
    −scale · P ∘ e, the gradient flash attention would produce with δ̂ = δ + e (see module docstring)."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, link: _FlashDeltaLink) -> torch.Tensor:
        ctx.link = link
        return scores.clone()

    @staticmethod
    def backward(ctx: Any, grad_scores: torch.Tensor) -> tuple[torch.Tensor, None]:
        link: _FlashDeltaLink = ctx.link
        if link.delta_error is None or link.probs is None:
            return grad_scores, None
        correction = link.probs.to(grad_scores.dtype) * link.delta_error.unsqueeze(-1).to(grad_scores.dtype)
        return grad_scores - link.scale * correction, None


def select_modules(model: nn.Module, pattern: str, kind: str,
                   accept: Callable[[nn.Module], bool] = lambda module: True) -> dict[str, nn.Module]:
    """The modules of ``model`` whose ``named_modules()`` name matches the fnmatch ``pattern`` and that ``accept``
    takes. Raises ValueError naming candidate modules when none does."""
    named = dict(model.named_modules())
    selected = {name: m for name, m in named.items() if fnmatch.fnmatchcase(name, pattern) and accept(m)}
    if not selected:
        candidates = sorted(name for name, m in named.items() if name and accept(m))
        raise ValueError(f"faults: {kind} pattern {pattern!r} matches no module it can act on; candidates: "
                         f"{candidates[:12]}{'...' if len(candidates) > 12 else ''}")
    return selected


def _is_router(module: nn.Module) -> bool:
    return internals.is_router(module)


class MechanismFault:
    """One configured mechanism fault on this rank (see module docstring). The caller (:class:`FaultInjector`)
    has already dropped specs for other ranks. ``fired`` receives ``(step, kind)`` once per step that the fault
    acted on."""

    def __init__(self, spec: FaultSpec, current_step: Callable[[], int], fired: list[tuple[int, str]]) -> None:
        if spec.kind not in MECHANISM_KINDS:
            raise ValueError(f"faults: {spec.kind!r} is not a mechanism fault ({', '.join(MECHANISM_KINDS)})")
        self.spec = spec
        self.pattern = spec.pattern or DEFAULT_PATTERNS[spec.kind]
        self.current_step = current_step
        self.fired = fired
        self._last_fired: int | None = None
        self._removers: list[Callable[[], None]] = []

    def active(self) -> bool:
        """Whether the fault acts at the current step attempt; records the step in ``fired`` the first time it
        does (pure Python, no sync)."""
        step = self.current_step()
        if step < self.spec.step or (not self.spec.persistent and step >= self.spec.step + self.spec.steps):
            return False
        if self._last_fired != step:
            self._last_fired = step
            self.fired.append((step, self.spec.kind))
        return True

    def install(self, model: nn.Module) -> list[str]:
        """Hook the matching modules of ``model``; returns their names. Raises ValueError when none matches, or
        when ``expert`` is not one of a router's experts. Local, not collective."""
        if self.spec.kind == "attention_lowbit":
            modules = select_modules(model, self.pattern, self.spec.kind)
            for name, module in modules.items():
                self._hook_attention(name, module)
            return list(modules)
        routers = select_modules(model, self.pattern, self.spec.kind, _is_router)
        for name, router in routers.items():
            num_experts = _num_experts(router)
            if num_experts is not None and not 0 <= self.spec.expert < num_experts:
                raise ValueError(f"faults: {self.spec.kind} expert {self.spec.expert} does not exist in router "
                                 f"{name!r} ({num_experts} experts)")
            self._removers.append(_wrap_gating(router, self._corrupt_logits))
        return list(routers)

    def remove(self) -> None:
        """Remove every hook and restore every wrapped router (idempotent)."""
        for remove in reversed(self._removers):
            remove()
        self._removers.clear()

    def _hook_attention(self, name: str, module: nn.Module) -> None:
        """One link per faulted call: created by the pre-hook on an active step, filled by the softmax's hooks,
        consumed by the output hook; calls on inactive steps see no link and pass through."""
        current: dict[str, _FlashDeltaLink | None] = {"link": None}
        softmax = internals.child_module(module, SOFTMAX_CHILD)
        if softmax is None:
            warnings.warn(f"faults: attention_lowbit on {name!r}: no unfused softmax child ({SOFTMAX_CHILD!r}), so "
                          f"flash attention's δ error cannot be added; only O and dO are rounded", stacklevel=3)

        def pre_hook(_module: nn.Module, args: tuple) -> None:
            current["link"] = _FlashDeltaLink() if self.active() else None

        def output_hook(_module: nn.Module, args: tuple, output: Any) -> Any:
            link, current["link"] = current["link"], None
            if link is None:
                return None
            if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                return (self._round_output(name, output[0], link), *output[1:])
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"faults: attention_lowbit expects a tensor (or a tuple led by one) from {name!r}, "
                                f"got {type(output).__name__}")
            return self._round_output(name, output, link)

        handles = [module.register_forward_pre_hook(pre_hook), module.register_forward_hook(output_hook)]
        if softmax is not None:
            def softmax_pre_hook(_module: nn.Module, args: tuple) -> tuple | None:
                link = current["link"]
                if link is None or not torch.is_grad_enabled():
                    return None
                link.scale = internals.softmax_scale(softmax)
                return (_FlashDelta.apply(args[0], link), *args[1:])

            def softmax_hook(_module: nn.Module, args: tuple, probs: torch.Tensor) -> None:
                if current["link"] is not None and torch.is_grad_enabled():
                    current["link"].probs = probs.detach()

            handles += [softmax.register_forward_pre_hook(softmax_pre_hook),
                        softmax.register_forward_hook(softmax_hook)]
        self._removers += [handle.remove for handle in handles]

    def _round_output(self, name: str, output: torch.Tensor, link: _FlashDeltaLink) -> torch.Tensor:
        if link.probs is not None:
            batch, heads, seq_q, _ = link.probs.shape
            if output.dim() != 3 or tuple(output.shape[:2]) != (seq_q, batch) or output.shape[2] % heads:
                raise ValueError(f"faults: attention_lowbit on {name!r}: output {tuple(output.shape)} is not "
                                 f"[sq={seq_q}, b={batch}, {heads} heads x head_dim] as the softmax "
                                 f"{tuple(link.probs.shape)} implies")
        return _LowBitOutput.apply(output, self.spec.bits, link)

    def _corrupt_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.active():
            return logits
        expert_mask = torch.arange(logits.shape[-1], device=logits.device) == self.spec.expert
        if self.spec.kind == "dead_expert":
            return logits.masked_fill(expert_mask, float("-inf"))
        return logits + expert_mask.to(logits.dtype) * self.spec.scale


def _num_experts(router: nn.Module) -> int | None:
    """Experts of a router: Megatron's ``config.num_moe_experts``, else the rows of its ``weight``; None if
    neither says."""
    return internals.router_experts(router)


def _wrap_gating(router: nn.Module, corrupt: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
    """Set ``router.gating`` (on the instance) to the original followed by ``corrupt``; returns the remover, which
    restores what the instance had before."""
    had_own = "gating" in vars(router)
    previous = vars(router).get("gating")
    original = router.gating

    def gating(*args: Any, **kwargs: Any) -> torch.Tensor:
        return corrupt(original(*args, **kwargs))

    router.gating = gating

    def remove() -> None:
        if had_own:
            router.gating = previous
        elif "gating" in vars(router):
            del router.gating

    return remove

"""Curvature of the loss at the current parameters (ARC paper §3.2): the Hessian trace (Hutchinson), its largest
eigenvalue (power iteration) and the SAM sharpness, from Hessian-vector products.

Each product is a double backward (``torch.autograd.grad`` through the gradient's own graph): the loss and its
gradient are built once, with ``create_graph``, and every product is one more backward through that graph. Nothing
is accumulated into ``.grad`` (``autograd.grad`` hands the results back), so a measurement between training steps
leaves the training state alone; :func:`measure` also restores the parameters after the SAM probe and the RNG state
after the loss function ran (dropout draws), so training continues bitwise as without it.

* Hutchinson: tr(H) = E[vᵀHv] over Rademacher v (exact for a diagonal H, whatever the number of probes);
* power iteration: v ← Hv/‖Hv‖, λ = vᵀHv (the Rayleigh quotient of the last v): the eigenvalue of largest
  magnitude, which at a minimum or along a sharp direction is the largest;
* SAM sharpness: L(θ + ρ g/‖g‖) − L(θ).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from arc_engine import runtime

LossFn = Callable[[], torch.Tensor]


class CurvatureGraph:
    """The loss and its gradient at the current parameters, kept with their graph for Hessian-vector products."""

    def __init__(self, loss_fn: LossFn, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        with torch.enable_grad():
            self.loss = loss_fn()
            self.grads = list(torch.autograd.grad(self.loss, self.params, create_graph=True, allow_unused=True))
        self.grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(self.grads, self.params,
                                                                                      strict=True)]
        self.used = [g.requires_grad for g in self.grads]

    def hvp(self, vectors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """H v for ``vectors`` shaped like the parameters (one backward through the gradient's graph)."""
        outputs = [g for g, used in zip(self.grads, self.used, strict=True) if used]
        inputs = [v for v, used in zip(vectors, self.used, strict=True) if used]
        if not outputs:
            return [torch.zeros_like(p) for p in self.params]
        products = iter(torch.autograd.grad(outputs, self.params, grad_outputs=inputs, retain_graph=True,
                                            allow_unused=True))
        return [p if p is not None else torch.zeros_like(param)
                for p, param in zip(products, self.params, strict=True)]


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum((x.double() * y.double()).sum() for x, y in zip(a, b, strict=True))  # type: ignore[return-value]


def _rademacher(params: Sequence[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
    return [(torch.randint(0, 2, p.shape, generator=generator, dtype=torch.int8).to(p.device) * 2 - 1).to(p.dtype)
            for p in params]


def hutchinson_trace(graph: CurvatureGraph, probes: int, generator: torch.Generator) -> float:
    """The mean of vᵀHv over ``probes`` Rademacher vectors."""
    total = 0.0
    for _ in range(probes):
        vectors = _rademacher(graph.params, generator)
        total += float(_dot(vectors, graph.hvp(vectors)))
    return total / probes


def top_eigenvalue(graph: CurvatureGraph, iterations: int, generator: torch.Generator) -> float:
    """Power iteration from a Gaussian start: the Rayleigh quotient vᵀHv of the last unit vector."""
    vectors = [torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.device, p.dtype)
               for p in graph.params]
    value = math.nan
    for _ in range(iterations):
        norm = math.sqrt(float(_dot(vectors, vectors)))
        if not norm > 0:
            return 0.0
        vectors = [v / norm for v in vectors]
        product = graph.hvp(vectors)
        value = float(_dot(vectors, product))
        vectors = product
    return value


@torch.no_grad()
def sam_sharpness(loss_fn: LossFn, graph: CurvatureGraph, rho: float) -> float:
    """L(θ + ρ g/‖g‖) − L(θ), the parameters put back exactly (copied, not subtracted) afterwards."""
    norm = math.sqrt(float(_dot(graph.grads, graph.grads)))
    if not (rho > 0 and norm > 0 and math.isfinite(norm)):
        return 0.0
    saved = [p.detach().clone() for p in graph.params]
    try:
        for param, grad in zip(graph.params, graph.grads, strict=True):
            param.add_(grad.detach(), alpha=rho / norm)
        perturbed = float(loss_fn())
    finally:
        for param, value in zip(graph.params, saved, strict=True):
            param.copy_(value)
    return perturbed - float(graph.loss.detach())


def measure(loss_fn: LossFn, params: Sequence[torch.Tensor], *, probes: int, iterations: int, rho: float,
            seed: int) -> dict[str, float]:
    """This rank's loss, Hessian trace, largest eigenvalue and SAM sharpness at the current parameters. The RNG
    state (CPU and the current CUDA device) is restored afterwards, so the loss function's random draws (dropout)
    do not shift training's. ``scaled_dot_product_attention`` runs its math kernel meanwhile (the fused ones have
    no double backward)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and any(p.is_cuda for p in params) else []
    # the fused attention kernels (flash, memory-efficient) have no double backward: the math one has
    with torch.random.fork_rng(devices=devices), sdpa_kernel([SDPBackend.MATH]):
        generator = torch.Generator().manual_seed(seed)
        graph = CurvatureGraph(loss_fn, params)
        result = {"loss": float(graph.loss.detach()), "hessian_trace": hutchinson_trace(graph, probes, generator),
                  "lambda_max": top_eigenvalue(graph, iterations, generator)}
        result["sam_sharpness"] = sam_sharpness(loss_fn, graph, rho)
    return result


KEYS = ("loss", "hessian_trace", "lambda_max", "sam_sharpness")


def measure_agreed(loss_fn: LossFn, params: Sequence[torch.Tensor], *, group: dist.ProcessGroup | None,
                   device: torch.device, probes: int, iterations: int, rho: float, seed: int) -> dict[str, float]:
    """Collective over ``group``: :func:`measure` on every rank, an error on any rank raised on every rank (none
    waits alone in the reduction), the values averaged; ``ranks`` says over how many."""
    local: dict[str, float] | None = None
    error: Exception | None = None
    try:
        local = measure(loss_fn, params, probes=probes, iterations=iterations, rho=rho, seed=seed)
    except Exception as err:  # agreed below
        error = err
    runtime.raise_on_every_rank(error, group, "measuring curvature")
    assert local is not None
    values = torch.tensor([local[key] for key in KEYS], dtype=torch.float64, device=device)
    ranks = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if ranks > 1:
        dist.all_reduce(values, group=group)
        values /= ranks
    return {**dict(zip(KEYS, values.tolist(), strict=True)), "ranks": ranks}


__all__ = ["CurvatureGraph", "LossFn", "hutchinson_trace", "measure", "measure_agreed", "sam_sharpness",
           "top_eigenvalue"]

"""QK-product increment spectra: from the thin-QR core versus from the dense d x d product, side by side.

    .venv/bin/python scripts/bench_qk_cores.py                    # d = 100 .. 4096, head dim 64, 3 repeats
    .venv/bin/python scripts/bench_qk_cores.py --sizes 512 2048

For each hidden size d, one head's first-order increment Δ₂ = [ΔW_q, W_q][W_k, ΔW_k]ᵀ (factors d x 2 d_k, the
largest of the three increments' cores) is decomposed two ways, in float64 on this machine's CPU:

* **dense**: materialise the d x d product and take its eigenvalues by ``eigvalsh`` of Δ Δᵀ (the paper's Table 1
  baseline), σ = sqrt(λ);
* **core**: thin QR of both factors and the singular values of the 2 d_k x 2 d_k core
  (:func:`arc_engine.monitors.spectra.core_singular_values`).

Reported per d: the median time of each (``--repeats``), the speed-up, and the relative difference of the nonzero
spectra, max |σ_core − σ_dense| / σ_max. One table row per d, ``| d | dense ms | core ms | speed-up Nx | rel diff |``.
The bar (issue 16): at least 50x faster at d = 2048 with a relative difference of at most 1e-5.

A second table prices the per-head attention-logit bound σ_max(W_q W_kᵀ)/√d_k (``detectors.qk_spectra``'s
``qk_logit`` monitor, from the d_k x d_k core of the head's W_q, W_k) beside the head's spectra measurement
(:func:`arc_engine.monitors.spectra.head_spectra_t`: ΔW_q, ΔW_k, Δ₁, Δ₂, Δ₃), per head and measurement, in float64:
``| d | spectra ms | bound ms | bound / spectra |``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from arc_engine.monitors.spectra import core_singular_values, head_spectra_t, qk_increment_factors

SIZES = (100, 200, 500, 1000, 2000, 2048, 4000, 4096)


def dense_spectrum(a_dr: torch.Tensor, b_dr: torch.Tensor) -> torch.Tensor:
    """Singular values of A Bᵀ from the eigenvalues of the materialised (A Bᵀ)(A Bᵀ)ᵀ, largest first."""
    product = a_dr @ b_dr.T
    eigenvalues = torch.linalg.eigvalsh(product @ product.T)
    return eigenvalues.clamp_min(0).sqrt().flip(0)


def relative_difference(core: torch.Tensor, dense: torch.Tensor) -> float:
    """max |σ_core − σ_dense| / σ_max over the core's values (the rest of the dense spectrum is ~0)."""
    count = min(core.numel(), dense.numel())
    return float((core[:count] - dense[:count]).abs().max() / dense[0])


def median_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def factors(d: int, head_dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One head's Δ₂ factors for hidden size ``d`` (a small update of random weights)."""
    gen = torch.Generator().manual_seed(seed)
    wq_prev = torch.randn(d, head_dim, generator=gen, dtype=torch.float64)
    wk_prev = torch.randn(d, head_dim, generator=gen, dtype=torch.float64)
    wq_t = wq_prev + 1e-2 * torch.randn(d, head_dim, generator=gen, dtype=torch.float64)
    wk_t = wk_prev + 1e-2 * torch.randn(d, head_dim, generator=gen, dtype=torch.float64)
    return qk_increment_factors(wq_t, wk_t, wq_prev, wk_prev)["delta2"]


def measure(d: int, head_dim: int, repeats: int) -> dict[str, float]:
    a, b = factors(d, head_dim)
    core = core_singular_values(a, b)
    dense = dense_spectrum(a, b)
    dense_ms = median_ms(lambda: dense_spectrum(a, b), repeats)
    core_ms = median_ms(lambda: core_singular_values(a, b), max(repeats, 5))
    return {"d": d, "dense_ms": dense_ms, "core_ms": core_ms, "speedup": dense_ms / core_ms,
            "rel_diff": relative_difference(core, dense)}


def measure_head(d: int, head_dim: int, repeats: int) -> dict[str, float]:
    """One head's spectra measurement and its logit bound, timed (median of ``repeats``, at least 5)."""
    gen = torch.Generator().manual_seed(1)
    wq_prev, wk_prev = (torch.randn(d, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    wq, wk = (w + 1e-2 * torch.randn(d, head_dim, generator=gen, dtype=torch.float64) for w in (wq_prev, wk_prev))
    spectra_ms = median_ms(lambda: head_spectra_t(wq, wk, wq_prev, wk_prev), max(repeats, 5))
    bound_ms = median_ms(lambda: core_singular_values(wq, wk)[0] / head_dim**0.5, max(repeats, 5))
    return {"d": d, "spectra_ms": spectra_ms, "bound_ms": bound_ms, "share": bound_ms / spectra_ms}


def table_row(row: dict[str, float]) -> str:
    return (f"| {row['d']:.0f} | {row['dense_ms']:.2f} | {row['core_ms']:.2f} | {row['speedup']:.1f}x | "
            f"{row['rel_diff']:.2e} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="hidden sizes d")
    parser.add_argument("--head-dim", type=int, default=64, help="d_k (the core is 2 d_k square)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method and size (median)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.repeats < 1 or args.head_dim < 1 or min(args.sizes) < 1:
        parser.error("--repeats, --head-dim and --sizes must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"head dim {args.head_dim}, float64, {torch.get_num_threads()} torch threads, median of {args.repeats}")
    print("| d | dense ms | core ms | speed-up Nx | rel diff |")
    print("|---:|---:|---:|---:|---:|")
    rows = [measure(d, args.head_dim, args.repeats) for d in args.sizes]
    for row in rows:
        print(table_row(row))
    print("\n| d | spectra ms | bound ms | bound / spectra |")
    print("|---:|---:|---:|---:|")
    for d in args.sizes:
        head = measure_head(d, args.head_dim, args.repeats)
        print(f"| {d} | {head['spectra_ms']:.2f} | {head['bound_ms']:.2f} | {head['share']:.0%} |")
    at_2048 = next((row for row in rows if row["d"] == 2048), None)
    if at_2048 is not None:
        met = at_2048["speedup"] >= 50 and at_2048["rel_diff"] <= 1e-5
        print(f"bar at d = 2048 (>= 50x, rel diff <= 1e-5): {'met' if met else 'NOT met'} "
              f"({at_2048['speedup']:.1f}x, {at_2048['rel_diff']:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""scripts/bench_fisher.py: the cost mode reports its side-by-side ratios; the recovery mode is the end-to-end
comparison on the same faults -- EWC-regularised recovery ends with a lower held-out loss than a plain rollback when a
corrupt shard follows the rollback (what docs/detectors.md reports, with the cases where it does not help)."""

from __future__ import annotations

import math

import pytest

from tests.scripts_loader import load_script

pytestmark = pytest.mark.timeout(300)


def test_the_cost_mode_reports_the_update_and_the_sums_beside_the_adamw_step() -> None:
    results = load_script("bench_fisher").main(["cost", "--layers", "1", "--d-model", "32", "--repeats", "3"])
    assert results["update_ratio"] > 0 and results["sums_ratio"] > 0 and math.isfinite(results["adamw_ms"])
    assert results["memory_mb"] == pytest.approx(8 * results["params_m"] * 1e6 / 2**20, rel=1e-6)


def test_ewc_recovery_keeps_a_lower_loss_than_a_plain_rollback_when_bad_data_follows() -> None:
    """Four seeds: a learning-rate spike rolled back, then a corrupt shard (60% random targets) read right after.
    With EWC (λ₀ = 3·10⁴) the held-out loss at the end is lower than the plain rollback's on at least three seeds
    and on average, and so is the training loss after the rollback."""
    bench = load_script("bench_fisher")
    results = bench.main(["recovery", "--seeds", "4", "--ewc", "30000"])
    scenario = next(name for name in results if "corrupt" in name)
    plain, ewc = results[scenario]["plain rollback"], results[scenario]["EWC λ0=30000"]
    assert not any(r["aborted"] for r in plain + ewc)
    assert sum(e["held_out"] < p["held_out"] for e, p in zip(ewc, plain, strict=True)) >= 3
    assert sum(e["held_out"] for e in ewc) < sum(p["held_out"] for p in plain)
    assert sum(e["after"] for e in ewc) < sum(p["after"] for p in plain)

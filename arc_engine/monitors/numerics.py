"""Non-finite values and gradient explosion/vanishing (ARC paper §3.2.1).

Pure functions over per-rank arrays, plus two small stateful monitors. A healthy step reads only agreed totals;
the per-rank values that name the offending rank are fetched (one rare collective) only when a total is non-finite.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from arc_engine.config.schema import GradNormConfig, NonFiniteConfig
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext
from arc_engine.monitors.loss_spike import robust_baseline
from arc_engine.stats import AgreedStats, names

# ---------------------------------------------------------------- pure functions


def nonfinite_ranks(loss_r: np.ndarray, loss_count_r: np.ndarray, nonfinite_rg: np.ndarray
                    ) -> list[tuple[int, str, int | None]]:
    """Rows (rank indices) holding a non-finite loss or gradient.

    ``loss_r``: per-rank loss; ``loss_count_r``: micro-batches recorded per rank (0 = no loss recorded);
    ``nonfinite_rg``: ranks x groups count of parameter tensors with a non-finite local gradient.
    Returns ``(row, what, first_group)`` with ``what`` in {"loss", "grad", "loss+grad"} and
    ``first_group`` the lowest group index with a non-finite gradient (None if only the loss is bad).
    """
    out: list[tuple[int, str, int | None]] = []
    for row in range(nonfinite_rg.shape[0]):
        bad_loss = bool(loss_count_r[row] > 0 and not math.isfinite(float(loss_r[row])))
        bad_groups = np.flatnonzero((nonfinite_rg[row] > 0) | ~np.isfinite(nonfinite_rg[row]))
        first_group = int(bad_groups[0]) if bad_groups.size else None
        if bad_loss or first_group is not None:
            what = "loss+grad" if bad_loss and first_group is not None else ("loss" if bad_loss else "grad")
            out.append((row, what, first_group))
    return out


def global_grad_norm(grad_sq_g: np.ndarray) -> float:
    """L2 norm of the whole gradient from per-group squared norms (NaN/Inf propagate)."""
    return float(math.sqrt(float(np.sum(grad_sq_g)))) if np.all(grad_sq_g >= 0) else float("nan")


def classify_grad_norm(norm: float, explosion_threshold: float, vanishing_threshold: float) -> str:
    """``"nonfinite"``, ``"explosion"`` (norm > threshold), ``"vanishing"`` (norm < threshold) or ``"ok"``."""
    if not math.isfinite(norm):
        return "nonfinite"
    if norm > explosion_threshold:
        return "explosion"
    if norm < vanishing_threshold:
        return "vanishing"
    return "ok"


# ---------------------------------------------------------------- monitors


class NonFiniteMonitor:
    """Flags NaN/Inf in any rank's loss or local (pre-reduction) gradient, naming the rank and group."""

    name = "non_finite"

    def __init__(self, config: NonFiniteConfig, group_names: list[str]) -> None:
        self.config = config
        self.group_names = group_names
        self.count = 0
        self._last = 0

    def required_stats(self) -> tuple[str, ...]:
        return (names.LOSS, names.LOSS_COUNT, names.GRAD_NONFINITE_LOCAL, names.GRAD_SQ)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        self._last = 0
        nonfinite_g = stats.total(names.GRAD_NONFINITE_LOCAL)
        local_bad = not math.isfinite(float(stats.total(names.LOSS)[0])) or bool(
            np.any((nonfinite_g > 0) | ~np.isfinite(nonfinite_g)))
        if not local_bad:
            return self._reduced_only(stats)
        hits = nonfinite_ranks(stats.per_rank(names.LOSS)[:, 0], stats.per_rank(names.LOSS_COUNT)[:, 0],
                               stats.per_rank(names.GRAD_NONFINITE_LOCAL))
        self._last = len(hits)
        if not hits:
            return self._reduced_only(stats)
        ranks = tuple(stats.ranks[row] for row, _, _ in hits)
        parts = []
        for row, what, group in hits:
            where = f" (first group {group}: {self.group_names[group]})" if group is not None else ""
            parts.append(f"rank {stats.ranks[row]} {what}{where}")
        first_group = next((g for _, _, g in hits if g is not None), None)
        values: dict[str, Any] = {
            "loss_per_rank": stats.per_rank(names.LOSS)[:, 0].tolist(),
            "nonfinite_params_per_rank": stats.per_rank(names.GRAD_NONFINITE_LOCAL).sum(axis=1).tolist(),
            "first_group": first_group,
            "first_group_name": self.group_names[first_group] if first_group is not None else None,
        }
        return [Finding(self.name, Action.parse(self.config.action), Severity.ERROR,
                        "non-finite values: " + "; ".join(parts), ranks, values)]

    def _reduced_only(self, stats: AgreedStats) -> list[Finding]:
        """Every local gradient and loss was finite, yet the reduced gradient is not: the corruption happened in
        (or after) the reduction. Names the ranks whose reduced gradient (or shard of it) is non-finite."""
        if np.all(np.isfinite(stats.total(names.GRAD_SQ))):
            return []
        reduced_rg = stats.per_rank(names.GRAD_SQ)
        self._last = 1
        rows = np.flatnonzero(~np.isfinite(reduced_rg).all(axis=1))
        ranks = tuple(stats.ranks[row] for row in rows)
        groups = np.flatnonzero(~np.isfinite(stats.total(names.GRAD_SQ)))
        first = int(groups[0]) if groups.size else 0
        return [Finding(self.name, Action.parse(self.config.action), Severity.ERROR,
                        f"non-finite reduced gradient with finite local gradients on every rank (first group "
                        f"{first}: {self.group_names[first]}): corrupted in the gradient reduction", ranks,
                        {"first_group": first, "first_group_name": self.group_names[first], "reduced": True})]

    def commit(self, step: int, applied: bool) -> None:
        self.count += int(self._last > 0)

    def metrics(self) -> dict[str, float]:
        return {"count": float(self.count)}

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])


def relative_limit(log_norms: deque[float] | list[float], factor: float, min_ratio: float) -> tuple[float, float]:
    """(the norm above which the relative arm fires, the baseline median norm) from accepted log-norms. Pure."""
    median, robust_std = robust_baseline(log_norms)
    return math.exp(median + max(factor * robust_std, math.log(min_ratio))), math.exp(median)


class GradNormMonitor:
    """Explosion (‖g‖ > τ_grad, or far above the run's own robust baseline of log-norms) and vanishing
    (‖g‖ < ε_grad) of the reduced, pre-clip gradient norm. Under clipping the pre-clip norm is what exploded: an
    explosion that the clip bounds still sends the step along the exploded direction."""

    name = "grad_norm"

    def __init__(self, config: GradNormConfig) -> None:
        self.config = config
        self.last_norm = float("nan")
        self.last_limit = float("nan")
        self.explosions = 0
        self.vanishings = 0
        self.history: deque[float] = deque(maxlen=config.window)  # log-norms of accepted steps
        self._last_kind = "ok"

    def required_stats(self) -> tuple[str, ...]:
        return (names.GRAD_SQ,)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        norm = global_grad_norm(stats.total(names.GRAD_SQ))
        self.last_norm = norm
        kind = classify_grad_norm(norm, self.config.explosion_threshold, self.config.vanishing_threshold)
        config = self.config
        if config.relative and kind == "ok" and len(self.history) >= config.warmup_steps:
            limit, median = relative_limit(self.history, config.relative_factor, config.relative_min_ratio)
            self.last_limit = limit
            if norm > limit:
                self._last_kind = "explosion"
                return [Finding(self.name, Action.parse(config.explosion_action), Severity.ERROR,
                                f"gradient explosion: |g| = {norm:.4g} is {norm / median:.3g}x the run's baseline "
                                f"{median:.4g} (limit {limit:.4g})",
                                values={"grad_norm": norm, "baseline": median, "limit": limit, "relative": True})]
        self._last_kind = kind
        if kind == "explosion":
            return [Finding(self.name, Action.parse(self.config.explosion_action), Severity.ERROR,
                            f"gradient explosion: |g| = {norm:.4g} > {self.config.explosion_threshold:.4g}",
                            values={"grad_norm": norm, "threshold": self.config.explosion_threshold})]
        if kind == "vanishing":
            return [Finding(self.name, Action.parse(self.config.vanishing_action), Severity.WARNING,
                            f"vanishing gradient: |g| = {norm:.3g} < {self.config.vanishing_threshold:.3g}",
                            values={"grad_norm": norm, "threshold": self.config.vanishing_threshold})]
        return []  # a non-finite norm is the NonFiniteMonitor's to report

    def commit(self, step: int, applied: bool) -> None:
        self.explosions += int(self._last_kind == "explosion")
        self.vanishings += int(self._last_kind == "vanishing")
        if applied and self._last_kind == "ok" and math.isfinite(self.last_norm) and self.last_norm > 0:
            self.history.append(math.log(self.last_norm))

    def metrics(self) -> dict[str, float]:
        return {"norm": self.last_norm, "limit": self.last_limit, "explosions": float(self.explosions)}

    def state_dict(self) -> dict[str, Any]:
        return {"explosions": self.explosions, "vanishings": self.vanishings, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.explosions = int(state["explosions"])
        self.vanishings = int(state["vanishings"])
        self.history = deque((float(v) for v in state.get("history", ())), maxlen=self.config.window)


# ---------------------------------------------------------------- families (the plugin seam)


class NonFiniteFamily(FamilyBase):
    """``detectors.non_finite``: reads the standard loss and gradient slots every adapter produces."""

    name = "non_finite"

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [NonFiniteMonitor(ctx.section, ctx.group_names)]


class GradNormFamily(FamilyBase):
    """``detectors.grad_norm``: reads the reduced gradient's squared norms every adapter produces."""

    name = "grad_norm"

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [GradNormMonitor(ctx.section)]

"""Gradient explosion and vanishing (ARC paper §3.2.1); non-finite values are ``non_finite.py``'s.

Pure functions over per-rank arrays, plus two small stateful monitors. A healthy step reads only agreed totals;
the per-rank values that name the offending rank are fetched (one rare collective) only when a total is non-finite.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from arc_engine.config.errors import require
from arc_engine.config.schema import ActionName
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext
from arc_engine.monitors.robust import robust_baseline
from arc_engine.stats import AgreedStats, names

# ---------------------------------------------------------------- pure functions


@dataclass(kw_only=True)
class GradNormConfig:
    """Gradient explosion and vanishing on the global (reduced, pre-clip) gradient norm (ARC paper §3.2.1).

    Two explosion arms: the fixed ceiling ``explosion_threshold`` (the paper's τ_grad), and a relative one that sees
    an explosion whatever the clipping threshold: after ``warmup_steps`` accepted steps, log ‖g‖ above the median of
    the last ``window`` accepted values by ``relative_factor`` robust standard deviations (1.4826 x MAD) and ‖g‖ at
    least ``relative_min_ratio`` times that median's norm (``relative: false`` turns it off). Both take
    ``explosion_action``; a flagged norm never enters the baseline."""

    enabled: bool = True
    """Explosion and vanishing of the global gradient norm (reduced, before clipping)."""
    explosion_threshold: float = 1.0e4
    """τ_grad of the ARC paper: a norm above it is an explosion.
    Allowed: > 0"""
    vanishing_threshold: float = 1.0e-10
    """ε_grad: a norm below it is vanishing.
    Allowed: >= 0 and < `explosion_threshold`"""
    explosion_action: ActionName = "skip"
    """What an explosion (either arm) gets."""
    vanishing_action: ActionName = "warn"
    """What a vanishing gradient gets."""
    relative: bool = True
    """The relative explosion arm: the pre-clip norm far above the run's own robust baseline of log-norms, whatever the
    clipping threshold ([detectors.md](detectors.md#relative-gradient-explosion))."""
    warmup_steps: int = 20
    """Accepted steps before the relative arm can fire.
    Allowed: >= 3"""
    window: int = 100
    """Accepted log-norms in the relative arm's baseline.
    Allowed: >= `warmup_steps`"""
    relative_factor: float = 8.0
    """Robust standard deviations (1.4826 x MAD of the log-norms) above their median that the relative arm needs.
    Allowed: > 0"""
    relative_min_ratio: float = 10.0
    """And the norm at least this many times the baseline median's (clean campaign runs peak at 3x).
    Allowed: >= 1"""

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 3, "warmup_steps", self.warmup_steps, "must be an integer >= 3")
        require(self.window >= self.warmup_steps, "window", self.window, "must be >= warmup_steps")
        require(self.relative_factor > 0, "relative_factor", self.relative_factor, "must be > 0")
        require(self.relative_min_ratio >= 1, "relative_min_ratio", self.relative_min_ratio, "must be >= 1")
        require(self.explosion_threshold > 0, "explosion_threshold", self.explosion_threshold, "must be > 0")
        require(0 <= self.vanishing_threshold < self.explosion_threshold, "vanishing_threshold",
                self.vanishing_threshold, "must be >= 0 and below explosion_threshold")



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


def relative_limit(log_norms: deque[float] | list[float], factor: float, min_ratio: float) -> tuple[float, float]:
    """(the norm above which the relative arm fires, the baseline median norm) from accepted log-norms. Pure."""
    median, robust_std = robust_baseline(log_norms)
    return math.exp(median + max(factor * robust_std, math.log(min_ratio))), math.exp(median)


class GradNormMonitor(Monitor):
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


class GradNormFamily(FamilyBase):
    """``detectors.grad_norm``: reads the reduced gradient's squared norms every adapter produces."""

    name = "grad_norm"
    config_class = GradNormConfig

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [GradNormMonitor(ctx.section)]

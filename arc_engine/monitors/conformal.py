"""``detectors.conformal``: conformal loss-forecast intervals with calibrated coverage (ARC paper §3.5, Algorithms
5-6).

Each monitored step the agreed loss y (the standard loss slots: every rank the same) is compared with its one-step
forecast ŷ (Holt's linear smoothing of the accepted losses: level and trend). The nonconformity score is |y − ŷ|;
the last ``window`` scores of accepted steps are the calibration set, and the threshold for miscoverage α is their
⌈(n + 1)(1 − α)⌉-th smallest (:func:`conformal_quantile`: split-conformal, valid in finite samples when the scores
are exchangeable). So the interval ŷ ± q̂_α holds the next loss with probability at least 1 − α.

The step's state is the smallest set of the three that the two intervals allow (:func:`stability_state`): HEALTHY
inside the 1 − ``alpha`` interval, WARNING outside it but inside the 1 − ``failure_alpha`` one, FAILURE outside
both. WARNING is a metric; FAILURE gets ``action``. Where ``explosion_loss`` is set, an upper bound ŷ + q̂ of the
1 − ``failure_alpha`` interval above it warns ahead (``forecast_action``, by default ``checkpoint``: recovery takes
a preventive checkpoint): the next loss may explode.

Coverage is monitored: the fraction of the last ``coverage_window`` steps inside the 1 − ``alpha`` interval. Below
1 − ``alpha`` − ``coverage_tolerance`` the scores have drifted (the run changed regime): the calibration set is cut
to its newest half, so the threshold follows (recalibration, reported once per episode).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from arc_engine.config.schema import ConformalConfig
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext
from arc_engine.monitors.loss_spike import mean_loss
from arc_engine.stats import AgreedStats, names

HEALTHY, WARNING, FAILURE = "healthy", "warning", "failure"


def conformal_quantile(scores: list[float], alpha: float) -> float:
    """The split-conformal threshold (Algorithm 5): the ⌈(n + 1)(1 − α)⌉-th smallest of the ``n`` scores; +inf when
    that rank exceeds n (too few scores for the level). Pure."""
    n = len(scores)
    rank = math.ceil((n + 1) * (1 - alpha))
    if n == 0 or rank > n:
        return math.inf
    return sorted(scores)[rank - 1]


def stability_state(score: float, warn_threshold: float, fail_threshold: float) -> str:
    """The prediction set's verdict for a score: HEALTHY within the 1 − α interval, WARNING within the
    1 − α_fail one only, FAILURE outside both. Pure."""
    if score <= warn_threshold:
        return HEALTHY
    return WARNING if score <= fail_threshold else FAILURE


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.4g}%"


class HoltForecast:
    """One-step forecast of a series: level ℓ and trend b, ℓ ← a y + (1 − a)(ℓ + b), b ← c (ℓ − ℓ_prev) +
    (1 − c) b; forecast ℓ + b."""

    def __init__(self, level_rate: float, trend_rate: float) -> None:
        self.a, self.c = level_rate, trend_rate
        self.level: float | None = None
        self.trend = 0.0

    def forecast(self) -> float | None:
        return None if self.level is None else self.level + self.trend

    def update(self, value: float) -> None:
        if self.level is None:
            self.level = value
            return
        previous = self.level
        self.level = self.a * value + (1 - self.a) * (self.level + self.trend)
        self.trend = self.c * (self.level - previous) + (1 - self.c) * self.trend

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "trend": self.trend}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.level = None if state["level"] is None else float(state["level"])
        self.trend = float(state["trend"])


class ConformalMonitor:
    """The loss's conformal interval, its state and its coverage (see the module docstring)."""

    name = "conformal"

    def __init__(self, config: ConformalConfig) -> None:
        self.config = config
        self.forecaster = HoltForecast(config.level_rate, config.trend_rate)
        self.scores: deque[float] = deque(maxlen=config.window)
        self.covered: deque[bool] = deque(maxlen=config.coverage_window)
        self.failures = self.recalibrations = 0
        self._pending: tuple[float, float | None, bool | None, str] | None = None
        self._values: dict[str, float] = {}
        self._drifted = False
        self._warned_ahead = False

    def required_stats(self) -> tuple[str, ...]:
        return (names.LOSS, names.LOSS_RANKS)

    def thresholds(self) -> tuple[float, float]:
        scores = list(self.scores)
        return conformal_quantile(scores, self.config.alpha), conformal_quantile(scores, self.config.failure_alpha)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        self._pending = None
        config = self.config
        loss = mean_loss(float(stats.total(names.LOSS)[0]), float(stats.total(names.LOSS_RANKS)[0]))
        if not math.isfinite(loss):
            return []  # the non-finite detector judges it; nothing enters the calibration
        forecast = self.forecaster.forecast()
        if forecast is None or len(self.scores) < config.min_calibration:
            self._pending = (loss, None if forecast is None else abs(loss - forecast), None, HEALTHY)
            return []
        warn, fail = self.thresholds()
        score = abs(loss - forecast)
        state = stability_state(score, warn, fail) if loss > forecast else HEALTHY  # only a rise is a failure
        inside = score <= warn
        self._pending = (loss, score, inside, state)
        coverage_window = [*self.covered, inside]
        coverage = sum(coverage_window) / len(coverage_window)
        self._values = {"loss": loss, "forecast": forecast, "lower": forecast - warn, "upper": forecast + warn,
                        "failure_upper": forecast + fail, "coverage": coverage,
                        "state": {HEALTHY: 0.0, WARNING: 1.0, FAILURE: 2.0}[state]}
        findings = []
        if state == FAILURE:
            findings.append(Finding(self.name, Action.parse(config.action), Severity.ERROR,
                                    f"loss {loss:.4g} outside its {_percent(1 - config.failure_alpha)} conformal "
                                    f"interval (forecast {forecast:.4g} + {fail:.3g})", values=dict(self._values)))
        # the interval for the next step: warn ahead when its failure bound crosses the explosion level
        ahead = config.explosion_loss > 0 and forecast + fail > config.explosion_loss
        if ahead and not self._warned_ahead:
            findings.append(Finding(self.name, Action.parse(config.forecast_action), Severity.WARNING,
                                    f"the loss forecast's {_percent(1 - config.failure_alpha)} upper bound "
                                    f"{forecast + fail:.4g} crosses explosion_loss {config.explosion_loss:.4g}: "
                                    "the loss may explode (preventive checkpoint)", values=dict(self._values)))
        self._warned_ahead = ahead
        full = len(coverage_window) >= config.coverage_window
        drifted = full and coverage < 1 - config.alpha - config.coverage_tolerance
        if drifted and not self._drifted:
            findings.append(Finding(self.name, Action.WARN, Severity.INFO,
                                    f"conformal coverage {coverage:.1%} over the last {len(coverage_window)} steps is "
                                    f"below {_percent(1 - config.alpha)} - {_percent(config.coverage_tolerance)}: "
                                    "recalibrating on the newest half of the scores", values=dict(self._values)))
        self._drifted = drifted
        return findings

    def commit(self, step: int, applied: bool) -> None:
        if self._pending is None:
            return
        loss, score, inside, state = self._pending
        self._pending = None
        if inside is not None:
            self.covered.append(inside)
        if state == FAILURE:
            self.failures += 1
            return  # a failure never enters the calibration or the forecast
        if not applied:
            return
        if score is not None:
            self.scores.append(score)
        self.forecaster.update(loss)
        if self._drifted:  # recalibration: the newest half of the scores, a fresh coverage count
            keep = list(self.scores)[len(self.scores) // 2:]
            self.scores = deque(keep, maxlen=self.config.window)
            self.covered.clear()
            self.recalibrations += 1
            self._drifted = False

    def metrics(self) -> dict[str, float]:
        return {**self._values, "failures": float(self.failures), "recalibrations": float(self.recalibrations)}

    def state_dict(self) -> dict[str, Any]:
        return {"forecaster": self.forecaster.state_dict(), "scores": list(self.scores),
                "covered": list(self.covered), "failures": self.failures, "recalibrations": self.recalibrations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.forecaster.load_state_dict(state["forecaster"])
        self.scores = deque((float(s) for s in state["scores"]), maxlen=self.config.window)
        self.covered = deque((bool(c) for c in state["covered"]), maxlen=self.config.coverage_window)
        self.failures, self.recalibrations = int(state["failures"]), int(state["recalibrations"])


class ConformalFamily(FamilyBase):
    """``detectors.conformal`` (off by default): reads the agreed loss (the standard loss slots)."""

    name = "conformal"

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [ConformalMonitor(ctx.section)]


__all__ = ["FAILURE", "HEALTHY", "WARNING", "ConformalFamily", "ConformalMonitor", "HoltForecast",
           "conformal_quantile", "stability_state"]

"""``detectors.conformal``: conformal forecast intervals with calibrated coverage for the loss and the gradient norm
(ARC paper §3.5, Algorithms 5-6).

Each signal in ``signals`` gets its own track (:class:`ConformalTrack`): ``loss``, the agreed mean loss, and
``grad_norm``, the agreed pre-clip global gradient norm judged in log space (its noise scales with it), which gives
the grad-norm detector's hand-set explosion threshold a calibrated counterpart; its warning ahead uses that
threshold (``detectors.grad_norm.explosion_threshold``) as the explosion level. What follows is said of the loss and
holds for each track.

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
from dataclasses import dataclass, field
from typing import Any, Literal

from arc_engine.config.errors import require
from arc_engine.config.schema import ActionName
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext, section_of
from arc_engine.monitors.loss_spike import mean_loss
from arc_engine.monitors.numerics import GradNormFamily
from arc_engine.stats import AgreedStats, names


@dataclass(kw_only=True)
class ConformalConfig:
    """Conformal loss-forecast intervals (ARC paper §3.5, Algorithms 5-6): each monitored step the agreed loss is
    compared with its one-step forecast (Holt's linear smoothing of the accepted losses: ``level_rate``,
    ``trend_rate``); the scores |loss − forecast| of the last ``window`` accepted steps calibrate split-conformal
    thresholds (the ⌈(n + 1)(1 − α)⌉-th smallest score) for miscoverage ``alpha`` and ``failure_alpha``, after
    ``min_calibration`` scores. A loss above its 1 − ``failure_alpha`` interval is a FAILURE (``action``); outside
    the 1 − ``alpha`` one a WARNING (a metric). With ``explosion_loss`` > 0, a forecast upper bound above it warns
    ahead (``forecast_action``: by default a preventive checkpoint). Coverage of the 1 − ``alpha`` interval over
    the last ``coverage_window`` steps below 1 − ``alpha`` − ``coverage_tolerance`` recalibrates on the newest half
    of the scores. ``signals``: what gets such intervals: ``loss`` and ``grad_norm`` (the agreed pre-clip global
    gradient norm, in log space; its warning ahead uses ``detectors.grad_norm.explosion_threshold``)."""

    enabled: bool = False
    """Conformal loss-forecast intervals with calibrated coverage (ARC paper §3.5;
    [detectors.md](detectors.md#conformal-loss-intervals))."""
    alpha: float = 0.1
    """Miscoverage of the warning interval (1 − alpha of the losses inside).
    Allowed: in (0, 1)"""
    failure_alpha: float = 0.005
    """Miscoverage of the failure interval: a loss above it is a failure.
    Allowed: in (0, `alpha`)"""
    window: int = 500
    """Scores of accepted steps kept as the calibration set.
    Allowed: >= `min_calibration`"""
    min_calibration: int = 200
    """Scores before any verdict.
    Allowed: >= ⌈(1 − failure_alpha) / failure_alpha⌉"""
    level_rate: float = 0.3
    """The forecast's level smoothing (Holt).
    Allowed: in (0, 1]"""
    trend_rate: float = 0.05
    """The forecast's trend smoothing (Holt; 0: no trend).
    Allowed: in [0, 1]"""
    coverage_window: int = 500
    """Steps over which the warning interval's coverage is measured.
    Allowed: >= 10"""
    coverage_tolerance: float = 0.05
    """Coverage below 1 − alpha − this recalibrates on the newest half of the scores.
    Allowed: in [0, 1)"""
    explosion_loss: float = 0.0
    """A forecast upper bound above this loss warns ahead (a preventive checkpoint is advised); 0: off.
    Allowed: >= 0"""
    signals: list[Literal["loss", "grad_norm"]] = field(default_factory=lambda: ["loss"])
    """The scalar signals that get conformal intervals: `loss` (the agreed mean loss) and `grad_norm` (the agreed
    pre-clip global gradient norm, judged in log space; its forecast warns ahead of
    `detectors.grad_norm.explosion_threshold`). Metrics of a signal other than the loss carry its name as a prefix.
    Allowed: a list of loss, grad_norm"""
    action: ActionName = "warn"
    """What a loss above its failure interval gets."""
    forecast_action: ActionName = "checkpoint"
    """What the forecast's bound crossing `explosion_loss` gets (`checkpoint`: a preventive checkpoint)."""

    def __post_init__(self) -> None:
        require(0 < self.alpha < 1, "alpha", self.alpha, "must be in (0, 1)")
        require(0 < self.failure_alpha < self.alpha, "failure_alpha", self.failure_alpha, "must be in (0, alpha)")
        needed = math.ceil((1 - self.failure_alpha) / self.failure_alpha)
        require(self.min_calibration >= needed, "min_calibration", self.min_calibration,
                f"must be >= {needed}: fewer scores cannot calibrate failure_alpha = {self.failure_alpha}")
        require(self.window >= self.min_calibration, "window", self.window, "must be >= min_calibration")
        require(0 < self.level_rate <= 1, "level_rate", self.level_rate, "must be in (0, 1]")
        require(0 <= self.trend_rate <= 1, "trend_rate", self.trend_rate, "must be in [0, 1]")
        require(self.coverage_window >= 10, "coverage_window", self.coverage_window, "must be an integer >= 10")
        require(0 <= self.coverage_tolerance < 1, "coverage_tolerance", self.coverage_tolerance, "must be in [0, 1)")
        require(self.explosion_loss >= 0, "explosion_loss", self.explosion_loss, "must be >= 0 (0 = off)")
        require(len(self.signals) >= 1 and len(set(self.signals)) == len(self.signals), "signals", self.signals,
                "must name each signal once, at least one")



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


#: the scalar signals a conformal track can follow: how each reads the agreed statistics, and whether it is judged in
#: log space (a norm, whose noise scales with it)
SIGNALS = ("loss", "grad_norm")
_LABELS = {"loss": "loss", "grad_norm": "gradient norm"}


def signal_value(signal: str, stats: AgreedStats) -> float:
    """The signal's value on this step, in the space it is judged in (NaN when unusable): the agreed mean loss; the
    natural log of the agreed pre-clip global gradient norm. Pure."""
    if signal == "loss":
        return mean_loss(float(stats.total(names.LOSS)[0]), float(stats.total(names.LOSS_RANKS)[0]))
    squared = float(stats.total(names.GRAD_SQ).sum())
    return 0.5 * math.log(squared) if squared > 0 and math.isfinite(squared) else math.nan


class ConformalTrack:
    """One signal's forecast, calibration set, coverage and counters (Algorithms 5-6); see the module docstring."""

    def __init__(self, config: ConformalConfig, signal: str, explosion: float) -> None:
        self.config, self.signal = config, signal
        self.explosion = explosion  # in the judged space; +inf: no warning ahead
        self.forecaster = HoltForecast(config.level_rate, config.trend_rate)
        self.scores: deque[float] = deque(maxlen=config.window)
        self.covered: deque[bool] = deque(maxlen=config.coverage_window)
        self.failures = self.recalibrations = 0
        self._pending: tuple[float, float | None, bool | None, str] | None = None
        self.values: dict[str, float] = {}
        self._drifted = False
        self._warned_ahead = False

    def thresholds(self) -> tuple[float, float]:
        scores = list(self.scores)
        return conformal_quantile(scores, self.config.alpha), conformal_quantile(scores, self.config.failure_alpha)

    def _shown(self, value: float) -> float:
        """A judged-space value as the user reads it (a norm, not its log)."""
        return value if self.signal == "loss" else math.exp(min(value, 700.0))

    def judge(self, name: str, value: float) -> list[Finding]:
        self._pending = None
        config = self.config
        if not math.isfinite(value):
            return []  # the non-finite and grad-norm detectors judge it; nothing enters the calibration
        forecast = self.forecaster.forecast()
        if forecast is None or len(self.scores) < config.min_calibration:
            self._pending = (value, None if forecast is None else abs(value - forecast), None, HEALTHY)
            return []
        warn, fail = self.thresholds()
        score = abs(value - forecast)
        state = stability_state(score, warn, fail) if value > forecast else HEALTHY  # only a rise is a failure
        inside = score <= warn
        self._pending = (value, score, inside, state)
        coverage_window = [*self.covered, inside]
        coverage = sum(coverage_window) / len(coverage_window)
        shown = self._shown
        self.values = {self.signal: shown(value), "forecast": shown(forecast), "lower": shown(forecast - warn),
                       "upper": shown(forecast + warn), "failure_upper": shown(forecast + fail),
                       "coverage": coverage, "state": {HEALTHY: 0.0, WARNING: 1.0, FAILURE: 2.0}[state]}
        label, findings = _LABELS[self.signal], []
        if state == FAILURE:
            findings.append(Finding(name, Action.parse(config.action), Severity.ERROR,
                                    f"{label} {shown(value):.4g} outside its {_percent(1 - config.failure_alpha)} "
                                    f"conformal interval (upper bound {shown(forecast + fail):.4g}, forecast "
                                    f"{shown(forecast):.4g})", values={**self.values, "signal": self.signal}))
        # the interval for the next step: warn ahead when its failure bound crosses the explosion level
        ahead = forecast + fail > self.explosion
        if ahead and not self._warned_ahead:
            findings.append(Finding(name, Action.parse(config.forecast_action), Severity.WARNING,
                                    f"the {label} forecast's {_percent(1 - config.failure_alpha)} upper bound "
                                    f"{shown(forecast + fail):.4g} crosses its explosion level "
                                    f"{shown(self.explosion):.4g}: the {label} may explode (preventive checkpoint)",
                                    values={**self.values, "signal": self.signal}))
        self._warned_ahead = ahead
        full = len(coverage_window) >= config.coverage_window
        drifted = full and coverage < 1 - config.alpha - config.coverage_tolerance
        if drifted and not self._drifted:
            findings.append(Finding(name, Action.WARN, Severity.INFO,
                                    f"conformal coverage of the {label} {coverage:.1%} over the last "
                                    f"{len(coverage_window)} steps is below {_percent(1 - config.alpha)} - "
                                    f"{_percent(config.coverage_tolerance)}: recalibrating on the newest half of the "
                                    "scores", values={**self.values, "signal": self.signal}))
        self._drifted = drifted
        return findings

    def commit(self, applied: bool) -> None:
        if self._pending is None:
            return
        value, score, inside, state = self._pending
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
        self.forecaster.update(value)
        if self._drifted:  # recalibration: the newest half of the scores, a fresh coverage count
            keep = list(self.scores)[len(self.scores) // 2:]
            self.scores = deque(keep, maxlen=self.config.window)
            self.covered.clear()
            self.recalibrations += 1
            self._drifted = False

    def state_dict(self) -> dict[str, Any]:
        return {"forecaster": self.forecaster.state_dict(), "scores": list(self.scores),
                "covered": list(self.covered), "failures": self.failures, "recalibrations": self.recalibrations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.forecaster.load_state_dict(state["forecaster"])
        self.scores = deque((float(s) for s in state["scores"]), maxlen=self.config.window)
        self.covered = deque((bool(c) for c in state["covered"]), maxlen=self.config.coverage_window)
        self.failures, self.recalibrations = int(state["failures"]), int(state["recalibrations"])


class ConformalMonitor(Monitor):
    """A conformal track per signal in ``signals`` (see the module docstring). The loss's metrics keep their plain
    names (``forecast``, ``upper``, ...); another signal's carry its name as a prefix (``grad_norm_upper``)."""

    name = "conformal"

    def __init__(self, config: ConformalConfig, grad_explosion: float = math.inf) -> None:
        self.config = config
        explosions = {"loss": config.explosion_loss if config.explosion_loss > 0 else math.inf,
                      "grad_norm": math.log(grad_explosion) if math.isfinite(grad_explosion) else math.inf}
        self.tracks = {signal: ConformalTrack(config, signal, explosions[signal]) for signal in config.signals}

    @property
    def failures(self) -> int:
        return sum(track.failures for track in self.tracks.values())

    @property
    def recalibrations(self) -> int:
        return sum(track.recalibrations for track in self.tracks.values())

    def required_stats(self) -> tuple[str, ...]:
        needed = (names.LOSS, names.LOSS_RANKS) if "loss" in self.tracks else ()
        return (*needed, names.GRAD_SQ) if "grad_norm" in self.tracks else needed

    def thresholds(self, signal: str = "loss") -> tuple[float, float]:
        return self.tracks[signal].thresholds()

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        findings: list[Finding] = []
        for signal, track in self.tracks.items():
            findings += track.judge(self.name, signal_value(signal, stats))
        return findings

    def commit(self, step: int, applied: bool) -> None:
        for track in self.tracks.values():
            track.commit(applied)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for signal, track in self.tracks.items():
            values = {**track.values, "failures": float(track.failures),
                      "recalibrations": float(track.recalibrations)}
            prefix = "" if signal == "loss" else f"{signal}_"
            out.update({(key if key == signal or not prefix else prefix + key): value
                        for key, value in values.items()})
        return out

    def state_dict(self) -> dict[str, Any]:
        return {signal: track.state_dict() for signal, track in self.tracks.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "forecaster" in state:  # the loss-only layout of arc_engine before the signals
            state = {"loss": state}
        for signal, track in self.tracks.items():
            if signal in state:
                track.load_state_dict(state[signal])


class ConformalFamily(FamilyBase):
    """``detectors.conformal`` (off by default): reads the agreed loss (the standard loss slots)."""

    name = "conformal"
    config_class = ConformalConfig

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        grad_norm = section_of(ctx.config, GradNormFamily())
        return [ConformalMonitor(ctx.section, grad_norm.explosion_threshold if grad_norm.enabled else math.inf)]


__all__ = ["FAILURE", "HEALTHY", "SIGNALS", "WARNING", "ConformalFamily", "ConformalMonitor", "ConformalTrack",
           "HoltForecast", "conformal_quantile", "signal_value", "stability_state"]

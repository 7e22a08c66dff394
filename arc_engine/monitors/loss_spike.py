"""Loss spikes against a robust running baseline.

Why not the usual rules:

* Megatron-LM's check flags a loss above 10x the largest loss seen early in training: it can only catch
  catastrophic spikes, since the early maximum is the random-init loss.
* Lightning's ``SpikeDetection`` compares against a running mean with a relative/absolute tolerance: the mean
  is dragged by the spikes themselves and a fixed tolerance fires on noisy (small-batch) losses.

Here the baseline is the median of the last ``window`` *accepted* losses and the scale is their median absolute
deviation (robust to the outliers being detected); a spike must clear both ``factor`` robust standard
deviations and a minimum relative increase, so a noisy but stable loss does not alarm and a quiet plateau does
not alarm on tiny wiggles. Flagged losses never enter the baseline.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any

from arc_engine.config.schema import LossSpikeConfig
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext
from arc_engine.stats import AgreedStats, names

MAD_TO_STD = 1.4826  # MAD x this estimates the standard deviation of a normal distribution


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def robust_baseline(history: Iterable[float]) -> tuple[float, float]:
    """``(median, robust_std)`` of ``history`` (finite values); robust_std = 1.4826 x median absolute deviation.
    Plain Python: for the window's hundred values it is several times faster than numpy's median, and it runs
    on every monitored step."""
    values = list(history)
    median = _median(values)
    return median, MAD_TO_STD * _median([abs(value - median) for value in values])


def spike_threshold(median: float, robust_std: float, factor: float, min_relative_increase: float) -> float:
    """The loss above which a step is a spike: both the robust-z and the relative conditions must hold."""
    return max(median + factor * robust_std, median + min_relative_increase * abs(median))


def mean_loss(loss_sum: float, ranks_recorded: float) -> float:
    """Mean loss over the ranks that recorded one, from the agreed sum of their losses and their number (NaN when
    none did; a non-finite loss on any rank makes it non-finite)."""
    return loss_sum / ranks_recorded if ranks_recorded > 0 else float("nan")


class LossSpikeMonitor:
    """Stateful wrapper: keeps the window of accepted losses; flags after ``warmup_steps`` of them."""

    name = "loss_spike"

    def __init__(self, config: LossSpikeConfig) -> None:
        self.config = config
        self.history: deque[float] = deque(maxlen=config.window)
        self.spikes = 0
        self.last_loss = float("nan")
        self.last_threshold = float("nan")
        self._flagged = False

    def required_stats(self) -> tuple[str, ...]:
        return (names.LOSS, names.LOSS_RANKS)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        loss = mean_loss(float(stats.total(names.LOSS)[0]), float(stats.total(names.LOSS_RANKS)[0]))
        self.last_loss = loss
        self._flagged = False
        if not math.isfinite(loss) or len(self.history) < self.config.warmup_steps:
            return []
        median, robust_std = robust_baseline(self.history)
        threshold = spike_threshold(median, robust_std, self.config.factor, self.config.min_relative_increase)
        self.last_threshold = threshold
        if loss <= threshold:
            return []
        self._flagged = True
        values = {"loss": loss, "baseline_median": median, "robust_std": robust_std, "threshold": threshold,
                  "ratio_to_median": loss / median if median else float("inf")}
        return [Finding(self.name, Action.parse(self.config.action), Severity.WARNING,
                        f"loss spike: {loss:.4g} vs baseline {median:.4g} (threshold {threshold:.4g})",
                        values=values)]

    def commit(self, step: int, applied: bool) -> None:
        if self._flagged:
            self.spikes += 1
        elif applied and math.isfinite(self.last_loss):
            self.history.append(self.last_loss)

    def metrics(self) -> dict[str, float]:
        return {"loss": self.last_loss, "threshold": self.last_threshold, "spikes": float(self.spikes)}

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "spikes": self.spikes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque((float(v) for v in state["history"]), maxlen=self.config.window)
        self.spikes = int(state["spikes"])


class LossSpikeFamily(FamilyBase):
    """``detectors.loss_spike``: reads the agreed loss (the standard loss slots)."""

    name = "loss_spike"

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [LossSpikeMonitor(ctx.section)]

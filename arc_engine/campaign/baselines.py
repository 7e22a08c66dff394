"""The detectors arc_engine is compared with in the fault-injection campaign, as online rules over the per-step
training loss and global gradient norm (one value per optimizer step, every rank the same).

From the R-Metric paper (§6.2, its univariate baselines):

* :class:`ConsecutiveIncreases`: the loss rose on ``count`` (3) consecutive steps.
* :class:`LossZScore`: the loss's z-score against the previous ``window`` finite losses above ``threshold`` (3). The
  paper scores the validation loss; the campaign scores the training loss every step (what a run without
  evaluations has), against a trailing window.
* :class:`GradNormThreshold`: the gradient norm above ``threshold`` (100).
* :class:`NoMonitoring`: never alarms (the run as it is today without any rule).

The rules users run today:

* :class:`MegatronSpikyLoss`: Megatron-LM's spiky-loss check (megatron-core's rerun state machine,
  ``is_unexpectedly_large`` with threshold 10): the largest |loss| of the first ``samples`` (100) finite losses is the
  reference; afterwards a loss of at least ``factor`` (10) times it alarms. Non-finite losses are left to its separate
  NaN check, so they do not alarm here.
* :class:`LightningSpikeDetection`: Lightning's ``SpikeDetection`` callback (mode ``min``, window 10, warm-up 1,
  rtol 2, no atol, finite only): a non-finite loss alarms; a loss no higher than the previous accepted one never does;
  otherwise it alarms when it exceeds the running mean of the last ``window`` accepted losses by ``rtol`` times that
  mean (and by ``atol`` when set). Losses that alarm do not enter the mean.

Every rule is pure Python over floats: the campaign replays a run's recorded series through each of them, so all
rules see exactly the same run.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from typing import Protocol


class Baseline(Protocol):
    """An online rule: :meth:`observe` takes one optimizer step's values and says whether it alarms."""

    name: str

    def observe(self, loss: float, grad_norm: float) -> bool: ...


class NoMonitoring:
    name = "no monitoring"

    def observe(self, loss: float, grad_norm: float) -> bool:
        return False


class ConsecutiveIncreases:
    """R-Metric §6.2 "simple heuristic": ``count`` consecutive loss increases."""

    def __init__(self, count: int = 3) -> None:
        self.name = f"{count} consecutive loss increases"
        self.count, self.rises = count, 0
        self.previous: float | None = None

    def observe(self, loss: float, grad_norm: float) -> bool:
        rose = self.previous is not None and math.isfinite(loss) and loss > self.previous
        self.rises = self.rises + 1 if rose else 0
        if math.isfinite(loss):
            self.previous = loss
        return self.rises >= self.count


class LossZScore:
    """R-Metric §6.2 "loss spike detection": z = (loss − mean) / std over the previous ``window`` finite losses (at
    least ``min_history``) above ``threshold``; a non-finite loss alarms."""

    def __init__(self, threshold: float = 3.0, window: int = 100, min_history: int = 10) -> None:
        self.name = f"loss z-score > {threshold:g}"
        self.threshold, self.min_history = threshold, min_history
        self.history: deque[float] = deque(maxlen=window)

    def observe(self, loss: float, grad_norm: float) -> bool:
        if not math.isfinite(loss):
            return True
        alarm = False
        if len(self.history) >= self.min_history:
            mean, spread = statistics.fmean(self.history), statistics.pstdev(self.history)
            alarm = spread > 0 and (loss - mean) / spread > self.threshold
        self.history.append(loss)
        return alarm


class GradNormThreshold:
    """R-Metric §6.2 "gradient monitoring": the global gradient norm above ``threshold`` (or not finite)."""

    def __init__(self, threshold: float = 100.0) -> None:
        self.name = f"gradient norm > {threshold:g}"
        self.threshold = threshold

    def observe(self, loss: float, grad_norm: float) -> bool:
        return not math.isfinite(grad_norm) or grad_norm > self.threshold


class MegatronSpikyLoss:
    """Megatron-LM's spiky-loss rule (see the module docstring)."""

    def __init__(self, factor: float = 10.0, samples: int = 100) -> None:
        self.name = f"Megatron-LM spiky loss ({factor:g}x the early max)"
        self.factor, self.samples = factor, samples
        self.seen, self.largest = 0, 0.0

    def observe(self, loss: float, grad_norm: float) -> bool:
        value = abs(loss)
        if not math.isfinite(value):
            return False
        if self.seen < self.samples:
            self.seen += 1
            self.largest = max(self.largest, value)
            return False
        return value >= self.largest * self.factor


class LightningSpikeDetection:
    """Lightning's ``SpikeDetection`` callback (see the module docstring)."""

    def __init__(self, window: int = 10, warmup: int = 1, rtol: float | None = 2.0,
                 atol: float | None = None) -> None:
        self.name = f"Lightning SpikeDetection (window {window}, rtol {rtol:g})" if rtol is not None else \
            f"Lightning SpikeDetection (window {window})"
        self.warmup, self.rtol, self.atol = warmup, rtol, atol
        self.accepted: deque[float] = deque(maxlen=window)
        self.last = 0.0
        self.index = 0

    def observe(self, loss: float, grad_norm: float) -> bool:
        index, self.index = self.index, self.index + 1
        spike = index >= self.warmup and self._spike(loss)
        if not spike:
            self.accepted.append(loss)
            self.last = loss
        return spike

    def _spike(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return True
        if loss - self.last <= 0:
            return False
        mean = statistics.fmean(self.accepted) if self.accepted else 0.0
        gap = abs(loss - mean)
        return (self.atol is None or gap >= abs(self.atol)) and (self.rtol is None or gap >= abs(self.rtol * mean))


def all_baselines() -> list[Baseline]:
    """One fresh instance of every rule, in the campaign table's order."""
    return [NoMonitoring(), ConsecutiveIncreases(), LossZScore(), GradNormThreshold(), MegatronSpikyLoss(),
            LightningSpikeDetection()]


def first_alarm(rule: Baseline, losses: Iterable[float], grad_norms: Iterable[float]) -> int | None:
    """The first step (0-based) at which ``rule`` alarms over the series, or None."""
    for step, (loss, norm) in enumerate(zip(losses, grad_norms, strict=True)):
        if rule.observe(loss, norm):
            return step
    return None


__all__ = ["Baseline", "ConsecutiveIncreases", "GradNormThreshold", "LightningSpikeDetection", "LossZScore",
           "MegatronSpikyLoss", "NoMonitoring", "all_baselines", "first_alarm"]

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

One rank's outlier batch is not a spike either: a rank whose batch is far harder than usual (a heavy-tailed
batch of real text, a corrupted shard) raises the mean loss by 1/n of its excess and the ranks' spread with it,
where a spike of the training (a learning-rate or optimizer fault, diverging weights) moves every rank's loss and
leaves the spread near its usual level. With the data detector on (``detectors.data``, which judges one rank's loss
against its peers and names it), a loss over the threshold is first reduced by what the spread's rise over its usual
level can carry -- (σ − σ₀)/√(n − 1), σ the ranks' standard deviation this step (the shared worker moments of the
step's one all-reduce), σ₀ the median of the last ``window`` accepted steps' -- which one rank's excess δ makes at
most δ/n; a loss still over the threshold is a spike, one under it an info finding left to the data detector
(``one_rank_to_data``).

A sustained rise is not a spike: the level-shift arm sums each loss's distance above the median of the last
``level_reference`` accepted losses in a one-sided CUSUM, in units of the noise scale of *successive differences*
(:func:`difference_noise`): a decaying learning rate's downward trend moves every loss but not the step-to-step
changes, so the scale stays the noise's. Each step adds at most ``level_cap`` units (a lone spike is the spike arm's),
minus the allowance; the arm fires once when the sum passes ``level_threshold`` and rearms when it is back at 0.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from arc_engine.config.errors import require
from arc_engine.config.schema import ActionName
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.bad_data import BadDataFamily
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext, StatDecl, section_of
from arc_engine.monitors.robust import median as median_of
from arc_engine.monitors.robust import robust_baseline
from arc_engine.monitors.worker_spread import WorkerMoments
from arc_engine.stats import AgreedStats, names


@dataclass(kw_only=True)
class LossSpikeConfig:
    """Loss spike against a robust running baseline (median and MAD of recent accepted losses).

    A step is a spike when, after ``warmup_steps`` accepted steps, its loss exceeds the window median by more
    than ``factor`` robust standard deviations (1.4826 x MAD) *and* by more than ``min_relative_increase`` of
    the median. Flagged losses never enter the baseline.

    The level-shift arm (``level_shift``) sees a sustained rise that no single step makes a spike, under any
    learning-rate schedule: each loss's distance above the median of the last ``level_reference`` accepted losses, in
    units of the noise scale of successive differences (1.4826 x the MAD of the window's step-to-step changes / √2,
    blind to a trend), capped at ``level_cap`` (one spike cannot trip it), is summed in a one-sided CUSUM with
    allowance ``level_allowance``; above ``level_threshold`` it is a finding with ``level_action``, once per episode
    (the sum back at 0 ends it).
    """

    enabled: bool = True
    """Loss above a robust running baseline (median and MAD of recent accepted losses)."""
    warmup_steps: int = 20
    """Accepted steps before the detector can flag.
    Allowed: >= 3"""
    window: int = 100
    """Accepted losses in the baseline.
    Allowed: >= `warmup_steps`"""
    factor: float = 6.0
    """Robust standard deviations (1.4826 x MAD) above the median that a spike must exceed.
    Allowed: > 0"""
    min_relative_increase: float = 0.25
    """And the fraction of the median it must exceed it by.
    Allowed: >= 0"""
    action: ActionName = "skip"
    """What a spike gets."""
    one_rank_to_data: bool = True
    """A loss over the threshold that one rank's loss carries (the rise of the ranks' spread over its usual level
    accounts for it) is left to the data detector, which judges and names the rank: an info finding, not a spike.
    Only with `detectors.data` on, past its warm-up, and 2 or more ranks recording a loss
    ([detectors.md](detectors.md#one-ranks-outlier-batch))."""
    level_shift: bool = True
    """The level-shift arm: a one-sided CUSUM of the loss above its recent median, in units of the successive-difference
    noise scale ([detectors.md](detectors.md#loss-level-shifts))."""
    level_reference: int = 20
    """Accepted losses whose median is the reference level.
    Allowed: [1, `window`]"""
    level_allowance: float = 1.0
    """Noise units subtracted from each step's distance (the CUSUM's k).
    Allowed: >= 0"""
    level_cap: float = 5.0
    """Largest distance one step adds (a single spike cannot trip the arm).
    Allowed: > `level_allowance`"""
    level_threshold: float = 15.0
    """The sum that is a level shift (the CUSUM's h).
    Allowed: > 0"""
    level_action: ActionName = "warn"
    """What a level shift gets (once per episode)."""

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 3, "warmup_steps", self.warmup_steps, "must be an integer >= 3")
        require(self.window >= self.warmup_steps, "window", self.window, "must be >= warmup_steps")
        require(self.factor > 0, "factor", self.factor, "must be > 0")
        require(self.min_relative_increase >= 0, "min_relative_increase", self.min_relative_increase,
                "must be >= 0")
        require(1 <= self.level_reference <= self.window, "level_reference", self.level_reference,
                "must be an integer in [1, window]")
        require(self.level_allowance >= 0, "level_allowance", self.level_allowance, "must be >= 0")
        require(self.level_cap > self.level_allowance, "level_cap", self.level_cap, "must be > level_allowance")
        require(self.level_threshold > 0, "level_threshold", self.level_threshold, "must be > 0")



def difference_noise(history: Iterable[float]) -> float:
    """The noise scale of a series from its successive differences: 1.4826 x MAD(Δ) / √2 (for independent noise of
    std σ around any slowly moving level, Δ has std σ√2). NaN with fewer than 3 values. Pure."""
    values = list(history)
    if len(values) < 3:
        return math.nan
    _, spread = robust_baseline([b - a for a, b in itertools.pairwise(values)])
    return spread / math.sqrt(2.0)


def cusum_step(total: float, distance: float, allowance: float, cap: float) -> float:
    """One step of the one-sided CUSUM: max(0, total + min(distance, cap) − allowance). Pure."""
    return max(0.0, total + min(distance, cap) - allowance)


def spike_threshold(median: float, robust_std: float, factor: float, min_relative_increase: float) -> float:
    """The loss above which a step is a spike: both the robust-z and the relative conditions must hold."""
    return max(median + factor * robust_std, median + min_relative_increase * abs(median))


def mean_loss(loss_sum: float, ranks_recorded: float) -> float:
    """Mean loss over the ranks that recorded one, from the agreed sum of their losses and their number (NaN when
    none did; a non-finite loss on any rank makes it non-finite)."""
    return loss_sum / ranks_recorded if ranks_recorded > 0 else float("nan")


class LossSpikeMonitor(Monitor):
    """Stateful wrapper: keeps the window of accepted losses; flags after ``warmup_steps`` of them."""

    name = "loss_spike"

    def __init__(self, config: LossSpikeConfig, read_spread: bool = False, data_warmup: int = 0) -> None:
        self.config = config
        #: whether the ranks' spread (the shared worker moments) is read: ``one_rank_to_data`` with the data detector
        self.read_spread = read_spread and config.one_rank_to_data
        #: accepted steps before an outlier is left to the data detector: its warm-up too (it could not judge before)
        self.spread_warmup = max(config.warmup_steps, data_warmup)
        self.history: deque[float] = deque(maxlen=config.window)
        self.spreads: deque[float] = deque(maxlen=config.window)  # the ranks' loss std on accepted steps
        self.one_rank = 0  # losses over the threshold left to the data detector
        self.last_spread = float("nan")
        self.spikes = 0
        self.last_loss = float("nan")
        self.last_threshold = float("nan")
        self._flagged = False
        self._outlier = False
        self.level_sum = 0.0       # the level-shift CUSUM (noise units)
        self.level_shifts = 0
        self._in_shift = False     # an episode is on (the sum has not been back at 0 since it fired)
        self._pending_sum: float | None = None  # this step's sum, committed with the step

    def required_stats(self) -> tuple[str, ...]:
        spread = WorkerMoments.LOSS_STATS if self.read_spread else ()
        return (names.LOSS, names.LOSS_RANKS, *spread)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        ranks = float(stats.total(names.LOSS_RANKS)[0])
        loss = mean_loss(float(stats.total(names.LOSS)[0]), ranks)
        self.last_loss = loss
        self.last_spread = WorkerMoments.read_loss(stats)[1] if self.read_spread else math.nan
        self._flagged = self._outlier = False
        self._pending_sum = None
        if not math.isfinite(loss) or len(self.history) < self.config.warmup_steps:
            return []
        found = self._level(loss) if self.config.level_shift else []
        median, robust_std = robust_baseline(self.history)
        threshold = spike_threshold(median, robust_std, self.config.factor, self.config.min_relative_increase)
        self.last_threshold = threshold
        if loss <= threshold:
            return found
        values = {"loss": loss, "baseline_median": median, "robust_std": robust_std, "threshold": threshold,
                  "ratio_to_median": loss / median if median else float("inf")}
        carried, spread_median = self._one_rank_share(ranks)
        self._outlier = True  # a spike or one rank's outlier: neither enters the baselines
        if loss - carried <= threshold:
            self.one_rank += 1
            return [*found, Finding(self.name, Action.NONE, Severity.INFO,
                                    f"loss {loss:.4g} over the spike threshold {threshold:.4g}, carried by one rank's "
                                    f"loss: the ranks' spread {self.last_spread:.3g} against its usual "
                                    f"{spread_median:.3g} accounts for {carried:.3g} of it; left to the data "
                                    f"detector", values={**values, "spread": self.last_spread,
                                                         "usual_spread": spread_median, "one_rank_share": carried})]
        self._flagged = True
        return [*found, Finding(self.name, Action.parse(self.config.action), Severity.WARNING,
                                f"loss spike: {loss:.4g} vs baseline {median:.4g} (threshold {threshold:.4g})",
                                values=values)]

    def _one_rank_share(self, ranks: float) -> tuple[float, float]:
        """(what one rank's excess can add to the mean loss beyond the usual spread, (σ − σ₀)⁺ / √(n − 1); σ₀): 0 and
        NaN when the spread is not read, fewer than 2 ranks recorded a loss, or before the warm-ups (this rule's and
        the data detector's)."""
        if not (self.read_spread and ranks >= 2 and len(self.spreads) >= self.spread_warmup
                and math.isfinite(self.last_spread)):
            return 0.0, math.nan
        usual = median_of(list(self.spreads))
        return max(0.0, self.last_spread - usual) / math.sqrt(ranks - 1), usual

    def _level(self, loss: float) -> list[Finding]:
        """The level-shift arm on this step's loss (its sum is committed with the step)."""
        config = self.config
        noise = difference_noise(self.history)
        if not (math.isfinite(noise) and noise > 0):
            return []
        reference = robust_baseline(list(self.history)[-config.level_reference:])[0]
        total = cusum_step(self.level_sum, (loss - reference) / noise, config.level_allowance, config.level_cap)
        self._pending_sum = total
        if total <= config.level_threshold or self._in_shift:
            return []
        rise = loss / reference - 1.0 if reference else math.inf
        return [Finding(self.name, Action.parse(config.level_action), Severity.WARNING,
                        f"loss level shift: {loss:.4g} is {rise:+.1%} from the recent level {reference:.4g} "
                        f"(CUSUM {total:.3g} > {config.level_threshold:g} noise units of {noise:.3g})",
                        values={"loss": loss, "reference": reference, "noise": noise, "cusum": total,
                                "level_shift": True})]

    def commit(self, step: int, applied: bool) -> None:
        if self._pending_sum is not None:
            fired = self._pending_sum > self.config.level_threshold and not self._in_shift
            self.level_shifts += int(fired)
            self._in_shift = (self._in_shift or fired) and self._pending_sum > 0.0
            self.level_sum = self._pending_sum
        self.spikes += int(self._flagged)
        if not self._outlier and applied and math.isfinite(self.last_loss):
            self.history.append(self.last_loss)
            if math.isfinite(self.last_spread):
                self.spreads.append(self.last_spread)

    def metrics(self) -> dict[str, float]:
        return {"loss": self.last_loss, "threshold": self.last_threshold, "spikes": float(self.spikes),
                "level_cusum": self.level_sum, "level_shifts": float(self.level_shifts),
                **({"one_rank": float(self.one_rank)} if self.read_spread else {})}

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "spikes": self.spikes, "level_sum": self.level_sum,
                "level_shifts": self.level_shifts, "in_shift": self._in_shift, "spreads": list(self.spreads),
                "one_rank": self.one_rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque((float(v) for v in state["history"]), maxlen=self.config.window)
        self.spikes = int(state["spikes"])
        self.level_sum = float(state.get("level_sum", 0.0))
        self.level_shifts = int(state.get("level_shifts", 0))
        self._in_shift = bool(state.get("in_shift", False))
        self.spreads = deque((float(v) for v in state.get("spreads", ())), maxlen=self.config.window)
        self.one_rank = int(state.get("one_rank", 0))


class LossSpikeFamily(FamilyBase):
    """``detectors.loss_spike``: reads the agreed loss (the standard loss slots)."""

    name = "loss_spike"
    config_class = LossSpikeConfig

    @staticmethod
    def _data_warmup(ctx: FamilyContext) -> int | None:
        """The data detector's warm-up when ``one_rank_to_data`` leaves outliers to it (it is on and writes the
        shared worker moments this reads); None otherwise."""
        data = section_of(ctx.config, BadDataFamily())
        if not (ctx.section.one_rank_to_data and BadDataFamily().enabled(dataclasses.replace(ctx, section=data))):
            return None
        return int(data.warmup_steps)

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        return WorkerMoments.loss_statistics() if self._data_warmup(ctx) is not None else []

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        warmup = self._data_warmup(ctx)
        return [LossSpikeMonitor(ctx.section, read_spread=warmup is not None, data_warmup=warmup or 0)]

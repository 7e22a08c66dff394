"""``detectors.straggler``: per-rank performance scores, as nvidia-resiliency-ext reports them.

A synchronous step is as slow as its slowest rank, and every rank's whole step is equally long (the fast ones wait
in the gradient reduction), so the step time cannot tell which rank is slow. The forward section can: each rank
times its step's first forward pass (:class:`arc_engine.stats.timing.SectionClock`: from the first forward
pre-hook to the first recorded loss; host clock on CPU, CUDA events on CUDA), which under DDP and ZeRO-1/2 is local
work before any wait on a peer.

Every ``every`` monitored steps each rank puts the median of its window's forward times into its per-rank slot and
the ranks' values are fetched (the family's one periodic per-rank collective: between reports nothing travels).
Every rank then scores every rank (:func:`performance_scores`):

* relative score = the fastest rank's median / the rank's median (1: the fastest);
* individual score = the rank's best median so far / its median (1: as fast as it ever was).

A rank whose relative score falls below ``relative_threshold`` (or individual score below
``individual_threshold``) while at least ``min_delay_s`` slower than that reference is a straggler; the event
names it once when it becomes one. Stragglers are also system events of the R-Metric (its λ).

Where a forward pass waits on peers (ZeRO-3 and FSDP2 parameter gathers, tensor-parallel all-reduces) part of a slow
rank's delay shows on those peers too; ranks that record no loss (pipeline stages before the last) have no forward
time and are not scored.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from arc_engine.config.schema import StragglerConfig
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext, Producer, StatDecl, StepView
from arc_engine.stats import AgreedStats, Reduce, StatBuffer

#: [3] DETAIL: this rank's median forward seconds over the report's window, its median iteration seconds, and the
#: number of steps with a forward time in the window (written on report steps only).
SECTION_TIMES = "straggler_times"


def performance_scores(times: np.ndarray, best: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(relative, individual) scores per rank: the fastest rank's time over each rank's, and each rank's ``best``
    time over its current one. NaN where a time is missing (NaN or not positive). Pure."""
    valid = np.isfinite(times) & (times > 0)
    relative = np.full(times.shape, math.nan)
    individual = np.full(times.shape, math.nan)
    if valid.any():
        relative[valid] = times[valid].min() / times[valid]
        known = valid & np.isfinite(best)
        individual[known] = np.minimum(best[known], times[known]) / times[known]
    return relative, individual


def report_due(step: int, interval: int, every: int) -> bool:
    """Whether optimizer step ``step`` (a monitored one) closes a report window: every ``every`` monitored steps,
    not the first."""
    monitored = step // interval
    return monitored > 0 and monitored % every == 0


class StragglerProducer:
    """Keeps this rank's forward and iteration times of the window (host floats) and writes their medians on
    report steps."""

    def __init__(self, every: int, interval: int) -> None:
        self.every, self.interval = every, interval
        self.forward: deque[float] = deque(maxlen=every)
        self.iteration: deque[float] = deque(maxlen=every)
        self._last_step = -1
        self._report: tuple[float, float, float] | None = None  # this step's medians, on a report step

    def write(self, buffer: StatBuffer, view: StepView) -> None:
        if view.step != self._last_step:  # once per step (a recomputed step agrees twice: same report)
            self._last_step = view.step
            forward, iteration = view.times
            if math.isfinite(forward):
                self.forward.append(forward)
            if math.isfinite(iteration):
                self.iteration.append(iteration)
            self._report = None
            if report_due(view.step, self.interval, self.every):
                self._report = (float(np.median(self.forward)) if self.forward else math.nan,
                                float(np.median(self.iteration)) if self.iteration else math.nan,
                                float(len(self.forward)))
                self.forward.clear()
                self.iteration.clear()
        if self._report is not None:
            slot = buffer.view(SECTION_TIMES)  # fills (kernels on CUDA), no host-to-device copy
            for index, value in enumerate(self._report):
                slot[index].fill_(value)


class StragglerMonitor:
    """Scores every rank on report steps (see the module docstring); names the ranks that become stragglers."""

    name = "straggler"

    def __init__(self, config: StragglerConfig, interval: int) -> None:
        self.config = config
        self.interval = interval
        self.best: np.ndarray | None = None  # per row of the decision group: the best forward median so far
        self.reports = 0
        self.stragglers: frozenset[int] = frozenset()  # global ranks flagged at the last report
        self.events = 0
        self._pending: tuple[np.ndarray, frozenset[int]] | None = None
        self._values: dict[str, float] = {}

    def required_stats(self) -> tuple[str, ...]:
        return (SECTION_TIMES,)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        self._pending = None
        if not report_due(step, self.interval, self.config.every):
            return []
        rows = stats.per_rank(SECTION_TIMES)  # collective, on a report step every rank shares
        forward, iteration = rows[:, 0], rows[:, 1]
        best = self.best if self.best is not None and len(self.best) == len(forward) else np.full(len(forward),
                                                                                                   math.inf)
        relative, individual = performance_scores(forward, best)
        valid = np.isfinite(relative)
        if not valid.any():
            return []
        fastest = float(forward[valid].min())
        config = self.config
        slow_relative = valid & (relative < config.relative_threshold) & (forward - fastest >= config.min_delay_s)
        slow_individual = (np.isfinite(individual) & (individual < config.individual_threshold)
                           & (forward - best >= config.min_delay_s)) if config.individual_threshold else \
            np.zeros(len(forward), dtype=bool)
        flagged = np.flatnonzero(slow_relative | slow_individual) if self.reports >= config.warmup_reports else \
            np.array([], dtype=int)
        named = frozenset(int(stats.ranks[row]) for row in flagged)
        improved = best.copy()
        improved[valid] = np.minimum(best[valid], forward[valid])
        self._pending = (improved, named)
        self._values = {"forward_fastest_s": fastest, "forward_slowest_s": float(forward[valid].max()),
                        "relative_score_min": float(np.nanmin(relative)),
                        "individual_score_min": float(np.nanmin(individual)) if np.isfinite(individual).any()
                        else math.nan,
                        "iteration_median_s": float(np.nanmedian(iteration)) if np.isfinite(iteration).any()
                        else math.nan,
                        "stragglers": float(len(named))}
        new = named - self.stragglers
        if not new:
            return []
        worst = [int(row) for row in flagged[np.argsort(relative[flagged])]]
        parts = [f"rank {stats.ranks[row]} forward {forward[row]:.4g} s (relative score {relative[row]:.2f}, "
                 f"individual {individual[row]:.2f})" for row in worst[:8]]
        more = f" and {len(worst) - 8} more" if len(worst) > 8 else ""
        values = {**self._values, "ranks": sorted(named),
                  "forward_s": {int(stats.ranks[row]): float(forward[row]) for row in worst[:64]},
                  "relative_score": {int(stats.ranks[row]): float(relative[row]) for row in worst[:64]}}
        return [Finding(self.name, Action.parse(config.action), Severity.WARNING,
                        f"stragglers: {'; '.join(parts)}{more}; fastest rank's forward {fastest:.4g} s "
                        f"(medians over {config.every} monitored steps)", ranks=tuple(sorted(new)),
                        values=values)]

    def commit(self, step: int, applied: bool) -> None:
        if self._pending is None:
            return
        self.best, named = self._pending
        self.events += len(named - self.stragglers)
        self.stragglers = named
        self.reports += 1
        self._pending = None

    def metrics(self) -> dict[str, float]:
        return {**self._values, "events": float(self.events)}

    def state_dict(self) -> dict[str, Any]:
        return {"best": None if self.best is None else self.best.tolist(), "reports": self.reports,
                "stragglers": sorted(self.stragglers), "events": self.events}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = None if state["best"] is None else np.asarray(state["best"], dtype=np.float64)
        self.reports = int(state["reports"])
        self.stragglers = frozenset(int(r) for r in state["stragglers"])
        self.events = int(state["events"])


class StragglerFamily(FamilyBase):
    """``detectors.straggler``: the ranks' forward-time medians, fetched every ``every`` monitored steps."""

    name = "straggler"

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        return [StatDecl(SECTION_TIMES, 3, Reduce.DETAIL)]

    def producers(self, ctx: FamilyContext) -> list[Producer]:
        producer = StragglerProducer(ctx.section.every, ctx.config.stats.interval)
        return [Producer("before_agreement", producer.write)]

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [StragglerMonitor(ctx.section, ctx.config.stats.interval)]

"""Bad data, found and localized: one rank's loss parting from its peers' on the same step.

Every data-parallel rank trains the same weights on its own batch, so on a healthy step the ranks' losses scatter
around their mean by an amount that changes slowly over a run (the batch-to-batch noise). A bad shard -- corrupted
tokens, a broken document, a mis-tokenized file -- raises the loss of the rank that reads it and of no other: the
spread of the ranks' losses jumps while the mean loss moves by only 1/n of that rank's excess (with many ranks, too
little for any rule on the mean loss). The spread comes from the step's one all-reduce
(:mod:`arc_engine.monitors.worker_spread`: the shifted loss moments, shared with the consistency family), so a
healthy step costs nothing more.

The rule: the spread (the standard deviation of the ranks' losses) against its run's own baseline -- the median of
the last ``window`` accepted values and 1.4826 x their median absolute deviation -- above the median by ``factor``
robust standard deviations and by at least ``min_ratio`` times the median, and at least half of ``min_excess`` of the
mean loss (what one rank ``min_excess`` above its peers moves it at least). No persistence: the step's update
carries the bad batch's gradient, so the step is judged on its own (skipped by default). On an alarm (the agreed
spread decides it, so every rank takes the branch) one MAX reduction of a rank key brings the rank with the highest
loss; the finding names it when its loss is at least ``min_excess`` above its peers' mean, and is marked
``bad_data`` (:class:`~arc_engine.events.Finding`): the engine adds the data position the step consumed and records
it in the data ledger (:mod:`arc_engine.data_ledger`). A spread past the limit never enters the baseline.

A bad shard that lasts (``sustained_threshold``): where the ranks' losses differ by the nature of their data (per-rank
shards of different kinds: one rank code, one prose) or scatter widely batch to batch (heavy-tailed real text, small
per-rank batches), one step's spread cannot tell a corrupted batch from a hard one. Each rank then follows its own
excess -- its loss minus the ranks' agreed mean -- against its own level and scale (exponential averages over
``window`` accepted steps, each step's deviation clipped at 3 scales), and sums the standardized excess above a
slack of 0.5 in a one-sided CUSUM (clipped at 3 per step, held below ``sustained_threshold`` + 2.5). Off by default
(0). Before the next agreement each rank writes whether its sum is past ``sustained_threshold`` into one SUM slot
(the step's one all-reduce; the sum itself stays in a DETAIL slot); past ``warmup_steps`` accepted steps, any rank
past it is an alarm, a step after the evidence (the sum of step t travels in the agreement of step t + 1), whose
follow-up (the spread's, one MAX reduction) also brings the largest sum packed with its rank: the rank named. It goes
through the same fingerprint check, finding and quarantine as the spread's. While a rank's sum is above the
threshold its level and scale stand still, so a shard that stays bad keeps it named (quarantined); the first step
its standardized excess is back under the slack sets the sum back to the threshold, so it is named at least one
step more (the step whose agreement carries that sum). Each rank's sum is its own state: a restore from another
rank's copy (a checkpoint's shared state) starts it again.

Under tensor or pipeline parallelism the ranks of one replica record the same loss; the named rank is then the
highest global rank of the replica whose batch it was (ties in a rank key go to the higher rank).

Replicas that diverged are not bad data: where every rank holds a whole replica (DDP, ZeRO-1/2), the alarm's
follow-up also carries a fingerprint of each rank's weights (the sum of its parameters, and its negation: their MAX is
the largest and the smallest); when they differ, the ranks' losses parted because their weights did (a corrupted
optimizer state or reduction on one rank), and the finding says so, is not ``bad_data``, starts no quarantine and
asks for ``diverged_action`` (a rollback to a verified snapshot, whose replicas are identical; a stop without
recovery).

Quarantine (``quarantine``, where the integration's tensor hooks see each rank's local gradient before the
reduction: DDP, ZeRO-1/2, every rank its own replica): after a step skipped for rank R's data, every rank registers a
tensor hook on each trainable parameter -- R's returns zeros, the others' their gradient x n/(n − 1) -- so the
reduced gradient is the mean of R's peers' and the step can be applied. While the rule keeps naming R its findings
are warnings ("applied without rank R's share"); the first step on which it does not (R's loss rejoined its peers,
or another rank is named) removes the hooks, and so does a restore. Outside a quarantine no hook exists.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from arc_engine import runtime
from arc_engine.config.errors import require
from arc_engine.config.schema import ActionName
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.consistency import ConsistencyFamily
from arc_engine.monitors.family import (
    FamilyBase,
    FamilyContext,
    LocalGrads,
    Producer,
    StatDecl,
    StepView,
    section_of,
    worker_positions,
)
from arc_engine.monitors.robust import robust_baseline
from arc_engine.monitors.worker_spread import Spread, WorkerMoments
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, names
from arc_engine.stats.rank_keys import check_rank, rank_key, split_key


@dataclass(kw_only=True)
class DataConfig:
    """Bad data, found and localized: the data-parallel ranks' losses on one step parting from each other.

    Each rank trains on its own batch; a bad shard (corrupted tokens, a broken document, a mis-tokenized file) raises
    the loss of the rank that reads it and of no other. On every monitored step the spread of the ranks' losses
    (the L4 norm of their deviations from the mean, from the step's one all-reduce) is compared with its run's own
    baseline (the median of the last ``window`` accepted values and 1.4826 x their MAD): past ``warmup_steps``
    accepted steps, a spread above the median by ``factor`` robust standard deviations, by at least ``min_ratio`` times
    the median and by at least half of ``min_excess`` of the mean loss is a finding with ``action``, on that step (no
    persistence: the step's update already carries the bad batch's gradient).
    The finding names the rank with the highest loss (one MAX reduction of a rank key, on alarms only) when its loss
    is at least ``min_excess`` (a fraction) above the mean of its peers', with the data position (the global batch
    index) the step consumed; the position goes into the data ledger (``data_ledger.jsonl``), which a resumed run
    honours and ``arc-engine data-ledger`` exports. Its skips count apart from the other skips
    (``policy.max_consecutive_data_skips``). Needs two or more ranks recording a loss; off under expert parallelism
    like ``detectors.consistency``.
    ``quarantine``: after a step skipped for a named rank's bad data, the following steps drop only that rank's share
    of the gradient (its local gradient x 0, the others' x n/(n − 1), before the reduction, on every rank alike) and
    are applied, for as long as the rule keeps naming that rank and at most ``quarantine_steps`` in a row (then its
    findings skip again, and the policy's bound on data skips applies). Where the integration's local gradients
    cannot be reached before the reduction (FSDP2, ZeRO-3, model parallelism), the steps are skipped.
    ``diverged_action``: where every rank holds a whole replica (DDP, ZeRO-1/2), an alarm whose replicas' weight
    fingerprints differ is not bad data (the ranks' weights parted, e.g. a corrupted optimizer state or reduction on
    one rank) and gets this action: a rollback to a verified snapshot (without recovery: a stop, exit code 3).
    Skipping cannot bring diverged replicas back together."""

    enabled: bool = True
    """Bad data, found and localized: the ranks' losses on one step parting from each other (the L4 norm of their
    deviations, from the step's one all-reduce); names the rank with the highest loss and the data position
    ([detectors.md](detectors.md#bad-data)). Needs 2 or more ranks; off under expert parallelism."""
    warmup_steps: int = 20
    """Accepted steps before the rule can fire.
    Allowed: >= 3"""
    window: int = 100
    """Accepted values in the baseline.
    Allowed: >= `warmup_steps`"""
    factor: float = 6.0
    """Robust standard deviations (1.4826 x MAD) above the baseline's median that a step's deviation must exceed.
    Allowed: > 0"""
    min_ratio: float = 10.0
    """And this many times the baseline's median (10: silent on the campaign's clean runs,
    [results.md](results.md#bad-data)).
    Allowed: >= 1"""
    min_excess: float = 0.05
    """The highest-loss rank is named when its loss is at least this fraction above its peers' mean.
    Allowed: >= 0"""
    action: ActionName = "skip"
    """What a finding gets; its skips count apart (`policy.max_consecutive_data_skips`)."""
    quarantine: bool = True
    """After a step skipped for a named rank's bad data, drop only that rank's share of the next steps' gradient (before
    the reduction) and apply them, while the rule keeps naming it (DDP, ZeRO-1/2; elsewhere: skip)."""
    quarantine_steps: int = 100
    """Quarantined steps in a row at most; past them the findings skip again.
    Allowed: >= 1"""
    sustained_threshold: float = 0.0
    """A bad shard that lasts: each rank's one-sided CUSUM of its loss above the ranks' mean, in its own robust units
    (slack 0.5, steps clipped at 3), alarms above this and names the rank; 0: off (12: for per-rank data of different
    kinds, [detectors.md](detectors.md#bad-data)).
    Allowed: >= 0"""
    diverged_action: ActionName = "rollback"
    """What an alarm gets whose data-parallel replicas' weights differ (not bad data; DDP, ZeRO-1/2): rollback restores
    identical replicas (without recovery: a stop)."""

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 3, "warmup_steps", self.warmup_steps, "must be an integer >= 3")
        require(self.window >= self.warmup_steps, "window", self.window, "must be >= warmup_steps")
        require(self.factor > 0, "factor", self.factor, "must be > 0")
        require(self.min_ratio >= 1, "min_ratio", self.min_ratio, "must be >= 1")
        require(self.min_excess >= 0, "min_excess", self.min_excess, "must be >= 0")
        require(self.quarantine_steps >= 1, "quarantine_steps", self.quarantine_steps, "must be an integer >= 1")
        require(self.sustained_threshold >= 0, "sustained_threshold", self.sustained_threshold,
                "must be >= 0 (0 = off)")



#: [1] DETAIL: this rank's global rank: on an alarm each rank's loss becomes a rank key on the host, reduced by MAX in a
#: follow-up (a healthy step only fills this one number).
RANK = "data_rank"
#: [1] DETAIL: this rank's sustained-excess sum (:class:`SustainedExcess`), with ``sustained_threshold`` (read by the
#: alarm's follow-up only).
SUSTAINED = "data_sustained"
#: [1] SUM: 1 on each rank whose sum is past ``sustained_threshold``: the ranks past it, in the step's one all-reduce.
SUSTAINED_RANKS = "data_sustained_ranks"


class SustainedExcess:
    """One rank's one-sided CUSUM of its loss above the ranks' agreed mean, in units of its own scale (the module
    docstring). Host arithmetic on two numbers a step; local state."""

    SLACK = 0.5   # standardized excess a step must exceed to add to the sum
    CLIP = 3.0    # the most one step adds (a heavy-tailed batch is one step)
    MAD_TO_STD = 1.2533  # a normal variable's standard deviation over its mean absolute deviation

    def __init__(self, threshold: float, window: int, warmup: int) -> None:
        self.threshold, self.alpha, self.warmup = threshold, 2.0 / (window + 1), warmup
        self.level = 0.0   # the excess's exponential mean over accepted steps
        self.spread = 0.0  # its mean absolute deviation, likewise
        self.count = 0     # accepted steps seen
        self.cusum = 0.0

    @property
    def warm(self) -> bool:
        return self.count >= self.warmup and self.spread > 0

    def value(self) -> float:
        """The sum this rank reports (0 before it is warm)."""
        return self.cusum if self.warm else 0.0

    def update(self, excess: float, accept: bool) -> None:
        """One step's excess (this rank's loss minus the agreed mean); ``accept``: the step was applied and not
        flagged, so it may move the level and scale (unless the sum is past the threshold)."""
        scale = self.MAD_TO_STD * self.spread
        if self.warm:
            z = min(self.CLIP, max(-self.CLIP, (excess - self.level) / scale))
            if self.cusum > self.threshold and z <= self.SLACK:  # its loss rejoined: no longer named from the next step
                self.cusum = self.threshold
            self.cusum = min(self.threshold + self.CLIP - self.SLACK, max(0.0, self.cusum + z - self.SLACK))
        if not accept or self.cusum >= self.threshold:
            return
        if self.count == 0:
            self.level = excess
        else:
            alpha = max(self.alpha, 1.0 / (self.count + 1))
            deviation = excess - self.level
            if self.warm:
                deviation = min(self.CLIP * scale, max(-self.CLIP * scale, deviation))
            self.level += alpha * deviation
            self.spread += alpha * (abs(deviation) - self.spread)
        self.count += 1

    def state_dict(self, rank: int) -> dict[str, float]:
        return {"rank": rank, "level": self.level, "spread": self.spread, "count": self.count, "cusum": self.cusum}

    def load_state_dict(self, state: dict[str, Any] | None, rank: int) -> None:
        """This rank's own state; another rank's (or none) starts it again."""
        own = state is not None and int(state.get("rank", -1)) == rank
        self.level = float(state["level"]) if own else 0.0
        self.spread = float(state["spread"]) if own else 0.0
        self.count = int(state["count"]) if own else 0
        self.cusum = float(state["cusum"]) if own else 0.0


class Quarantine:
    """One rank's share of the gradient dropped before the reduction (see the module docstring): tensor hooks on
    ``local.params``, registered only while a rank is quarantined, on the ranks of the blamed rank's reduction
    group (``local.group``) only. Local; every rank starts and stops it on the same agreed step."""

    def __init__(self, rank: int, local: LocalGrads | None = None) -> None:
        self.rank = rank
        self.params: list[torch.Tensor] = [p for p in local.params if p.requires_grad] if local is not None else []
        self.group = local.group if local is not None else None
        self.blamed: int | None = None  # the quarantined rank
        self.since = -1                 # the first step applied without its share
        self.steps = 0                  # quarantined steps so far
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def reduction_ranks(self) -> list[int]:
        """The global ranks this rank's local gradient is averaged with (its own included)."""
        if self.group is not None:
            return dist.get_process_group_ranks(self.group)
        return list(range(dist.get_world_size())) if dist.is_initialized() else [self.rank]

    def start(self, blamed: int, step: int) -> None:
        """From the next backward on, on the ranks of ``blamed``'s reduction group: this rank's local gradient dropped
        (``blamed`` is this rank) or scaled by ``n / (n − 1)`` (its peers), n the ranks that reduction averages over
        (every one contributes a gradient, whether it recorded a loss or not), so the mean is the peers' mean.
        Elsewhere nothing changes: their reduction does not hold the blamed rank's gradient."""
        self.stop()
        members = self.reduction_ranks()
        self.blamed, self.since, self.steps = blamed, step + 1, 0
        if blamed not in members or len(members) < 2:
            return
        scale = len(members) / (len(members) - 1)

        def drop(grad: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(grad)  # (not grad * 0: a NaN in the bad batch's gradient would stay)

        def rescale(grad: torch.Tensor) -> torch.Tensor:
            return grad * scale

        hook = drop if self.rank == blamed else rescale
        self._handles = [param.register_hook(hook) for param in self.params if param.requires_grad]

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.blamed = None


def spread_limit(history: deque[float] | list[float], factor: float, min_ratio: float) -> tuple[float, float]:
    """(the limit the loss spread must exceed, the baseline median) from the accepted spreads. Pure."""
    median, robust_std = robust_baseline(history)
    return max(median + factor * robust_std, min_ratio * median), median


def loss_key(row: np.ndarray, layout: Any) -> float:
    """The rank key of a rank's loss from its buffer row (-inf when it recorded none). Pure."""
    recorded = float(row[layout[names.LOSS_COUNT].span][0]) > 0
    return rank_key(float(row[layout[names.LOSS].span][0]) if recorded else math.nan,
                    int(row[layout[RANK].span][0]))


class BadDataMonitor(Monitor):
    """The loss-spread rule of the module docstring; names the highest-loss rank on an alarm."""

    name = "data"

    def __init__(self, config: DataConfig, rank: int, positions: int = 1, position: int = 0,
                 write_moments: bool = True, local: LocalGrads | None = None) -> None:
        check_rank(rank)
        self.config = config
        self.quarantine = Quarantine(rank, local) if local is not None and config.quarantine else None
        self._named = -1  # the rank this step's finding names (-1: none)
        self.rank = rank
        self.moments = WorkerMoments(positions, position)
        self.write_moments = write_moments  # False: the consistency family writes the shared slots
        self.history: deque[float] = deque(maxlen=config.window)
        self.alarms = 0
        self._spread: Spread | None = None
        self._flagged = False
        self._values: dict[str, float] = {}
        self.sustained = SustainedExcess(config.sustained_threshold, config.window, config.warmup_steps) \
            if config.sustained_threshold > 0 else None
        self._excess = math.nan  # this step's own loss minus the agreed mean

    def required_stats(self) -> tuple[str, ...]:
        return (*WorkerMoments.required_stats(), RANK,
                *((SUSTAINED, SUSTAINED_RANKS) if self.sustained is not None else ()))

    @torch.no_grad()
    def write(self, buffer: StatBuffer, view: StepView) -> None:
        """Producer: this rank's global rank, its sustained-excess key and the shared loss moments, unless the
        consistency family writes them (device-side fills of host numbers, no sync)."""
        buffer.view(RANK).fill_(float(self.rank))
        if self.sustained is not None:
            value = self.sustained.value()
            buffer.view(SUSTAINED).fill_(value)
            buffer.view(SUSTAINED_RANKS).fill_(1.0 if value > self.config.sustained_threshold else 0.0)
        if self.write_moments:
            self.moments.write(buffer)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        self._flagged, self._named = False, -1
        spread = self._spread = self.moments.read(stats)
        ranks = float(stats.total(names.LOSS_RANKS)[0])
        deviation = spread.loss_l4
        self._values = {"loss_std": spread.loss_std, "deviation": deviation, "ranks": ranks}
        recorded = float(stats.local(names.LOSS_COUNT)[0]) > 0
        self._excess = float(stats.local(names.LOSS)[0]) - spread.loss_mean if recorded else math.nan
        if ranks < 2 or not (math.isfinite(deviation) and math.isfinite(spread.loss_mean)) \
                or len(self.history) < self.config.warmup_steps:
            return []
        limit, median = spread_limit(self.history, self.config.factor, self.config.min_ratio)
        # and a floor: one rank min_excess above its peers is at least (n - 1) / n >= 1/2 of that from the mean (a run
        # whose ranks read the same data has a baseline of rounding noise)
        limit = max(limit, 0.5 * self.config.min_excess * abs(spread.loss_mean))
        self._values.update(limit=limit, baseline=median)
        sustained = self.sustained is not None and float(stats.total(SUSTAINED_RANKS)[0]) > 0
        if self.sustained is not None:
            self._values["sustained"] = float(stats.local(SUSTAINED)[0])  # this rank's own sum (metrics)
        if deviation <= limit and not sustained:
            return []
        return self._alarm(stats, spread, ranks, deviation, limit, median, sustained=deviation <= limit)

    def _alarm(self, stats: AgreedStats, spread: Spread, ranks: float, deviation: float, limit: float,
               median: float, sustained: bool = False) -> list[Finding]:
        """An agreed alarm (every rank takes it): who (the spread's highest loss, or with ``sustained`` the rank
        holding the largest sum), whether the replicas diverged, the finding. One MAX follow-up brings them all."""
        self._flagged = True
        self.alarms += 1
        layout = stats.layout
        replicas = self.quarantine is not None and bool(self.quarantine.params)  # whole replicas on every rank

        def contribution(row: np.ndarray) -> np.ndarray:
            held = [rank_key(float(row[layout[SUSTAINED].span][0]), int(row[layout[RANK].span][0]))] \
                if sustained else []
            return np.array([loss_key(row, layout), *held, *(self._fingerprint() if replicas else ())])

        key = stats.follow_up(contribution, Reduce.MAX)
        highest, rank = split_key(float(key[0]))
        sustained_sum, sustained_by = split_key(float(key[1])) if sustained else (math.nan, -1)
        key = key[1:] if sustained else key  # the fingerprints follow
        diverged = replicas and float(key[1]) != -float(key[2])
        total = spread.loss_mean * ranks
        peers = (total - highest) / (ranks - 1) if rank >= 0 else math.nan
        excess = (highest - peers) / abs(peers) if rank >= 0 and peers else math.nan
        named = rank >= 0 and math.isfinite(excess) and excess >= self.config.min_excess
        values = {"deviation": deviation, "loss_std": spread.loss_std, "limit": limit, "baseline": median,
                  "loss_mean": spread.loss_mean,
                  "rank": rank if named else -1, "rank_loss": highest, "peers_loss": peers, "excess": excess}
        where = (f"rank {rank}'s loss {highest:.4g} is {excess:.0%} above its peers' {peers:.4g}" if named else
                 "no single rank's loss stands out")
        if sustained_by >= 0:  # the sum names the rank whose loss has stood above its own level
            rank, named = sustained_by, True
            values.update(rank=rank, sustained=sustained_sum, sustained_threshold=self.config.sustained_threshold)
            where = (f"rank {rank}'s loss has stood above the ranks' mean, against its own level, for several steps "
                     f"(sustained excess {sustained_sum:.3g} > {self.config.sustained_threshold:g})")
        action = Action.parse(self.config.action)
        if diverged:  # not the data: the replicas' weights differ, which no skip repairs
            values.update(replicas_diverged=True, fingerprint_max=float(key[1]), fingerprint_min=-float(key[2]))
            return [Finding(self.name, Action.parse(self.config.diverged_action), Severity.WARNING,
                            f"the data-parallel replicas' weights differ (parameter sums {-float(key[2]):.9g} to "
                            f"{float(key[1]):.9g}): the ranks' losses parted because their weights did, not their "
                            f"data; {where}", ranks=(rank,) if named else (), values=values,
                            hardware="replica_divergence")]
        self._named = rank if named else -1
        held = self.quarantine
        dropped = held is not None and named and rank == held.blamed and held.steps < self.config.quarantine_steps
        if dropped:
            action = Action.WARN  # its share is not in this step's gradient: the step can be applied
            where += f"; applied without rank {rank}'s share of the gradient (quarantined since step {held.since})"
            values["quarantined"] = rank
        what = "one rank's loss stood apart" if sustained_by >= 0 else \
            f"the ranks' losses parted (deviation {deviation:.3g}, limit {limit:.3g}, baseline {median:.3g})"
        return [Finding(self.name, action, Severity.WARNING, f"bad data: {what}; {where}",
                        ranks=(rank,) if named else (), values=values, bad_data=True, data_dropped=bool(dropped))]

    @torch.no_grad()
    def _fingerprint(self) -> tuple[float, float]:
        """(s, −s), s the sum of this rank's parameters in float64 (one host read; on alarms only): replicas that
        hold the same weights give the same s bitwise."""
        assert self.quarantine is not None
        total = float(torch.stack([p.detach().double().sum() for p in self.quarantine.params]).sum())
        total = total if math.isfinite(total) else math.inf  # a non-finite replica differs from a finite one
        return total, -total

    def commit(self, step: int, applied: bool) -> None:
        if self._spread is not None:
            self.moments.advance(self._spread)
        if self.sustained is not None and math.isfinite(self._excess) and self._values.get("ranks", 0.0) >= 2:
            self.sustained.update(self._excess, applied and not self._flagged)
        self._excess = math.nan
        held = self.quarantine
        if held is not None:
            if held.blamed is not None and self._named != held.blamed:
                held.stop()  # its loss rejoined its peers', or another rank's data went bad
            elif held.blamed is not None:
                held.steps += 1
            ranks = int(self._values.get("ranks", 0.0))
            if held.blamed is None and self._named >= 0 and not applied and ranks >= 2:
                held.start(self._named, step)
        if applied and not self._flagged and math.isfinite(self._values.get("deviation", math.nan)) \
                and self._values.get("ranks", 0.0) >= 2:
            self.history.append(self._values["deviation"])

    def metrics(self) -> dict[str, float]:
        return {**{key: self._values.get(key, math.nan) for key in ("loss_std", "deviation", "limit", "sustained")},
                "alarms": float(self.alarms)}

    def state_dict(self) -> dict[str, Any]:
        own = {"sustained": self.sustained.state_dict(self.rank)} if self.sustained is not None else {}
        return {"history": list(self.history), "alarms": self.alarms, **self.moments.state_dict(), **own}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.quarantine is not None:  # a restore (rollback, resume) ends a quarantine
            self.quarantine.stop()
        self.history = deque((float(v) for v in state["history"]), maxlen=self.config.window)
        self.alarms = int(state["alarms"])
        self.moments.load_state_dict(state)
        if self.sustained is not None:
            self.sustained.load_state_dict(state.get("sustained"), self.rank)


class BadDataFamily(FamilyBase):
    """``detectors.data``: the spread of the ranks' losses (the shared worker moments), naming the bad rank."""

    name = "data"
    config_class = DataConfig

    def __init__(self) -> None:
        self._monitor: tuple[int, BadDataMonitor] | None = None

    def enabled(self, ctx: FamilyContext) -> bool:
        return bool(ctx.section.enabled) and worker_positions(ctx.parts) is not None

    def _monitor_for(self, ctx: FamilyContext) -> BadDataMonitor:
        if self._monitor is None or self._monitor[0] != id(ctx):
            positions, position = worker_positions(ctx.parts) or (1, 0)
            monitor = BadDataMonitor(ctx.section, runtime.global_rank(), positions, position,
                                     write_moments=not section_of(ctx.config, ConsistencyFamily()).enabled,
                                     local=ctx.local_grads if positions == 1 else None)
            self._monitor = (id(ctx), monitor)
        return self._monitor[1]

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        monitor = self._monitor_for(ctx)
        return [*monitor.moments.statistics(), StatDecl(RANK, 1, Reduce.DETAIL),
                *((StatDecl(SUSTAINED, 1, Reduce.DETAIL), StatDecl(SUSTAINED_RANKS, 1, Reduce.SUM))
                  if monitor.sustained is not None else ())]

    def producers(self, ctx: FamilyContext) -> list[Producer]:
        return [Producer("before_agreement", self._monitor_for(ctx).write)]

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [self._monitor_for(ctx)]


__all__ = ["RANK", "SUSTAINED", "SUSTAINED_RANKS", "BadDataFamily", "BadDataMonitor", "Quarantine", "SustainedExcess",
           "loss_key", "spread_limit"]

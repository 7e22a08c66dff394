"""Cross-worker consistency (the silent-inconsistency paper): do the data-parallel workers still train alike?

All-reduce keeps the weights equal after every step, so a worker whose losses or gradients drift from its peers'
(desynchronized data order or seeds, a faulty device, a collective that scales one rank's contribution) is invisible
in the averaged loss. Three signals, on every monitored step, from the ranks' own pre-reduction values:

* **loss dispersion** D_loss = std_i ℓ_i over the ranks that recorded a loss;
* **gradient-norm dispersion** D_grad = std_i ‖g_i‖ of the ranks' local (pre-reduction) gradient norms, and its
  coefficient of variation CV_grad = D_grad / mean_i ‖g_i‖ (scale-free: what the alarm watches);
* **gradient-direction consistency** C_dir = mean over pairs i < j of cos(g_i, g_j), estimated from each rank's
  signed block-sum sketch of its local gradient (:mod:`arc_engine.monitors.sdc_local`).

All three come through the step's one all-reduce with a size independent of the number of ranks: each rank adds
its shifted loss and local-norm moments (:mod:`arc_engine.monitors.worker_spread`, shared with the R-Metric) and
its unit sketch ŝ_i = s_i / ‖s_i‖ into SUM slots; then
Σ_{i,j} cos(s_i, s_j) = ‖Σ_i ŝ_i‖², so C_dir = (‖Σ ŝ_i‖² − n) / (n (n − 1)) (:func:`direction_consistency`).
Every ``detail_every`` monitored steps the ranges (max − min) and the rank farthest from its peers come through a
MAX slot reduced on those steps only (:data:`EXTREMES`: the largest and smallest loss and, per position, local norm,
each packed with the rank holding it, :mod:`arc_engine.stats.rank_keys`): the farthest rank is the one of those
extremes farthest from the mean of the others (the mean from the SUM moments). Its size is fixed: nothing per rank
travels on a healthy step. An alarm (a fault being diagnosed) fetches every rank's values once, on that step: the
finding names the rank farthest from the median of the others and carries every rank's loss and norm.

The alarm: CV_grad above its run's robust baseline (the median of the last ``window`` accepted values plus
``factor`` robust standard deviations, and at least ``min_cv_ratio`` times the median), or C_dir below its baseline by
as much (the direction arm only on sketch steps), on ``persist`` consecutive measurements: with few ranks and small
batches one step's spread has a long tail (2 ranks of the tests' GPT: median CV 0.07, largest of 400 clean steps
0.55), while a faulty rank stays faulty. A run that is inconsistent from the start (S1-3 of the paper: every
rank on its own data) has that as its baseline; what alarms is a change. The finding names the rank whose local norm
is farthest from the peers' median.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from arc_engine import runtime
from arc_engine.config.errors import require
from arc_engine.config.schema import ActionName
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import (
    FamilyBase,
    FamilyContext,
    Producer,
    StatDecl,
    StepView,
    periodic_due,
    section_of,
    worker_positions,
)
from arc_engine.monitors.robust import robust_baseline
from arc_engine.monitors.sdc import SDCFamily
from arc_engine.monitors.worker_spread import GRAD_NORM_MOMENTS, Spread, WorkerMoments
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, names
from arc_engine.stats.rank_keys import check_rank, rank_key_t, split_key


@dataclass(kw_only=True)
class ConsistencyConfig:
    """Cross-worker consistency over the data-parallel ranks (silent-inconsistency paper), on every monitored step:
    the loss dispersion (std over ranks), the dispersion of the ranks' local pre-reduction gradient norms (std and
    coefficient of variation) and, every ``direction_every`` monitored steps, the gradient-direction consistency
    C_dir (mean pairwise cosine of the local gradients, from a ``sketch_size``-number signed chunk-sum sketch per rank
    summed through the step's one all-reduce; exact, from the whole local gradient, under DDP and FSDP2 when the model
    has at most ``exact_max_params`` trainable elements and the SDC sketch is off). Ranges (max - min) and the rank
    farthest from its peers come every ``detail_every`` monitored steps through a fixed-size MAX reduction (the
    extreme ranks); every rank's values are fetched on an alarm. Alarm: after ``warmup_steps`` accepted
    steps, the gradient-norm CV above the median of the last ``window`` accepted values by ``factor`` robust standard
    deviations and by at least ``min_cv_ratio`` times that median, or C_dir below its median by ``factor`` robust
    standard deviations and at least ``min_direction_drop``, on ``persist`` consecutive measurements (once per
    episode). Under megatron-core tensor/pipeline parallelism the ranks are compared within each model-parallel
    position (the replicas of one shard); off under expert parallelism."""

    enabled: bool = True
    """Cross-worker consistency over the data-parallel ranks: loss and local gradient-norm dispersion every monitored
    step, direction consistency periodically ([detectors.md](detectors.md)). Off by itself under tensor, pipeline,
    context or expert parallelism."""
    warmup_steps: int = 20
    """Accepted steps before the alarms can fire.
    Allowed: >= 3"""
    window: int = 100
    """Accepted values (gradient-norm CV, C_dir) in the baseline.
    Allowed: >= warmup_steps"""
    factor: float = 6.0
    """Robust standard deviations (1.4826 x MAD) from the baseline's median that alarm.
    Allowed: > 0"""
    min_cv_ratio: float = 2.0
    """The gradient-norm CV must also exceed this many times its baseline median.
    Allowed: >= 1"""
    min_direction_drop: float = 0.1
    """C_dir must also fall this far below its baseline median (cosine units).
    Allowed: [0, 2]"""
    persist: int = 3
    """Consecutive measurements past the limit before an alarm (one alarm per episode); one step's spread has a long
    tail with few ranks.
    Allowed: >= 1"""
    direction: bool = True
    """Measure C_dir, the mean pairwise cosine of the ranks' local gradients, from a gradient sketch (one more pass over
    the local gradient on its steps)."""
    direction_every: int = 10
    """Monitored steps between C_dir measurements (the sketch is taken only then; on every monitored step when
    `detectors.sdc.sketch_size` is set).
    Allowed: >= 1"""
    sketch_size: int = 256
    """Numbers in each rank's sketch (`detectors.sdc.sketch_size` wins when set): the estimate's error falls as
    1/sqrt(size) ([detectors.md](detectors.md)).
    Allowed: >= 2"""
    exact_max_params: int = 0
    """Under DDP and FSDP2, a model with at most this many trainable elements sends each rank's whole unit gradient
    instead of the sketch: C_dir is then exact, and the all-reduce carries that many more numbers on every monitored
    step (small models and tests); 0: always the sketch. `detectors.sdc.sketch_size` wins when set.
    Allowed: >= 0"""
    detail_every: int = 100
    """Monitored steps between readings of the ranges of the ranks' loss and local norm and of the rank farthest from
    its peers; 0: on alarms only. One MAX reduction of 2 + 2 x positions numbers on those steps (the extreme ranks), not
    a per-rank gather.
    Allowed: >= 0"""
    action: ActionName = "warn"
    """What an alarm gets."""

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 3, "warmup_steps", self.warmup_steps, "must be an integer >= 3")
        require(self.exact_max_params >= 0, "exact_max_params", self.exact_max_params,
                "must be an integer >= 0 (0 = always the sketch)")
        require(self.window >= self.warmup_steps, "window", self.window, "must be >= warmup_steps")
        require(self.factor > 0, "factor", self.factor, "must be > 0")
        require(self.min_cv_ratio >= 1, "min_cv_ratio", self.min_cv_ratio, "must be >= 1")
        require(0 <= self.min_direction_drop <= 2, "min_direction_drop", self.min_direction_drop, "must be in [0, 2]")
        require(self.persist >= 1, "persist", self.persist, "must be an integer >= 1")
        require(self.direction_every >= 1, "direction_every", self.direction_every, "must be an integer >= 1")
        require(self.sketch_size >= 2, "sketch_size", self.sketch_size, "must be an integer >= 2")
        require(self.detail_every >= 0, "detail_every", self.detail_every,
                "must be an integer >= 0 (0 = on alarms only)")



#: [positions x (k' + 1)] SUM, per model-parallel position: Σ_i ŝ_i (its ranks' unit gradient sketches, folded to
#: k' = :func:`position_sketch_size` numbers) and the number of ranks with a non-zero sketch.
DIRECTION_SUM = "consistency_direction"
#: [1] DETAIL: this rank's model-parallel position (under model parallelism only; per-rank fetches group by it).
POSITION = "consistency_position"
#: [2 + 2 x positions] MAX, reduced on detail steps only: rank keys of the largest loss and of the negated smallest
#: (over the ranks that recorded one), then per position of the largest and the negated smallest local norm.
EXTREMES = "consistency_extremes"


def detail_due(step: int, interval: int, every: int) -> bool:
    """Whether monitored step ``step`` is a detail step (every ``every`` monitored steps, not the first; never when
    ``every`` is 0). Pure."""
    return periodic_due(step, interval, every)


class ExtremesProducer:
    """Writes this rank's loss and local norm as rank keys into :data:`EXTREMES` on detail steps (device-side)."""

    def __init__(self, interval: int, every: int, position: int, rank: int) -> None:
        check_rank(rank)
        self.interval, self.every, self.position, self.rank = interval, every, position, rank

    @torch.no_grad()
    def write(self, buffer: StatBuffer, view: StepView) -> None:
        if not detail_due(view.step, self.interval, self.every):
            return
        loss = buffer.view(names.LOSS)[:1]
        loss = torch.where(buffer.view(names.LOSS_COUNT)[:1] > 0, loss, torch.full_like(loss, math.nan))
        norm = buffer.view(names.GRAD_SQ_LOCAL).sum().sqrt().reshape(1)
        slot = buffer.view(EXTREMES)
        row = 2 + 2 * self.position
        for index, value in ((0, loss), (1, -loss), (row, norm), (row + 1, -norm)):
            slot[index:index + 1].copy_(rank_key_t(value, self.rank))


def extremes_detail(keys: np.ndarray, moments: np.ndarray) -> tuple[dict[str, float], dict[str, dict[int, float]]]:
    """From the agreed :data:`EXTREMES` keys and :data:`GRAD_NORM_MOMENTS` rows (``[positions, 4]``): the ranges,
    the farthest rank (of each position's largest and smallest norm, the one farthest from the mean of the others,
    relative to it; -1 when no position has two ranks) and the extreme ranks' values. Pure."""
    (loss_high, loss_high_rank), (loss_low, loss_low_rank) = split_key(keys[0]), split_key(keys[1])
    loss_low = -loss_low
    per_rank: dict[str, dict[int, float]] = {"loss": {}, "grad_norm": {}}
    if loss_high_rank >= 0:
        per_rank["loss"] = {loss_low_rank: loss_low, loss_high_rank: loss_high}
    highest, lowest, farthest, distance = -math.inf, math.inf, -1, -math.inf
    for position, row in enumerate(moments.reshape(-1, 4)):
        (high, high_rank), (low, low_rank) = split_key(keys[2 + 2 * position]), split_key(keys[3 + 2 * position])
        if high_rank < 0:
            continue
        low = -low
        per_rank["grad_norm"].update({low_rank: low, high_rank: high})
        highest, lowest = max(highest, high), min(lowest, low)
        count = float(row[2])
        if count < 2:
            continue
        total = float(row[0]) + float(row[3])  # Σ (x − c) + Σ c = Σ x
        for value, rank in ((high, high_rank), (low, low_rank)):
            others = (total - value) / (count - 1)
            away = abs(value - others) / abs(others) if others else abs(value - others)
            if away > distance:
                farthest, distance = rank, away
    values = {"loss_range": loss_high - loss_low if loss_high_rank >= 0 else math.nan,
              "grad_norm_range": highest - lowest if math.isfinite(highest) else math.nan,
              "farthest_rank": float(farthest), "farthest_distance": distance if farthest >= 0 else math.nan}
    return values, per_rank


def position_sketch_size(sketch_size: int, positions: int) -> int:
    """The numbers per position in the direction sum: the whole sketch with one position, else an equal share of
    it (at least 16), so the slot stays about ``sketch_size`` long whatever the model-parallel layout. Pure."""
    return sketch_size if positions <= 1 else max(16, sketch_size // positions)


def direction_consistency(unit_sum: np.ndarray, count: float) -> float:
    """C_dir = mean over pairs i < j of cos(x_i, x_j), from the sum of the ``count`` unit vectors x_i / ‖x_i‖:
    ‖Σ x̂_i‖² = n + Σ_{i≠j} cos = n + n (n − 1) C_dir. NaN with fewer than two vectors. Pure."""
    if count < 2:
        return math.nan
    return (float(np.dot(unit_sum, unit_sum)) - count) / (count * (count - 1.0))


def exact_direction_consistency(vectors: np.ndarray) -> float:
    """The definition, for tests and benchmarks: mean over pairs i < j of the cosine of rows i and j. Pure."""
    norms = np.linalg.norm(vectors, axis=1)
    unit = vectors / norms[:, None]
    cosines = unit @ unit.T
    upper = np.triu_indices(len(vectors), k=1)
    return float(cosines[upper].mean())


def farthest_rank_within(values: np.ndarray, groups: np.ndarray) -> tuple[int, float]:
    """:func:`farthest_rank` among the ranks of each group (ranks holding the same shards), the farthest of all:
    (its index in ``values``, its distance). Pure."""
    best, best_distance = -1, -math.inf
    for group in np.unique(groups):
        members = np.flatnonzero(groups == group)
        row, distance = farthest_rank(values[members])
        if row >= 0 and distance > best_distance:
            best, best_distance = int(members[row]), distance
    return best, best_distance


def farthest_rank(values: np.ndarray) -> tuple[int, float]:
    """The rank whose value is farthest from the median of the others', and that distance relative to the median
    (NaN values never win). Pure."""
    best, best_distance = -1, -math.inf
    for rank, value in enumerate(values):
        others = np.delete(values, rank)
        others = others[np.isfinite(others)]
        if not math.isfinite(value) or others.size == 0:
            continue
        median = float(np.median(others))
        distance = abs(value - median) / abs(median) if median else abs(value - median)
        if distance > best_distance:
            best, best_distance = rank, distance
    return best, best_distance


class ConsistencyMonitor(Monitor):
    """D_loss, D_grad / CV_grad and C_dir per monitored step (see the module docstring); alarms on CV_grad and
    C_dir against the run's own baseline."""

    name = "consistency"

    def __init__(self, config: ConsistencyConfig, sketch_size: int, interval: int = 1, positions: int = 1,
                 position: int = 0) -> None:
        self.config = config
        self.sketch_size = sketch_size
        self.interval = interval  # stats.interval: the detail schedule counts monitored steps
        self.positions, self.position = positions, position
        self.folded = position_sketch_size(sketch_size, positions) if sketch_size else 0
        self._fold: torch.Tensor | None = None  # sketch entry -> folded entry (built on first use)
        self.moments = WorkerMoments(positions, position)
        self.cv_history: deque[float] = deque(maxlen=config.window)
        self.direction_history: deque[float] = deque(maxlen=config.window)
        self.alarms = 0
        self._values: dict[str, float] = {}
        self._rank_values: dict[str, dict[int, float]] = {}  # per rank, on a step that fetched them
        self._spread: Spread | None = None  # this step's, until commit
        self._flagged = False
        self._exceeded = (False, False)  # this step's CV above / C_dir below its limit
        self._direction = math.nan  # this step's C_dir (NaN: not measured on this step)
        self._runs = (0, 0)  # consecutive applied steps with the CV above / C_dir below its limit

    @property
    def loss_shift(self) -> float:
        return self.moments.loss_shift

    def required_stats(self) -> tuple[str, ...]:
        wanted = (*WorkerMoments.required_stats(), *((POSITION,) if self.positions > 1 else ()))
        return (*wanted, names.GRAD_SKETCH_LOCAL, DIRECTION_SUM) if self.sketch_size else wanted

    @torch.no_grad()
    def before_agreement(self, buffer: StatBuffer) -> None:
        """This rank's shifted loss and local-norm moments and its unit sketch, into the SUM slots (device-side)."""
        self.moments.write(buffer)
        if self.positions > 1:
            buffer.view(POSITION).fill_(float(self.position))
        if self.sketch_size:
            sketch = buffer.view(names.GRAD_SKETCH_LOCAL)
            if self.folded < sketch.numel():  # a fixed fold (entry j -> j mod k'): still a linear sketch
                if self._fold is None or self._fold.device != sketch.device:
                    self._fold = torch.arange(sketch.numel(), device=sketch.device) % self.folded
                sketch = sketch.new_zeros(self.folded).index_add_(0, self._fold, sketch)
            length = torch.linalg.vector_norm(sketch)
            row = self.position * (self.folded + 1)
            direction = buffer.view(DIRECTION_SUM)[row:row + self.folded + 1]
            direction[:-1].copy_(sketch / torch.where(length > 0, length, 1.0))
            direction[-1].copy_((length > 0).double())

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        self._flagged = False
        self._exceeded = (False, False)
        spread = self.moments.read(stats)
        self._spread = spread
        mean_loss, loss_std, mean_norm, norm_std = spread.loss_mean, spread.loss_std, spread.norm_mean, spread.norm_std
        cv = spread.norm_cv
        direction = direction_mean = math.nan
        if self.sketch_size:  # per position; the alarm watches the lowest
            rows = np.asarray(stats.total(DIRECTION_SUM), dtype=np.float64).reshape(self.positions, -1)
            values = np.array([direction_consistency(row[:-1], float(row[-1])) for row in rows])
            if np.isfinite(values).any():
                direction, direction_mean = float(np.nanmin(values)), float(np.nanmean(values))
        previous = self._values.get("direction", math.nan)
        self._direction = direction  # this step's own value (NaN off the sketch steps) is what the alarm judges
        self._values = {"loss_std": loss_std, "loss_mean": mean_loss, "grad_norm_std": norm_std,
                        "grad_norm_mean": mean_norm, "grad_norm_cv": cv}
        if self.sketch_size:  # the metric keeps the last measurement between sketch steps
            self._values["direction"] = direction if math.isfinite(direction) else previous
        if self.positions > 1:  # the alarm's inputs are the worst position's; the means beside them
            self._values["grad_norm_cv_mean"] = float(np.nanmean(spread.norm_cvs)) \
                if np.isfinite(spread.norm_cvs).any() else math.nan
            if self.sketch_size and math.isfinite(direction_mean):
                self._values["direction_mean"] = direction_mean
        if not all(math.isfinite(v) for v in (mean_loss, loss_std, mean_norm, norm_std)):
            return []  # a non-finite loss or gradient: the non-finite detector's case
        reasons = self._alarms(cv, direction)
        if not reasons:
            if detail_due(step, self.interval, self.config.detail_every):  # fixed-size: the extremes
                detail, self._rank_values = extremes_detail(stats.total(EXTREMES), stats.total(GRAD_NORM_MOMENTS))
                detail.pop("farthest_distance")
                self._values.update(detail)
            return []
        # an alarm: every rank's values, once, on this step (a fault being diagnosed)
        per_rank_loss = stats.per_rank(names.LOSS)[:, 0]
        recorded = stats.per_rank(names.LOSS_COUNT)[:, 0] > 0
        per_rank_norm = np.sqrt(stats.per_rank(names.GRAD_SQ_LOCAL).sum(axis=1))
        losses = per_rank_loss[recorded]
        self._values["loss_range"] = float(losses.max() - losses.min()) if losses.size else math.nan
        self._values["grad_norm_range"] = float(per_rank_norm.max() - per_rank_norm.min())
        global_ranks = [int(r) for r in stats.ranks]
        self._rank_values = {
            "loss": {r: float(v) for r, v, ok in zip(global_ranks, per_rank_loss, recorded, strict=True) if ok},
            "grad_norm": {r: float(v) for r, v in zip(global_ranks, per_rank_norm, strict=True)}}
        groups = stats.per_rank(POSITION)[:, 0] if self.positions > 1 else np.zeros(len(per_rank_norm))
        row, distance = farthest_rank_within(per_rank_norm, groups)
        rank = stats.ranks[row] if row >= 0 else -1  # the global rank of that row of the decision group
        self._values["farthest_rank"] = float(rank)
        self._flagged = True
        values = {**self._values, "per_rank_grad_norm": per_rank_norm.tolist(), "per_rank_loss": per_rank_loss.tolist(),
                  "distance_from_peers": distance}
        return [Finding(self.name, Action.parse(self.config.action), Severity.WARNING,
                        f"workers inconsistent: {'; '.join(reasons)}; rank {rank} farthest from its peers "
                        f"(local gradient norm {per_rank_norm[row]:.4g}, {distance:.1%} from the peers' median)",
                        ranks=(rank,) if rank >= 0 else (), values=values)]

    def _alarms(self, cv: float, direction: float) -> list[str]:
        """The reasons to alarm on this step: a baseline crossed on ``persist`` consecutive applied monitored steps,
        this step being the ``persist``-th (so a lasting fault alarms once, and again only after it cleared)."""
        config, reasons = self.config, []
        high_cv = low_direction = False
        if len(self.cv_history) >= config.warmup_steps and math.isfinite(cv):
            median, spread = robust_baseline(self.cv_history)
            limit = max(median + config.factor * spread, median * config.min_cv_ratio)
            high_cv = cv > limit
            if high_cv and self._runs[0] + 1 == config.persist:
                reasons.append(f"gradient-norm CV {cv:.3g} above {limit:.3g} (baseline {median:.3g}) for "
                               f"{config.persist} steps")
        if len(self.direction_history) >= config.warmup_steps and math.isfinite(direction):
            median, spread = robust_baseline(self.direction_history)
            limit = median - max(config.factor * spread, config.min_direction_drop)
            low_direction = direction < limit
            if low_direction and self._runs[1] + 1 == config.persist:
                reasons.append(f"gradient-direction consistency {direction:.3g} below {limit:.3g} "
                               f"(baseline {median:.3g}) for {config.persist} measurements")
        self._exceeded = (high_cv, low_direction)
        return reasons

    def commit(self, step: int, applied: bool) -> None:
        values = self._values
        if self._spread is not None:
            self.moments.advance(self._spread)
        if self._flagged:
            self.alarms += 1
        if not applied:
            return
        high_cv, low_direction = self._exceeded
        measured = math.isfinite(self._direction)  # C_dir runs count measurements
        self._runs = (self._runs[0] + 1 if high_cv else 0,
                      (self._runs[1] + 1 if low_direction else 0) if measured else self._runs[1])
        # a value past its baseline's limit never enters the baseline (a lasting fault would become the norm)
        if not high_cv and math.isfinite(values.get("grad_norm_cv", math.nan)):
            self.cv_history.append(values["grad_norm_cv"])
        if not low_direction and measured:
            self.direction_history.append(self._direction)

    def metrics(self) -> dict[str, float]:
        return {**self._values, "alarms": float(self.alarms)}

    def rank_metrics(self) -> dict[str, dict[int, float]]:
        """Each rank's loss and local gradient norm, once, after a step that fetched them (empty otherwise)."""
        values, self._rank_values = self._rank_values, {}
        return values

    def state_dict(self) -> dict[str, Any]:
        return {"cv_history": list(self.cv_history), "direction_history": list(self.direction_history),
                "alarms": self.alarms, **self.moments.state_dict(), "runs": list(self._runs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cv_history = deque((float(v) for v in state["cv_history"]), maxlen=self.config.window)
        self.direction_history = deque((float(v) for v in state["direction_history"]), maxlen=self.config.window)
        self.alarms = int(state["alarms"])
        self.moments.load_state_dict(state)
        runs = state.get("runs", (0, 0))
        self._runs = (int(runs[0]), int(runs[1]))


def sketch_size(ctx: FamilyContext) -> int:
    """The gradient sketch's size when the direction consistency needs it (0: off)."""
    return shared_sketch_size(ctx.config, ctx.exact_sketch_size) if ctx.section.direction else 0


def shared_sketch_size(config: Any, exact_size: int = 0) -> int:
    """The one ``grad_sketch_local`` slot's size, shared by the families that read it: the SDC detector's
    ``sketch_size`` when set; else the whole local gradient (``exact_size`` elements, when the adapter can write it
    so) if it has at most ``exact_max_params``; else the consistency family's ``sketch_size`` (0: no family wants
    it)."""
    sdc, consistency = section_of(config, SDCFamily()), section_of(config, ConsistencyFamily())
    if sdc.enabled and sdc.sketch_size:
        return sdc.sketch_size
    if not (consistency.enabled and consistency.direction):
        return 0
    if 0 < exact_size <= consistency.exact_max_params:
        return exact_size  # the adapter writes every element at its place: C_dir is exact
    return consistency.sketch_size


class ConsistencyFamily(FamilyBase):
    """``detectors.consistency``: loss and gradient-norm dispersion and the direction consistency over the
    data-parallel ranks (the standard loss and local-gradient slots, plus its own SUM slots)."""

    name = "consistency"
    config_class = ConsistencyConfig

    def enabled(self, ctx: FamilyContext) -> bool:
        # Under model parallelism a rank's local gradient is its shard's: ranks are compared within a model-parallel
        # position; without positions (e.g. expert parallelism) there is nothing to compare.
        return bool(ctx.section.enabled) and worker_positions(ctx.parts) is not None

    def sketch_due(self, ctx: FamilyContext, step: int) -> bool:
        monitored = step // ctx.config.stats.interval  # the count of monitored steps before this one
        return bool(ctx.section.direction) and monitored % ctx.section.direction_every == 0

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        positions, position = worker_positions(ctx.parts) or (1, 0)
        decls = WorkerMoments(positions, position).statistics()
        if positions > 1:
            decls.append(StatDecl(POSITION, 1, Reduce.DETAIL))
        every, interval = ctx.section.detail_every, ctx.config.stats.interval
        if every:
            decls.append(StatDecl(EXTREMES, 2 + 2 * positions, Reduce.MAX,
                                  due=lambda step: detail_due(step, interval, every)))
        size = sketch_size(ctx)
        if size:
            folded = position_sketch_size(size, positions)
            decls += [StatDecl(names.GRAD_SKETCH_LOCAL, size, Reduce.DETAIL),
                      StatDecl(DIRECTION_SUM, positions * (folded + 1), Reduce.SUM)]
        return decls

    def producers(self, ctx: FamilyContext) -> list[Producer]:
        if not ctx.section.detail_every:
            return []
        _, position = worker_positions(ctx.parts) or (1, 0)
        producer = ExtremesProducer(ctx.config.stats.interval, ctx.section.detail_every, position,
                                    runtime.global_rank())
        return [Producer("before_agreement", producer.write)]

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        positions, position = worker_positions(ctx.parts) or (1, 0)
        return [ConsistencyMonitor(ctx.section, sketch_size(ctx), ctx.config.stats.interval, positions, position)]

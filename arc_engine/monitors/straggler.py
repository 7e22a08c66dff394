"""``detectors.straggler``: per-rank performance scores, as nvidia-resiliency-ext reports them, and which rank of a
model-parallel replica is the slow one -- with collectives whose size does not grow with the number of ranks.

A synchronous step is as slow as its slowest rank, and every rank's whole step is equally long (the fast ones wait
in the gradient reduction), so the step time cannot tell which rank is slow. Each rank measures two sections
(:mod:`arc_engine.stats.timing`; host clock on CPU, CUDA events on CUDA):

* its **forward section**, the step's first forward pass (first forward pre-hook to first recorded loss): under DDP
  and ZeRO-1/2 local work before any wait on a peer; where the forward pass communicates (tensor-parallel
  all-reduces, ZeRO-3 and FSDP2 gathers) it also holds the waits for a slow peer;
* its **compute** (every ``compute_every`` monitored steps): the summed forward time of modules that make no
  collective, which no peer's slowness lengthens.

Every ``every`` monitored steps (a report) each rank takes its window medians. Scores (:func:`judge`):

* relative score = the fastest median among the ranks of its pipeline stage (they do the same work) / the rank's
  (1: the fastest), of the forward section and of the compute;
* individual score = the rank's best median so far / its median (1: as fast as it ever was; kept by the rank).

A rank is slow when a relative score falls below ``relative_threshold`` (or its individual score below
``individual_threshold``, unless every rank of its stage slowed as much) while it is at least ``min_delay_s`` slower
than that reference. It is named only once slow in ``persist_reports`` reports in a row: on a contended machine
(another job on the cores) the slowest rank changes from one report to the next, and that, or a slowdown every rank
shares, is one info event about the machine, not a straggler. Within a replica (the ranks that wait on each other
inside the forward pass, :func:`attribute`):

* some but not all of its ranks compute slowly: those are **slow model-parallel peers** (tensor-parallel or
  pipeline); their peers' long forward sections are waits and the peers are not named;
* all of its ranks compute slowly, or its forward sections are slow with no rank's compute slow (an input, host or
  network delay): a **slow replica**, its slow ranks named.

Without replicas (DDP, ZeRO, FSDP2) each rank stands alone.

**What travels, O(1) in ranks.** Nothing between reports. On a report step: the step's agreement reduces a MAX slot
of ``6 x stages`` numbers (each stage's fastest and slowest forward and compute medians, the slowest iteration median
and the highest individual score); then every rank judges *itself* against its stage's fastest, exactly, and one
follow-up MAX of ``2 x NAMED_SLOTS + 3`` numbers carries the candidates: each slow rank's badness packed with its rank
(:mod:`arc_engine.stats.rank_keys`) in slot ``rank mod NAMED_SLOTS`` (compute-slow ranks in one half, forward-only
ones in the other; a slot keeps its worst rank) and the lowest scores. Only when a slot holds a rank: a SUM of the
named ranks' details (times, scores, who they are) and the count of slow ranks; and, under model parallelism, a SUM of
the named ranks' replicas' member counts (how many compute slowly) for the attribution. Up to ``NAMED_SLOTS`` ranks
of each kind are named per report; slow ranks that shared a slot with a worse one are counted in the event
(``unnamed_slow_ranks``). Each candidate's run of slow reports is counted from these agreed candidates, so every
rank keeps the same counts. The event names each new straggler once; stragglers are also system events of the
R-Metric (its λ).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from arc_engine import runtime
from arc_engine.config.errors import require
from arc_engine.config.schema import ActionName
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext, Producer, StatDecl, StepView, periodic_due
from arc_engine.stats import AgreedStats, Reduce, StatBuffer
from arc_engine.stats.rank_keys import check_rank, rank_key, split_key


@dataclass(kw_only=True)
class StragglerConfig:
    """Straggler scores (as nvidia-resiliency-ext reports them): each rank times its own forward section (the step's
    first forward pass, from the first forward pre-hook to the first ``record_loss``) on every monitored step, and
    every ``compute_every`` monitored steps its local compute (the summed forward time of up to ``compute_modules``
    modules that make no collective, so no wait on a peer is in it) -- host clock on CPU, CUDA events on CUDA (read
    when complete, no sync). Every ``every`` monitored steps each rank scores itself against the ranks of its
    pipeline stage (their fastest median comes through a MAX reduction on that step): relative = fastest rank's
    median / the rank's median, individual = the rank's best median so far / its median (1 = as fast as it gets);
    the slow ranks and their details come through fixed-size follow-up reductions (no per-rank gather). A rank is
    slow when its relative score (forward or compute) is below ``relative_threshold`` (or its individual score below
    ``individual_threshold``, 0 = off; not when every rank slowed) and it is at least ``min_delay_s`` slower than the
    reference; after ``warmup_reports`` reports; it is named once slow in ``persist_reports`` reports in a row
    (slowness that moves between ranks, or that every rank shares, is one info event about the machine). Under model
    parallelism the slow ranks of a replica are told apart: a model-parallel peer that computes slowly (its peers
    only wait for it) or a whole slow replica. The event names the ranks; stragglers also count as system events of
    the R-Metric."""

    enabled: bool = True
    """Per-rank straggler scores from each rank's forward-section time (first forward pre-hook to first recorded loss),
    as nvidia-resiliency-ext scores them ([detectors.md](detectors.md))."""
    every: int = 20
    """Monitored steps per report: every rank scores its window medians against its stage's fastest (fixed-size
    reductions on that step only, no per-rank gather).
    Allowed: >= 3"""
    relative_threshold: float = 0.7
    """A rank whose fastest-rank-median / own-median (forward or compute, among the ranks of its pipeline stage) falls
    below this is a straggler.
    Allowed: in (0, 1)"""
    individual_threshold: float = 0.7
    """A rank whose best-median-so-far / current median falls below this, and that is ``min_delay_s`` behind its
    stage's fastest rank, is a straggler (it slowed down); 0: off.
    Allowed: in [0, 1)"""
    min_delay_s: float = 0.005
    """A straggler is also at least this many seconds slower than its reference (timer noise of fast steps never flags).
    Allowed: >= 0"""
    warmup_reports: int = 2
    """Reports before ranks can be flagged (the first steps compile and warm caches).
    Allowed: >= 0"""
    persist_reports: int = 2
    """Consecutive reports a rank must be slow in before it is named: a rank slow in one report only is the machine's
    noise (another job on the cores), told once as an info event when it moves between ranks; 1 names a rank at its
    first slow report.
    Allowed: >= 1"""
    compute_every: int = 5
    """Monitored steps between samples of each rank's local compute time (modules without a collective; tells a slow
    tensor/pipeline-parallel peer from the peers that wait for it); 0: off.
    Allowed: >= 0"""
    compute_modules: int = 64
    """At most this many leaf modules are timed on a sampled step (spread evenly over the model).
    Allowed: >= 1"""
    action: ActionName = "warn"
    """What a new straggler gets (the event names the ranks)."""

    def __post_init__(self) -> None:
        require(self.every >= 3, "every", self.every, "must be an integer >= 3 (monitored steps per report)")
        require(0 < self.relative_threshold < 1, "relative_threshold", self.relative_threshold, "must be in (0, 1)")
        require(0 <= self.individual_threshold < 1, "individual_threshold", self.individual_threshold,
                "must be in [0, 1) (0 = off)")
        require(self.min_delay_s >= 0, "min_delay_s", self.min_delay_s, "must be >= 0 seconds")
        require(self.warmup_reports >= 0, "warmup_reports", self.warmup_reports, "must be an integer >= 0")
        require(self.persist_reports >= 1, "persist_reports", self.persist_reports,
                "must be an integer >= 1 (consecutive slow reports before a rank is named)")
        require(self.compute_every >= 0, "compute_every", self.compute_every,
                "must be an integer >= 0 (monitored steps between compute samples; 0 = off)")
        require(self.compute_modules >= 1, "compute_modules", self.compute_modules, "must be an integer >= 1")



#: [11] this rank's own (never reduced nor gathered), written on report steps: its median forward seconds over the
#: report's window, its median iteration seconds, its number of forward times in the window, its median compute
#: seconds, its number of compute samples, its replica (-1: not known), its tensor-parallel rank, its pipeline stage,
#: its best forward and compute medians of the earlier reports (inf: none yet) and its global rank.
SECTION_TIMES = "straggler_times"
(FORWARD, ITERATION, FORWARD_COUNT, COMPUTE, COMPUTE_COUNT, REPLICA, TENSOR_RANK, STAGE, BEST_FORWARD, BEST_COMPUTE,
 GLOBAL_RANK) = range(11)
#: [stages x 6] MAX, reduced on report steps only: per pipeline stage -fastest and slowest forward median, -fastest
#: and slowest compute median, slowest iteration median, and the highest individual score (the rank that slowed
#: least against its own best) (-inf: no rank of the stage has one).
STAGE_TIMES = "straggler_stage_times"
STAGE_COLUMNS = 6
#: calm reports (no rank slow) after which a contended machine's info event can be told again
CALM_REPORTS = 5
#: candidate slots per kind (compute-slow, forward-only slow) of the follow-up reduction: a report names at most this
#: many ranks of each kind; a slow rank shares slot ``rank mod NAMED_SLOTS`` with others and the worst one is named
NAMED_SLOTS = 64
#: per named rank in the details reduction: forward, compute, replica, tensor-parallel rank, stage, relative score,
#: compute score, individual score, computes slowly (0/1)
_DETAILS = 9

#: what :func:`attribute` calls a replica's slow ranks
RANK, PEER, REPLICA_SLOW = "rank", "model-parallel peer", "replica"


def performance_scores(times: np.ndarray, best: np.ndarray, stages: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(relative, individual) scores per rank, for tools that hold every rank's times (a simulation, a report): the
    fastest time among the ranks of the same ``stages`` entry (all ranks when None) over each rank's, and each rank's
    ``best`` time over its current one. NaN where a time is missing (NaN or not positive). Pure."""
    valid = np.isfinite(times) & (times > 0)
    relative = np.full(times.shape, math.nan)
    individual = np.full(times.shape, math.nan)
    stages = np.zeros(times.shape, dtype=np.int64) if stages is None else stages
    for stage in np.unique(stages[valid]):
        members = valid & (stages == stage)
        relative[members] = times[members].min() / times[members]
    known = valid & np.isfinite(best)
    individual[known] = np.minimum(best[known], times[known]) / times[known]
    return relative, individual


def _ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator for two positive finite times, else NaN."""
    if math.isfinite(numerator) and math.isfinite(denominator) and numerator > 0 and denominator > 0:
        return numerator / denominator
    return math.nan


@dataclass(frozen=True)
class Verdict:
    """One rank's report as it judges itself (:func:`judge`), or as the details reduction brings it to every rank."""

    rank: int
    replica: int
    tensor_rank: int
    stage: int
    forward: float
    compute: float
    relative: float
    relative_compute: float
    individual: float
    forward_slow: bool = False
    compute_slow: bool = False

    @property
    def slow(self) -> bool:
        return self.forward_slow or self.compute_slow

    @property
    def compute_known(self) -> bool:
        return math.isfinite(self.relative_compute)

    def badness(self) -> float:
        """How many times slower than its reference (>= 1): the slow section's, or the individual one's."""
        scores = (self.relative_compute if self.compute_slow else self.relative, self.individual)
        inverse = [1.0 / s for s in scores if math.isfinite(s) and s > 0]
        return max(inverse, default=1.0)

    def details(self) -> list[float]:
        return [self.forward, self.compute, float(self.replica), float(self.tensor_rank), float(self.stage),
                self.relative, self.relative_compute, self.individual, float(self.compute_slow)]

    @classmethod
    def from_details(cls, rank: int, values: np.ndarray, forward_slow: bool) -> Verdict:
        """The verdict :meth:`details` described (``forward_slow``: the candidate's half says it)."""
        forward, compute, replica, tensor_rank, stage, relative, relative_compute, individual, computing = values
        return cls(rank, int(replica), int(tensor_rank), int(stage), float(forward), float(compute), float(relative),
                   float(relative_compute), float(individual), forward_slow, bool(computing))


def individual_score(forward: float, compute: float, best_forward: float, best_compute: float
                     ) -> tuple[float, float, float]:
    """(individual score, current time, best time) of one rank: of its compute where it is measured (a coupled
    forward pass slows every rank waiting for a slow one), else of its forward section; the score is NaN without an
    earlier best. Pure."""
    own_time, own_best = (compute, best_compute) if math.isfinite(compute) and compute > 0 else \
        (forward, best_forward)
    individual = _ratio(min(own_best, own_time), own_time) if math.isfinite(own_best) else math.nan
    return individual, own_time, own_best


def judge(row: np.ndarray, stage_rows: np.ndarray, config: StragglerConfig, warm: bool) -> Verdict:
    """One rank's verdict on itself from its own report ``row`` (:data:`SECTION_TIMES`) and the agreed per-stage times
    ``stage_rows`` (:data:`STAGE_TIMES`, ``[stages, 6]``); nobody is slow before ``warm``. An individual slowdown
    that every rank of the stage shares (the stage's highest individual score below the threshold) is the machine's
    or the job's, not a rank's: it flags nobody; nor does it flag a rank that is not ``min_delay_s`` behind its
    stage's fastest now (a rank as fast as its peers does not hold the job back, and a job whose work per step grew,
    such as a batch-size ramp, slows every rank against a best its ranks took at different noise levels). Pure."""
    stage = int(row[STAGE])
    fastest, _, fastest_compute, _, _, stage_individual = stage_rows[min(max(stage, 0), len(stage_rows) - 1)]
    fastest, fastest_compute = -fastest, -fastest_compute
    forward, compute = float(row[FORWARD]), float(row[COMPUTE])
    relative, relative_compute = _ratio(fastest, forward), _ratio(fastest_compute, compute)
    compute_known = math.isfinite(relative_compute)
    individual, own_time, own_best = individual_score(forward, compute, float(row[BEST_FORWARD]),
                                                      float(row[BEST_COMPUTE]))
    delay = config.min_delay_s
    forward_slow = math.isfinite(relative) and relative < config.relative_threshold and forward - fastest >= delay
    compute_slow = compute_known and relative_compute < config.relative_threshold and \
        compute - fastest_compute >= delay
    shared = math.isfinite(stage_individual) and stage_individual < config.individual_threshold
    if config.individual_threshold and not shared and math.isfinite(individual) and \
            individual < config.individual_threshold and own_time - own_best >= delay:
        # and behind its stage's fastest now: a slowdown its fastest peer shares is the job's (a batch-size ramp)
        compute_slow |= compute_known and compute - fastest_compute >= delay
        forward_slow |= not compute_known and forward - fastest >= delay
    if not warm:
        forward_slow = compute_slow = False
    return Verdict(int(row[GLOBAL_RANK]), int(row[REPLICA]), int(row[TENSOR_RANK]), stage, forward, compute, relative,
                   relative_compute, individual, forward_slow, compute_slow)


def candidate_keys(verdict: Verdict) -> np.ndarray:
    """This rank's part of the candidates reduction (MAX, ``2 x NAMED_SLOTS + 3``): its rank key in its slot when
    it is slow, and its negated scores (the lowest score of the job comes back). Pure."""
    out = np.full(2 * NAMED_SLOTS + 3, -math.inf)
    if verdict.slow:
        slot = verdict.rank % NAMED_SLOTS + (0 if verdict.compute_slow else NAMED_SLOTS)
        out[slot] = rank_key(verdict.badness(), verdict.rank)
    for index, score in enumerate((verdict.relative, verdict.relative_compute, verdict.individual)):
        if math.isfinite(score):
            out[2 * NAMED_SLOTS + index] = -score
    return out


def attribute(named: list[Verdict], members: dict[int, tuple[int, int, int]]
              ) -> list[tuple[str, list[Verdict], list[int], int]]:
    """Who is slow, per replica with a named rank: ``(kind, named, waiting peers named, other waiting peers)``, in
    rank order. ``members[replica]`` = (its ranks, those computing slowly, those whose compute is timed). The ranks
    of a replica wait on each other inside the forward pass: when some but not all of them compute slowly, those are
    slow model-parallel peers (``PEER``) and the replica's other ranks wait for them (the slow-forward ones among
    the candidates are listed, the rest counted); when all do, or none does while forward sections are slow, the
    replica is slow (``REPLICA_SLOW``, its named ranks). A rank without a replica (-1) or alone in its replica
    stands alone (``RANK``). Pure."""
    result: list[tuple[str, list[Verdict], list[int], int]] = []
    by_replica: dict[int, list[Verdict]] = {}
    for verdict in sorted(named, key=lambda v: v.rank):
        size = members.get(verdict.replica, (1, 0, 0))[0]
        if verdict.replica < 0 or size <= 1:
            result.append((RANK, [verdict], [], 0))
        else:
            by_replica.setdefault(verdict.replica, []).append(verdict)
    for replica, verdicts in by_replica.items():
        size, computing, _ = members[replica]
        if 0 < computing < size:
            culprits = [v for v in verdicts if v.compute_slow]
            waiting = [v.rank for v in verdicts if not v.compute_slow]
            if culprits:
                result.append((PEER, culprits, waiting, size - computing - len(waiting)))
        else:
            result.append((REPLICA_SLOW, verdicts, [], 0))
    return sorted(result, key=lambda item: item[1][0].rank)


def report_due(step: int, interval: int, every: int) -> bool:
    """Whether optimizer step ``step`` (a monitored one) closes a report window: every ``every`` monitored steps,
    not the first."""
    return periodic_due(step, interval, every)


def _median(values: deque[float]) -> float:
    return float(np.median(values)) if values else math.nan


class StragglerProducer:
    """Keeps this rank's forward, iteration and compute times of the window and its best medians (host floats);
    on report steps writes its report (:data:`SECTION_TIMES`, with who it is: ``identity`` = replica,
    tensor-parallel rank, pipeline stage; and ``rank``) and its stage's row of :data:`STAGE_TIMES`."""

    def __init__(self, every: int, interval: int, identity: tuple[int, int, int] = (-1, 0, 0), rank: int = 0,
                 stages: int = 1) -> None:
        check_rank(rank)
        self.every, self.interval = every, interval
        self.identity, self.rank, self.stages = identity, rank, stages
        self.forward: deque[float] = deque(maxlen=every)
        self.iteration: deque[float] = deque(maxlen=every)
        self.compute: deque[float] = deque(maxlen=every)
        self.best_forward = self.best_compute = math.inf
        self._last_step = -1
        self._report: tuple[float, ...] | None = None  # this step's report, on a report step

    def write(self, buffer: StatBuffer, view: StepView) -> None:
        if view.step != self._last_step:  # once per step (a recomputed step agrees twice: same report)
            self._last_step = view.step
            forward, iteration = view.times
            if math.isfinite(forward):
                self.forward.append(forward)
            if math.isfinite(iteration):
                self.iteration.append(iteration)
            self.compute.extend(value for value in view.compute if math.isfinite(value))
            self._report = None
            if report_due(view.step, self.interval, self.every):
                forward, compute = _median(self.forward), _median(self.compute)
                self._report = (forward, _median(self.iteration), float(len(self.forward)), compute,
                                float(len(self.compute)), *map(float, self.identity), self.best_forward,
                                self.best_compute, float(self.rank))
                if forward > 0:
                    self.best_forward = min(self.best_forward, forward)
                if compute > 0:
                    self.best_compute = min(self.best_compute, compute)
                self.forward.clear()
                self.iteration.clear()
                self.compute.clear()
        if self._report is not None:
            report = self._report
            slot = buffer.view(SECTION_TIMES)  # fills (kernels on CUDA), no host-to-device copy
            for index, value in enumerate(report):
                slot[index].fill_(value)
            row = min(max(int(report[STAGE]), 0), self.stages - 1) * STAGE_COLUMNS
            stage = buffer.view(STAGE_TIMES)
            individual, _, _ = individual_score(report[FORWARD], report[COMPUTE], report[BEST_FORWARD],
                                                report[BEST_COMPUTE])
            for index, value in enumerate((-report[FORWARD], report[FORWARD], -report[COMPUTE], report[COMPUTE],
                                           report[ITERATION], individual)):
                if math.isfinite(value):
                    stage[row + index].fill_(value)

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "best_forward": self.best_forward, "best_compute": self.best_compute}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The bests of this rank's own state; another rank's (a checkpoint's shared copy) are not this rank's."""
        if int(state.get("rank", -1)) == self.rank:
            self.best_forward, self.best_compute = float(state["best_forward"]), float(state["best_compute"])


class StragglerMonitor(Monitor):
    """Judges every rank on report steps, each rank itself, and tells which ranks are slow (see the module
    docstring); names the ranks that stay slow for ``persist_reports`` reports, and tells once (an info event) when
    the slowness is the machine's: it moves between ranks, or every rank of a stage slowed against its own best."""

    name = "straggler"

    def __init__(self, config: StragglerConfig, interval: int, producer: StragglerProducer | None = None) -> None:
        self.config = config
        self.interval = interval
        self.producer = producer  # this rank's (its best medians travel with the monitor's state)
        self.reports = 0
        self.stragglers: frozenset[int] = frozenset()  # global ranks named at the last report
        self.events = 0
        # agreed: each slow rank's consecutive slow reports; the ranks whose run ended short of persist_reports
        # since the machine was last calm, whether that was told, and the calm reports since
        self.streaks: dict[int, int] = {}
        self.passing: frozenset[int] = frozenset()
        self.contention_told = False
        self.calm = 0
        self._pending: _Report | None = None
        self._values: dict[str, float] = {}

    def required_stats(self) -> tuple[str, ...]:
        return (SECTION_TIMES, STAGE_TIMES)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        self._pending = None
        if not report_due(step, self.interval, self.config.every):
            return []
        stage_rows = stats.total(STAGE_TIMES).reshape(-1, STAGE_COLUMNS)
        if not np.isfinite(stage_rows[:, [0, 2]]).any():
            return []  # no rank timed anything in this window
        config, warm = self.config, self.reports >= self.config.warmup_reports

        def verdict_of(row: np.ndarray) -> Verdict:
            return judge(row[stats.layout[SECTION_TIMES].span], stage_rows, config, warm)

        # one MAX of fixed size: every rank's key in its slot when it is slow, and the lowest scores
        candidates = stats.follow_up(lambda row: candidate_keys(verdict_of(row)), Reduce.MAX)
        lowest = -candidates[2 * NAMED_SLOTS:]
        winners = [(slot, split_key(key)[1]) for slot, key in enumerate(candidates[:2 * NAMED_SLOTS])
                   if math.isfinite(key)]
        named_verdicts, unnamed = self._named(stats, verdict_of, winners)
        verdicts = attribute(*named_verdicts) if named_verdicts[0] else []
        # a slow rank is named once slow in persist_reports reports in a row; before that it is passing
        streaks = {v.rank: self.streaks.get(v.rank, 0) + 1 for _, slow, _, _ in verdicts for v in slow}
        lasting = [(kind, kept, waiting, others) for kind, slow, waiting, others in verdicts
                   if (kept := [v for v in slow if streaks[v.rank] >= config.persist_reports])]
        named = frozenset(v.rank for _, slow, _, _ in lasting for v in slow)
        passing = frozenset(rank for rank in streaks if rank not in named)
        individual = stage_rows[:, 5]
        shared = warm and config.individual_threshold > 0 and bool(np.isfinite(individual).any()) and \
            bool((individual[np.isfinite(individual)] < config.individual_threshold).all())
        with np.errstate(invalid="ignore"):
            self._values = {"forward_fastest_s": _extreme(-stage_rows[:, 0], min),
                            "forward_slowest_s": _extreme(stage_rows[:, 1], max),
                            "compute_fastest_s": _extreme(-stage_rows[:, 2], min),
                            "compute_slowest_s": _extreme(stage_rows[:, 3], max),
                            "relative_score_min": _finite(lowest[0]), "compute_score_min": _finite(lowest[1]),
                            "individual_score_min": _finite(lowest[2]),
                            "individual_score_max": _extreme(individual, max),
                            "iteration_slowest_s": _extreme(stage_rows[:, 4], max),
                            "stragglers": float(len(named)), "passing_slow_ranks": float(len(passing))}
        findings = []
        new = named - self.stragglers
        if new:
            findings.append(self._stragglers(lasting, named, new, unnamed))
        # ranks whose run of slow reports ended short of persist_reports: the machine's, not theirs
        ended = frozenset(rank for rank, count in self.streaks.items()
                          if rank not in streaks and count < config.persist_reports)
        seen = (frozenset() if self.calm >= CALM_REPORTS else self.passing) | ended
        told = self.contention_told and self.calm < CALM_REPORTS
        if not told and (len(seen) >= 2 or shared):
            told = True
            findings.append(self._contention(seen, shared))
        self._pending = _Report(named, streaks, seen, told, bool(streaks) or shared)
        return findings

    def _stragglers(self, lasting: list[tuple[str, list[Verdict], list[int], int]], named: frozenset[int],
                    new: frozenset[int], unnamed: int) -> Finding:
        config = self.config
        parts = [self._describe(kind, slow, waiting, others) for kind, slow, waiting, others in lasting]
        shown = parts[:8]
        more = f"; and {len(parts) - 8} more" if len(parts) > 8 else ""
        if unnamed:
            more += f"; {unnamed} more slow rank(s) not named (they share a slot with a slower rank)"
        slow_verdicts = [v for _, slow, _, _ in lasting for v in slow]
        values = {**self._values, "ranks": sorted(named), "unnamed_slow_ranks": unnamed,
                  "kinds": {v.rank: kind for kind, slow, _, _ in lasting for v in slow},
                  "forward_s": {v.rank: v.forward for v in slow_verdicts},
                  "compute_s": {v.rank: v.compute for v in slow_verdicts},
                  "relative_score": {v.rank: v.relative for v in slow_verdicts}}
        persisted = f"{config.persist_reports} reports in a row of {config.every} monitored steps" \
            if config.persist_reports > 1 else f"medians over {config.every} monitored steps"
        return Finding(self.name, Action.parse(config.action), Severity.WARNING,
                       f"stragglers: {'; '.join(shown)}{more} ({persisted})", ranks=tuple(sorted(new)), values=values,
                       hardware="straggler")

    def _contention(self, seen: frozenset[int], shared: bool) -> Finding:
        """The info event of a contended machine: slowness that no rank keeps, or that every rank shares."""
        config = self.config
        if shared:
            what = (f"every rank is slower than its own best (the highest individual score "
                    f"{self._values['individual_score_max']:.2f} < {config.individual_threshold}): the machine or "
                    f"the job slowed, not a rank")
        else:
            what = (f"ranks {', '.join(map(str, sorted(seen)))} were each slow and recovered within "
                    f"{config.persist_reports - 1} report(s), none for {config.persist_reports} in a row: the machine "
                    f"is contended (another job on the cores, a noisy neighbour), not a rank")
        return Finding(self.name, Action.NONE, Severity.INFO,
                       f"{what}; no straggler is named for it (told once until {CALM_REPORTS} calm reports)",
                       values={**self._values, "passing_ranks": sorted(seen), "every_rank_slower": shared})

    @staticmethod
    def _named(stats: AgreedStats, verdict_of: Callable[[np.ndarray], Verdict], winners: list[tuple[int, int]]
               ) -> tuple[tuple[list[Verdict], dict[int, tuple[int, int, int]]], int]:
        """The candidates' verdicts and their replicas' member counts (``attribute``'s arguments), and the number of
        slow ranks left unnamed: one SUM of the candidates' details, and one of their replicas' counts when any has
        a replica (collectives every rank reaches alike: ``winners`` is agreed)."""
        if not winners:
            return ([], {}), 0
        ranks = [rank for _, rank in winners]

        def details(row: np.ndarray) -> np.ndarray:
            verdict = verdict_of(row)
            out = np.zeros(len(ranks) * _DETAILS + 1)
            if verdict.rank in ranks:
                index = ranks.index(verdict.rank)
                out[index * _DETAILS:(index + 1) * _DETAILS] = verdict.details()
            out[-1] = float(verdict.slow)
            return out

        summed = stats.follow_up(details, Reduce.SUM)
        # a candidate is slow: in the compute half computing slowly, in the other its forward section only
        named = [Verdict.from_details(rank, summed[i * _DETAILS:(i + 1) * _DETAILS], slot >= NAMED_SLOTS)
                 for i, (slot, rank) in enumerate(winners)]
        unnamed = round(summed[-1]) - len(named)
        replicas = sorted({v.replica for v in named if v.replica >= 0})
        if not replicas:
            return (named, {}), unnamed

        def counts(row: np.ndarray) -> np.ndarray:
            verdict = verdict_of(row)
            out = np.zeros(3 * len(replicas))
            if verdict.replica in replicas:
                index = 3 * replicas.index(verdict.replica)
                out[index:index + 3] = (1.0, float(verdict.compute_slow), float(verdict.compute_known))
            return out

        totals = stats.follow_up(counts, Reduce.SUM).reshape(-1, 3)
        members = {replica: (round(row[0]), round(row[1]), round(row[2])) for replica, row in zip(replicas, totals,
                                                                                                  strict=True)}
        return (named, members), unnamed

    @staticmethod
    def _describe(kind: str, slow: list[Verdict], waiting: list[int], others: int) -> str:
        def times(v: Verdict) -> str:
            timed = [f"{what} {seconds:.4g} s" for what, seconds in (("forward", v.forward), ("compute", v.compute))
                     if math.isfinite(seconds)]
            return ", ".join(timed) or "not timed"

        if kind == RANK:
            (v,) = slow
            return f"rank {v.rank} {times(v)} (relative score {v.relative:.2f}, compute score " \
                   f"{v.relative_compute:.2f}, individual {v.individual:.2f})"
        replica = slow[0].replica
        if kind == PEER:
            described = ", ".join(f"rank {v.rank} (tensor-parallel rank {v.tensor_rank}, pipeline stage {v.stage}: "
                                  f"{times(v)}, compute score {v.relative_compute:.2f})" for v in slow)
            if waiting:  # the waiting peers that were candidates (their forward sections slow) by rank
                peers = "its peers " + ", ".join(str(rank) for rank in waiting) + \
                    (f" and {others} more" if others else "") + " only wait for it"
            else:
                peers = "its other rank only waits for it" if others == 1 else \
                    f"its {others} other ranks only wait for it"
            return f"slow model-parallel peer in replica {replica}: {described}; {peers}"
        members = ", ".join(f"rank {v.rank} {times(v)}" for v in slow)
        if not all(v.compute_known for v in slow):
            where = "compute not timed, so which of its ranks is slow cannot be told"
        elif all(v.compute_slow for v in slow):
            where = "every rank computes slowly"
        else:
            where = "no rank's compute is slow: an input, host or network delay"
        return f"slow replica {replica} ({where}): {members}"

    def commit(self, step: int, applied: bool) -> None:
        report = self._pending
        if report is None:
            return
        self.events += len(report.named - self.stragglers)
        self.stragglers = report.named
        self.streaks = report.streaks
        self.passing, self.contention_told = report.passing, report.told
        self.calm = 0 if report.slow else self.calm + 1
        self.reports += 1
        self._pending = None

    def metrics(self) -> dict[str, float]:
        return {**self._values, "events": float(self.events)}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"reports": self.reports, "stragglers": sorted(self.stragglers), "events": self.events,
                                 "streaks": [[rank, count] for rank, count in sorted(self.streaks.items())],
                                 "passing": sorted(self.passing), "contention_told": self.contention_told,
                                 "calm": self.calm}
        if self.producer is not None:
            state["own"] = self.producer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reports = int(state["reports"])
        self.stragglers = frozenset(int(r) for r in state["stragglers"])
        self.events = int(state["events"])
        # a checkpoint written before persist_reports existed holds no streaks: its stragglers count as lasting
        self.streaks = {int(rank): int(count) for rank, count in state.get(
            "streaks", [[rank, self.config.persist_reports] for rank in self.stragglers])}
        self.passing = frozenset(int(r) for r in state.get("passing", ()))
        self.contention_told = bool(state.get("contention_told", False))
        self.calm = int(state.get("calm", 0))
        if self.producer is not None and "own" in state:
            self.producer.load_state_dict(state["own"])


@dataclass(frozen=True)
class _Report:
    """A report's agreed outcome, committed with its step: the ranks named, each slow rank's streak, the ranks slow
    for a shorter run since the machine was last calm, whether the contention was told, and whether any rank was
    slow."""

    named: frozenset[int]
    streaks: dict[int, int]
    passing: frozenset[int]
    told: bool
    slow: bool


def _finite(value: float) -> float:
    return float(value) if math.isfinite(value) else math.nan


def _extreme(values: np.ndarray, pick: Callable[..., float]) -> float:
    finite = values[np.isfinite(values)]
    return float(pick(finite)) if finite.size else math.nan


class StragglerFamily(FamilyBase):
    """``detectors.straggler``: the ranks' window medians, judged every ``every`` monitored steps (fixed-size
    reductions on report steps only)."""

    name = "straggler"
    config_class = StragglerConfig

    @staticmethod
    def _stages(ctx: FamilyContext) -> int:
        return max(1, ctx.parts.pipeline_stages) if ctx.parts is not None else 1

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        every, interval = ctx.section.every, ctx.config.stats.interval
        return [StatDecl(SECTION_TIMES, 11, Reduce.DETAIL),
                StatDecl(STAGE_TIMES, STAGE_COLUMNS * self._stages(ctx), Reduce.MAX,
                         due=lambda step: report_due(step, interval, every))]

    def __init__(self) -> None:
        self._shared: tuple[FamilyContext, StragglerProducer] | None = None  # the monitor reads its producer's bests

    def _producer(self, ctx: FamilyContext) -> StragglerProducer:
        if self._shared is None or self._shared[0] is not ctx:
            parts = ctx.parts
            identity = (parts.replica, parts.tensor_rank, parts.pipeline_stage) if parts is not None else (-1, 0, 0)
            self._shared = (ctx, StragglerProducer(ctx.section.every, ctx.config.stats.interval, identity,
                                                   runtime.global_rank(), self._stages(ctx)))
        return self._shared[1]

    def producers(self, ctx: FamilyContext) -> list[Producer]:
        return [Producer("before_agreement", self._producer(ctx).write)]

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [StragglerMonitor(ctx.section, ctx.config.stats.interval, self._producer(ctx))]

"""``detectors.straggler``: per-rank performance scores, as nvidia-resiliency-ext reports them, and which rank of a
model-parallel replica is the slow one.

A synchronous step is as slow as its slowest rank, and every rank's whole step is equally long (the fast ones wait
in the gradient reduction), so the step time cannot tell which rank is slow. Each rank measures two sections
(:mod:`arc_engine.stats.timing`; host clock on CPU, CUDA events on CUDA):

* its **forward section**, the step's first forward pass (first forward pre-hook to first recorded loss): under DDP
  and ZeRO-1/2 local work before any wait on a peer; where the forward pass communicates (tensor-parallel
  all-reduces, ZeRO-3 and FSDP2 gathers) it also holds the waits for a slow peer;
* its **compute** (every ``compute_every`` monitored steps): the summed forward time of modules that make no
  collective, which no peer's slowness lengthens.

Every ``every`` monitored steps each rank puts its window medians, and who it is (replica, tensor-parallel rank,
pipeline stage), into its per-rank slot and the ranks' values are fetched (the family's one periodic per-rank
collective: between reports nothing travels). Every rank then scores every rank against the ranks of its pipeline
stage (they do the same work; :func:`performance_scores`):

* relative score = the fastest rank's median / the rank's median (1: the fastest), of the forward section and of
  the compute;
* individual score = the rank's best forward median so far / its median (1: as fast as it ever was).

A rank is slow when a relative score falls below ``relative_threshold`` (or its individual score below
``individual_threshold``) while it is at least ``min_delay_s`` slower than that reference. Within a replica (the
ranks that wait on each other inside the forward pass, :func:`attribute`):

* some but not all of its ranks compute slowly: those are **slow model-parallel peers** (tensor-parallel or
  pipeline); their peers' long forward sections are waits and the peers are not named;
* all of its ranks compute slowly, or its forward sections are slow with no rank's compute slow (an input, host or
  network delay): a **slow replica**, every slow rank named.

Without replicas (DDP, ZeRO, FSDP2) each rank stands alone. The event names each new straggler once; stragglers are
also system events of the R-Metric (its λ).
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

#: [8] DETAIL, written on report steps only: this rank's median forward seconds over the report's window, its median
#: iteration seconds, its number of forward times in the window, its median compute seconds, its number of compute
#: samples, its replica (-1: not known), its tensor-parallel rank and its pipeline stage.
SECTION_TIMES = "straggler_times"
FORWARD, ITERATION, FORWARD_COUNT, COMPUTE, COMPUTE_COUNT, REPLICA, TENSOR_RANK, STAGE = range(8)

#: what :func:`attribute` calls a replica's slow ranks
RANK, PEER, REPLICA_SLOW = "rank", "model-parallel peer", "replica"


def performance_scores(times: np.ndarray, best: np.ndarray, stages: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(relative, individual) scores per rank: the fastest time among the ranks of the same ``stages`` entry (all
    ranks when None) over each rank's, and each rank's ``best`` time over its current one. NaN where a time is
    missing (NaN or not positive). Pure."""
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


def fastest_of_stage(times: np.ndarray, stages: np.ndarray) -> np.ndarray:
    """Per rank, the fastest valid time among the ranks of its stage (NaN where none). Pure."""
    valid = np.isfinite(times) & (times > 0)
    fastest = np.full(times.shape, math.nan)
    for stage in np.unique(stages[valid]):
        fastest[stages == stage] = times[valid & (stages == stage)].min()
    return fastest


def attribute(forward_slow: np.ndarray, compute_slow: np.ndarray, compute_known: np.ndarray,
              replicas: np.ndarray) -> list[tuple[str, list[int], list[int]]]:
    """Who is slow, per replica with a slow rank: ``(kind, named rows, waiting rows)``, rows in order. The ranks of
    a replica (same ``replicas`` value >= 0) wait on each other inside the forward pass: when some but not all of
    them compute slowly, those are slow model-parallel peers (``PEER``) and the replica's other ranks wait for them;
    when all do, or none does while forward sections are slow, the replica is slow (``REPLICA_SLOW``, every slow rank
    named; when ``compute_known`` is False for its ranks, which rank is slow inside it cannot be told). A rank
    without a replica (-1) or alone in its replica stands alone (``RANK``). Pure."""
    result: list[tuple[str, list[int], list[int]]] = []
    slow = forward_slow | compute_slow
    # one grouping of the rows by replica (a report over thousands of ranks stays linear in them)
    values, inverse, counts = np.unique(replicas, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")
    groups = np.split(order, np.cumsum(counts)[:-1])
    alone = [row for row in np.flatnonzero(slow) if replicas[row] < 0 or counts[inverse[row]] == 1]
    result.extend((RANK, [int(row)], []) for row in alone)
    for index in sorted({int(inverse[row]) for row in np.flatnonzero(slow)}):
        members = groups[index]
        if values[index] < 0 or len(members) == 1:
            continue
        computing = [int(row) for row in members if compute_slow[row]]
        if computing and len(computing) < len(members):
            result.append((PEER, computing, [int(row) for row in members if not compute_slow[row]]))
        else:
            result.append((REPLICA_SLOW, [int(row) for row in members if slow[row]], []))
    return sorted(result, key=lambda item: item[1][0])


def report_due(step: int, interval: int, every: int) -> bool:
    """Whether optimizer step ``step`` (a monitored one) closes a report window: every ``every`` monitored steps,
    not the first."""
    monitored = step // interval
    return monitored > 0 and monitored % every == 0


def _median(values: deque[float]) -> float:
    return float(np.median(values)) if values else math.nan


class StragglerProducer:
    """Keeps this rank's forward, iteration and compute times of the window (host floats) and writes their medians,
    and who this rank is (``identity``: replica, tensor-parallel rank, pipeline stage), on report steps."""

    def __init__(self, every: int, interval: int, identity: tuple[int, int, int] = (-1, 0, 0)) -> None:
        self.every, self.interval = every, interval
        self.identity = identity
        self.forward: deque[float] = deque(maxlen=every)
        self.iteration: deque[float] = deque(maxlen=every)
        self.compute: deque[float] = deque(maxlen=every)
        self._last_step = -1
        self._report: tuple[float, ...] | None = None  # this step's medians, on a report step

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
                self._report = (_median(self.forward), _median(self.iteration), float(len(self.forward)),
                                _median(self.compute), float(len(self.compute)), *map(float, self.identity))
                self.forward.clear()
                self.iteration.clear()
                self.compute.clear()
        if self._report is not None:
            slot = buffer.view(SECTION_TIMES)  # fills (kernels on CUDA), no host-to-device copy
            for index, value in enumerate(self._report):
                slot[index].fill_(value)


class StragglerMonitor:
    """Scores every rank on report steps and tells which ranks are slow (see the module docstring); names the
    ranks that become stragglers."""

    name = "straggler"

    def __init__(self, config: StragglerConfig, interval: int) -> None:
        self.config = config
        self.interval = interval
        #: per row of the decision group: the best forward median so far, and the best compute median
        self.best: np.ndarray | None = None
        self.best_compute: np.ndarray | None = None
        self.reports = 0
        self.stragglers: frozenset[int] = frozenset()  # global ranks flagged at the last report
        self.events = 0
        self._pending: tuple[np.ndarray, np.ndarray, frozenset[int]] | None = None
        self._values: dict[str, float] = {}

    def required_stats(self) -> tuple[str, ...]:
        return (SECTION_TIMES,)

    def _best(self, stored: np.ndarray | None, rows: int) -> np.ndarray:
        return stored if stored is not None and len(stored) == rows else np.full(rows, math.inf)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        self._pending = None
        if not report_due(step, self.interval, self.config.every):
            return []
        rows = stats.per_rank(SECTION_TIMES)  # collective, on a report step every rank shares
        forward, iteration, compute = rows[:, FORWARD], rows[:, ITERATION], rows[:, COMPUTE]
        stages, replicas = rows[:, STAGE].astype(np.int64), rows[:, REPLICA].astype(np.int64)
        best, best_compute = self._best(self.best, len(forward)), self._best(self.best_compute, len(forward))
        relative, individual = performance_scores(forward, best, stages)
        relative_compute, individual_compute = performance_scores(compute, best_compute, stages)
        # the individual score of a rank's compute where it is measured (a coupled forward pass slows every rank
        # waiting for a slow one), else of its forward section
        compute_known = np.isfinite(relative_compute)
        own = np.where(compute_known, individual_compute, individual)
        own_best, own_time = np.where(compute_known, best_compute, best), np.where(compute_known, compute, forward)
        valid = np.isfinite(relative) | compute_known
        if not valid.any():
            return []
        config = self.config
        fastest, fastest_compute = fastest_of_stage(forward, stages), fastest_of_stage(compute, stages)
        with np.errstate(invalid="ignore"):
            forward_slow = np.isfinite(relative) & (relative < config.relative_threshold) & \
                (forward - fastest >= config.min_delay_s)
            compute_slow = compute_known & (relative_compute < config.relative_threshold) & \
                (compute - fastest_compute >= config.min_delay_s)
            if config.individual_threshold:
                slowed = np.isfinite(own) & (own < config.individual_threshold) & \
                    (own_time - own_best >= config.min_delay_s)
                compute_slow |= slowed & compute_known
                forward_slow |= slowed & ~compute_known
        if self.reports < config.warmup_reports:
            forward_slow[:] = compute_slow[:] = False
        verdicts = attribute(forward_slow, compute_slow, compute_known, replicas)
        named = frozenset(int(stats.ranks[row]) for _, slow, _ in verdicts for row in slow)
        improved, improved_compute = best.copy(), best_compute.copy()
        known = np.isfinite(relative)
        improved[known] = np.minimum(best[known], forward[known])
        improved_compute[compute_known] = np.minimum(best_compute[compute_known], compute[compute_known])
        self._pending = (improved, improved_compute, named)
        finite = np.isfinite(forward)
        self._values = {"forward_fastest_s": float(forward[finite].min()) if finite.any() else math.nan,
                        "forward_slowest_s": float(forward[finite].max()) if finite.any() else math.nan,
                        "compute_fastest_s": float(compute[compute_known].min()) if compute_known.any()
                        else math.nan,
                        "compute_slowest_s": float(compute[compute_known].max()) if compute_known.any()
                        else math.nan,
                        "relative_score_min": float(np.nanmin(relative)) if known.any() else math.nan,
                        "compute_score_min": float(np.nanmin(relative_compute)) if compute_known.any() else math.nan,
                        "individual_score_min": float(np.nanmin(own)) if np.isfinite(own).any() else math.nan,
                        "iteration_median_s": float(np.nanmedian(iteration)) if np.isfinite(iteration).any()
                        else math.nan,
                        "stragglers": float(len(named))}
        new = named - self.stragglers
        if not new:
            return []
        parts, kinds = [], {}
        for kind, slow, waiting in verdicts:
            for row in slow:
                kinds[int(stats.ranks[row])] = kind
            parts.append(self._describe(kind, slow, waiting, rows, relative, relative_compute, compute_slow, own,
                                        stats.ranks))
        shown = parts[:8]
        more = f"; and {len(parts) - 8} more" if len(parts) > 8 else ""
        slow_rows = [row for _, slow, _ in verdicts for row in slow]
        values = {**self._values, "ranks": sorted(named), "kinds": {rank: kinds[rank] for rank in sorted(kinds)[:64]},
                  "forward_s": {int(stats.ranks[row]): float(forward[row]) for row in slow_rows[:64]},
                  "compute_s": {int(stats.ranks[row]): float(compute[row]) for row in slow_rows[:64]},
                  "relative_score": {int(stats.ranks[row]): float(relative[row]) for row in slow_rows[:64]}}
        return [Finding(self.name, Action.parse(config.action), Severity.WARNING,
                        f"stragglers: {'; '.join(shown)}{more} (medians over {config.every} monitored steps)",
                        ranks=tuple(sorted(new)), values=values)]

    @staticmethod
    def _describe(kind: str, slow: list[int], waiting: list[int], rows: np.ndarray, relative: np.ndarray,
                  relative_compute: np.ndarray, compute_slow: np.ndarray, own: np.ndarray,
                  ranks: tuple[int, ...]) -> str:
        def who(row: int) -> str:
            return f"rank {ranks[row]}"

        def times(row: int) -> str:
            text = f"forward {rows[row, FORWARD]:.4g} s"
            if math.isfinite(rows[row, COMPUTE]):
                text += f", compute {rows[row, COMPUTE]:.4g} s"
            return text

        if kind == RANK:
            (row,) = slow
            return f"{who(row)} {times(row)} (relative score {relative[row]:.2f}, compute score " \
                   f"{relative_compute[row]:.2f}, individual {own[row]:.2f})"
        replica = int(rows[slow[0], REPLICA])
        if kind == PEER:
            described = ", ".join(f"{who(row)} (tensor-parallel rank {int(rows[row, TENSOR_RANK])}, pipeline stage "
                                  f"{int(rows[row, STAGE])}: {times(row)}, compute score {relative_compute[row]:.2f})"
                                  for row in slow)
            return f"slow model-parallel peer in replica {replica}: {described}; its peers " \
                   f"{', '.join(str(ranks[row]) for row in waiting)} only wait for it"
        members = ", ".join(f"{who(row)} {times(row)}" for row in slow)
        if not all(math.isfinite(rows[row, COMPUTE]) for row in slow):
            where = "compute not timed, so which of its ranks is slow cannot be told"
        elif all(compute_slow[row] for row in slow):
            where = "every rank computes slowly"
        else:
            where = "no rank's compute is slow: an input, host or network delay"
        return f"slow replica {replica} ({where}): {members}"

    def commit(self, step: int, applied: bool) -> None:
        if self._pending is None:
            return
        self.best, self.best_compute, named = self._pending
        self.events += len(named - self.stragglers)
        self.stragglers = named
        self.reports += 1
        self._pending = None

    def metrics(self) -> dict[str, float]:
        return {**self._values, "events": float(self.events)}

    def state_dict(self) -> dict[str, Any]:
        return {"best": None if self.best is None else self.best.tolist(),
                "best_compute": None if self.best_compute is None else self.best_compute.tolist(),
                "reports": self.reports, "stragglers": sorted(self.stragglers), "events": self.events}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = None if state["best"] is None else np.asarray(state["best"], dtype=np.float64)
        compute = state.get("best_compute")
        self.best_compute = None if compute is None else np.asarray(compute, dtype=np.float64)
        self.reports = int(state["reports"])
        self.stragglers = frozenset(int(r) for r in state["stragglers"])
        self.events = int(state["events"])


class StragglerFamily(FamilyBase):
    """``detectors.straggler``: the ranks' forward-time medians, fetched every ``every`` monitored steps."""

    name = "straggler"

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        return [StatDecl(SECTION_TIMES, 8, Reduce.DETAIL)]

    def producers(self, ctx: FamilyContext) -> list[Producer]:
        parts = ctx.parts
        identity = (parts.replica, parts.tensor_rank, parts.pipeline_stage) if parts is not None else (-1, 0, 0)
        producer = StragglerProducer(ctx.section.every, ctx.config.stats.interval, identity)
        return [Producer("before_agreement", producer.write)]

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [StragglerMonitor(ctx.section, ctx.config.stats.interval)]

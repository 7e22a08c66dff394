"""``detectors.r_metric``: the R-Metric early warning (r-metric paper), one agreed score per monitored step.

R(t) = w_λ·norm(λ_t) + w_σ·norm(σ²_t) + w_ΔL·norm(ΔL_t), weights 0.10 / 0.45 / 0.70 by default:

* λ_t -- system events in the last ``event_window`` monitored steps: stragglers named by the straggler family,
  framework overflow skips, SDC findings (agreed: counted from the decisions, :meth:`RMetricMonitor.observe`),
  plus each rank's own hang reports and NVML hardware events (:mod:`arc_engine.monitors.hardware_events`), summed
  through a SUM slot; the devices that reported events are named in a ``hardware_events`` finding (no action) that
  the device ledger records (docs/hardware.md);
* σ²_t -- the variance of the data-parallel ranks' local gradient norms (:mod:`arc_engine.monitors.worker_spread`;
  held neutral under model parallelism, where a rank's norm is a shard's); by default read relative to its own
  recent level (``variance_relative``: log σ²_t − the median log σ² of the previous ``window`` values), because the
  ranks' spread grows by orders of magnitude over a healthy run (gradient noise outgrows the signal as the loss
  falls), and a percentile against a rising history reads that trend as a warning;
* ΔL_t -- |L_t − mean of the previous ``drift_window`` values| of the validation loss
  (:meth:`arc_engine.attach.Arc.record_validation_loss`, the mean over the ranks that recorded one), or of the
  agreed training loss until a validation loss arrives (the proxy; the first validation loss restarts the term).

The three-stage normalization (:class:`Normalizer`): p = the mid-rank percentile of the value among the previous
``window`` values (ties count half, so a stream of zeros is neutral), s_t = ``ema``·p + (1 − ``ema``)·s_{t−1}
(s_0 = 0.5), norm = 1 / (1 + exp(−``gain``·(s_t − 0.5))). A term without a new value keeps its last norm.

As written (weights summing to 1.25, threshold 0.57), a stationary run sits at R ≈ 0.62 and alerts on most steps;
``score: normalized`` (the default) compares R / Σw -- on the normalization's own scale, 0.5 when nothing moves --
with the threshold, and the alert needs the score above it on ``persist_fraction`` of the last ``persist``
monitored steps, this one included (docs/detectors.md has
the measured false-alarm rates of both readings; ``scripts/bench_r_metric.py`` reproduces them).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from arc_engine.config.errors import require
from arc_engine.config.schema import ActionName
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.consistency import ConsistencyFamily
from arc_engine.monitors.family import (
    FamilyBase,
    FamilyContext,
    Producer,
    StatDecl,
    StepView,
    section_of,
    worker_positions,
)
from arc_engine.monitors.hardware_events import HardwareEvents
from arc_engine.monitors.worker_spread import Spread, WorkerMoments
from arc_engine.policy import Decision
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, names, stats_device


@dataclass(kw_only=True)
class RMetricConfig:
    """The R-Metric early warning (r-metric paper): R = w_λ·norm(λ) + w_σ·norm(σ²) + w_ΔL·norm(ΔL) on every monitored
    step. λ: system events (stragglers, framework overflow skips, SDC findings, hang reports, and NVML ECC / XID /
    slowdown events with ``nvml`` on a GPU) per ``event_window`` monitored steps. σ²: the variance of the
    data-parallel ranks' local gradient norms, by default relative to its recent level (``variance_relative``:
    log σ² minus the median log σ² of the previous ``window`` values; the spread grows over a healthy run). ΔL:
    |L − mean of the previous ``drift_window`` values| of the validation loss (``Arc.record_validation_loss``) or,
    until one is recorded, of the agreed training loss (the proxy). norm: the mid-rank percentile p of the value
    among the previous ``window`` values, s ← ``ema``·p + (1 − ``ema``)·s, norm = 1 / (1 + exp(−``gain``·(s − 0.5))).
    ``score``: ``normalized`` compares R / (sum of the weights) with ``threshold`` (as written, the weights sum to
    1.25 and a stationary run sits at R ≈ 0.62 > 0.57: see docs/detectors.md); ``paper`` compares R itself. Alert
    after ``warmup_steps`` values, when the score is above ``threshold`` on this step and on ``persist_fraction`` of
    the last ``persist`` monitored steps (once per episode: again only after fewer than that were above)."""

    enabled: bool = True
    """The R-Metric early warning: system events λ, worker gradient-norm variance σ², loss drift ΔL, each
    percentile-normalized ([detectors.md](detectors.md))."""
    lambda_weight: float = 0.10
    """Weight of norm(λ).
    Allowed: >= 0"""
    variance_weight: float = 0.45
    """Weight of norm(σ²).
    Allowed: >= 0"""
    drift_weight: float = 0.70
    """Weight of norm(ΔL).
    Allowed: >= 0 (not all three 0)"""
    threshold: float = 0.57
    """Alert level of the score.
    Allowed: > 0"""
    score: Literal["normalized", "paper"] = "normalized"
    """`normalized`: the weighted sum divided by the weights' sum (0.5 when nothing moves); `paper`: the weighted sum
    itself, as written (alerts on most steps of a stationary run with the default weights)."""
    window: int = 100
    """Previous values each percentile rank is taken among.
    Allowed: >= 2"""
    ema: float = 0.3
    """Smoothing of the percentile: s = ema * p + (1 - ema) * s.
    Allowed: in (0, 1]"""
    gain: float = 4.0
    """Slope of the sigmoid: norm = 1 / (1 + exp(-gain * (s - 0.5))).
    Allowed: > 0"""
    drift_window: int = 10
    """Previous losses whose mean ΔL is measured from.
    Allowed: >= 1"""
    variance_relative: bool = True
    """σ² read as log σ² minus the median log σ² of the previous `window` values (the ranks' spread grows over a healthy
    run, which a percentile against the raw history reads as a warning); false: the paper's raw σ²."""
    event_window: int = 100
    """Monitored steps λ counts system events over.
    Allowed: >= 1"""
    warmup_steps: int = 30
    """Applied monitored steps before an alert can fire.
    Allowed: >= 1"""
    persist: int = 40
    """Monitored steps the alert looks back over (one alert per episode).
    Allowed: >= 1"""
    persist_fraction: float = 0.8
    """Share of those steps whose score must be above the threshold (this step's too); 1: every one of them.
    Allowed: in (0, 1]"""
    nvml: bool = True
    """Count NVML ECC, XID and clock-slowdown events of the rank's GPU when `nvidia-ml-py` is installed and the
    statistics live on CUDA (polled every 10 monitored steps)."""
    action: ActionName = "warn"
    """What an alert gets."""

    def __post_init__(self) -> None:
        for key in ("lambda_weight", "variance_weight", "drift_weight"):
            require(getattr(self, key) >= 0, key, getattr(self, key), "must be >= 0")
        require(self.lambda_weight + self.variance_weight + self.drift_weight > 0, "drift_weight",
                self.drift_weight, "the three weights must not all be 0")
        require(self.threshold > 0, "threshold", self.threshold, "must be > 0")
        require(self.window >= 2, "window", self.window, "must be an integer >= 2")
        require(0 < self.ema <= 1, "ema", self.ema, "must be in (0, 1]")
        require(self.gain > 0, "gain", self.gain, "must be > 0")
        require(self.drift_window >= 1, "drift_window", self.drift_window, "must be an integer >= 1")
        require(self.event_window >= 1, "event_window", self.event_window, "must be an integer >= 1")
        require(self.warmup_steps >= 1, "warmup_steps", self.warmup_steps, "must be an integer >= 1")
        require(self.persist >= 1, "persist", self.persist, "must be an integer >= 1")
        require(0 < self.persist_fraction <= 1, "persist_fraction", self.persist_fraction, "must be in (0, 1]")



#: [1] SUM: system events this rank saw since its previous monitored step (hang reports, NVML events).
EVENTS = "r_metric_events"
#: [1] SUM: the part of :data:`EVENTS` this rank's device reported (NVML events, an injected ``hardware_events``
#: fault). When the sum is not 0 the ranks are read from the rows (:meth:`RMetricMonitor.evaluate`, on demand) and
#: named in a ``hardware_events`` finding, whose evidence the device ledger records.
DEVICE_EVENTS = "r_metric_device_events"
#: [2] SUM: Σ validation losses recorded since the previous monitored step, and their number.
VALIDATION = "r_metric_validation"
#: The terms, in weight order.
TERMS = ("lambda", "variance", "drift")
#: Agreed findings that count as system events for λ (a straggler finding counts each rank it names; its info event
#: about a contended machine names none and counts nothing).
EVENT_DETECTORS = ("straggler", "deepspeed_overflow", "grad_scaler_overflow", "megatron_overflow", "sdc")
#: σ² below this is read as this in its log level (identical norms: a zero spread).
VARIANCE_FLOOR = 1e-30
#: NVML is polled every this many monitored steps.
NVML_POLL_EVERY = 10


def device_events_finding(named: dict[int, int]) -> Finding:
    """The ``hardware_events`` finding: the ranks whose devices reported events (``{global rank: events}``), with
    their evidence for the device ledger. No action: the events count in λ, and the ledger's rule decides what they
    say of the device. Pure."""
    listed = ", ".join(f"rank {rank}: {count}" for rank, count in named.items())
    return Finding("hardware_events", Action.NONE, Severity.WARNING,
                   f"hardware events (NVML ECC / XID / clock slowdown) reported by the device of {listed}",
                   ranks=tuple(named), values={"events_per_rank": {str(r): c for r, c in named.items()}},
                   hardware="hardware_event")


def percentile_rank(history: np.ndarray, value: float) -> float:
    """The mid-rank percentile of ``value`` among ``history``: (#below + #equal / 2) / n; 0.5 when empty. Pure."""
    if history.size == 0:
        return 0.5
    return float(((history < value).sum() + 0.5 * (history == value).sum()) / history.size)


class Normalizer:
    """The paper's three stages for one signal; :meth:`peek` computes without changing state, :meth:`push` keeps."""

    def __init__(self, window: int, ema: float, gain: float) -> None:
        self.history: deque[float] = deque(maxlen=window)
        self.ema, self.gain = ema, gain
        self.smoothed = 0.5
        self.norm = 0.5  # the last value's (0.5 before any)

    def peek(self, value: float) -> tuple[float, float]:
        """(smoothed s_t, norm_t) for ``value``."""
        p = percentile_rank(np.fromiter(self.history, dtype=np.float64, count=len(self.history)), value)
        smoothed = self.ema * p + (1.0 - self.ema) * self.smoothed
        return smoothed, 1.0 / (1.0 + math.exp(-self.gain * (smoothed - 0.5)))

    def push(self, value: float) -> None:
        self.smoothed, self.norm = self.peek(value)
        self.history.append(value)

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "smoothed": self.smoothed, "norm": self.norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque((float(v) for v in state["history"]), maxlen=self.history.maxlen)
        self.smoothed, self.norm = float(state["smoothed"]), float(state["norm"])


class RMetricMonitor(Monitor):
    """R(t) per monitored step and its alert (see the module docstring). Also this rank's writer of the event and
    validation slots (:meth:`write`, the family's producer)."""

    name = "r_metric"

    def __init__(self, config: RMetricConfig, variance: bool, hardware: HardwareEvents | None = None,
                 positions: int = 1, position: int = 0, write_moments: bool = True) -> None:
        self.config = config
        self.variance = variance  # σ² measurable (ranks comparable: whole gradients, or shards by position)
        self.moments = WorkerMoments(positions, position)
        #: whether this family writes the shared worker moments (not when the consistency family does: the same
        #: values, written once per step)
        self.write_moments = write_moments
        self.hardware = hardware
        self.normalizers = {term: Normalizer(config.window, config.ema, config.gain) for term in TERMS}
        self.events: deque[float] = deque(maxlen=config.event_window)
        self.losses: deque[float] = deque(maxlen=config.drift_window)
        self.log_variances: deque[float] = deque(maxlen=config.window)  # σ²'s recent level (variance_relative)
        self.source = "train_loss"  # or "validation" once a validation loss was agreed
        self.observed = 0  # agreed events seen in decisions since the previous commit
        self.steps = 0
        self.above: deque[bool] = deque(maxlen=config.persist)  # the last applied steps: score above the threshold
        self.armed = True  # an alert is possible (re-armed once the condition no longer holds)
        self.alerts = 0
        self._local_seen = self._device_seen = 0  # this rank's local (and device) events already sent
        self._monitored = 0
        self._last_step = -1
        self._new_events = self._new_device_events = 0.0  # this step's, as written
        self._validation: list[float] = []  # this rank's, since its previous monitored step
        self._pending: dict[str, Any] | None = None
        self._committed = 0  # monitored steps committed
        self._reported: dict[int, int] = {}  # this step's devices with events (global rank: events), until commit
        self._device_named: dict[int, int] = {}  # global rank -> the monitored step its device's events were last seen
        self._spread: Spread | None = None  # this step's, until commit
        self._values: dict[str, float] = {}

    # ------------------------------------------------------------ this rank's inputs (before the agreement)

    def record_validation_loss(self, value: float) -> None:
        self._validation.append(float(value))

    def write(self, buffer: StatBuffer, view: StepView) -> None:
        """Producer: this rank's new local events and validation losses into the SUM slots; the worker moments."""
        if view.step != self._last_step:  # once per step (a recomputed step agrees twice: same values)
            self._last_step = view.step
            hardware = self.hardware.poll() if self.hardware is not None and self.hardware.active and \
                self._monitored % NVML_POLL_EVERY == 0 else 0
            self._monitored += 1
            self._new_events = float(view.local_events - self._local_seen + hardware)
            self._new_device_events = float(view.device_events - self._device_seen + hardware)
            self._local_seen, self._device_seen = view.local_events, view.device_events
        buffer.view(EVENTS).fill_(self._new_events)
        buffer.view(DEVICE_EVENTS).fill_(self._new_device_events)
        validation = buffer.view(VALIDATION)
        validation[0].fill_(math.fsum(self._validation))
        validation[1].fill_(float(len(self._validation)))
        if self.variance and self.write_moments:
            self.moments.write(buffer)

    # ------------------------------------------------------------ the agreed score

    def required_stats(self) -> tuple[str, ...]:
        wanted = (names.LOSS, names.LOSS_RANKS, EVENTS, DEVICE_EVENTS, VALIDATION)
        return (*wanted, *WorkerMoments.required_stats()) if self.variance else wanted

    def _raw(self, stats: AgreedStats) -> dict[str, float]:
        """This step's agreed raw inputs: new events, σ² (NaN when off), and the loss and its source (1: validation,
        0: the training-loss proxy; absent when there is none)."""
        raw = {"events": float(stats.total(EVENTS)[0]) + self.observed, "variance": math.nan}
        if self.variance:
            self._spread = self.moments.read(stats)
            raw["variance"] = self._spread.norm_std ** 2
        total, count = (float(v) for v in stats.total(VALIDATION))
        loss_ranks = float(stats.total(names.LOSS_RANKS)[0])
        if count > 0:
            raw["loss"], raw["source"] = total / count, 1.0
        elif self.source == "train_loss" and loss_ranks > 0:
            raw["loss"], raw["source"] = float(stats.total(names.LOSS)[0]) / loss_ranks, 0.0
        return raw

    def _inputs(self, raw: dict[str, float]) -> dict[str, float]:
        """Each term's value on this step (NaN: no new value): λ over the event window, σ², ΔL."""
        window = [*self.events, raw["events"]]
        values = {**raw, "lambda": math.fsum(window[-self.config.event_window:]), "drift": math.nan,
                  "variance_raw": raw["variance"]}
        loss = raw.get("loss", math.nan)
        restart = raw.get("source") == 1.0 and self.source != "validation"  # the proxy's history does not count
        history = [] if restart else list(self.losses)
        if math.isfinite(loss) and history:
            values["drift"] = abs(loss - math.fsum(history) / len(history))
        values["variance_level"] = math.log(max(raw["variance"], VARIANCE_FLOOR)) if math.isfinite(raw["variance"]) \
            else math.nan
        if self.config.variance_relative and math.isfinite(raw["variance"]):
            level = float(np.median(np.fromiter(self.log_variances, dtype=np.float64))) if self.log_variances \
                else values["variance_level"]
            values["variance"] = values["variance_level"] - level
        return values

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        findings = self.judge(self._raw(stats))
        self._reported = {}
        if float(stats.total(DEVICE_EVENTS)[0]) > 0:  # agreed: every rank reads the rows (rare: on demand)
            counts = stats.per_rank(DEVICE_EVENTS)[:, 0]
            self._reported = {int(stats.ranks[row]): int(counts[row]) for row in np.flatnonzero(counts > 0)}
            # named once per episode: again only after event_window monitored steps without its device's events
            fresh = {rank: count for rank, count in self._reported.items()
                     if self._committed - self._device_named.get(rank, -self.config.event_window - 1)
                     > self.config.event_window}
            if fresh:
                findings.append(device_events_finding(fresh))
        return findings

    def judge(self, raw: dict[str, float]) -> list[Finding]:
        """The score and the alert from this step's agreed raw inputs (:meth:`evaluate` without the statistics
        buffer; ``scripts/bench_r_metric.py`` drives it directly). Keeps nothing until :meth:`commit`."""
        config = self.config
        inputs = self._inputs(raw)
        norms, smoothed = {}, {}
        for term in TERMS:
            value, normalizer = inputs[term], self.normalizers[term]
            if math.isfinite(value):
                smoothed[term], norms[term] = normalizer.peek(value)
            else:
                norms[term] = normalizer.norm
        weights = np.array([config.lambda_weight, config.variance_weight, config.drift_weight])
        paper = float(np.dot(weights, [norms[t] for t in TERMS]))
        score = paper / float(weights.sum()) if config.score == "normalized" else paper
        above = self.steps >= config.warmup_steps and score > config.threshold
        self._pending = {"inputs": inputs, "above": above}
        self._values = {"score": score, "score_paper": paper, **{f"norm_{t}": norms[t] for t in TERMS},
                        "lambda": inputs["lambda"], "variance": inputs["variance_raw"], "drift": inputs["drift"],
                        "validation": float(self.source == "validation" or inputs.get("source") == 1.0)}
        if not (above and self.armed and self._holds([*self.above, above])):
            return []
        contributions = {t: w * norms[t] for t, w in zip(TERMS, weights, strict=True)}
        largest = max(contributions, key=lambda t: contributions[t])
        label = {"lambda": "system events λ", "variance": "worker gradient-norm variance σ²",
                 "drift": f"{'validation' if self._values['validation'] else 'training'}-loss drift ΔL"}
        return [Finding(self.name, Action.parse(config.action), Severity.WARNING,
                        f"R-Metric {score:.3f} above {config.threshold} on {self._required()} of the last "
                        f"{config.persist} monitored steps "
                        f"(norm λ {norms['lambda']:.2f}, σ² {norms['variance']:.2f}, ΔL {norms['drift']:.2f}); "
                        f"largest term: {label[largest]}", values=dict(self._values))]

    def _required(self) -> int:
        return math.ceil(self.config.persist_fraction * self.config.persist - 1e-9)

    def _holds(self, flags: list[bool]) -> bool:
        """The alert's condition over the last ``persist`` flags (the newest last): a full window with at least
        ``persist_fraction`` of them above the threshold."""
        window = flags[-self.config.persist:]
        return len(window) == self.config.persist and sum(window) >= self._required()

    def observe(self, decision: Decision) -> None:
        """Agreed findings that are system events (see :data:`EVENT_DETECTORS`) count towards λ."""
        for finding in decision.findings:
            if finding.detector in EVENT_DETECTORS:
                self.observed += len(finding.ranks) if finding.detector == "straggler" else 1

    def commit(self, step: int, applied: bool) -> None:
        self._validation.clear()  # sent with this step's agreement
        self._device_named.update(dict.fromkeys(self._reported, self._committed))
        self._reported, self._committed = {}, self._committed + 1
        pending, self._pending = self._pending, None
        if pending is None:
            return
        inputs = pending["inputs"]
        self.events.append(inputs["events"])
        self.observed = 0
        if self._spread is not None:
            self.moments.advance(self._spread)
            self._spread = None
        if not applied:  # a skipped step's values stay out of the histories
            return
        self.steps += 1
        if pending["above"] and self.armed and self._holds([*self.above, True]):
            self.alerts += 1
            self.armed = False
        self.above.append(pending["above"])
        if sum(self.above) < self._required():  # the episode is over: the next one may alert
            self.armed = True
        for term in TERMS:
            if math.isfinite(inputs[term]):
                self.normalizers[term].push(inputs[term])
        if inputs.get("source") == 1.0 and self.source != "validation":
            self.source = "validation"  # the proxy's history ends here
            self.losses.clear()
            self.normalizers["drift"] = Normalizer(self.config.window, self.config.ema, self.config.gain)
            if math.isfinite(inputs["drift"]):
                self.normalizers["drift"].push(inputs["drift"])
        if math.isfinite(inputs.get("loss", math.nan)):
            self.losses.append(inputs["loss"])
        if math.isfinite(inputs["variance_level"]):
            self.log_variances.append(inputs["variance_level"])

    def metrics(self) -> dict[str, float]:
        return {**self._values, "alerts": float(self.alerts)}

    def state_dict(self) -> dict[str, Any]:
        return {"normalizers": {t: n.state_dict() for t, n in self.normalizers.items()}, "events": list(self.events),
                "losses": list(self.losses), "log_variances": list(self.log_variances), "source": self.source,
                "steps": self.steps, "above": list(self.above), "armed": self.armed,
                "alerts": self.alerts, "moments": self.moments.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for term, normalizer in self.normalizers.items():
            normalizer.load_state_dict(state["normalizers"][term])
        self.events = deque((float(v) for v in state["events"]), maxlen=self.config.event_window)
        self.losses = deque((float(v) for v in state["losses"]), maxlen=self.config.drift_window)
        self.log_variances = deque((float(v) for v in state.get("log_variances", ())), maxlen=self.config.window)
        self.source = str(state["source"])
        self.steps, self.alerts, self.armed = int(state["steps"]), int(state["alerts"]), bool(state["armed"])
        self.above = deque((bool(v) for v in state["above"]), maxlen=self.config.persist)
        self.moments.load_state_dict(state["moments"])


class RMetricFamily(FamilyBase):
    """``detectors.r_metric``: its event and validation slots (and the worker moments it shares with the
    consistency family), one producer, one monitor."""

    name = "r_metric"
    config_class = RMetricConfig

    def __init__(self) -> None:
        self._monitor: tuple[int, RMetricMonitor] | None = None

    def _monitor_for(self, ctx: FamilyContext) -> RMetricMonitor:
        """The context's one monitor (its producer is the monitor's :meth:`RMetricMonitor.write`)."""
        if self._monitor is None or self._monitor[0] != id(ctx):
            where = worker_positions(ctx.parts)
            variance = where is not None
            device = stats_device(None, ctx.config.stats.device) if ctx.section.nvml else torch.device("cpu")
            hardware = HardwareEvents(device, True) if device.type == "cuda" else None
            consistency = section_of(ctx.config, ConsistencyFamily())  # (it writes the moments when on)
            monitor = RMetricMonitor(ctx.section, variance, hardware, *(where or (1, 0)),
                                     write_moments=not consistency.enabled)
            self._monitor = (id(ctx), monitor)
        return self._monitor[1]

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        decls = [StatDecl(EVENTS, 1, Reduce.SUM), StatDecl(DEVICE_EVENTS, 1, Reduce.SUM),
                 StatDecl(VALIDATION, 2, Reduce.SUM)]
        monitor = self._monitor_for(ctx)
        return decls + monitor.moments.statistics() if monitor.variance else decls

    def producers(self, ctx: FamilyContext) -> list[Producer]:
        return [Producer("before_agreement", self._monitor_for(ctx).write)]

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [self._monitor_for(ctx)]

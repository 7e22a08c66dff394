"""The typed configuration tree.

Every component owns a small ``kw_only`` dataclass; :class:`ArcConfig` composes them. Each dataclass validates
its own values in ``__post_init__`` and raises :class:`~arc_engine.config.errors.ConfigError` naming the key
(relative to that dataclass; the loader prefixes the path and the source file).

The docstring of a key's field -- the string literal on the line after it -- is that key's entry in
docs/configuration.md (:mod:`arc_engine.config.docs` renders it): one description, in Markdown, and a last line
``Allowed: ...`` where the type does not say which values ``__post_init__`` accepts (a format; every number's
range). A key without one fails the generator and ``tests/test_docs.py``; a section's field needs none (its class
docstring introduces it).

Actions a detector may request (``action`` keys):

* ``warn``  -- emit an event, apply the step as usual;
* ``skip``  -- the optimizer does not apply this step on any rank (counted and reported);
* ``rollback`` -- the step is not applied and every rank returns to the newest verified-stable state, then heals
  (needs ``recovery.enabled``; otherwise it aborts);
* ``abort`` -- every rank stops with :data:`arc_engine.policy.EXIT_ABORT`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from arc_engine.config.errors import ConfigError, require

ActionName = Literal["warn", "checkpoint", "skip", "rollback", "abort"]
SeverityName = Literal["debug", "info", "warning", "error", "critical"]
FaultKind = Literal["nan_grad", "inf_grad", "nan_loss", "loss_scale", "lr_scale", "bitflip", "stall",
                    "attention_lowbit", "router_collapse", "dead_expert", "grad_scale", "data_corruption",
                    "optimizer_state", "collective_corruption", "weight_corruption", "hardware_events",
                    "memory_leak"]
OptimizerStateKey = Literal["exp_avg", "exp_avg_sq"]


@dataclass(kw_only=True)
class RunConfig:
    """Where a run writes and how it is named.

    ``run_id``: a name shared by every rank; when unset, torchrun's ``TORCHELASTIC_RUN_ID`` is used if it is
    set, else rank 0 makes one (``YYYYmmdd-HHMMSS``) and broadcasts it once at attach time.
    ``run_dir``: parent folder; the run's files go to ``<run_dir>/<run_id>/``.
    """

    run_id: str | None = None
    """Name shared by every rank. Null: `$TORCHELASTIC_RUN_ID` if set (stable across torchrun's restarts), else rank 0's
    timestamp `YYYYmmdd-HHMMSS`, broadcast once at attach.
    Allowed: letters, digits, `-`, `_`, `.`"""
    run_dir: str = "arc_runs"
    """Parent folder; the run's files go to `<run_dir>/<run_id>/`.
    Allowed: a non-empty path"""

    def __post_init__(self) -> None:
        require(self.run_dir != "", "run_dir", self.run_dir, "must be a non-empty path")
        if self.run_id is not None:
            ok = self.run_id != "" and all(c.isalnum() or c in "-_." for c in self.run_id)
            require(ok, "run_id", self.run_id, "letters, digits, '-', '_' and '.' only")


@dataclass(kw_only=True)
class StatsConfig:
    """The per-step statistics pipeline.

    ``interval``: monitor every k-th optimizer step (1 = every step). Unmonitored steps run no statistics,
    no collective and no detector: a fault on such a step is not seen.
    ``device``: where the gathered buffer lives: ``auto`` follows the backend (CUDA for NCCL, CPU for gloo).
    ``optimizer_stats_every``: per-group weight norms and the prospective Adam update RMS (SDC paper), computed on
    each rank's own parameters or shard inside the optimizer step, on every k-th monitored step (0 = never).
    They cost about one extra Adam step of memory traffic, hence not every step by default.
    ``own_work``: time arc_engine's own work per step, piece by piece (thread CPU time of each hook, the decision,
    snapshots...; CUDA event time of its kernels on CUDA), reported in the run summary (``own_work``). Off: no
    timer on the hot path; on: about a microsecond per timed call.
    """

    interval: int = 1
    """Monitor every k-th optimizer step. Unmonitored steps run no statistics, no collective and no detector: a fault on
    such a step is applied unseen.
    Allowed: >= 1"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the step's statistics buffer lives: `auto` is CUDA for NCCL groups, else CPU."""
    optimizer_stats_every: int = 10
    """Per-group weight norms and the prospective Adam update RMS on every k-th monitored step (about one extra Adam
    step of memory traffic; 0: never). The SDC detector computes the update RMS every monitored step regardless.
    Allowed: >= 0"""
    own_work: bool = False
    """Time arc_engine's own work per step, piece by piece (thread CPU time of each hook, the decision, snapshots; CUDA
    event time of its kernels on CUDA), reported in the run summary's `own_work` ([performance.md](performance.md)).
    Off: no timer on the hot path; on: about a microsecond per timed call."""

    def __post_init__(self) -> None:
        require(self.interval >= 1, "interval", self.interval, "must be an integer >= 1")
        require(self.optimizer_stats_every >= 0, "optimizer_stats_every", self.optimizer_stats_every,
                "must be an integer >= 0 (0 = never)")


@dataclass(kw_only=True)
class RecomputeConfig:
    """Recovery from SDC by localized recomputation (needs a ``recompute_fn`` at attach; DDP, DeepSpeed ZeRO-1/2 and
    megatron-core).

    Before the gradient reduction each rank checks its own local gradient (per DDP or megatron bucket / per ZeRO
    parameter): a non-finite norm, or (after ``detectors.sdc.warmup_steps`` observations) a norm above
    ``gate_factor`` times its running reference, is withheld (the rank contributes zeros). The suspect alone (under
    Megatron: its data-parallel replica's model-parallel group) then re-runs forward and backward on the same
    micro-batches with the same RNG state and adds its recomputed share back through the framework's reductions.
    If the recomputation reproduces the anomaly, the lowest healthy rank (replica) recomputes the suspect's
    micro-batches: agreeing (within ``peer_rtol``) means the data caused it (``detectors.loss_spike.action``
    decides); disagreeing means the suspect's device is faulty: it is written to ``quarantine.json`` in the run
    directory and ``on_faulty_device`` applies (``abort``: every rank stops with exit code 5; ``exclude``: the
    peer's recomputation replaces the suspect's share and training continues). When only the update-RMS rule fires
    (nothing withheld), every rank recomputes once, then the rule's ``action`` applies if it still fires."""

    enabled: bool = False
    """Withhold a suspect local gradient before the reduction and recompute it on that rank only (DDP, DeepSpeed
    ZeRO-1/2; megatron-core: on its replica's model-parallel group; needs `recompute_fn` at attach)."""
    gate_factor: float = 8.0
    """A local gradient norm above this many times its running reference is withheld.
    Allowed: > 1"""
    peer_rtol: float = 0.01
    """Relative tolerance of the peer check: the suspect's recomputation and a healthy peer's agree within it (the data
    caused it) or not (the device is faulty).
    Allowed: (0, 1)"""
    on_faulty_device: Literal["abort", "exclude"] = "abort"
    """`abort`: every rank stops with exit code 5; `exclude`: the peer's recomputation replaces the suspect's share and
    training goes on."""

    def __post_init__(self) -> None:
        require(self.gate_factor > 1, "gate_factor", self.gate_factor, "must be > 1")
        require(0 < self.peer_rtol < 1, "peer_rtol", self.peer_rtol, "must be in (0, 1)")
        require(self.on_faulty_device in ("abort", "exclude"), "on_faulty_device", self.on_faulty_device,
                "one of 'abort', 'exclude'")


@dataclass(kw_only=True)
class SDCConfig:
    """Silent data corruption on jumps of the Adam update RMS (SDC paper §VI): flag step t when
    |R_t - R_{t-1}| > μ / (α √ΔG_t), μ the mean jump over the first ``warmup_steps`` applied steps, ΔG_t the positive
    jump of the pre-clip gradient norm; or when that norm is not finite. Needs the prospective update RMS on every
    monitored step (so it overrides ``stats.optimizer_stats_every``); evaluated before the update is applied.
    ``alpha`` in (0, 1]: larger is more sensitive (the paper's default 0.05). ``localize_factor``: on a flagged
    step, a rank whose local (pre-reduction) gradient-norm jump exceeds this many times its peers' median jump is
    named as the suspect. ``update_sample``: the fraction of each tensor's elements the update RMS is computed on (one
    contiguous window per tensor, at least 256 elements, moving every monitored step so that every element is
    covered every ceil(1/update_sample) steps; ZeRO-1/2 partitions in up to 16 segments); below 1 it is an
    estimate of R_t at that fraction of the cost (the pre-clip norm stays exact). ``sketch_size``: numbers per
    rank in the signed chunk-sum sketch of the local gradient, fetched from every rank on a flagged step (0: off,
    the default: it costs one more pass over every local gradient bucket per step); a rank whose sketch points
    away from its peers' stands out in the finding's ``sketch_cosine_to_peers``."""

    enabled: bool = True
    """The SDC paper's update-RMS rule (on by default); computes the sampled update RMS on every monitored step."""
    alpha: float = 0.05
    """α of the rule ΔR_t > μ/(α√ΔG_t); larger is more sensitive.
    Allowed: (0, 1]"""
    warmup_steps: int = 100
    """Applied steps over which μ (the mean update-RMS jump) is learned; also the recomputation gate's warm-up.
    Allowed: >= 1"""
    localize_factor: float = 4.0
    """On a flagged step, a rank whose local gradient-norm jump exceeds this many times its peers' median jump is named
    the suspect.
    Allowed: > 1"""
    action: ActionName = "skip"
    """What a flagged step gets."""
    update_sample: float = 0.03125
    """Fraction of each tensor the update RMS is computed on: one contiguous window (at least 256 elements) that moves
    every monitored step, so every element is covered every ceil(1/update_sample) steps; 1.0 gives the paper's exact
    R_t.
    Allowed: (0, 1]"""
    sketch_size: int = 0
    """Numbers per rank in the signed chunk-sum sketch of the local gradient (0: off, the default; e.g. 256: one more
    pass over each local gradient bucket per step).
    Allowed: >= 0"""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)

    def __post_init__(self) -> None:
        require(0 < self.alpha <= 1, "alpha", self.alpha, "must be in (0, 1]")
        require(self.localize_factor > 1, "localize_factor", self.localize_factor, "must be > 1")
        require(self.warmup_steps >= 1, "warmup_steps", self.warmup_steps, "must be an integer >= 1")
        require(0 < self.update_sample <= 1, "update_sample", self.update_sample, "must be in (0, 1]")
        require(self.sketch_size >= 0, "sketch_size", self.sketch_size, "must be an integer >= 0 (0 = off)")


@dataclass(kw_only=True)
class TrajectoryMonitorConfig:
    """What the mechanism families share: a measurement every ``every`` optimizer steps, alarms against a trend
    learned from the last ``window`` accepted measurements, after ``warmup_measurements`` of them."""

    enabled: bool = True
    """Measure and alarm (on only where the adapter describes the model's structure)."""
    every: int = 50
    """Optimizer steps between measurements.
    Allowed: a multiple of `stats.interval`"""
    warmup_measurements: int = 8
    """Accepted measurements before the alarms can fire.
    Allowed: >= 3"""
    window: int = 50
    """Accepted measurements in each layer's healthy trajectory.
    Allowed: >= `warmup_measurements`"""

    def __post_init__(self) -> None:
        require(self.every >= 1, "every", self.every, "must be an integer >= 1")
        require(self.warmup_measurements >= 3, "warmup_measurements", self.warmup_measurements,
                "must be an integer >= 3")
        require(self.window >= self.warmup_measurements, "window", self.window, "must be >= warmup_measurements")


@dataclass(kw_only=True)
class QKSpectraConfig(TrajectoryMonitorConfig):
    """Attention weight-update and QK-product spectra per head (mechanism-driven monitors; Megatron only: the
    adapter describes where each tensor-parallel rank's heads are).

    Every ``every`` optimizer steps (δ; a multiple of ``stats.interval``), for each layer and query head: the spectra
    of ΔW_q, ΔW_k over the last δ steps and of the QK-product increments Δ₁, Δ₂, Δ₃ (from thin-QR cores). Only W_q
    and W_k at t − δ are kept, on one data-parallel copy per layer.

    The alarm is a one-sided CUSUM on the model's relative drop of Δ₂ spectral entropy: each measurement, each
    layer's median head is compared with that layer's trend (Theil-Sen through the last ``window`` accepted
    measurements, :mod:`arc_engine.monitors.trajectory`); d = the mean over layers of (trend − value) / trend; the
    sum S = max(0, S + d − ``allowance``) alarms when it exceeds ``alarm_drop``, after ``warmup_measurements``. A
    measurement taken while S > 0 stays out of the trajectory; after an alarm S restarts at 0 and the new level
    joins it (one alarm per episode). A sustained drop of x alarms after about ``alarm_drop`` / (x − ``allowance``)
    measurements; a fault confined to one of L layers counts 1/L.

    Attention logit growth per head: each measurement, every head's bound on its attention logits per unit input
    norms, σ_max(W_q W_kᵀ)/√d_k (from the same thin-QR cores), is compared with its own trend (Theil-Sen of the log
    bound through the last ``window`` accepted measurements); a head above it by a factor of more than 1 +
    ``logit_growth`` and by more than ``logit_factor`` robust standard deviations alarms (``logit_action``), once
    per episode (the alarmed level joins the trend), after ``logit_warmup_measurements`` accepted measurements
    (early training moves the bounds fastest). Where the attention implementation records the measured max
    logit per head (Transformer Engine >= 2.9 with ``current_max_attn_logits``), it is reported beside the bound.
    """

    # The inherited keys again, for this family's own docstrings (the defaults are the base's).
    enabled: bool = True
    """Attention ΔW and QK-product spectra per head and tensor-parallel shard (Megatron; off elsewhere)."""
    every: int = 50
    """δ: optimizer steps between measurements (W_q, W_k at t − δ are kept).
    Allowed: a multiple of `stats.interval`"""
    warmup_measurements: int = 8
    """Accepted measurements before the alarm can fire.
    Allowed: >= 3"""
    window: int = 16
    """Accepted measurements in each layer's healthy trajectory.
    Allowed: >= `warmup_measurements`"""
    allowance: float = 0.05
    """Relative drop per measurement (mean over layers of each layer's median head below its trend) the accumulated sum
    absorbs.
    Allowed: [0, 1)"""
    alarm_drop: float = 0.5
    """Accumulated drop beyond the allowance that alarms (e.g. 0.5: a sustained 30 % drop alarms on the 3rd
    measurement).
    Allowed: > 0"""
    action: ActionName = "warn"
    """What an alarm gets."""
    logit_growth: float = 1.0
    """A head's attention-logit bound σ_max(W_q W_kᵀ)/√d_k above its own trend by a factor of more than 1 + this alarms
    (with `logit_factor`).
    Allowed: > 0"""
    logit_factor: float = 6.0
    """... and by more than this many robust standard deviations of the log bound's residuals.
    Allowed: > 0"""
    logit_warmup_measurements: int = 10
    """Accepted measurements before the logit-growth alarm can fire (early training moves the bounds fastest).
    Allowed: 3 to `window`"""
    logit_action: ActionName = "warn"
    """What a logit-growth alarm gets."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.allowance < 1, "allowance", self.allowance, "must be in [0, 1)")
        require(self.alarm_drop > 0, "alarm_drop", self.alarm_drop, "must be > 0")
        require(self.logit_growth > 0, "logit_growth", self.logit_growth, "must be > 0 (e.g. 1.0: twice the trend)")
        require(self.logit_factor > 0, "logit_factor", self.logit_factor, "must be > 0")
        require(3 <= self.logit_warmup_measurements <= self.window, "logit_warmup_measurements",
                self.logit_warmup_measurements, "an integer from 3 to `window`")


@dataclass(kw_only=True)
class RouterConfig(TrajectoryMonitorConfig):
    """MoE router health per MoE layer, over all the tokens of the job (mechanism-driven monitors; Megatron only).

    Every ``every`` optimizer steps (a multiple of ``stats.interval``): router weight similarity sim(W_R), the
    conditioning ratio ε, per-token routing entropy of the full softmax (mean and low percentiles), tokens per
    expert, MaxVio and dead experts, summed over the expert-parallel and expert-data-parallel ranks. Alarms against
    the run's own healthy trajectory (a robust trend through the last ``window`` accepted measurements, after
    ``warmup_measurements``): the mean routing entropy falls, or the similarity rises, by more than ``factor`` robust
    standard deviations of the residuals and by more than ``min_relative_change`` of the predicted value (the
    similarity, a mean cosine near 0 for a healthy router, also by ``min_similarity_change`` in absolute terms); an
    expert that received tokens in the baseline and none now (``dead_expert_action``).
    """

    enabled: bool = True
    """MoE router health per MoE layer over every token of the job (Megatron with experts; off elsewhere)."""
    every: int = 10
    """Optimizer steps between measurements.
    Allowed: a multiple of `stats.interval`"""
    warmup_measurements: int = 5
    """Accepted measurements before the alarms can fire.
    Allowed: >= 3"""
    factor: float = 6.0
    """Robust standard deviations of change (entropy down, similarity up) that alarm.
    Allowed: > 0"""
    min_relative_change: float = 0.15
    """And the fraction of the predicted value the change must exceed.
    Allowed: >= 0"""
    min_similarity_change: float = 0.05
    """And, for the similarity (a mean cosine, about 0 for a healthy router), this absolute rise.
    Allowed: [0, 2]"""
    action: ActionName = "warn"
    """What an entropy or similarity alarm gets."""
    dead_expert_action: ActionName = "warn"
    """What an expert gets that was alive in the baseline and receives no token."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.factor > 0, "factor", self.factor, "must be > 0")
        require(self.min_relative_change >= 0, "min_relative_change", self.min_relative_change, "must be >= 0")
        require(0 <= self.min_similarity_change <= 2, "min_similarity_change", self.min_similarity_change,
                "must be in [0, 2]")


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
    ``individual_threshold``, 0 = off) and it is at least ``min_delay_s`` slower than the reference; after
    ``warmup_reports`` reports. Under model parallelism the slow ranks of a replica are told apart: a model-parallel
    peer that computes slowly (its peers only wait for it) or a whole slow replica. The event names the ranks;
    stragglers also count as system events of the R-Metric."""

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
    """A rank whose best-median-so-far / current median falls below this is a straggler (it slowed down); 0: off.
    Allowed: in [0, 1)"""
    min_delay_s: float = 0.005
    """A straggler is also at least this many seconds slower than its reference (timer noise of fast steps never flags).
    Allowed: >= 0"""
    warmup_reports: int = 2
    """Reports before ranks can be flagged (the first steps compile and warm caches).
    Allowed: >= 0"""
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
        require(self.compute_every >= 0, "compute_every", self.compute_every,
                "must be an integer >= 0 (monitored steps between compute samples; 0 = off)")
        require(self.compute_modules >= 1, "compute_modules", self.compute_modules, "must be an integer >= 1")


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


@dataclass(kw_only=True)
class WeightHealthConfig:
    """Weight-matrix health and per-layer gradient statistics (ARC paper §3.2.3, §3.2.1), every ``every`` optimizer
    steps (a multiple of ``stats.interval``) on up to ``max_tensors`` weight matrices (parameters of 2 or more
    dimensions, spread evenly over the model when it has more).

    Alarms, on each measurement while they hold: ‖W‖_F above ``max_norm`` or non-finite (explosion); ‖W‖_F / ‖W₀‖_F
    below ``collapse_ratio`` (W₀: the matrix at the first measurement); the fraction of |w| < ``sparsity_eps`` above
    its first value + ``sparsity_increase``; the effective rank exp(H(σ/Σσ)) of ``rank_samples`` matrices per
    measurement (rotating; 0: none) below (1 - ``rank_drop``) x the largest of its previous ``rank_window``
    measured values (0: its first value, the ARC paper's rule, which a long healthy run trips: learning compresses
    a matrix, an embedding most, well below its random initialization's rank); the weight-health score
    (``norm_weight`` x NormScore + ``rank_weight`` x RankScore + ``sparsity_weight`` x SparsityScore, normalized over
    the components available) below ``score_min``: all with ``action``. A layer's gradient coefficient of variation
    σ/|μ| above ``cv_max`` (0: off; the paper's 10 fires on every layer of a healthy model) gets ``grad_action``.
    The gradient histogram counts elements in ``hist_bins`` equal log2-magnitude bins over
    [2^``hist_min_log2``, 2^``hist_max_log2``) (its normalized entropy is a metric)."""

    enabled: bool = False
    """Weight-matrix health (Frobenius norm, effective rank, sparsity, a score) and per-layer gradient CV and histogram
    entropy (ARC paper; [detectors.md](detectors.md#weight-health))."""
    every: int = 50
    """Optimizer steps between measurements; off the schedule its slots stay zero.
    Allowed: >= 1, a multiple of `stats.interval`"""
    max_tensors: int = 64
    """Weight matrices (parameters of 2+ dimensions) tracked: all when they fit, else this many spread evenly over the
    model. Sets the slots' size (8 numbers per matrix).
    Allowed: [1, 4096]"""
    max_norm: float = 1.0e4
    """Explosion: a matrix's Frobenius norm above this (or not finite).
    Allowed: > 0"""
    collapse_ratio: float = 1.0e-3
    """Collapse: ‖W‖_F / ‖W₀‖_F below this (W₀: the matrix at the family's first measurement); 0: off.
    Allowed: [0, 1)"""
    sparsity_eps: float = 1.0e-8
    """Sparsity counts the elements with |w| below this.
    Allowed: > 0"""
    sparsity_increase: float = 0.1
    """Sparsity explosion: a matrix's sparsity above its first value plus this.
    Allowed: (0, 1]"""
    rank_samples: int = 2
    """Matrices whose effective rank (one SVD each) is computed per measurement, rotating; 0: none. Replicated matrices
    only.
    Allowed: [0, max_tensors]"""
    rank_drop: float = 0.5
    """Alarm when a matrix's effective rank falls by more than this fraction of its reference (`rank_window`).
    Allowed: (0, 1]"""
    rank_window: int = 5
    """The rank drop's reference: the largest of the matrix's last this many measured effective ranks (a collapse is a
    fall within them, not learning's slow compression); 0: its first value, the ARC paper's rule.
    Allowed: [0, 1000]"""
    cv_max: float = 0.0
    """Alarm when a layer's gradient σ/|μ| exceeds this; 0: off (the paper's 10 fires on every layer of a healthy
    model).
    Allowed: >= 0"""
    hist_bins: int = 48
    """Equal log2-magnitude bins of the gradient histogram (its normalized entropy is the metric `grad_entropy`).
    Allowed: [2, 1024]"""
    hist_min_log2: int = -40
    """Lower edge of the histogram's bins, log2|g|; smaller values (zeros too) count in the first bin.
    Allowed: < hist_max_log2"""
    hist_max_log2: int = 8
    """Upper edge of the histogram's bins, log2|g|; larger values count in the last bin.
    Allowed: > hist_min_log2"""
    norm_weight: float = 0.4
    """Weight of NormScore (the fraction of matrices with a healthy norm) in the score.
    Allowed: >= 0 (the three weights sum > 0)"""
    rank_weight: float = 0.3
    """Weight of RankScore (mean of min(1, rank / first rank)) in the score.
    Allowed: >= 0"""
    sparsity_weight: float = 0.3
    """Weight of SparsityScore (mean of 1 − sparsity rise / `sparsity_increase`, clipped to [0, 1]) in the score.
    Allowed: >= 0"""
    score_min: float = 0.5
    """Alarm when the weight-health score (in [0, 1]) falls below this; 0: off.
    Allowed: [0, 1]"""
    action: ActionName = "warn"
    """What a weight alarm (explosion, collapse, sparsity, rank drop, score) gets; the paper rolls back on a low
    score."""
    grad_action: ActionName = "warn"
    """What a gradient-CV alarm gets."""

    def __post_init__(self) -> None:
        require(self.every >= 1, "every", self.every, "must be an integer >= 1")
        require(1 <= self.max_tensors <= 4096, "max_tensors", self.max_tensors, "must be an integer in [1, 4096]")
        require(self.max_norm > 0, "max_norm", self.max_norm, "must be > 0")
        require(0 <= self.collapse_ratio < 1, "collapse_ratio", self.collapse_ratio, "must be in [0, 1)")
        require(self.sparsity_eps > 0, "sparsity_eps", self.sparsity_eps, "must be > 0")
        require(0 < self.sparsity_increase <= 1, "sparsity_increase", self.sparsity_increase, "must be in (0, 1]")
        require(0 <= self.rank_samples <= self.max_tensors, "rank_samples", self.rank_samples,
                "must be an integer in [0, max_tensors]")
        require(0 < self.rank_drop <= 1, "rank_drop", self.rank_drop, "must be in (0, 1]")
        require(0 <= self.rank_window <= 1000, "rank_window", self.rank_window, "must be an integer in [0, 1000]")
        require(self.cv_max >= 0, "cv_max", self.cv_max, "must be >= 0 (0 = off)")
        require(2 <= self.hist_bins <= 1024, "hist_bins", self.hist_bins, "must be an integer in [2, 1024]")
        require(self.hist_min_log2 < self.hist_max_log2, "hist_max_log2", self.hist_max_log2,
                "must be > hist_min_log2")
        for key in ("norm_weight", "rank_weight", "sparsity_weight"):
            require(getattr(self, key) >= 0, key, getattr(self, key), "must be >= 0")
        require(self.norm_weight + self.rank_weight + self.sparsity_weight > 0, "norm_weight", self.norm_weight,
                "norm_weight + rank_weight + sparsity_weight must be > 0")
        require(0 <= self.score_min <= 1, "score_min", self.score_min, "must be in [0, 1] (0 = off)")


@dataclass(kw_only=True)
class DynamicsConfig:
    """Training dynamics (ARC paper §3.4): every ``every`` optimizer steps (a multiple of ``stats.interval``) the
    parameter velocity v = ‖θ_t − θ_{t−every}‖ (exact: each rank adds its own part of the parameters, each element
    once over the decision group; each rank keeps a copy of its part), the online Lyapunov estimate λ̂ = mean over
    the last ``lyapunov_window`` velocities of ln(v_k / v_{k−1}) / ``every`` (per optimizer step, Algorithm 4),
    smoothed λ̄ ← ``ema`` λ̂ + (1 − ``ema``) λ̄, and the phase (§3.4.8): λ̄ above ``divergent`` is a failure
    (``action``; the paper rolls back), above ``warning`` a warning; |λ̄| below ``marginal`` checks the last
    ``window`` velocities for an oscillation (§3.4.7): the largest FFT power (the window's mean removed) above
    ``oscillation_factor`` times the
    mean power (the paper's 2 fires on white noise; see detectors.md) gets ``oscillation_action``. Each phase is
    reported when it begins; after ``warmup_measurements`` velocities. With ``stabilize`` (opt-in, §3.4.6), while
    λ̄ > ``marginal`` every monitored step's gradient g becomes g S + (1 − S) clip(g, c), S = exp(−λ̄),
    c = (1 − ``stabilize_strength``) + ``stabilize_strength`` e^{−λ̄} (a norm), from the agreed global norm.
    Attractor detection (§3.4.5): the displacements are also written as an ``attractor_sketch``-number random-sign
    sketch, whose running sum tracks the trajectory; over the last ``window`` positions, R = max ‖θ_t − θ̄‖ below
    ``attractor_radius`` (> 0) or below ``attractor_ratio`` times the path length, for ``attractor_steps``
    consecutive measurements, reports that training settled into an attractor (an info event)."""

    enabled: bool = False
    """Training dynamics (ARC paper §3.4): the parameter velocity, the online Lyapunov estimate, the phase and an FFT
    oscillation check ([detectors.md](detectors.md#training-dynamics)). Each rank keeps a copy of its part of the
    parameters (1/N of the model under DDP)."""
    every: int = 10
    """Optimizer steps between velocity measurements (v = ‖θ_t − θ_{t−every}‖).
    Allowed: >= 1, a multiple of `stats.interval`"""
    lyapunov_window: int = 8
    """Velocities whose mean log-ratio is the Lyapunov estimate (Algorithm 4's window).
    Allowed: >= 3"""
    window: int = 32
    """Velocities kept; the oscillation check's FFT window.
    Allowed: >= 4 and >= `lyapunov_window`"""
    ema: float = 0.3
    """Smoothing of the Lyapunov estimate: λ̄ ← ema λ̂ + (1 − ema) λ̄.
    Allowed: in (0, 1]"""
    divergent: float = 0.2
    """λ̄ (per optimizer step) above this: divergent, a failure that gets `action` (the paper rolls back).
    Allowed: > `warning`"""
    warning: float = 0.1
    """λ̄ above this: unstable, a warning; below minus this: convergent.
    Allowed: > 0"""
    marginal: float = 0.05
    """|λ̄| below this: marginal, and the velocity window is checked for an oscillation.
    Allowed: in (0, `warning`]"""
    oscillation_factor: float = 8.0
    """An oscillation: the largest FFT power of the velocity window (its mean removed) above this many times the mean
    power (the paper's 2 fires on white noise).
    Allowed: > 1"""
    warmup_measurements: int = 4
    """Velocities before a phase is reported.
    Allowed: >= 3"""
    stabilize: bool = False
    """Opt-in (§3.4.6): while λ̄ > `marginal`, scale each monitored step's gradient to g S + (1 − S) clip(g, c), S =
    exp(−λ̄), on every rank alike."""
    stabilize_strength: float = 0.5
    """The stabilisation's intervention strength: the clip norm c = (1 − strength) + strength e^{−λ̄}.
    Allowed: in [0, 1]"""
    attractor_sketch: int = 128
    """Numbers in the random-sign sketch of each displacement (in the step's one all-reduce) from which the trajectory's
    positions are tracked; 0: no attractor detection.
    Allowed: >= 0"""
    attractor_ratio: float = 0.05
    """An attractor (§3.4.5): over the last `window` positions, the largest distance from their centroid below this
    times the path length walked; 0: off.
    Allowed: in [0, 1)"""
    attractor_radius: float = 0.0
    """An attractor: that largest distance below this (parameter-space units, the paper's τ_attractor); 0: off.
    Allowed: >= 0"""
    attractor_steps: int = 5
    """Consecutive measurements inside the attractor rule before it is reported (an info event).
    Allowed: >= 1"""
    action: ActionName = "warn"
    """What a divergent trajectory gets."""
    oscillation_action: ActionName = "warn"
    """What an oscillation gets."""

    def __post_init__(self) -> None:
        require(self.every >= 1, "every", self.every, "must be an integer >= 1 (optimizer steps)")
        require(self.lyapunov_window >= 3, "lyapunov_window", self.lyapunov_window,
                "must be an integer >= 3 (velocities)")
        require(self.window >= max(4, self.lyapunov_window), "window", self.window,
                "must be an integer >= 4 and >= lyapunov_window (velocities)")
        require(0 < self.ema <= 1, "ema", self.ema, "must be in (0, 1]")
        require(self.divergent > self.warning > 0, "divergent", self.divergent, "must be > warning > 0")
        require(0 < self.marginal <= self.warning, "marginal", self.marginal, "must be in (0, warning]")
        require(self.oscillation_factor > 1, "oscillation_factor", self.oscillation_factor, "must be > 1")
        require(self.warmup_measurements >= 3, "warmup_measurements", self.warmup_measurements,
                "must be an integer >= 3 (two velocity ratios)")
        require(0 <= self.stabilize_strength <= 1, "stabilize_strength", self.stabilize_strength,
                "must be in [0, 1]")
        require(self.attractor_sketch >= 0, "attractor_sketch", self.attractor_sketch,
                "must be an integer >= 0 (0 = no attractor detection)")
        require(0 <= self.attractor_ratio < 1, "attractor_ratio", self.attractor_ratio, "must be in [0, 1)")
        require(self.attractor_radius >= 0, "attractor_radius", self.attractor_radius, "must be >= 0 (0 = off)")
        require(self.attractor_steps >= 1, "attractor_steps", self.attractor_steps, "must be an integer >= 1")


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


@dataclass(kw_only=True)
class FisherConfig:
    """Fisher-aware recovery (ARC paper §3.3 and §3.6, Algorithms 3, 7, 8): a diagonal Fisher estimate F ←
    ``decay`` g² + (1 − ``decay``) F of the gradient each rank's optimizer applies to its own tensors (its partition
    under ZeRO and FSDP2, the whole replica under DDP), updated every ``every`` applied steps (a multiple of
    ``stats.interval``). On those steps the agreement carries ΣF, ΣF ln F, the element count and the Fisher-Rao
    distance d_FR = √Σ F (θ − θ*)² from the last verified-stable state θ* (recovery's snapshots). After
    ``warmup_measurements``: d_FR above ``drift_threshold`` (> 0) or above ``drift_factor`` times the median of the
    last ``window`` healthy values gets ``drift_action`` (a preventive checkpoint); the Fisher's effective rank
    exp(H(F / ΣF)) below ``min_rank_fraction`` of the element count a warning. With ``importance_rollback`` a
    rollback blends θ = β θ_ckpt + (1 − β) θ_cur, β = sigmoid(``sharpness`` (F / F̄ − 1)); with ``ewc_strength``
    λ₀ > 0 the steps after a rollback add the EWC penalty's gradient λ_t F (θ − θ*), λ_t = λ₀ exp(−t /
    ``ewc_decay_steps``), for ``ewc_steps`` applied steps."""

    enabled: bool = False
    """Fisher-aware recovery (ARC paper §3.3, §3.6; [detectors.md](detectors.md#fisher-aware-recovery)): a diagonal
    Fisher estimate of each rank's own part, the Fisher-Rao drift from the last verified state, the Fisher's effective
    rank. Memory: 8 bytes per element of the rank's own part (DDP: the whole replica)."""
    every: int = 10
    """Applied optimizer steps between Fisher updates (and its statistics).
    Allowed: >= 1, a multiple of `stats.interval`"""
    decay: float = 0.05
    """F ← decay g² + (1 − decay) F (the first update sets F = g²).
    Allowed: in (0, 1]"""
    warmup_measurements: int = 20
    """Measurements before any verdict.
    Allowed: >= 1"""
    window: int = 64
    """Healthy Fisher-Rao distances kept; their median scales `drift_factor`.
    Allowed: >= 3"""
    drift_threshold: float = 0.0
    """A Fisher-Rao distance from the last verified-stable state above this gets `drift_action`; 0: off.
    Allowed: >= 0"""
    drift_factor: float = 10.0
    """A Fisher-Rao distance above this times the median of the healthy ones gets `drift_action`; 0: off.
    Allowed: 0 or > 1"""
    drift_action: ActionName = "checkpoint"
    """What a Fisher-Rao drift gets (a preventive checkpoint: the next verified snapshot goes to disk and becomes the
    new reference)."""
    min_rank_fraction: float = 0.001
    """The Fisher's effective rank below this fraction of the parameters: a warning; 0: off.
    Allowed: in [0, 1)"""
    importance_rollback: bool = False
    """A rollback keeps θ = β θ_ckpt + (1 − β) θ_now, β = sigmoid(sharpness (F / F̄ − 1)): the important parameters
    restored, the others kept. Needs `recovery.enabled`."""
    sharpness: float = 5.0
    """The importance weights' sharpness (the paper's λ times F̄).
    Allowed: > 0"""
    ewc_strength: float = 0.0
    """λ₀ of the EWC penalty (λ_t / 2) Σ F (θ − θ*)² added after a rollback (its gradient, inside the optimizer step);
    0: off. Needs `recovery.enabled`.
    Allowed: >= 0"""
    ewc_decay_steps: float = 50.0
    """λ_t = λ₀ exp(−t / this), t the applied steps since the rollback.
    Allowed: > 0"""
    ewc_steps: int = 200
    """Applied steps the EWC penalty lasts after a rollback.
    Allowed: >= 1"""

    def __post_init__(self) -> None:
        require(self.every >= 1, "every", self.every, "must be an integer >= 1 (optimizer steps)")
        require(0 < self.decay <= 1, "decay", self.decay, "must be in (0, 1]")
        require(self.warmup_measurements >= 1, "warmup_measurements", self.warmup_measurements,
                "must be an integer >= 1")
        require(self.window >= 3, "window", self.window, "must be an integer >= 3 (measurements)")
        require(self.drift_threshold >= 0, "drift_threshold", self.drift_threshold, "must be >= 0 (0 = off)")
        require(self.drift_factor == 0 or self.drift_factor > 1, "drift_factor", self.drift_factor,
                "must be 0 (off) or > 1")
        require(0 <= self.min_rank_fraction < 1, "min_rank_fraction", self.min_rank_fraction, "must be in [0, 1)")
        require(self.sharpness > 0, "sharpness", self.sharpness, "must be > 0")
        require(self.ewc_strength >= 0, "ewc_strength", self.ewc_strength, "must be >= 0 (0 = off)")
        require(self.ewc_decay_steps > 0, "ewc_decay_steps", self.ewc_decay_steps, "must be > 0 (applied steps)")
        require(self.ewc_steps >= 1, "ewc_steps", self.ewc_steps, "must be an integer >= 1 (applied steps)")


@dataclass(kw_only=True)
class DetectorsConfig:
    """One section per monitor family. A plugin family (:func:`arc_engine.monitors.registry.register_family`)
    reads ``detectors.<its name>`` like a built-in; the loader parses it with the family's own config class and
    keeps it in ``plugins`` (never written as a key of its own)."""

    sdc: SDCConfig = field(default_factory=SDCConfig)
    qk_spectra: QKSpectraConfig = field(default_factory=QKSpectraConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    consistency: ConsistencyConfig = field(default_factory=ConsistencyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    weight_health: WeightHealthConfig = field(default_factory=WeightHealthConfig)
    dynamics: DynamicsConfig = field(default_factory=DynamicsConfig)
    conformal: ConformalConfig = field(default_factory=ConformalConfig)
    fisher: FisherConfig = field(default_factory=FisherConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    r_metric: RMetricConfig = field(default_factory=RMetricConfig)
    plugins: dict[str, Any] = field(default_factory=dict, metadata={"plugin_sections": True})
    """The section of a monitor family registered as a plugin ([families.md](families.md)), parsed with that family's
    own config class; `--arc.detectors.<family>.<key>=VALUE` overrides work as for built-in sections.
    Allowed: a registered family's name and keys"""


@dataclass(kw_only=True)
class PolicyConfig:
    """How verdicts escalate.

    ``max_consecutive_skips``: a run of more than this many skipped steps in a row is no longer transient and
    escalates to ``on_persistent_failure``: ``rollback`` (with ``recovery.enabled``; otherwise it aborts) or
    ``abort``.
    ``max_consecutive_data_skips``: the same bound for the steps skipped for bad data (a finding that attributes the
    step to its batch, ``detectors.data``): a bad shard lasts as long as it lasts, and skipping it is the cure, so
    these count apart; past this many in a row the bad data does not end and the run escalates, saying so.
    ``max_consecutive_overflow_skips``: the same bound for the steps a dynamic loss scaler skips itself (torch.amp
    ``GradScaler``, DeepSpeed and megatron-core fp16) for non-finite gradients at a finite loss: a scaler searching
    its scale skips a few steps in a row, halving the scale each time, so these count apart and escalate only past
    this bound (32 halvings take Megatron's initial scale 2^32 to 1). Not when the same ranks, not every rank, hold
    the non-finite gradients step after step: no scale cures one rank's NaN, so those count as ordinary skips and
    escalate past ``max_consecutive_skips``, naming the ranks.
    ``mode``: ``act`` carries the decisions out; ``observe`` detects, reports and alerts exactly as ``act`` would
    (every finding, every event, W&B alerts, the action ``act`` would have taken) but never skips, rolls back,
    recomputes, aborts or ends a rank: every step the framework applies is applied, the hang watchdog only alerts,
    and no run of findings escalates. Steps the framework skips itself (a loss scaler's overflow) are still reported
    as its skips. ``recovery.enabled`` and ``detectors.sdc.recompute.enabled`` are refused under ``observe``.
    """

    max_consecutive_skips: int = 5
    """More skipped steps in a row than this escalate: the fault is persistent.
    Allowed: >= 0"""
    max_consecutive_data_skips: int = 100
    """More steps in a row than this skipped for bad data (a `detectors.data` finding, a data-ledger position) escalate:
    the bad data does not end; they do not count towards `max_consecutive_skips`.
    Allowed: >= 0"""
    max_consecutive_overflow_skips: int = 32
    """More steps in a row than this that a dynamic loss scaler skipped itself (fp16 overflow at a finite loss)
    escalate; they do not count towards `max_consecutive_skips`, except while the same ranks (not every rank) hold
    the non-finite gradients each time: that is a fault on those ranks, bounded by `max_consecutive_skips`.
    Allowed: >= 0"""
    on_persistent_failure: Literal["abort", "rollback"] = "rollback"
    """What escalation does; `rollback` needs `recovery.enabled`, else it aborts (exit code 3)."""
    mode: Literal["act", "observe"] = "act"
    """`act`: carry the decisions out; `observe`: detect, report and alert only (never skip, roll back, recompute, abort
    or end a rank; refuses `recovery.enabled` and `detectors.sdc.recompute.enabled`)."""

    def __post_init__(self) -> None:
        for key in ("max_consecutive_skips", "max_consecutive_data_skips", "max_consecutive_overflow_skips"):
            require(getattr(self, key) >= 0, key, getattr(self, key), "must be an integer >= 0")


@dataclass(kw_only=True)
class ConsoleSinkConfig:
    enabled: bool = True
    """Print events to the console."""
    min_severity: SeverityName = "info"
    """Lowest severity printed."""
    color: Literal["auto", "always", "never"] = "auto"
    """ANSI colours: `auto` when the output is a terminal."""


@dataclass(kw_only=True)
class JsonlSinkConfig:
    """Append-only JSON-lines logs in the run directory: one event (or metrics record) per line.

    ``ranks_file``: the per-rank statistics, on the steps a monitor has them (``detectors.consistency``: the extreme
    ranks' loss and local gradient norm every ``detail_every`` steps, every rank's on an alarm), for
    ``arc-engine report``'s per-rank panels.
    ``ranks_max``: per statistic, the values of at most this many ranks: every rank in a group no larger, else the
    ranks farthest from the median (so the line stays small on thousands of ranks).
    """

    enabled: bool = True
    """Append events and metrics as JSON lines in the run directory."""
    events_file: str = "events.jsonl"
    """File name of the event log.
    Allowed: a plain file name"""
    metrics_file: str = "metrics.jsonl"
    """File name of the metrics log.
    Allowed: a plain file name"""
    ranks_file: str = "ranks.jsonl"
    """File name of the per-rank statistics (the report's per-rank panels).
    Allowed: a plain file name"""
    ranks_max: int = 64
    """Per statistic, the values of at most this many ranks: all in a group no larger, else those farthest from the
    median.
    Allowed: an integer >= 1"""

    def __post_init__(self) -> None:
        for key in ("events_file", "metrics_file", "ranks_file"):
            value = getattr(self, key)
            require(value != "" and "/" not in value, key, value, "a plain file name")
        require(self.ranks_max >= 1, "ranks_max", self.ranks_max, "must be an integer >= 1")


@dataclass(kw_only=True)
class WandbSinkConfig:
    """Weights & Biases (the ``wandb`` extra): alerts for events at or above ``alert_min_severity`` and the monitors'
    metrics (under ``arc/``, every ``sinks.metrics_interval`` monitored steps), from one rank only.

    If a W&B run is already active in the process when arc_engine attaches (DeepSpeed's W&B monitor, Megatron's
    ``--wandb-project``, your own ``wandb.init``), it is reused (on whichever rank holds it); otherwise global rank
    0 starts one with ``project`` / ``entity`` / ``name`` / ``group`` / ``mode`` (None: wandb's own default or
    ``WANDB_MODE``), its files under ``dir`` (None: the arc run directory) and the W&B run id ``arc-<run id>``
    (``resume="allow"``, so a restart with the same ``run.run_id`` continues the same W&B run).
    ``alert_wait_s``: repeats of an alert with the same key (detector + ranks) within this window are counted, not
    sent; the count goes out in a summary alert when the window ends (and at close); also passed to W&B as
    ``wait_duration``. ``queue_size``: events and metrics wait in a bounded queue for the background thread (the
    training thread never blocks on W&B; overflow is dropped and counted). ``init_timeout_s`` bounds
    ``wandb.init``; ``close_timeout_s`` bounds the flush at close.
    """

    enabled: bool = False
    """Alerts and `arc/` metrics to Weights & Biases, from one rank."""
    project: str = "arc_engine"
    """Project of the run arc_engine starts when none is active.
    Allowed: a non-empty name"""
    entity: str | None = None
    """Entity of that run (null: wandb's default)."""
    name: str | None = None
    """Display name of that run (null: the arc run id)."""
    group: str | None = None
    """W&B group of that run."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """W&B mode of that run (null: wandb's default or `WANDB_MODE`)."""
    dir: str | None = None
    """Where that run's files go (null: the arc run directory)."""
    reuse_run: bool = True
    """Log into a W&B run already active in the job (on whichever rank holds it)."""
    alert_min_severity: SeverityName = "error"
    """Events at or above it become W&B alerts."""
    alert_wait_s: float = 600.0
    """Seconds during which repeats of an alert (same detector and ranks) are counted, not sent; also W&B's
    `wait_duration`.
    Allowed: >= 0"""
    queue_size: int = 1000
    """Bounded queue to the W&B thread; overflow is dropped and counted.
    Allowed: >= 1"""
    init_timeout_s: float = 90.0
    """Bound on `wandb.init`.
    Allowed: > 0"""
    close_timeout_s: float = 30.0
    """Bound on the flush at close.
    Allowed: > 0"""

    def __post_init__(self) -> None:
        require(bool(self.project), "project", self.project, "a non-empty W&B project name")
        require(self.alert_wait_s >= 0, "alert_wait_s", self.alert_wait_s, "must be >= 0 seconds")
        require(self.queue_size >= 1, "queue_size", self.queue_size, "must be an integer >= 1")
        require(self.init_timeout_s > 0, "init_timeout_s", self.init_timeout_s, "must be > 0 seconds")
        require(self.close_timeout_s > 0, "close_timeout_s", self.close_timeout_s, "must be > 0 seconds")


@dataclass(kw_only=True)
class SinksConfig:
    """Where events and metrics go.

    ``metrics_interval``: send the monitors' metrics to the sinks every k monitored steps (0 = never).
    ``all_ranks``: every rank writes its own sinks (files get a ``.rank<N>`` suffix); by default only global
    rank 0 does, since every rank holds the same gathered statistics and decisions.
    """

    console: ConsoleSinkConfig = field(default_factory=ConsoleSinkConfig)
    jsonl: JsonlSinkConfig = field(default_factory=JsonlSinkConfig)
    wandb: WandbSinkConfig = field(default_factory=WandbSinkConfig)
    metrics_interval: int = 10
    """Send the monitors' metrics to the sinks every k monitored steps (0: never).
    Allowed: >= 0"""
    all_ranks: bool = False
    """Every rank writes its own console and JSONL sinks (files get a `.rank<N>` suffix); W&B stays on one rank."""

    def __post_init__(self) -> None:
        require(self.metrics_interval >= 0, "metrics_interval", self.metrics_interval, "must be an integer >= 0")


@dataclass(kw_only=True)
class FaultSpec:
    """One injected fault: what, where (global rank) and when (optimizer step, 0-based).

    ``nan_grad`` / ``inf_grad``: the local gradient of parameter ``param`` (a name from
    ``model.named_parameters()``; default: the first one) on ``rank`` becomes NaN/Inf before the gradient
    reduction. ``nan_loss``: that rank's loss becomes NaN. ``loss_scale``: the loss (and so its gradient) is
    multiplied by ``scale`` on ``rank`` (-1 = every rank), like a pathological batch.
    ``lr_scale``: the learning rate of every parameter group is multiplied by ``scale`` for that step's update on
    ``rank`` (use -1: a learning-rate spike on one DDP replica only would also desynchronize the replicas).
    ``bitflip``: exponent-bit flips (:mod:`arc_engine.faults.bitflip`) in the outputs of the ``nn.Linear`` modules
    matching ``pattern`` (fnmatch on module names), ``where`` = ``forward`` (the GEMM output), ``backward`` (the
    backward-data GEMM output: the gradient of the layer's input) or ``weight_grad``; ``bit`` (None: the dtype's
    default exponent bit), ``count`` elements or a ``rate``; transient (fires once per step, on the first GEMM of
    each step in ``[step, step + steps)``, so a recomputation does not see it) or ``persistent`` (every call from
    ``step`` on, recomputations included: a faulty device).
    ``stall``: ``rank`` sleeps ``seconds`` at the start of the step (a hung data loader or a stuck device), so it
    stops stepping and its peers wait in the next collective (what the hang watchdog is for); with ``pattern``
    (fnmatch on module names) it sleeps right after the first matching module's forward in the step instead, as if
    that module's work took longer (a slow device; the straggler family times it as compute).
    Mechanism faults (:mod:`arc_engine.faults.mechanism`, for the mechanism-driven monitors), on every step in
    ``[step, step + steps)`` or, with ``persistent``, every step from ``step`` on:
    ``attention_lowbit``: biased low-bit rounding in attention (the paper's Appendix B): the output O and its
    gradient dO of the modules matching ``pattern`` (default ``*core_attention``) are rounded to BF16 with their
    lowest ``bits`` bits zeroed (1-7, the BF16 mantissa). ``router_collapse``: ``scale`` is added to the logit of
    expert ``expert`` of the routers matching ``pattern`` (default ``*router``) before routing. ``dead_expert``:
    that expert's logit is -inf before routing, so it receives no token from ``rank``.
    State faults (:mod:`arc_engine.faults.state_faults`; the R-Metric paper's fault library and ARC's sabotage), on
    every step attempt in ``[step, step + steps)`` or, with ``persistent``, every one from ``step`` on:
    ``grad_scale``: the local gradient (before the reduction) of the parameters whose names match ``pattern``
    (fnmatch on ``named_parameters()`` names; default: every parameter) becomes ``scale * g + N(0, (noise *
    rms(g))^2)`` on a ``rate`` fraction of its elements (None: all). ``data_corruption``: a ``rate`` fraction (None:
    0.3) of the token ids in the model's first positional argument become uniform random ids below the vocabulary
    size of the model's first embedding, on every forward. ``optimizer_state``: before the update, the optimizer
    state ``state_key`` of every stepped parameter is multiplied by ``scale``. ``collective_corruption``: before
    the update, the reduced gradient of every stepped parameter is multiplied by ``scale``, with probability
    ``rate`` (None: 1) per step (a collective that gave ``rank`` a wrong result; it acts after arc_engine's checks
    of the step, so it shows from the next step on). For these two, ``bit`` (a bit of the tensors' dtype) flips
    that bit in ``count`` (None: 1) elements of one stepped tensor instead of scaling them all (SDC in the
    optimizer's memory or in a reduction's result). ``weight_corruption``: at the step's first forward the
    parameters matching ``pattern`` (default: every one) become ``scale * w + N(0, (noise * rms(w))^2)`` on a
    ``rate`` fraction of their elements (None: all), in place. ``hardware_events``: ``count`` (None: 1) system
    events per step attempt, counted by the R-Metric's λ. ``memory_leak``: ``megabytes`` MiB allocated on the
    model's device per step attempt and kept until the injector is removed.
    ``steps``: how many consecutive steps from ``step`` the fault lasts (1 = transient).

    ``step`` counts step *attempts* (:attr:`ArcEngine.iteration`): it equals the optimizer step until a rollback
    replays steps, after which it keeps counting up, so a transient fault does not fire again on the replay.
    """

    kind: FaultKind
    """What to inject (see [faults.md](faults.md))."""
    rank: int
    """Global rank to inject on; -1: every rank.
    Allowed: >= -1"""
    step: int
    """Step attempt (0-based; keeps counting through rollbacks) at which it starts.
    Allowed: >= 0"""
    steps: int = 1
    """Consecutive steps it lasts (1: transient).
    Allowed: >= 1"""
    param: str | None = None
    """`nan_grad` / `inf_grad`: the parameter (a `named_parameters()` name; null: the first)."""
    scale: float = 50.0
    """`loss_scale` / `lr_scale`: the factor; `router_collapse`: what is added to the chosen expert's logit;
    `grad_scale` / `weight_corruption`: the factor on the chosen gradient / weight elements; `optimizer_state`: the
    factor on the optimizer state; `collective_corruption`: the factor on the reduced gradient.
    Allowed: any number"""
    pattern: str | None = None
    """`bitflip`: fnmatch pattern on the names of the `nn.Linear` modules (and megatron-core's parallel linears) to
    corrupt; `attention_lowbit` / `router_collapse` / `dead_expert`: on the attention (default `*core_attention`) or
    router (default `*router`) modules; `grad_scale` / `weight_corruption`: on the `named_parameters()` names (default:
    every parameter).
    Allowed: required for `bitflip`"""
    where: Literal["forward", "backward", "weight_grad"] = "backward"
    """`bitflip`: the GEMM output corrupted: forward output, backward-data output (the layer input's gradient) or weight
    gradient."""
    bit: int | None = None
    """`bitflip`: the bit to flip (null: the dtype's default exponent bit); `optimizer_state` / `collective_corruption`:
    flip this bit in `count` elements of one stepped tensor instead of scaling (null: scale).
    Allowed: [0, 31] or null"""
    count: int | None = None
    """`bitflip`, and `optimizer_state` / `collective_corruption` with `bit`: elements flipped per hit (with neither
    `count` nor `rate`: one); `hardware_events`: system events per step attempt (null: one).
    Allowed: >= 1 or null; not with `rate` for `bitflip`"""
    rate: float | None = None
    """`bitflip`: probability that each element is flipped; `grad_scale` / `weight_corruption`: fraction of the elements
    changed (null: all); `data_corruption`: fraction of the token ids replaced (null: 0.3); `collective_corruption`:
    probability that a step in the window is corrupted (null: 1).
    Allowed: (0, 1] or null; not with `count` for `bitflip`"""
    persistent: bool = False
    """`bitflip`: fire on every call from `step` on, recomputations included (a faulty device); else once per step, on
    the first GEMM. Mechanism and state faults: active on every step from `step` on."""
    seed: int = 0
    """`bitflip` and the state faults: seed of their random choices (mixed with the step).
    Allowed: any integer"""
    seconds: float = 0.0
    """`stall`: how long the rank sleeps at the step's first forward.
    Allowed: > 0 for `stall`"""
    bits: int = 6
    """`attention_lowbit`: the lowest bits of each BF16 word of the attention output and its gradient that are zeroed (a
    biased rounding toward zero).
    Allowed: [1, 7]"""
    expert: int = 0
    """`router_collapse`: the expert whose logit gets `scale` added; `dead_expert`: the expert that receives no token.
    Allowed: >= 0, below the number of experts"""
    noise: float = 0.0
    """`grad_scale` / `weight_corruption`: standard deviation of the Gaussian noise added to the chosen elements, in
    multiples of the tensor's RMS.
    Allowed: >= 0"""
    state_key: OptimizerStateKey = "exp_avg"
    """`optimizer_state`: the optimizer state tensor multiplied by `scale` (Adam's first or second moment)."""
    megabytes: float = 0.5
    """`memory_leak`: MiB allocated and kept on the model's device per step attempt.
    Allowed: > 0, finite"""

    def __post_init__(self) -> None:
        require(self.rank >= -1, "rank", self.rank, "a global rank >= 0, or -1 for every rank")
        require(self.kind != "bitflip" or bool(self.pattern), "pattern", self.pattern,
                "a Linear-module name pattern is required for kind 'bitflip'")
        require(self.where in ("forward", "backward", "weight_grad"), "where", self.where,
                "one of 'forward', 'backward', 'weight_grad'")
        require(self.step >= 0, "step", self.step, "must be an integer >= 0")
        require(self.steps >= 1, "steps", self.steps, "must be an integer >= 1")
        require(self.kind != "stall" or self.seconds > 0, "seconds", self.seconds, "must be > 0 for kind 'stall'")
        require(1 <= self.bits <= 7, "bits", self.bits, "an integer in [1, 7] (the BF16 mantissa bits to zero)")
        require(self.expert >= 0, "expert", self.expert, "an expert index >= 0")
        require(self.rate is None or 0.0 < self.rate <= 1.0, "rate", self.rate, "a fraction in (0, 1], or null")
        require(self.count is None or self.count >= 1, "count", self.count, "an integer >= 1, or null")
        require(self.noise >= 0.0, "noise", self.noise, "must be >= 0 (a multiple of the tensor's RMS)")
        require(self.state_key in ("exp_avg", "exp_avg_sq"), "state_key", self.state_key,
                "one of 'exp_avg', 'exp_avg_sq'")
        require(0.0 < self.megabytes < math.inf, "megabytes", self.megabytes, "a finite number > 0 (MiB per step)")


@dataclass(kw_only=True)
class FaultsConfig:
    """Fault injection, for tests and demos. Empty by default; never enable it in production."""

    injections: list[FaultSpec] = field(default_factory=list)
    """Faults to inject, for tests and demos only; each entry is a fault spec (the `faults.injections[]` keys below)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Persistent sharded checkpoints (torch.distributed.checkpoint ``async_save``), the disk tier of recovery.

    ``dir``: where checkpoints go (a filesystem every rank sees); default ``<run_dir>/<run_id>/checkpoints``.
    Resuming after a restart needs the same directory, so set ``run.run_id`` or ``dir`` (torchrun's
    ``TORCHELASTIC_RUN_ID`` is stable across its restarts).
    ``every_steps``: save a verified-stable state to disk at the first one at least this many steps after the
    previous save (0 = no disk checkpoints). ``keep_last``: committed checkpoints kept (pinned ones are kept
    besides). ``commit_timeout_s``: bound on waiting for every rank's shard before a save is declared failed.
    ``resume``: on attach, load the newest committed checkpoint if there is one (of ``resume_step`` where a trainer
    resumed that step and one was committed; none where the trainer's is the newer). ``format``: the files inside a
    checkpoint: ``auto`` is the framework's own where arc_engine writes one (megatron-core: ``dist_checkpointing``,
    which Megatron users load with their tools), else arc_engine's DCP layout; ``dcp`` and ``megatron`` force one.
    ``on_error``: a directory that is not writable at attach ends the job with exit code 2 and one line
    (``raise``), or an error event and no disk tier for the run (``continue``). A save that fails later is always an
    error event (every sink, W&B alert included) naming the checkpoint and the reason; its files are removed.
    """

    enabled: bool = True
    """The disk tier: sharded async checkpoints of verified-stable states."""
    dir: str | None = None
    """Checkpoint directory, on a filesystem every rank sees (null: `<run_dir>/<run_id>/checkpoints`).
    Allowed: a non-empty path or null"""
    every_steps: int = 100
    """Save a verified-stable state at least this many steps after the previous save (0: never).
    Allowed: >= 0"""
    keep_last: int = 3
    """Committed checkpoints kept, besides pinned ones.
    Allowed: >= 1"""
    commit_timeout_s: float = 600.0
    """Bound on waiting for every rank's shard before a save is declared failed.
    Allowed: > 0"""
    resume: bool = True
    """At attach, load the newest committed checkpoint if there is one."""
    resume_step: int | None = None
    """The step a trainer resumed from its own checkpoint (counted as `resume_counter` says; the HF and Lightning
    callbacks and the Megatron-LM launcher set it): at attach, resume the committed checkpoint of that step when there
    is one -- the newer ones, of the run that went past it, are removed --, none when the trainer's is newer than the
    newest, else the newest. Unset: the newest.
    Allowed: >= 0, or unset"""
    resume_counter: Literal["applied_steps", "step"] = "applied_steps"
    """What `resume_step` counts: `applied_steps` (a trainer whose step counter counts applied steps: the HF Trainer,
    Lightning) or `step` (one that counts every step, applied or not: Megatron-LM's iteration)."""
    format: Literal["auto", "dcp", "megatron"] = "auto"
    """Files inside a checkpoint: `auto` (the framework's own where arc_engine writes it: megatron-core
    `dist_checkpointing`; else DCP), `dcp` (arc_engine's DCP layout), `megatron`."""
    on_error: Literal["raise", "continue"] = "raise"
    """A checkpoint directory that is not writable at attach: `raise` (every rank exits with code 2 after one line) or
    `continue` (an error event, no disk tier for the run)."""

    def __post_init__(self) -> None:
        require(self.dir is None or self.dir != "", "dir", self.dir, "a non-empty path (or unset)")
        require(self.every_steps >= 0, "every_steps", self.every_steps, "must be an integer >= 0 (0 = never)")
        require(self.keep_last >= 1, "keep_last", self.keep_last, "must be an integer >= 1")
        require(self.commit_timeout_s > 0, "commit_timeout_s", self.commit_timeout_s, "must be > 0 seconds")
        require(self.resume_step is None or self.resume_step >= 0, "resume_step", self.resume_step,
                "must be an integer >= 0 (or unset)")
        require(self.format in ("auto", "dcp", "megatron"), "format", self.format, "one of auto, dcp, megatron")
        require(self.resume_counter in ("applied_steps", "step"), "resume_counter", self.resume_counter,
                "one of applied_steps, step")


@dataclass(kw_only=True)
class RecoveryConfig:
    """The ARC self-healing loop (paper §3.1, Algorithm 1): verified-stable snapshots, rollback, heal, escape.

    ``checkpoint_freq``: consecutive healthy steps after which the state is snapshotted; the snapshot becomes
    verified-stable when the next monitored step is healthy too. ``memory_ring_mb``: host memory per rank for
    verified-stable snapshots (0 = disk tier only; unset = sized from the state: room for two snapshots of the
    largest rank, within a quarter of this host's memory shared by its ranks). ``lr_reduction_factor``: the learning
    rate is multiplied by it at each rollback (compounding over consecutive rollbacks) and returns linearly to the
    scheduled value over ``lr_recovery_steps`` healthy steps. ``skip_data``: ``window`` resumes the data after the
    batch that failed (the batches between the snapshot and the failure are not replayed), ``none`` replays them,
    ``stream`` is for loaders that cannot seek (the Hugging Face and Lightning trainers'): training goes on with the
    batches the loader yields next, as ``window`` would, and an escape skips no batches. ``rollback``:
    ``in_process`` restores the state in the running job; ``relaunch`` (for loops that own the iteration counter and
    the data, like Megatron-LM's ``pretrain()``) stops every rank with exit code 7 once the newest disk checkpoint
    is committed, writing ``relaunch.json`` in the run directory: the checkpoint to load and the steps whose batches
    to skip (per ``skip_data``); it needs the disk tier (``checkpoint.every_steps``). ``heal_clip_grad_norm``: while
    the learning rate is reduced, also scale gradients to at most this global norm (unset = no extra clipping).
    ``max_consecutive_rollbacks``: rollbacks without a verified-stable state in between before the next failure
    escapes instead: ``perturbation_scale`` x the RMS of each parameter (or shard) of Gaussian noise on the restored
    weights and ``skip_ahead_steps`` batches skipped. ``max_escapes``: escapes in one recovery episode before
    training stops with exit code 4. An episode ends after ``lr_recovery_steps`` healthy steps.
    """

    enabled: bool = False
    """The ARC loop: verified-stable snapshots, rollback, heal, escape, resume."""
    checkpoint_freq: int = 20
    """Healthy steps between snapshots; a snapshot becomes verified-stable when the next step is healthy.
    Allowed: >= 1"""
    memory_ring_mb: float | None = None
    """Host memory per rank for verified-stable snapshots (0: disk tier only; unset: room for two snapshots of the
    largest rank, within a quarter of the host's memory shared by its ranks). A state that does not fit is a
    `memory_ring_off` warning event.
    Allowed: >= 0, or unset"""
    lr_reduction_factor: float = 0.5
    """Learning rate x this factor per rollback (compounding).
    Allowed: (0, 1]"""
    lr_recovery_steps: int = 100
    """Healthy steps over which the learning rate returns linearly to the schedule; also the length of a recovery
    episode.
    Allowed: >= 1"""
    skip_data: Literal["window", "none", "stream"] = "window"
    """`window`: resume the data after the failed batch; `none`: replay the same batches; `stream`: the loader cannot
    seek, training goes on with its next batches (escapes skip none)."""
    rollback: Literal["in_process", "relaunch"] = "in_process"
    """`in_process`: restore the state in the running job; `relaunch`: stop every rank (exit code 7) and write
    `relaunch.json` (the checkpoint to load, the batches to skip) for loops that own the iteration counter
    (Megatron-LM's `pretrain()`)."""
    heal_clip_grad_norm: float | None = None
    """While healing, also scale gradients to at most this global norm (null: no extra clipping).
    Allowed: > 0 or null"""
    max_consecutive_rollbacks: int = 3
    """Rollbacks without a new verified-stable state before the next failure escapes instead.
    Allowed: >= 1"""
    perturbation_scale: float = 1.0e-3
    """Escape: Gaussian noise of this many times each parameter's RMS on the restored weights.
    Allowed: >= 0"""
    skip_ahead_steps: int = 10
    """Escape: batches skipped.
    Allowed: >= 0"""
    max_escapes: int = 2
    """Escapes in one recovery episode before training stops with exit code 4.
    Allowed: >= 0"""
    seed: int = 0
    """Seed of the escape noise (the same on every replica).
    Allowed: any integer"""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        require(self.checkpoint_freq >= 1, "checkpoint_freq", self.checkpoint_freq, "must be an integer >= 1")
        require(self.memory_ring_mb is None or self.memory_ring_mb >= 0, "memory_ring_mb", self.memory_ring_mb,
                "must be >= 0 (0 = disk only), or unset (sized from the state)")
        require(0 < self.lr_reduction_factor <= 1, "lr_reduction_factor", self.lr_reduction_factor,
                "must be in (0, 1]")
        require(self.lr_recovery_steps >= 1, "lr_recovery_steps", self.lr_recovery_steps, "must be an integer >= 1")
        require(self.heal_clip_grad_norm is None or self.heal_clip_grad_norm > 0, "heal_clip_grad_norm",
                self.heal_clip_grad_norm, "must be > 0 (or unset)")
        require(self.max_consecutive_rollbacks >= 1, "max_consecutive_rollbacks", self.max_consecutive_rollbacks,
                "must be an integer >= 1")
        require(self.perturbation_scale >= 0, "perturbation_scale", self.perturbation_scale, "must be >= 0")
        require(self.skip_ahead_steps >= 0, "skip_ahead_steps", self.skip_ahead_steps, "must be an integer >= 0")
        require(self.max_escapes >= 0, "max_escapes", self.max_escapes, "must be an integer >= 0")
        require(self.rollback != "relaunch" or self.checkpoint.every_steps > 0, "rollback", self.rollback,
                "relaunch needs the disk tier: set recovery.checkpoint.every_steps > 0")


@dataclass(kw_only=True)
class WatchdogConfig:
    """The hang watchdog: a background thread on every rank that fires when no step completes in time.

    Before ``warmup_steps`` steps have completed the timeout is ``initial_timeout_s`` (first steps compile, build
    communicators, load data); after, ``safety_factor`` x the longest step seen since warm-up, clamped to
    [``min_timeout_s``, ``max_timeout_s``]. On firing: a critical ``hang`` event through every sink of the rank
    (alerts included) and, with ``dump_stacks``, every thread's Python stack in
    ``<run_dir>/<run_id>/stacks/rank<N>-iter<I>.txt``. Once per hang; re-armed by the next completed step. It never
    takes part in a collective, so a dead collective cannot hang it. Each rank's progress (steps completed, and
    whether it is waiting in the step's agreement) is published in the job's c10d store from the watchdog thread:
    the hang event names the ranks that stopped -- the ones behind the others -- not the rank that noticed. With
    ``action: abort``, after ``abort_after`` timeouts in a row without a completed step the rank exits with code 6
    (every rank's own watchdog does the same, so every rank that can still run exits).
    """

    enabled: bool = True
    """A thread per rank that reports a hang when no step completes in time."""
    warmup_steps: int = 10
    """Completed steps before the timeout is derived from step times.
    Allowed: >= 1"""
    initial_timeout_s: float = 1800.0
    """The timeout until then (compilation, communicator set-up).
    Allowed: > 0"""
    safety_factor: float = 5.0
    """Timeout = this factor x the longest step since the warm-up, clamped.
    Allowed: >= 1"""
    min_timeout_s: float = 300.0
    """Lower clamp of the derived timeout.
    Allowed: > 0"""
    max_timeout_s: float = 3600.0
    """Upper clamp of the derived timeout.
    Allowed: >= `min_timeout_s`"""
    dump_stacks: bool = True
    """On a hang, write every thread's Python stack to `<run_dir>/<run_id>/stacks/rank<N>-iter<I>.txt`."""
    action: Literal["alert", "abort"] = "abort"
    """`alert`: report the hang only; `abort`: after `abort_after` timeouts in a row, exit with code 6 (every rank's own
    watchdog does)."""
    abort_after: int = 2
    """Timeouts in a row without a completed step before `abort` ends the process.
    Allowed: >= 1"""

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 1, "warmup_steps", self.warmup_steps, "must be an integer >= 1")
        require(self.initial_timeout_s > 0, "initial_timeout_s", self.initial_timeout_s, "must be > 0 seconds")
        require(self.safety_factor >= 1, "safety_factor", self.safety_factor, "must be >= 1")
        require(self.min_timeout_s > 0, "min_timeout_s", self.min_timeout_s, "must be > 0 seconds")
        require(self.max_timeout_s >= self.min_timeout_s, "max_timeout_s", self.max_timeout_s,
                "must be >= min_timeout_s")
        require(self.abort_after >= 1, "abort_after", self.abort_after, "must be an integer >= 1")


@dataclass(kw_only=True)
class CurvatureConfig:
    """Curvature diagnostics (ARC paper §3.2): on demand (:meth:`arc_engine.attach.Arc.measure_curvature`, with the
    user's loss on a held micro-batch), and every ``every`` optimizer steps where the loop asks
    (:meth:`arc_engine.attach.Arc.curvature_due`; 0: on demand only). Each rank measures on its own micro-batch with
    Hessian-vector products (double backward, ``torch.autograd.grad``, never ``.grad``): the Hutchinson trace over
    ``probes`` Rademacher vectors, the largest eigenvalue by ``power_iterations`` steps of power iteration, and the
    SAM sharpness L(θ + ``sam_rho`` g/‖g‖) − L(θ); the ranks' values are averaged (one all-reduce of 4 numbers). The
    parameters, their gradients and the RNG state are left as they were. Probe vectors are drawn from ``seed`` and
    the step, the same on every rank."""

    every: int = 0
    """Optimizer steps between curvature measurements when the training loop asks `arc.curvature_due()`; 0: on demand
    only ([diagnostics.md](diagnostics.md)).
    Allowed: >= 0"""
    probes: int = 8
    """Rademacher vectors of the Hutchinson trace estimate (one Hessian-vector product each).
    Allowed: >= 1"""
    power_iterations: int = 10
    """Power-iteration steps for the largest Hessian eigenvalue (one Hessian-vector product each).
    Allowed: >= 1"""
    sam_rho: float = 0.05
    """SAM radius: sharpness = L(θ + ρ g/‖g‖) − L(θ); 0: not measured.
    Allowed: >= 0"""
    seed: int = 0
    """Seed of the probe vectors (with the step: the same on every rank).
    Allowed: any integer"""

    def __post_init__(self) -> None:
        require(self.every >= 0, "every", self.every, "must be an integer >= 0 (0 = on demand only)")
        require(self.probes >= 1, "probes", self.probes, "must be an integer >= 1")
        require(self.power_iterations >= 1, "power_iterations", self.power_iterations, "must be an integer >= 1")
        require(self.sam_rho >= 0, "sam_rho", self.sam_rho, "must be >= 0 (0 = no SAM sharpness)")


@dataclass(kw_only=True)
class DiagnosticsConfig:
    """Expensive diagnostics that run on demand or every N steps, never on the step's hot path."""

    curvature: CurvatureConfig = field(default_factory=CurvatureConfig)


@dataclass(kw_only=True)
class ArcConfig:
    """The root of the arc_engine configuration (what ``--arc-config arc.yaml`` holds)."""

    run: RunConfig = field(default_factory=RunConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    detectors: DetectorsConfig = field(default_factory=DetectorsConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    sinks: SinksConfig = field(default_factory=SinksConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)

    def __post_init__(self) -> None:
        if self.policy.mode == "observe":  # settings whose only purpose is to act
            require(not self.recovery.enabled, "recovery.enabled", self.recovery.enabled,
                    "must be false under policy.mode: observe (observe never rolls back)")
            require(not self.detectors.sdc.recompute.enabled, "detectors.sdc.recompute.enabled",
                    self.detectors.sdc.recompute.enabled,
                    "must be false under policy.mode: observe (observe never recomputes a step)")

    @property
    def observing(self) -> bool:
        """``policy.mode: observe``: decisions are reported, never carried out."""
        return self.policy.mode == "observe"


__all__ = [
    "ArcConfig",
    "CheckpointConfig",
    "ConfigError",
    "ConsoleSinkConfig",
    "DetectorsConfig",
    "FaultSpec",
    "FaultsConfig",
    "JsonlSinkConfig",
    "PolicyConfig",
    "RecoveryConfig",
    "RunConfig",
    "SDCConfig",
    "SinksConfig",
    "StatsConfig",
    "WandbSinkConfig",
    "WatchdogConfig",
]

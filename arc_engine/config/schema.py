"""The typed configuration tree.

Every component owns a small ``kw_only`` dataclass; :class:`ArcConfig` composes them. Each dataclass validates
its own values in ``__post_init__`` and raises :class:`~arc_engine.config.errors.ConfigError` naming the key
(relative to that dataclass; the loader prefixes the path and the source file).

Actions a detector may request (``action`` keys):

* ``warn``  -- emit an event, apply the step as usual;
* ``skip``  -- the optimizer does not apply this step on any rank (counted and reported);
* ``abort`` -- every rank stops with :data:`arc_engine.policy.EXIT_ABORT`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from arc_engine.config.errors import ConfigError, require

ActionName = Literal["warn", "skip", "abort"]
SeverityName = Literal["debug", "info", "warning", "error", "critical"]
FaultKind = Literal["nan_grad", "inf_grad", "nan_loss", "loss_scale"]


@dataclass(kw_only=True)
class RunConfig:
    """Where a run writes and how it is named.

    ``run_id``: a name shared by every rank; when unset, torchrun's ``TORCHELASTIC_RUN_ID`` is used if it is
    set, else rank 0 makes one (``YYYYmmdd-HHMMSS``) and broadcasts it once at attach time.
    ``run_dir``: parent folder; the run's files go to ``<run_dir>/<run_id>/``.
    """

    run_id: str | None = None
    run_dir: str = "arc_runs"

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
    """

    interval: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    optimizer_stats_every: int = 10

    def __post_init__(self) -> None:
        require(self.interval >= 1, "interval", self.interval, "must be an integer >= 1")
        require(self.optimizer_stats_every >= 0, "optimizer_stats_every", self.optimizer_stats_every,
                "must be an integer >= 0 (0 = never)")


@dataclass(kw_only=True)
class NonFiniteConfig:
    """NaN/Inf in any rank's loss or local gradient (per parameter group)."""

    enabled: bool = True
    action: ActionName = "skip"


@dataclass(kw_only=True)
class LossSpikeConfig:
    """Loss spike against a robust running baseline (median and MAD of recent accepted losses).

    A step is a spike when, after ``warmup_steps`` accepted steps, its loss exceeds the window median by more
    than ``factor`` robust standard deviations (1.4826 x MAD) *and* by more than ``min_relative_increase`` of
    the median. Flagged losses never enter the baseline.
    """

    enabled: bool = True
    warmup_steps: int = 20
    window: int = 100
    factor: float = 6.0
    min_relative_increase: float = 0.25
    action: ActionName = "skip"

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 3, "warmup_steps", self.warmup_steps, "must be an integer >= 3")
        require(self.window >= self.warmup_steps, "window", self.window, "must be >= warmup_steps")
        require(self.factor > 0, "factor", self.factor, "must be > 0")
        require(self.min_relative_increase >= 0, "min_relative_increase", self.min_relative_increase,
                "must be >= 0")


@dataclass(kw_only=True)
class GradNormConfig:
    """Gradient explosion and vanishing on the global (reduced, pre-clip) gradient norm (ARC paper §3.2.1)."""

    enabled: bool = True
    explosion_threshold: float = 1.0e4
    vanishing_threshold: float = 1.0e-10
    explosion_action: ActionName = "skip"
    vanishing_action: ActionName = "warn"

    def __post_init__(self) -> None:
        require(self.explosion_threshold > 0, "explosion_threshold", self.explosion_threshold, "must be > 0")
        require(0 <= self.vanishing_threshold < self.explosion_threshold, "vanishing_threshold",
                self.vanishing_threshold, "must be >= 0 and below explosion_threshold")


@dataclass(kw_only=True)
class DetectorsConfig:
    non_finite: NonFiniteConfig = field(default_factory=NonFiniteConfig)
    loss_spike: LossSpikeConfig = field(default_factory=LossSpikeConfig)
    grad_norm: GradNormConfig = field(default_factory=GradNormConfig)


@dataclass(kw_only=True)
class PolicyConfig:
    """How verdicts escalate.

    ``max_consecutive_skips``: a run of more than this many skipped steps in a row is no longer transient and
    escalates to ``on_persistent_failure``.
    """

    max_consecutive_skips: int = 5
    on_persistent_failure: Literal["abort"] = "abort"

    def __post_init__(self) -> None:
        require(self.max_consecutive_skips >= 0, "max_consecutive_skips", self.max_consecutive_skips,
                "must be an integer >= 0")


@dataclass(kw_only=True)
class ConsoleSinkConfig:
    enabled: bool = True
    min_severity: SeverityName = "info"
    color: Literal["auto", "always", "never"] = "auto"


@dataclass(kw_only=True)
class JsonlSinkConfig:
    """Append-only JSON-lines logs in the run directory: one event (or metrics record) per line."""

    enabled: bool = True
    events_file: str = "events.jsonl"
    metrics_file: str = "metrics.jsonl"

    def __post_init__(self) -> None:
        for key in ("events_file", "metrics_file"):
            value = getattr(self, key)
            require(value != "" and "/" not in value, key, value, "a plain file name")


@dataclass(kw_only=True)
class SinksConfig:
    """Where events and metrics go.

    ``metrics_interval``: send the monitors' metrics to the sinks every k monitored steps (0 = never).
    ``all_ranks``: every rank writes its own sinks (files get a ``.rank<N>`` suffix); by default only global
    rank 0 does, since every rank holds the same gathered statistics and decisions.
    """

    console: ConsoleSinkConfig = field(default_factory=ConsoleSinkConfig)
    jsonl: JsonlSinkConfig = field(default_factory=JsonlSinkConfig)
    metrics_interval: int = 10
    all_ranks: bool = False

    def __post_init__(self) -> None:
        require(self.metrics_interval >= 0, "metrics_interval", self.metrics_interval, "must be an integer >= 0")


@dataclass(kw_only=True)
class FaultSpec:
    """One injected fault: what, where (global rank) and when (optimizer step, 0-based).

    ``nan_grad`` / ``inf_grad``: the local gradient of parameter ``param`` (a name from
    ``model.named_parameters()``; default: the first one) on ``rank`` becomes NaN/Inf before the gradient
    reduction. ``nan_loss``: that rank's loss becomes NaN. ``loss_scale``: the loss (and so its gradient) is
    multiplied by ``scale`` on ``rank`` (-1 = every rank), like a pathological batch.
    ``steps``: how many consecutive steps from ``step`` the fault lasts (1 = transient).
    """

    kind: FaultKind
    rank: int
    step: int
    steps: int = 1
    param: str | None = None
    scale: float = 50.0

    def __post_init__(self) -> None:
        require(self.rank >= -1, "rank", self.rank, "a global rank >= 0, or -1 for every rank")
        require(self.step >= 0, "step", self.step, "must be an integer >= 0")
        require(self.steps >= 1, "steps", self.steps, "must be an integer >= 1")


@dataclass(kw_only=True)
class FaultsConfig:
    """Fault injection, for tests and demos. Empty by default; never enable it in production."""

    injections: list[FaultSpec] = field(default_factory=list)


@dataclass(kw_only=True)
class ArcConfig:
    """The root of the arc_engine configuration (what ``--arc-config arc.yaml`` holds)."""

    run: RunConfig = field(default_factory=RunConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    detectors: DetectorsConfig = field(default_factory=DetectorsConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    sinks: SinksConfig = field(default_factory=SinksConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)


__all__ = [
    "ArcConfig",
    "ConfigError",
    "ConsoleSinkConfig",
    "DetectorsConfig",
    "FaultSpec",
    "FaultsConfig",
    "GradNormConfig",
    "JsonlSinkConfig",
    "LossSpikeConfig",
    "NonFiniteConfig",
    "PolicyConfig",
    "RunConfig",
    "SinksConfig",
    "StatsConfig",
]

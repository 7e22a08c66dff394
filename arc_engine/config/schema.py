"""The typed configuration tree.

Every component owns a small ``kw_only`` dataclass; :class:`ArcConfig` composes them. Each dataclass validates
its own values in ``__post_init__`` and raises :class:`~arc_engine.config.errors.ConfigError` naming the key
(relative to that dataclass; the loader prefixes the path and the source file). The engine's own sections live
here; each monitor family's ``detectors.<name>`` section lives in its module (``arc_engine/monitors/<family>.py``).

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
    """Where a run writes and how it is named."""

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
    """The per-step statistics pipeline. The optimizer statistics are computed on each rank's own parameters or
    shard inside the optimizer step."""

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
class DetectorsConfig:
    """One section per monitor family. Each family's section is a dataclass of its own (the family's
    ``config_class``, in its module under ``arc_engine/monitors``; a plugin's registered with
    :func:`arc_engine.monitors.registry.register_family`): the loader parses ``detectors.<name>`` with it and keeps it
    in ``plugins`` (never written as a key of its own; a section at its defaults is kept as absent). Read a section with
    :func:`arc_engine.monitors.family.section_of`."""

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
    ``arc-engine report``'s per-rank panels; ``ranks_max`` keeps the line small on thousands of ranks.
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
    """Where events and metrics go. By default only global rank 0 writes them: every rank holds the same gathered
    statistics and decisions."""

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
    """Persistent sharded checkpoints (torch.distributed.checkpoint, written in the background): the disk tier.

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
            # the sdc family's section, read here without its module (absent: its defaults, recomputation off)
            sdc = self.detectors.plugins.get("sdc")
            recompute = sdc is not None and sdc.recompute.enabled
            require(not recompute, "detectors.sdc.recompute.enabled", recompute,
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
    "SinksConfig",
    "StatsConfig",
    "WandbSinkConfig",
    "WatchdogConfig",
]

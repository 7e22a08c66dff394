"""Silent data corruption: jumps of the Adam update RMS (SDC paper §VI; clean form in ../shared/papers/README.md).

Per step, from the prospective update U = m̂/(√v̂+ε) that the optimizer is *about to* apply (computed from the
final gradient and the current moments, so a flagged update is never applied):

* R_t = max over parameter groups of RMS(U);  ΔR_t = |R_t − R_{t−1}|;
* μ = mean of ΔR over the warm-up (the first ``warmup_steps`` applied steps with a ΔR);
* ΔG_t = max(0, ‖G_t‖_pre − ‖G_{t−1}‖_pre), the pre-clip global gradient norm;
* flag when ΔR_t > μ / (α √ΔG_t) (ΔG_t = 0 never flags), or when ‖G_t‖_pre is not finite (left to the non-finite
  detector when it is on -- the default -- and the recomputation is off, so a NaN step, a bad batch's as much as a
  corrupted device's, is reported once, with the rank it came from, and not as suspected SDC).

R_t is computed on windows that move every monitored step when ``update_sample`` < 1
(:mod:`arc_engine.stats.sampling`); μ is learned under the same motion, so the rule needs no change for it.

The rule runs on the agreed (reduced) statistics, so every rank takes the same decision. Only applied steps move
the baselines: after a skipped step, R_{t−1} and ‖G_{t−1}‖ are still those of the last applied update.

Localization: each rank's *local* gradient norm (before the reduction: DDP comm hook, ZeRO tensor hooks, FSDP2
unsharded hooks) is in its statistics buffer, next to its own norm at the previous applied step (which the monitor
keeps for its rank and writes before the agreement). Only a flagged step fetches them from every rank (the rare
per-rank collective): a rank is named suspect when its local norm is not finite, or when its jump against its own
previous applied step exceeds ``localize_factor`` times the median jump of the other ranks (so it works from 2
ranks up: a healthy peer's jump is the reference). The finding also carries each rank's gradient-sketch cosine to
its peers (``sdc_local.py``): the corrupted rank's sketch points away.

Recovery (withholding before the reduction, recomputation on the suspect only, the peer check) is in
``arc_engine/recovery/recompute.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from arc_engine.config.errors import require
from arc_engine.config.schema import ActionName
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext, StatDecl, optimizer_statistics, section_of
from arc_engine.monitors.non_finite import NonFiniteFamily
from arc_engine.monitors.sdc_local import cosine_to_peers
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, names
from arc_engine.stats.optim_stats import rms_per_group


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




def update_rms_max(update_sq_g: np.ndarray, count_g: np.ndarray) -> float:
    """R_t: the largest per-group RMS of U over groups that have elements (NaN when none has)."""
    rms = [r for r, c in zip(rms_per_group(update_sq_g, count_g), count_g, strict=True) if c > 0]
    return max(rms) if rms else float("nan")


def sdc_threshold(mu: float, alpha: float, delta_g: float) -> float:
    """The largest ΔR_t that is not flagged: μ / (α √ΔG_t); infinite when ΔG_t = 0 (the rule cannot fire)."""
    if delta_g <= 0.0:
        return math.inf
    return mu / (alpha * math.sqrt(delta_g))


def suspect_ranks(local_norm_r: np.ndarray, previous_local_norm_r: np.ndarray, factor: float) -> list[int]:
    """Row indices of the ranks whose local gradient norm is non-finite, or whose jump (this step / previous
    applied step) is more than ``factor`` times the median jump of the other ranks. Pure."""
    with np.errstate(divide="ignore", invalid="ignore"):
        jump_r = local_norm_r / previous_local_norm_r
    suspects = []
    for row, (norm, jump) in enumerate(zip(local_norm_r, jump_r, strict=True)):
        others = np.delete(jump_r, row)
        others = others[np.isfinite(others)]
        jumped = others.size > 0 and np.isfinite(jump) and jump > factor * max(float(np.median(others)), 1e-12)
        if not np.isfinite(norm) or jumped:
            suspects.append(row)
    return suspects


def is_sdc(r_t: float, r_prev: float, g_t: float, g_prev: float, mu: float, alpha: float) -> bool:
    """The paper's rule for one step (see the module docstring). Pure."""
    if not math.isfinite(g_t):
        return True
    delta_r = abs(r_t - r_prev)
    return delta_r > sdc_threshold(mu, alpha, max(0.0, g_t - g_prev))


class SDCMonitor(Monitor):
    """Stateful wrapper: the previous applied step's R and ‖G‖, and the warm-up mean μ of ΔR."""

    name = "sdc"

    def __init__(self, config: SDCConfig, defer_nonfinite: bool = False) -> None:
        self.config = config
        #: leave a non-finite gradient norm or update RMS to the non-finite detector (on by default), which names
        #: the rank it came from, instead of reporting the same step twice
        self.defer_nonfinite = defer_nonfinite
        self.r_prev = float("nan")
        self.g_prev = float("nan")
        self.mu_sum = 0.0
        self.mu_count = 0
        self.flags = 0
        self._pending: tuple[float, float] | None = None
        self._flagged = False
        self.local_prev = float("nan")  # this rank's local gradient norm at the previous applied step
        self._local_now = float("nan")
        self.locations: dict[int, str] = {}  # global rank -> "host:device", filled at attach
        self.last = {"update_rms_max": float("nan"), "delta_r": float("nan"), "threshold": float("nan")}

    @property
    def mu(self) -> float:
        return self.mu_sum / self.mu_count if self.mu_count else float("nan")

    @property
    def warmed_up(self) -> bool:
        return self.mu_count >= self.config.warmup_steps

    def required_stats(self) -> tuple[str, ...]:
        return (names.UPDATE_SQ, names.UPDATE_COUNT, names.GRAD_SQ, names.GRAD_SQ_LOCAL)

    def on_start(self, locations: dict[int, str]) -> None:
        """At attach: ``{global rank: "host:device"}``, to name a suspect's device."""
        self.locations = locations

    def before_agreement(self, buffer: StatBuffer) -> None:
        """Write this rank's previous local norm where a flagged step's per-rank fetch will find it."""
        if names.SDC_LOCAL_NORM_PREV in buffer.layout:
            buffer.put(names.SDC_LOCAL_NORM_PREV, self.local_prev)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        self._flagged, self._pending = False, None
        counts = stats.total(names.UPDATE_COUNT)
        if not np.any(counts):  # the producers did not compute U on this step
            return []
        r_t = update_rms_max(stats.total(names.UPDATE_SQ), counts)
        grad_sq = float(np.sum(stats.total(names.GRAD_SQ)))
        g_t = math.sqrt(grad_sq) if math.isfinite(grad_sq) else math.inf
        self._pending = (r_t, g_t)
        local_sq = float(stats.local(names.GRAD_SQ_LOCAL).sum())
        self._local_now = math.sqrt(local_sq) if 0.0 <= local_sq < math.inf else math.inf
        delta_r = abs(r_t - self.r_prev)
        threshold = sdc_threshold(self.mu, self.config.alpha, max(0.0, g_t - self.g_prev)) \
            if self.warmed_up and math.isfinite(g_t) else math.inf
        self.last = {"update_rms_max": r_t, "delta_r": delta_r, "threshold": threshold}
        nonfinite = not math.isfinite(g_t) or not math.isfinite(r_t)
        if nonfinite and self.defer_nonfinite:
            self._pending = None  # a step that is not applied: the baselines do not move
            return []
        if not nonfinite and (not self.warmed_up or not math.isfinite(self.r_prev) or delta_r <= threshold):
            return []
        self._flagged = True
        local_now_r = np.sqrt(stats.per_rank(names.GRAD_SQ_LOCAL).sum(axis=1))
        local_prev_r = stats.per_rank(names.SDC_LOCAL_NORM_PREV)[:, 0] if stats.has(names.SDC_LOCAL_NORM_PREV) \
            else np.full(stats.num_ranks, np.nan)
        rows = suspect_ranks(local_now_r, local_prev_r, self.config.localize_factor)
        ranks = tuple(stats.ranks[row] for row in rows)
        values = {"update_rms_max": r_t, "previous_update_rms_max": self.r_prev, "delta_r": delta_r,
                  "mu": self.mu, "alpha": self.config.alpha, "grad_norm_pre_clip": g_t,
                  "previous_grad_norm_pre_clip": self.g_prev, "threshold": threshold,
                  "local_grad_norm_per_rank": local_now_r.tolist(),
                  "previous_local_grad_norm_per_rank": local_prev_r.tolist(),
                  "suspects": {str(rank): self.locations.get(rank, "?") for rank in ranks}}
        if self.config.sketch_size and stats.has(names.GRAD_SKETCH_LOCAL):
            values["sketch_cosine_to_peers"] = cosine_to_peers(stats.per_rank(names.GRAD_SKETCH_LOCAL)).tolist()
        reason = "pre-clip gradient norm is not finite" if nonfinite else (
            f"update RMS jump {delta_r:.3g} > μ/(α√ΔG) = {threshold:.3g} (R {self.r_prev:.4g} -> {r_t:.4g})")
        where = ", ".join(f"rank {rank} ({self.locations.get(rank, '?')})" for rank in ranks) or \
            "no single rank stands out"
        return [Finding(self.name, Action.parse(self.config.action), Severity.ERROR,
                        f"silent data corruption suspected on {where}: {reason}", ranks, values)]

    def commit(self, step: int, applied: bool) -> None:
        if self._flagged:
            self.flags += 1
        if not applied or self._pending is None or self._flagged:
            return
        r_t, g_t = self._pending
        if math.isfinite(self.r_prev) and not self.warmed_up:
            self.mu_sum += abs(r_t - self.r_prev)
            self.mu_count += 1
        self.r_prev, self.g_prev = r_t, g_t
        self.local_prev = self._local_now

    def metrics(self) -> dict[str, float]:
        return {**self.last, "mu": self.mu, "flags": float(self.flags)}

    def state_dict(self) -> dict[str, Any]:
        return {"r_prev": self.r_prev, "g_prev": self.g_prev, "mu_sum": self.mu_sum, "mu_count": self.mu_count,
                "flags": self.flags, "local_prev": self.local_prev}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.r_prev, self.g_prev = float(state["r_prev"]), float(state["g_prev"])
        self.mu_sum, self.mu_count = float(state["mu_sum"]), int(state["mu_count"])
        self.flags = int(state["flags"])
        self.local_prev = float(state.get("local_prev", math.nan))


class SDCFamily(FamilyBase):
    """``detectors.sdc``: the update RMS on every monitored step, each rank's previous local norm (detail), the
    gradient sketch (detail) and, with the recomputation, the count of withheld slots."""

    name = "sdc"
    config_class = SDCConfig

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        sdc = ctx.section
        decls = [*optimizer_statistics(ctx), StatDecl(names.SDC_LOCAL_NORM_PREV, 1, Reduce.DETAIL)]
        if sdc.sketch_size:  # the slot detectors.consistency shares (shared_sketch_size: this size wins)
            decls.append(StatDecl(names.GRAD_SKETCH_LOCAL, sdc.sketch_size, Reduce.DETAIL))
        if sdc.recompute.enabled:
            decls.append(StatDecl(names.SDC_WITHHELD, 1, Reduce.SUM))
        return decls

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        # with the recomputation on, the non-finite case stays the rule's: its finding is what makes every rank
        # recompute a step whose reduced gradient is not finite (nothing withheld), instead of skipping it
        defer = section_of(ctx.config, NonFiniteFamily()).enabled and not ctx.section.recompute.enabled
        return [SDCMonitor(ctx.section, defer_nonfinite=defer)]

    def optimizer_stats_due(self, ctx: FamilyContext, step: int) -> tuple[bool, bool]:
        return True, False  # the update RMS on every monitored step; the rule needs no weight norms

    def sketch_due(self, ctx: FamilyContext, step: int) -> bool:
        return bool(ctx.section.sketch_size)  # on every monitored step

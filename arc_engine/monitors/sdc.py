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
from typing import Any

import numpy as np

from arc_engine.config.schema import SDCConfig
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext, StatDecl, section_of
from arc_engine.monitors.non_finite import NonFiniteFamily
from arc_engine.monitors.optimizer import optimizer_statistics
from arc_engine.monitors.sdc_local import cosine_to_peers
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, names
from arc_engine.stats.optim_stats import rms_per_group


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

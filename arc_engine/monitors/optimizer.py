"""Optimizer-side health metrics: weight norms and the Adam update RMS per parameter group.

R_t = max over groups of RMS(U) is the SDC paper's signal; this monitor only reports it (the SDC detector, which
acts on its jumps, builds on the same gathered values).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from arc_engine.events import Finding
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import (
    FamilyBase,
    FamilyContext,
    StatDecl,
    optimizer_statistics,
    optimizer_stats_schedule,
    section_of,
)
from arc_engine.monitors.sdc import SDCFamily
from arc_engine.stats import AgreedStats, names
from arc_engine.stats.optim_stats import rms_per_group


class OptimizerStatsMonitor(Monitor):
    """Metrics only: ``update/rms_max`` (R_t), ``update/rms/<group>``, ``weight_norm/<group>``."""

    name = "optimizer"

    def __init__(self, group_names: list[str]) -> None:
        self.group_names = group_names
        self.update_rms_g: list[float] = [float("nan")] * len(group_names)
        self.weight_norm_g: list[float] = [float("nan")] * len(group_names)

    @property
    def update_rms_max(self) -> float:
        """R_t: the largest per-group update RMS of the last monitored step (NaN when unknown)."""
        finite = [v for v in self.update_rms_g if not math.isnan(v)]
        return max(finite) if finite else float("nan")

    def required_stats(self) -> tuple[str, ...]:
        return (names.WEIGHT_SQ, names.UPDATE_SQ, names.UPDATE_COUNT)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        """Refresh the metrics when the producers computed them this step (``optimizer_stats_every``)."""
        weight_sq_g = stats.total(names.WEIGHT_SQ)
        if not np.any(weight_sq_g):
            return []
        counts = stats.total(names.UPDATE_COUNT)
        self.update_rms_g = [r if c > 0 else float("nan")
                             for r, c in zip(rms_per_group(stats.total(names.UPDATE_SQ), counts), counts, strict=True)]
        self.weight_norm_g = [math.sqrt(v) if v >= 0 else float("nan") for v in weight_sq_g]
        return []

    def commit(self, step: int, applied: bool) -> None:
        return None

    def metrics(self) -> dict[str, float]:
        out = {"update_rms_max": self.update_rms_max}
        for name, rms, norm in zip(self.group_names, self.update_rms_g, self.weight_norm_g, strict=True):
            out[f"update_rms/{name}"] = rms
            out[f"weight_norm/{name}"] = norm
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class OptimizerStatsFamily(FamilyBase):
    """Weight norms and update RMS as metrics, on the ``stats.optimizer_stats_every`` schedule (no config section
    of its own under ``detectors``; on whenever that schedule is, or when the SDC detector needs the slots)."""

    name = "optimizer"

    def enabled(self, ctx: FamilyContext) -> bool:
        return bool(ctx.config.stats.optimizer_stats_every) or section_of(ctx.config, SDCFamily()).enabled

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        return optimizer_statistics(ctx)

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [OptimizerStatsMonitor(ctx.group_names)]

    def optimizer_stats_due(self, ctx: FamilyContext, step: int) -> tuple[bool, bool]:
        due = optimizer_stats_schedule(ctx.config, step)
        return due, due

"""``detectors.non_finite``: NaN/Inf in any rank's loss or local gradient, or in the reduced gradient (ARC paper
§3.2.1). A built-in family in the shape every family takes: its config, its monitor and its family in one module,
registered through the same seam as a plugin (docs/families.md walks through it).

A healthy step reads only agreed totals; the per-rank values that name the offending rank are fetched (one rare
collective) only when a total is non-finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from arc_engine.config.schema import ActionName
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext
from arc_engine.stats import AgreedStats, names


@dataclass(kw_only=True)
class NonFiniteConfig:
    """NaN/Inf in any rank's loss or local gradient (per parameter group)."""

    enabled: bool = True
    """NaN/Inf in any rank's loss or local (pre-reduction) gradient; the finding names the rank and the first parameter
    group."""
    action: ActionName = "skip"
    """What a non-finite step gets."""


def nonfinite_ranks(loss_r: np.ndarray, loss_count_r: np.ndarray, nonfinite_rg: np.ndarray
                    ) -> list[tuple[int, str, int | None]]:
    """Rows (rank indices) holding a non-finite loss or gradient.

    ``loss_r``: per-rank loss; ``loss_count_r``: micro-batches recorded per rank (0 = no loss recorded);
    ``nonfinite_rg``: ranks x groups count of parameter tensors with a non-finite local gradient.
    Returns ``(row, what, first_group)`` with ``what`` in {"loss", "grad", "loss+grad"} and
    ``first_group`` the lowest group index with a non-finite gradient (None if only the loss is bad).
    """
    out: list[tuple[int, str, int | None]] = []
    for row in range(nonfinite_rg.shape[0]):
        bad_loss = bool(loss_count_r[row] > 0 and not math.isfinite(float(loss_r[row])))
        bad_groups = np.flatnonzero((nonfinite_rg[row] > 0) | ~np.isfinite(nonfinite_rg[row]))
        first_group = int(bad_groups[0]) if bad_groups.size else None
        if bad_loss or first_group is not None:
            what = "loss+grad" if bad_loss and first_group is not None else ("loss" if bad_loss else "grad")
            out.append((row, what, first_group))
    return out



class NonFiniteMonitor(Monitor):
    """Flags NaN/Inf in any rank's loss or local (pre-reduction) gradient, naming the rank and group."""

    name = "non_finite"

    def __init__(self, config: NonFiniteConfig, group_names: list[str]) -> None:
        self.config = config
        self.group_names = group_names
        self.count = 0
        self._last = 0

    def required_stats(self) -> tuple[str, ...]:
        return (names.LOSS, names.LOSS_COUNT, names.GRAD_NONFINITE_LOCAL, names.GRAD_SQ)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        self._last = 0
        nonfinite_g = stats.total(names.GRAD_NONFINITE_LOCAL)
        local_bad = not math.isfinite(float(stats.total(names.LOSS)[0])) or bool(
            np.any((nonfinite_g > 0) | ~np.isfinite(nonfinite_g)))
        if not local_bad:
            return self._reduced_only(stats)
        hits = nonfinite_ranks(stats.per_rank(names.LOSS)[:, 0], stats.per_rank(names.LOSS_COUNT)[:, 0],
                               stats.per_rank(names.GRAD_NONFINITE_LOCAL))
        self._last = len(hits)
        if not hits:
            return self._reduced_only(stats)
        ranks = tuple(stats.ranks[row] for row, _, _ in hits)
        parts = []
        for row, what, group in hits:
            where = f" (first group {group}: {self.group_names[group]})" if group is not None else ""
            parts.append(f"rank {stats.ranks[row]} {what}{where}")
        first_group = next((g for _, _, g in hits if g is not None), None)
        values: dict[str, Any] = {
            "loss_per_rank": stats.per_rank(names.LOSS)[:, 0].tolist(),
            "nonfinite_params_per_rank": stats.per_rank(names.GRAD_NONFINITE_LOCAL).sum(axis=1).tolist(),
            "first_group": first_group,
            "first_group_name": self.group_names[first_group] if first_group is not None else None,
        }
        suspects = self._suspect_data(stats, hits)
        suspicion = ""
        if suspects:
            values["suspect_data_ranks"] = list(suspects)
            suspicion = f"; suspect data: the batch of rank {', '.join(map(str, suspects))} gave a non-finite loss " \
                f"where the other ranks had a finite one on the same weights"
        return [Finding(self.name, Action.parse(self.config.action), Severity.ERROR,
                        "non-finite values: " + "; ".join(parts) + suspicion, ranks, values,
                        data_suspect=bool(suspects), hardware="non_finite")]

    @staticmethod
    def _suspect_data(stats: AgreedStats, hits: list[tuple[int, str, int | None]]) -> tuple[int, ...]:
        """The ranks whose loss is non-finite when some of the ranks that recorded one had a finite loss on the same
        weights: their batches are suspect (their data, or that device's forward pass). The finding then blames the
        batches (``data_suspect``: the data ledger records the positions as suspect bad data, skipped again once
        suspected twice) and its skip stays an ordinary one, which ``policy.max_consecutive_skips`` bounds as for a
        faulty device. None when every rank's loss is non-finite (the model's, not a batch's)."""
        rows = [row for row, what, _ in hits if what.startswith("loss")]
        recorded = int(np.count_nonzero(stats.per_rank(names.LOSS_COUNT)[:, 0] > 0))
        return tuple(stats.ranks[row] for row in rows) if 0 < len(rows) < recorded else ()

    def _reduced_only(self, stats: AgreedStats) -> list[Finding]:
        """Every local gradient and loss was finite, yet the reduced gradient is not: the corruption happened in
        (or after) the reduction. Names the ranks whose reduced gradient (or shard of it) is non-finite."""
        if np.all(np.isfinite(stats.total(names.GRAD_SQ))):
            return []
        reduced_rg = stats.per_rank(names.GRAD_SQ)
        self._last = 1
        rows = np.flatnonzero(~np.isfinite(reduced_rg).all(axis=1))
        ranks = tuple(stats.ranks[row] for row in rows)
        groups = np.flatnonzero(~np.isfinite(stats.total(names.GRAD_SQ)))
        first = int(groups[0]) if groups.size else 0
        return [Finding(self.name, Action.parse(self.config.action), Severity.ERROR,
                        f"non-finite reduced gradient with finite local gradients on every rank (first group "
                        f"{first}: {self.group_names[first]}): corrupted in the gradient reduction", ranks,
                        {"first_group": first, "first_group_name": self.group_names[first], "reduced": True})]

    def commit(self, step: int, applied: bool) -> None:
        self.count += int(self._last > 0)

    def metrics(self) -> dict[str, float]:
        return {"count": float(self.count)}

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])


class NonFiniteFamily(FamilyBase):
    """``detectors.non_finite``: reads the standard loss and gradient slots every adapter produces."""

    name = "non_finite"
    config_class = NonFiniteConfig

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [NonFiniteMonitor(ctx.section, ctx.group_names)]

"""The data-parallel ranks' spread of losses and local gradient norms, through the step's one all-reduce.

Shared by the families that read it (cross-worker consistency: D_loss and D_grad; the R-Metric: σ² = D_grad²). Each
rank adds (x_i − c), (x_i − c)² and c itself into SUM slots, c being the previous agreed mean (identical on every
rank): the variance then comes without the cancellation of raw moments, and a reader takes c from the slot, so
every family that writes the slots (they write the same values; the last one wins) and every family that reads them
agree whatever state each keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from arc_engine.monitors.family import StatDecl
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, names

#: [3] SUM over the ranks that recorded a loss: Σ (ℓ_i − c), Σ (ℓ_i − c)², Σ c (c: the previous agreed mean loss).
LOSS_MOMENTS = "worker_loss_moments"
#: [4] SUM over the ranks: Σ (‖g_i‖ − c), Σ (‖g_i‖ − c)², the number of ranks, Σ c (‖g_i‖: the rank's local
#: pre-reduction gradient norm; c: the previous agreed mean).
GRAD_NORM_MOMENTS = "worker_grad_norm_moments"


def dispersion(shifted_sum: float, shifted_sq_sum: float, count: float, shift: float) -> tuple[float, float]:
    """(mean, population std) of ``count`` values from Σ (x − shift) and Σ (x − shift)² (NaN when count is 0). Pure."""
    if count <= 0:
        return math.nan, math.nan
    centred = shifted_sum / count
    variance = shifted_sq_sum / count - centred * centred
    return shift + centred, math.sqrt(max(variance, 0.0))


@dataclass(frozen=True)
class Spread:
    """One step's agreed spread over the ranks (NaN where no rank contributed)."""

    loss_mean: float
    loss_std: float
    norm_mean: float
    norm_std: float

    @property
    def norm_cv(self) -> float:
        """The local gradient norms' coefficient of variation (NaN at a zero mean)."""
        return self.norm_std / self.norm_mean if self.norm_mean > 0 else math.nan


class WorkerMoments:
    """Writes this rank's shifted moments before the agreement and reads the agreed spread after it; the shifts
    follow the agreed means (:meth:`advance`)."""

    def __init__(self) -> None:
        self.loss_shift = 0.0
        self.norm_shift = 0.0

    @staticmethod
    def statistics() -> list[StatDecl]:
        return [StatDecl(LOSS_MOMENTS, 3, Reduce.SUM), StatDecl(GRAD_NORM_MOMENTS, 4, Reduce.SUM)]

    @staticmethod
    def required_stats() -> tuple[str, ...]:
        return (names.LOSS, names.LOSS_COUNT, names.LOSS_RANKS, names.GRAD_SQ_LOCAL, LOSS_MOMENTS, GRAD_NORM_MOMENTS)

    @torch.no_grad()
    def write(self, buffer: StatBuffer) -> None:
        """This rank's moments into the slots (device-side, no sync; overwrites)."""
        recorded = (buffer.view(names.LOSS_COUNT) > 0).double()
        loss = (buffer.view(names.LOSS) - self.loss_shift) * recorded
        moments = buffer.view(LOSS_MOMENTS)
        moments[0:1].copy_(loss)
        moments[1:2].copy_(loss * loss)
        moments[2:3].copy_(recorded * self.loss_shift)
        norm = buffer.view(names.GRAD_SQ_LOCAL).sum().sqrt() - self.norm_shift
        grad = buffer.view(GRAD_NORM_MOMENTS)
        grad[0].copy_(norm)
        grad[1].copy_(norm * norm)
        grad[2].fill_(1.0)
        grad[3].fill_(self.norm_shift)

    @staticmethod
    def read(stats: AgreedStats) -> Spread:
        loss = stats.total(LOSS_MOMENTS)
        loss_ranks = float(stats.total(names.LOSS_RANKS)[0])
        loss_shift = float(loss[2]) / loss_ranks if loss_ranks > 0 else 0.0
        loss_mean, loss_std = dispersion(float(loss[0]), float(loss[1]), loss_ranks, loss_shift)
        grad = stats.total(GRAD_NORM_MOMENTS)
        count = float(grad[2])
        norm_shift = float(grad[3]) / count if count > 0 else 0.0
        norm_mean, norm_std = dispersion(float(grad[0]), float(grad[1]), count, norm_shift)
        return Spread(loss_mean, loss_std, norm_mean, norm_std)

    def advance(self, spread: Spread) -> None:
        """The next step's shifts: this step's agreed means, where finite."""
        if math.isfinite(spread.loss_mean):
            self.loss_shift = spread.loss_mean
        if math.isfinite(spread.norm_mean):
            self.norm_shift = spread.norm_mean

    def state_dict(self) -> dict[str, Any]:
        return {"loss_shift": self.loss_shift, "norm_shift": self.norm_shift}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_shift, self.norm_shift = float(state["loss_shift"]), float(state["norm_shift"])

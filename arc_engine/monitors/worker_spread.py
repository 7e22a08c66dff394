"""The data-parallel ranks' spread of losses and local gradient norms, through the step's one all-reduce.

Shared by the families that read it (cross-worker consistency: D_loss and D_grad; the R-Metric: σ² = D_grad²). Each
rank adds (x_i − c), (x_i − c)² and c itself into SUM slots, c being the previous agreed mean (identical on every
rank): the variance then comes without the cancellation of raw moments, and a reader takes c from the slot, so
every family that writes the slots (they write the same values; the last one wins) and every family that reads them
agree whatever state each keeps.

Under model parallelism (Megatron tensor x pipeline) a rank's local gradient is one shard of its replica's, so the
gradient-norm moments are kept per model-parallel *position* (the ranks holding the same shards,
:func:`arc_engine.monitors.family.worker_positions`): one row of 4 per position, each rank writing its own; the
spread is over the data-parallel replicas of each shard. The loss is every rank's that recorded one (tensor-parallel
peers record the same loss, which repeats every replica's value equally often and leaves mean and std unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from arc_engine.monitors.family import StatDecl
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, names

#: [5] SUM over the ranks that recorded a loss: Σ (ℓ_i − c), Σ (ℓ_i − c)², Σ c, Σ (ℓ_i − c)³, Σ (ℓ_i − c)⁴ (c: the
#: previous agreed mean loss; the higher moments give the L4 norm of the deviations, :func:`deviation_l4`).
LOSS_MOMENTS = "worker_loss_moments"
#: [positions x 4] SUM over each position's ranks: Σ (‖g_i‖ − c), Σ (‖g_i‖ − c)², the number of ranks, Σ c (‖g_i‖:
#: the rank's local pre-reduction gradient norm; c: the position's previous agreed mean).
GRAD_NORM_MOMENTS = "worker_grad_norm_moments"


def dispersion(shifted_sum: float, shifted_sq_sum: float, count: float, shift: float) -> tuple[float, float]:
    """(mean, population std) of ``count`` values from Σ (x − shift) and Σ (x − shift)² (NaN when count is 0). Pure."""
    if count <= 0:
        return math.nan, math.nan
    centred = shifted_sum / count
    variance = shifted_sq_sum / count - centred * centred
    return shift + centred, math.sqrt(max(variance, 0.0))


def deviation_l4(sums: tuple[float, float, float, float], count: float, shift: float, mean: float) -> float:
    """(Σ_i (x_i − mean)⁴)^¼, the L4 norm of the deviations from the mean, from the shifted sums Σ (x − shift)^k,
    k = 1..4, of ``count`` values (NaN when count is 0). One value far from the others dominates it -- about that
    value's deviation whatever the number of values -- while n values of noise σ give (3n)^¼ σ: a lone outlier
    stands out of it by n^¼ more than out of the standard deviation. Pure."""
    if count <= 0:
        return math.nan
    s1, s2, s3, s4 = sums
    d = mean - shift  # Σ (x − mean)⁴ = Σ ((x − shift) − d)⁴, expanded
    fourth = s4 - 4 * d * s3 + 6 * d * d * s2 - 4 * d ** 3 * s1 + count * d ** 4
    return math.sqrt(math.sqrt(max(fourth, 0.0)))


@dataclass(frozen=True)
class Spread:
    """One step's agreed spread over the ranks (NaN where no rank contributed); the norms per position."""

    loss_mean: float
    loss_std: float
    norm_means: np.ndarray
    norm_stds: np.ndarray
    loss_l4: float = math.nan  # (Σ_i (ℓ_i − mean)⁴)^¼ over the ranks that recorded a loss

    @property
    def norm_mean(self) -> float:
        """The local gradient norm's mean (over positions: the mean of their means)."""
        return float(np.mean(self.norm_means))

    @property
    def norm_std(self) -> float:
        """The local gradient norms' std over the ranks (over positions: the root mean of their variances)."""
        return float(np.sqrt(np.mean(np.square(self.norm_stds))))

    @property
    def norm_cvs(self) -> np.ndarray:
        """Each position's coefficient of variation (NaN at a zero mean)."""
        with np.errstate(all="ignore"):
            return np.where(self.norm_means > 0, self.norm_stds / self.norm_means, np.nan)

    @property
    def norm_cv(self) -> float:
        """The coefficient of variation of the local gradient norms: the largest over positions (NaN if none)."""
        cvs = self.norm_cvs
        return float(np.nanmax(cvs)) if np.isfinite(cvs).any() else math.nan


class WorkerMoments:
    """Writes this rank's shifted moments before the agreement and reads the agreed spread after it; the shifts
    follow the agreed means (:meth:`advance`). ``positions`` / ``position``: see the module docstring."""

    def __init__(self, positions: int = 1, position: int = 0) -> None:
        self.positions, self.position = positions, position
        self.loss_shift = 0.0
        self.norm_shift = np.zeros(positions)

    #: what :meth:`read_loss` reads
    LOSS_STATS = (names.LOSS_RANKS, LOSS_MOMENTS)

    def statistics(self) -> list[StatDecl]:
        return [*self.loss_statistics(), StatDecl(GRAD_NORM_MOMENTS, 4 * self.positions, Reduce.SUM)]

    @staticmethod
    def loss_statistics() -> list[StatDecl]:
        """The loss moments' slot alone (a family that reads the loss spread another family writes)."""
        return [StatDecl(LOSS_MOMENTS, 5, Reduce.SUM)]

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
        moments[3:4].copy_(loss * loss * loss)
        moments[4:5].copy_(loss.square().square())
        shift = float(self.norm_shift[self.position])
        norm = buffer.view(names.GRAD_SQ_LOCAL).sum().sqrt() - shift
        grad = buffer.view(GRAD_NORM_MOMENTS)[4 * self.position:4 * self.position + 4]
        grad[0].copy_(norm)
        grad[1].copy_(norm * norm)
        grad[2].fill_(1.0)
        grad[3].fill_(shift)

    @staticmethod
    def _loss_sums(stats: AgreedStats) -> tuple[np.ndarray, float, float]:
        """The loss moments' agreed sums, the ranks that recorded a loss, and the shift they were taken around."""
        loss = stats.total(LOSS_MOMENTS)
        loss_ranks = float(stats.total(names.LOSS_RANKS)[0])
        return loss, loss_ranks, float(loss[2]) / loss_ranks if loss_ranks > 0 else 0.0

    @staticmethod
    def read_loss(stats: AgreedStats) -> tuple[float, float]:
        """The agreed (mean, population std) of the ranks' losses this step (NaN where no rank recorded one)."""
        loss, loss_ranks, loss_shift = WorkerMoments._loss_sums(stats)
        return dispersion(float(loss[0]), float(loss[1]), loss_ranks, loss_shift)

    @staticmethod
    def read(stats: AgreedStats) -> Spread:
        loss, loss_ranks, loss_shift = WorkerMoments._loss_sums(stats)
        loss_mean, loss_std = dispersion(float(loss[0]), float(loss[1]), loss_ranks, loss_shift)
        l4 = deviation_l4((float(loss[0]), float(loss[1]), float(loss[3]), float(loss[4])), loss_ranks, loss_shift,
                          loss_mean) if math.isfinite(loss_mean) else math.nan
        rows = stats.total(GRAD_NORM_MOMENTS).reshape(-1, 4)
        spreads = [dispersion(float(row[0]), float(row[1]), float(row[2]),
                              float(row[3]) / float(row[2]) if row[2] > 0 else 0.0) for row in rows]
        return Spread(loss_mean, loss_std, np.array([m for m, _ in spreads]), np.array([s for _, s in spreads]), l4)

    def advance(self, spread: Spread) -> None:
        """The next step's shifts: this step's agreed means, where finite."""
        if math.isfinite(spread.loss_mean):
            self.loss_shift = spread.loss_mean
        finite = np.isfinite(spread.norm_means)
        self.norm_shift = np.where(finite, spread.norm_means, self.norm_shift)

    def state_dict(self) -> dict[str, Any]:
        return {"loss_shift": self.loss_shift, "norm_shift": [float(v) for v in self.norm_shift]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_shift = float(state["loss_shift"])
        shift = np.atleast_1d(np.asarray(state["norm_shift"], dtype=np.float64))
        self.norm_shift = shift if shift.size == self.positions else np.zeros(self.positions)

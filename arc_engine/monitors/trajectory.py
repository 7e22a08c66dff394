"""A healthy trajectory learned from a run's own accepted measurements: a robust straight-line trend.

The mechanism monitors (attention spectra, MoE routers) compare a measurement with where the run was heading, not
with an absolute level: attention-update entropy and routing entropy drift during healthy training (learning-rate
warm-up and decay, specialisation), so a fixed level or a plain median of the recent past either alarms on the drift
or has to be so loose it misses a collapse. Per series, over the last ``n`` accepted measurements x_0 .. x_{n-1}:

* the Theil-Sen line: slope b = the median of the pairwise slopes (x_j − x_i) / (j − i), intercept a = the median
  of x_i − b i -- robust to a minority of outliers (a fault's measurements never enter the history anyway);
* the prediction for the next measurement, a + b n, and the spread, 1.4826 x the median absolute residual.

Vectorised over series (heads, layers); NaN entries (a series not measured that time) are ignored.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from arc_engine.config.errors import require


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



MAD_TO_STD = 1.4826


def robust_trend(history_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(prediction_s, spread_s)`` for the next measurement of each series, from ``history_ns`` ``[n, series]``
    (oldest first). Needs n >= 2 for a slope; with n = 1 the prediction is that value and the spread 0."""
    history_ns = np.asarray(history_ns, dtype=np.float64)
    n = history_ns.shape[0]
    index_n = np.arange(n, dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN series stay NaN
        if n >= 2:
            i, j = np.triu_indices(n, k=1)
            slopes_ps = (history_ns[j] - history_ns[i]) / (j - i)[:, None]
            slope_s = np.nanmedian(slopes_ps, axis=0)
        else:
            slope_s = np.zeros(history_ns.shape[1:])
        slope_s = np.nan_to_num(slope_s, nan=0.0)
        intercept_s = np.nanmedian(history_ns - slope_s * index_n[:, None], axis=0)
        residual_ns = history_ns - (intercept_s + slope_s * index_n[:, None])
        spread_s = MAD_TO_STD * np.nanmedian(np.abs(residual_ns), axis=0)
    return intercept_s + slope_s * n, spread_s

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

import numpy as np

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

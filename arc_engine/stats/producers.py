"""Writers shared by every integration: one parameter group's optimizer statistics into the step's buffer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from arc_engine.stats import names
from arc_engine.stats.layout import StatBuffer
from arc_engine.stats.optim_stats import AdamViews, WindowCache, sampled, update_sq_total, weight_sq_sums


@torch.no_grad()
def record_group_optimizer_stats(buffer: StatBuffer, group_id: int, weights: Sequence[torch.Tensor],
                                 views: AdamViews | None, update_sample: float = 1.0,
                                 with_weights: bool = True, windows: WindowCache | None = None) -> None:
    """Add this rank's part of group ``group_id``'s weight squared norm and, for Adam-family optimizers, the
    prospective update Σ U² and element count (over :func:`sampled` windows when ``update_sample`` < 1; ``windows``
    keeps this group's windows between steps). No-op when the layout has no optimizer-statistics slots."""
    if names.WEIGHT_SQ not in buffer.layout or not weights:
        return
    slot = slice(group_id, group_id + 1)
    device = buffer.device
    if with_weights:
        buffer.view(names.WEIGHT_SQ)[slot].add_(weight_sq_sums(weights).sum().to(device))
    if views is None or not views.grads:
        return
    views = sampled(views, update_sample, windows)
    update_sq = update_sq_total(views.params, views.grads, views.exp_avgs, views.exp_avg_sqs, views.step, views.hyper)
    buffer.view(names.UPDATE_SQ)[slot].add_(update_sq.to(device))
    buffer.view(names.UPDATE_COUNT)[slot].add_(float(sum(g.numel() for g in views.grads)))

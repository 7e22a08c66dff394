"""Writers shared by every integration: one parameter group's optimizer statistics into the step's buffer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from arc_engine.monitors.family import section_of
from arc_engine.monitors.sdc import SDCFamily
from arc_engine.stats import names
from arc_engine.stats.layout import StatBuffer
from arc_engine.stats.optim_stats import AdamViews, update_sq_total, weight_sq_sums
from arc_engine.stats.sampling import WindowCache, sample_phase, sampled, sampled_segments

if TYPE_CHECKING:
    from arc_engine.engine import ArcEngine


@torch.no_grad()
def record_group_optimizer_stats(buffer: StatBuffer, group_id: int, weights: Sequence[torch.Tensor],
                                 views: AdamViews | None, update_sample: float = 1.0,
                                 with_weights: bool = True, windows: WindowCache | None = None, phase: int = 0,
                                 grad_scale: float | torch.Tensor = 1.0, flat_partitions: bool = False) -> None:
    """Add this rank's part of group ``group_id``'s weight squared norm (when ``with_weights``) and, for Adam-family
    optimizers, the prospective update Σ U² and element count (over the :func:`sampled` windows of ``phase`` when
    ``update_sample`` < 1; ``windows`` keeps this group's windows between steps). ``grad_scale`` multiplies the
    gradients first (see :func:`update_sq_total`). ``flat_partitions``: ``views`` hold whole flat partitions
    (ZeRO-1/2), sampled per :func:`~arc_engine.stats.sampling.segmented` segment. Local, device-side; no-op when the
    layout has no optimizer-statistics slots."""
    if names.WEIGHT_SQ not in buffer.layout or not weights:
        return
    slot = slice(group_id, group_id + 1)
    device = buffer.device
    if with_weights:
        buffer.view(names.WEIGHT_SQ)[slot].add_(weight_sq_sums(weights).sum().to(device))
    if views is None or not views.grads:
        return
    views = (sampled_segments if flat_partitions else sampled)(views, update_sample, windows, phase)
    update_sq = update_sq_total(views.params, views.grads, views.exp_avgs, views.exp_avg_sqs, views.step, views.hyper,
                                grad_scale=grad_scale)
    buffer.view(names.UPDATE_SQ)[slot].add_(update_sq.to(device))
    buffer.view(names.UPDATE_COUNT)[slot].add_(float(sum(map(torch.Tensor.numel, views.grads))))


def record_optimizer_stats(engine: ArcEngine, group_id: int, weights: Sequence[torch.Tensor],
                           views: AdamViews | None, windows: WindowCache | None = None,
                           grad_scale: float | torch.Tensor = 1.0, flat_partitions: bool = False) -> None:
    """:func:`record_group_optimizer_stats` under the engine's settings, for the current step: the sample
    (``detectors.sdc.update_sample``) and its window phase (:func:`sample_phase` of ``engine.progress.step``), and the
    weight norms only on the steps of ``stats.optimizer_stats_every`` (``engine.wants_weight_stats()``). Every
    integration writes its optimizer statistics through here, so none can ignore a setting.
    ``flat_partitions``: ``views`` hold whole flat partitions (ZeRO-1/2), sampled per :func:`segmented` segment.
    Call on every rank where ``engine.wants_optimizer_stats()``; local, no communication."""
    assert engine.buffer is not None, "optimizer statistics are recorded on monitored steps only"
    config = engine.config
    sample = section_of(config, SDCFamily()).update_sample
    with engine.own_work.section("optimizer_stats"):
        record_group_optimizer_stats(engine.buffer, group_id, weights, views, sample, engine.wants_weight_stats(),
                                     windows, sample_phase(engine.progress.step, config.stats.interval), grad_scale,
                                     flat_partitions)

"""``detectors.qk_spectra``: attention weight-update and QK-product spectra per head, per tensor-parallel shard.

Every δ = ``every`` optimizer steps, the rank that owns a layer (one data-parallel copy per layer; layers are dealt
round-robin over the data-parallel ranks, so the work is spread) takes, for each query head of its tensor-parallel
shard, the spectra of ΔW_q, ΔW_k and of the QK-product increments Δ₁, Δ₂, Δ₃ (:mod:`arc_engine.monitors.spectra`:
thin-QR cores, never a d x d product). It keeps W_q and W_k at t − δ of the layers it owns and nothing else.

Through the one agreement (SUM slots; each (layer, head) is written by exactly one rank):

* ``qk_delta2_entropy`` ``[layers x heads]``: each head's Δ₂ spectral entropy -- the alarm's input, and the per-head
  detail an alarm names;
* ``qk_layer_sums`` ``[layers x 9]``: per layer, sums over heads of the other summaries (ΔW_q / ΔW_k entropy, stable
  rank and squared norm, Δ₁ and Δ₃ entropy, Δ₂ stable rank) -- layer means for the dashboards;
* ``qk_measured`` ``[layers]``: heads measured (0 on the steps between measurements, and on the first one, which
  only records W_{t−δ});
* ``qk_logit_bound`` ``[layers x heads]``: each head's bound on its attention logits per unit input norms,
  σ_max(W_q W_kᵀ)/√d_k (the largest singular value of a d_k x d_k core), on every measurement (the first included;
  0: not measured); with a softmax scale other than 1/√d_k or QK layer norms the logits scale differently, and the
  growth is still the head's own;
* ``qk_max_logit`` ``[layers x heads]`` (MAX; declared only where the attention records it, Transformer Engine's
  ``current_max_attn_logits``): the largest attention logit each head produced since the implementation last reset
  it, as measured.

The alarm is on a persistent drop of the model's attention updates, not on one head: per measurement, each layer's
median head is compared with that layer's healthy trajectory (a robust trend through the last ``window`` accepted
measurements, :mod:`arc_engine.monitors.trajectory`), the relative drops are averaged over layers, and a one-sided
CUSUM accumulates them beyond an allowance (see :class:`QKSpectraConfig`); the event names the
layers and the heads that fell most, with their tensor-parallel ranks. A second monitor (``qk_logit``) follows each
head's logit bound against its own trend and names the heads that grew off it. Its cost is periodic: a few small SVDs
per head every δ steps (``scripts/bench_qk_cores.py``), plus a host copy of the results."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from arc_engine import internals
from arc_engine.config.errors import require
from arc_engine.config.schema import ActionName
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import (
    FamilyBase,
    FamilyContext,
    ModelParts,
    Producer,
    StatDecl,
    StepView,
    periodic_family_enabled,
)
from arc_engine.monitors.spectra import (
    HEAD_QUANTITIES,
    SUMMARIES,
    core_singular_values,
    head_spectra_and_bound_t,
    split_qkv_rows,
)
from arc_engine.monitors.trajectory import TrajectoryMonitorConfig, robust_trend
from arc_engine.stats import Reduce, StatBuffer


@dataclass(kw_only=True)
class QKSpectraConfig(TrajectoryMonitorConfig):
    """Attention weight-update and QK-product spectra per head (mechanism-driven monitors; Megatron only: the
    adapter describes where each tensor-parallel rank's heads are).

    Every ``every`` optimizer steps (δ; a multiple of ``stats.interval``), for each layer and query head: the spectra
    of ΔW_q, ΔW_k over the last δ steps and of the QK-product increments Δ₁, Δ₂, Δ₃ (from thin-QR cores). Only W_q
    and W_k at t − δ are kept, on one data-parallel copy per layer.

    The alarm is a one-sided CUSUM on the model's relative drop of Δ₂ spectral entropy: each measurement, each
    layer's median head is compared with that layer's trend (Theil-Sen through the last ``window`` accepted
    measurements, :mod:`arc_engine.monitors.trajectory`); d = the mean over layers of (trend − value) / trend; the
    sum S = max(0, S + d − ``allowance``) alarms when it exceeds ``alarm_drop``, after ``warmup_measurements``. A
    measurement taken while S > 0 stays out of the trajectory; after an alarm S restarts at 0 and the new level
    joins it (one alarm per episode). A sustained drop of x alarms after about ``alarm_drop`` / (x − ``allowance``)
    measurements; a fault confined to one of L layers counts 1/L.

    Attention logit growth per head: each measurement, every head's bound on its attention logits per unit input
    norms, σ_max(W_q W_kᵀ)/√d_k (from the same thin-QR cores), is compared with its own trend (Theil-Sen of the log
    bound through the last ``window`` accepted measurements); a head above it by a factor of more than 1 +
    ``logit_growth`` and by more than ``logit_factor`` robust standard deviations alarms (``logit_action``), once
    per episode (the alarmed level joins the trend), after ``logit_warmup_measurements`` accepted measurements
    (early training moves the bounds fastest). Where the attention implementation records the measured max
    logit per head (Transformer Engine >= 2.9 with ``current_max_attn_logits``), it is reported beside the bound.
    """

    # The inherited keys again, for this family's own docstrings (the defaults are the base's).
    enabled: bool = True
    """Attention ΔW and QK-product spectra per head and tensor-parallel shard (Megatron; off elsewhere)."""
    every: int = 50
    """δ: optimizer steps between measurements (W_q, W_k at t − δ are kept).
    Allowed: a multiple of `stats.interval`"""
    warmup_measurements: int = 8
    """Accepted measurements before the alarm can fire.
    Allowed: >= 3"""
    window: int = 16
    """Accepted measurements in each layer's healthy trajectory.
    Allowed: >= `warmup_measurements`"""
    allowance: float = 0.05
    """Relative drop per measurement (mean over layers of each layer's median head below its trend) the accumulated sum
    absorbs.
    Allowed: [0, 1)"""
    alarm_drop: float = 0.5
    """Accumulated drop beyond the allowance that alarms (e.g. 0.5: a sustained 30 % drop alarms on the 3rd
    measurement).
    Allowed: > 0"""
    action: ActionName = "warn"
    """What an alarm gets."""
    logit_growth: float = 1.0
    """A head's attention-logit bound σ_max(W_q W_kᵀ)/√d_k above its own trend by a factor of more than 1 + this alarms
    (with `logit_factor`).
    Allowed: > 0"""
    logit_factor: float = 6.0
    """... and by more than this many robust standard deviations of the log bound's residuals.
    Allowed: > 0"""
    logit_warmup_measurements: int = 10
    """Accepted measurements before the logit-growth alarm can fire (early training moves the bounds fastest).
    Allowed: 3 to `window`"""
    logit_action: ActionName = "warn"
    """What a logit-growth alarm gets."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.allowance < 1, "allowance", self.allowance, "must be in [0, 1)")
        require(self.alarm_drop > 0, "alarm_drop", self.alarm_drop, "must be > 0")
        require(self.logit_growth > 0, "logit_growth", self.logit_growth, "must be > 0 (e.g. 1.0: twice the trend)")
        require(self.logit_factor > 0, "logit_factor", self.logit_factor, "must be > 0")
        require(3 <= self.logit_warmup_measurements <= self.window, "logit_warmup_measurements",
                self.logit_warmup_measurements, "an integer from 3 to `window`")



HEAD_ENTROPY = "qk_delta2_entropy"
LAYER_SUMS = "qk_layer_sums"
MEASURED = "qk_measured"
LOGIT_BOUND = "qk_logit_bound"
MAX_LOGIT = "qk_max_logit"
#: The per-layer sums, in slot order: (quantity, summary) of :func:`~arc_engine.monitors.spectra.head_spectra`.
LAYER_FIELDS = (("dwq", "entropy"), ("dwk", "entropy"), ("dwq", "stable_rank"), ("dwk", "stable_rank"),
                ("dwq", "norm_sq"), ("dwk", "norm_sq"), ("delta1", "entropy"), ("delta3", "entropy"),
                ("delta2", "stable_rank"))


def _layer_values(heads_hqs: np.ndarray) -> np.ndarray:
    """The :data:`LAYER_FIELDS` of each head, ``[heads, fields]``, from :func:`head_spectra_t` values
    ``[heads, quantities, summaries]``."""
    columns = []
    for quantity, summary in LAYER_FIELDS:
        row = HEAD_QUANTITIES.index(quantity)
        if summary == "norm_sq":
            columns.append(heads_hqs[:, row, SUMMARIES.index("norm")] ** 2)
        else:
            columns.append(heads_hqs[:, row, SUMMARIES.index(summary)])
    return np.stack(columns, axis=1)


class QKSpectraProducer:
    """Writes this rank's heads every δ steps (see module docstring). Local; the SVDs run on the weights' device
    and their summaries come to the host in one copy per measurement (the family's one periodic host read), then
    travel to the buffer in one copy per slot.

    A head is measured only over an increment of exactly δ steps of the current timeline (after a rollback or a
    resume the first measurement only records W) and only when its weights moved: a window of skipped steps has
    ΔW = 0, whose spectrum says nothing about the attention updates (its entropy would read 0)."""

    def __init__(self, parts: ModelParts, every: int, max_logits: bool = False) -> None:
        self.parts, self.every, self.max_logits = parts, every, max_logits
        self.shards = [s for s in parts.attention if s.owner]
        self.previous: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # layer: (step, W_q, W_k)

    @torch.no_grad()
    def write(self, buffer: StatBuffer, view: StepView) -> None:
        if view.step % self.every != 0:
            return
        if self.max_logits:
            self._write_max_logits(buffer)
        if not self.shards:
            return
        num_layers, num_heads = self.parts.num_layers, self.parts.num_heads
        entropy = np.zeros((num_layers, num_heads))
        sums = np.zeros((num_layers, len(LAYER_FIELDS)))
        measured = np.zeros(num_layers)
        bounds = np.zeros((num_layers, num_heads))
        pending = self._measure(view.step)
        # one host read for every shard: [finite flag, the heads' logit bounds, the heads' summaries] per shard
        flat = [torch.cat([finite.double().reshape(1), bound, heads.reshape(-1)])
                for _, finite, bound, heads in pending]
        host = torch.cat(flat).cpu().numpy() if flat else np.zeros(0)
        offset = 0
        for shard, _, bound, heads in pending:
            finite = host[offset] > 0
            bound_h = host[offset + 1:offset + 1 + bound.numel()]
            offset += 1 + bound.numel()
            values = host[offset:offset + heads.numel()]
            offset += heads.numel()
            if not finite:  # diverged weights: no spectrum, and no baseline after
                self.previous.pop(shard.layer, None)
                continue
            bounds[shard.layer, shard.first_head:shard.first_head + len(bound_h)] = bound_h
            if heads.numel() == 0:
                continue
            heads_hqs = values.reshape(heads.shape)
            norms = heads_hqs[:, HEAD_QUANTITIES.index("delta2"), SUMMARIES.index("norm")]
            if np.all(np.isfinite(norms) & (norms > 0.0)):  # else: no update (skipped steps), or NaN
                delta2 = heads_hqs[:, HEAD_QUANTITIES.index("delta2"), SUMMARIES.index("entropy")]
                entropy[shard.layer, shard.first_head:shard.first_head + len(delta2)] = delta2
                sums[shard.layer] += _layer_values(heads_hqs).sum(axis=0)
                measured[shard.layer] += len(delta2)
        device = buffer.device
        if bounds.any():
            buffer.view(LOGIT_BOUND).add_(torch.from_numpy(bounds.reshape(-1)).to(device))
        if measured.any():
            buffer.view(HEAD_ENTROPY).add_(torch.from_numpy(entropy.reshape(-1)).to(device))
            buffer.view(LAYER_SUMS).add_(torch.from_numpy(sums.reshape(-1)).to(device))
            buffer.view(MEASURED).add_(torch.from_numpy(measured).to(device))

    def _write_max_logits(self, buffer: StatBuffer) -> None:
        """The attention's own per-head max logits (every rank's shards: the MAX over data-parallel copies is the
        job's), where it recorded them since its last reset; local, on the buffer's device."""
        slot = buffer.view(MAX_LOGIT).view(self.parts.num_layers, self.parts.num_heads)
        for shard in self.parts.attention:
            recorded = internals.recorded_max_logits(shard.core_attention)
            if recorded is not None and recorded.numel():
                values = recorded.detach().reshape(-1).to(slot.device, slot.dtype)
                row = slot[shard.layer, shard.first_head:shard.first_head + values.numel()]
                torch.maximum(row, values[:row.numel()], out=row)

    def _measure(self, step: int) -> list[tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per shard: (the shard, finite flag, ``[heads]`` logit bounds, ``[heads, quantities, summaries]`` of
        :func:`head_spectra_t`, empty when there is no increment of exactly δ steps), on its device. The SVDs are
        batched over the heads of many layers: the shards whose heads have one shape go through two QR calls and
        six SVD calls per :data:`BATCH_BYTES` of inputs (:func:`head_spectra_and_bound_t`; one batch at 125M
        parameters, 2 at 350M, 6 at 1.3B), not per head (one call per head, layer and product made a 32-layer, 32-head
        model synchronise a GPU thousands of times per measurement, and eight QRs per head cost four times the
        arithmetic). The shards' W_q,
        W_k become the next measurement's reference. Non-finite weights are measured as zeros and dropped once the
        flag is read."""
        prepared = [self._prepare(shard, step) for shard in self.shards]
        # a head with a previous measurement: its bound and spectra from one pair of QRs; without, its bound alone
        both = _batched([(q, k, *previous) if previous is not None else None for _, q, k, previous in prepared],
                        _bounds_and_spectra, lambda n, device: torch.cat([
                            torch.zeros(n, 1, dtype=torch.float64, device=device),
                            torch.full((n, len(HEAD_QUANTITIES) * len(SUMMARIES)), math.nan, dtype=torch.float64,
                                       device=device)], dim=1))
        alone = _batched([(q, k) if previous is None else None for _, q, k, previous in prepared], _logit_bounds,
                         lambda n, device: torch.zeros(n, dtype=torch.float64, device=device))
        out = []
        for shard, (finite, q, _, _), packed, bound in zip(self.shards, prepared, both, alone, strict=True):
            heads = torch.zeros((0, len(HEAD_QUANTITIES), len(SUMMARIES)), dtype=torch.float64, device=q.device)
            if packed is not None:
                bound, heads = packed[:, 0], packed[:, 1:].reshape(-1, len(HEAD_QUANTITIES), len(SUMMARIES))
            out.append((shard, finite, bound if bound is not None else heads.new_zeros(0), heads))
        return out

    def _prepare(self, shard: Any, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                        tuple[torch.Tensor, torch.Tensor] | None]:
        """One shard's (finite flag, its query heads ``[heads, d, d_k]``, each head's key ``[heads, d, d_k]``, the
        same δ steps ago when that is the previous measurement, else None); keeps this step's as the reference."""
        weight = shard.weight.detach()
        if shard.gather is not None:  # a query group split over TP ranks: gather its rows (periodic only)
            pieces = [torch.empty_like(weight) for _ in range(dist.get_world_size(shard.gather))]
            dist.all_gather(pieces, weight.contiguous(), group=shard.gather)
            weight = torch.cat(pieces)
        finite = torch.isfinite(weight).all()
        weight = torch.where(finite, weight, torch.zeros_like(weight))
        q, k = split_qkv_rows(weight, shard.num_query_groups, shard.heads_per_group, shard.head_dim)
        first, last = shard.heads if shard.heads is not None else (0, q.shape[0])
        q = q[first:last]
        group = torch.arange(first, first + q.shape[0], device=weight.device) // shard.heads_per_group
        previous = self.previous.get(shard.layer)
        earlier = None
        if previous is not None and step - previous[0] == self.every:
            _, q_prev, k_prev = previous
            earlier = (q_prev, k_prev[group])
        self.previous[shard.layer] = (step, q.float().clone(), k.float().clone())
        return finite, q, k[group], earlier


def _logit_bounds(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Each head's attention-logit bound σ_max(W_q W_kᵀ)/√d_k (``[heads, d, d_k]`` factors)."""
    return core_singular_values(q, k)[..., 0] / math.sqrt(q.shape[-1])


def _bounds_and_spectra(q: torch.Tensor, k: torch.Tensor, q_prev: torch.Tensor, k_prev: torch.Tensor) -> torch.Tensor:
    """``[heads, 1 + quantities x summaries]``: each head's logit bound, then its :func:`head_spectra_t` values."""
    bound, spectra = head_spectra_and_bound_t(q, k, q_prev, k_prev)
    return torch.cat([(bound / math.sqrt(q.shape[-1])).unsqueeze(-1), spectra.flatten(-2)], dim=-1)


#: The float64 bytes of the inputs one batched call takes at most (whole items: a layer's heads are never split).
#: Batches of every layer at once hold temporaries of several times this: at 1.3B (24 layers x 32 heads, d 2048)
#: one call over all 768 heads made about 1.6 GB of them and was slower on a CPU than head by head.
BATCH_BYTES = 2**29


def _batched(items: list[tuple[torch.Tensor, ...] | None], compute: Any, failed: Any) -> list[torch.Tensor | None]:
    """``compute(*item)`` for each item (tensors batched along dim 0, the heads; None: nothing to compute), the items
    of one shape, device and dtype concatenated into calls of at most :data:`BATCH_BYTES` of float64 inputs and split
    back. When a call fails to converge (``LinAlgError``: overflowing updates), its items are computed one by one,
    and ``failed(heads, device)`` stands for an item that fails alone."""
    out: list[torch.Tensor | None] = [None] * len(items)
    present = {index: item for index, item in enumerate(items) if item is not None and item[0].shape[0] > 0}
    batches: list[list[int]] = []
    open_batch: dict[tuple[Any, ...], tuple[list[int], int]] = {}
    for index, item in present.items():
        kind = tuple((t.shape[1:], t.dtype, t.device) for t in item)
        size = 8 * sum(t.numel() for t in item)
        members, held = open_batch.get(kind, (None, 0))
        if members is None or held + size > BATCH_BYTES:
            members, held = [], 0
            batches.append(members)
        members.append(index)
        open_batch[kind] = (members, held + size)
    for members in batches:
        sizes = [present[i][0].shape[0] for i in members]
        try:
            joined = compute(*(torch.cat(parts) for parts in zip(*(present[i] for i in members), strict=True)))
            out_parts = list(joined.split(sizes))
        except torch.linalg.LinAlgError:
            out_parts = []
            for i, size in zip(members, sizes, strict=True):
                try:
                    out_parts.append(compute(*present[i]))
                except torch.linalg.LinAlgError:
                    out_parts.append(failed(size, present[i][0].device))
        for i, part in zip(members, out_parts, strict=True):
            out[i] = part
    return out


class QKSpectraMonitor(Monitor):
    """A persistent drop of the model's attention-update entropy below its own healthy trajectory (see
    :class:`QKSpectraConfig`); per-head detail in the event."""

    name = "qk_spectra"

    def __init__(self, config: QKSpectraConfig, parts: ModelParts, heads_per_tp_rank: int) -> None:
        self.config = config
        self.num_layers, self.num_heads = parts.num_layers, parts.num_heads
        self.heads_per_tp_rank = max(1, heads_per_tp_rank)
        self.history: deque[np.ndarray] = deque(maxlen=config.window)  # accepted [layers, heads] measurements
        self.cusum = 0.0  # accumulated drop beyond the allowance
        self.alarms = 0
        self.measurements = 0
        self._current: np.ndarray | None = None
        self._layer_sums: np.ndarray | None = None
        self._measured: np.ndarray | None = None
        self._cusum_now: float | None = None  # what this measurement makes of the sum (None: not judged)
        self._drop_now = float("nan")
        self._flagged = False

    def required_stats(self) -> tuple[str, ...]:
        return (HEAD_ENTROPY, LAYER_SUMS, MEASURED)

    def evaluate(self, step: int, stats: Any) -> list[Finding]:
        measured = np.asarray(stats.total(MEASURED), dtype=np.float64)
        self._flagged, self._cusum_now, self._drop_now = False, None, float("nan")
        complete = measured >= self.num_heads  # each head is written by one rank: a layer counts when all were
        if not complete.any():
            self._current = None
            return []
        current = np.asarray(stats.total(HEAD_ENTROPY), dtype=np.float64).reshape(self.num_layers, self.num_heads)
        current = np.where(complete[:, None], current, np.nan)
        self._current, self._measured = current, measured
        self._layer_sums = np.asarray(stats.total(LAYER_SUMS), dtype=np.float64).reshape(self.num_layers, -1)
        if len(self.history) < self.config.warmup_measurements:
            return []
        history = np.stack(self.history)  # [n, layers, heads]
        with np.errstate(all="ignore"), _quiet_nan_warnings():
            layer_now = np.nanmedian(current, axis=1)
            layer_baseline, _ = robust_trend(np.nanmedian(history, axis=2))
            layer_drop = _relative_drop(layer_baseline, layer_now)
            drop = float(np.nanmean(layer_drop)) if np.isfinite(layer_drop).any() else 0.0
        self._drop_now = drop
        self._cusum_now = max(0.0, self.cusum + drop - self.config.allowance)
        if self._cusum_now <= self.config.alarm_drop:
            return []
        self._flagged = True
        with np.errstate(all="ignore"), _quiet_nan_warnings():
            head_baseline, _ = robust_trend(history.reshape(len(history), -1))
        head_baseline = head_baseline.reshape(current.shape)
        head_drop = _relative_drop(head_baseline, current)
        order = np.argsort(-np.nan_to_num(head_drop, nan=-np.inf), axis=None)
        heads = [{"layer": int(layer), "head": int(head), "tp_rank": int(head) // self.heads_per_tp_rank,
                  "delta2_entropy": float(current[layer, head]), "baseline": float(head_baseline[layer, head]),
                  "drop": float(head_drop[layer, head])}
                 for layer, head in (np.unravel_index(i, current.shape) for i in order[:16])
                 if np.isfinite(head_drop[layer, head])]
        layers = [{"layer": layer, "delta2_entropy_median": float(layer_now[layer]),
                   "baseline": float(layer_baseline[layer]), "drop": float(layer_drop[layer])}
                  for layer in range(self.num_layers) if np.isfinite(layer_drop[layer])]
        message = (f"attention update collapse: Δ₂ spectral entropy {drop:.0%} below its healthy trajectory "
                   f"(mean over layers; accumulated drop {self._cusum_now:.2f} > {self.config.alarm_drop:g})")
        if heads:
            worst = heads[0]
            message += (f"; largest: layer {worst['layer']} head {worst['head']} (TP rank {worst['tp_rank']}) "
                        f"{worst['delta2_entropy']:.3g} vs healthy {worst['baseline']:.3g}")
        return [Finding(self.name, Action.parse(self.config.action), Severity.WARNING, message,
                        values={"drop": drop, "accumulated_drop": self._cusum_now, "layers": layers,
                                "heads": heads})]

    def commit(self, step: int, applied: bool) -> None:
        if self._current is None:
            return
        self.measurements += 1
        self.alarms += int(self._flagged)
        if applied:
            if self._cusum_now is None:  # warm-up
                self.history.append(self._current)
            elif self._flagged:  # one alarm per episode: the new level becomes the baseline
                self.cusum = 0.0
                self.history.append(self._current)
            else:
                self.cusum = self._cusum_now
                if self.cusum == 0.0:  # a measurement inside a drop stays out of the healthy trajectory
                    self.history.append(self._current)
        self._current = None

    def metrics(self) -> dict[str, float]:
        out = {"alarms": float(self.alarms), "accumulated_drop": float(self.cusum)}
        if np.isfinite(self._drop_now):
            out["delta2_entropy_drop"] = self._drop_now
        if self._measured is None or self._layer_sums is None or (not self.history and self._current is None):
            return out
        latest = self._current if self._current is not None else self.history[-1]
        with np.errstate(all="ignore"), _quiet_nan_warnings():
            for layer in range(self.num_layers):
                row = latest[layer]
                if np.isnan(row).all():
                    continue
                out[f"layer{layer}/delta2_entropy_min"] = float(np.nanmin(row))
                out[f"layer{layer}/delta2_entropy_median"] = float(np.nanmedian(row))
                out[f"layer{layer}/delta2_entropy_max"] = float(np.nanmax(row))
                count = self._measured[layer]
                if count > 0:
                    for (quantity, summary), total in zip(LAYER_FIELDS, self._layer_sums[layer], strict=True):
                        out[f"layer{layer}/{quantity}_{summary}_mean"] = float(total / count)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"history": [h.tolist() for h in self.history], "cusum": self.cusum, "alarms": self.alarms,
                "measurements": self.measurements}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque((np.asarray(h, dtype=np.float64) for h in state["history"]), maxlen=self.config.window)
        self.cusum = float(state.get("cusum", 0.0))
        self.alarms, self.measurements = int(state["alarms"]), int(state["measurements"])


class QKLogitMonitor(Monitor):
    """Each head's attention-logit bound σ_max(W_q W_kᵀ)/√d_k against its own trend (Theil-Sen of the log bound
    through the last ``window`` accepted measurements): a head above it by a factor of more than 1 +
    ``logit_growth`` and by ``logit_factor`` robust standard deviations alarms, naming layer, head and TP rank;
    one alarm per episode (an alarmed head's trend restarts from its new level). Reports the bounds (and the
    measured max logits, where the attention records them) per layer."""

    name = "qk_logit"

    def __init__(self, config: QKSpectraConfig, parts: ModelParts, heads_per_tp_rank: int,
                 max_logits: bool = False) -> None:
        self.config = config
        self.num_layers, self.num_heads = parts.num_layers, parts.num_heads
        self.heads_per_tp_rank = max(1, heads_per_tp_rank)
        self.max_logits = max_logits
        self.history: deque[np.ndarray] = deque(maxlen=config.window)  # accepted [layers, heads] log bounds
        self.alarms = 0
        self._current: np.ndarray | None = None
        self._measured_max: np.ndarray | None = None
        self._grown: np.ndarray | None = None  # the heads this measurement alarms on

    def required_stats(self) -> tuple[str, ...]:
        return (LOGIT_BOUND, MAX_LOGIT) if self.max_logits else (LOGIT_BOUND,)

    def evaluate(self, step: int, stats: Any) -> list[Finding]:
        self._grown = None
        bound = np.asarray(stats.total(LOGIT_BOUND), dtype=np.float64).reshape(self.num_layers, self.num_heads)
        if self.max_logits:  # NaN off its steps (the MAX slot is not reduced), -inf where nothing was recorded
            measured = np.asarray(stats.total(MAX_LOGIT), dtype=np.float64).reshape(self.num_layers, self.num_heads)
            if np.isfinite(measured).any():
                self._measured_max = np.where(np.isfinite(measured), measured, np.nan)
        if not (bound > 0).any():
            self._current = None
            return []
        with np.errstate(all="ignore"):
            current = np.where(bound > 0, np.log(bound), np.nan)
        self._current = current
        if len(self.history) < self.config.logit_warmup_measurements:
            return []
        with np.errstate(all="ignore"), _quiet_nan_warnings():
            predicted, spread = robust_trend(np.stack(self.history).reshape(len(self.history), -1))
        predicted, spread = predicted.reshape(current.shape), spread.reshape(current.shape)
        margin = np.maximum(math.log1p(self.config.logit_growth), self.config.logit_factor * spread)
        with np.errstate(all="ignore"):
            excess = current - predicted
            grown = np.isfinite(excess) & (excess > margin)
        if not grown.any():
            return []
        self._grown = grown
        order = np.argsort(-np.where(grown, excess, -np.inf), axis=None)
        heads = [{"layer": int(layer), "head": int(head), "tp_rank": int(head) // self.heads_per_tp_rank,
                  "bound": float(np.exp(current[layer, head])), "trend": float(np.exp(predicted[layer, head])),
                  "growth": float(np.exp(excess[layer, head]))}
                 for layer, head in (np.unravel_index(i, current.shape) for i in order[:int(grown.sum())][:16])]
        if self._measured_max is not None:
            for head in heads:
                head["measured_max_logit"] = float(self._measured_max[head["layer"], head["head"]])
        worst = heads[0]
        message = (f"attention logit growth: {len(heads)} head(s) above their trend; largest: layer "
                   f"{worst['layer']} head {worst['head']} (TP rank {worst['tp_rank']}) bound "
                   f"σ_max(W_q W_kᵀ)/√d_k = {worst['bound']:.3g}, {worst['growth']:.2f}x its trend "
                   f"{worst['trend']:.3g} (> {1 + self.config.logit_growth:g}x)")
        return [Finding(self.name, Action.parse(self.config.logit_action), Severity.WARNING, message,
                        values={"heads": heads, "grown": int(grown.sum())})]

    def commit(self, step: int, applied: bool) -> None:
        if self._current is None:
            return
        self.alarms += int(self._grown is not None)
        if applied:
            if self._grown is not None:  # one alarm per episode: an alarmed head's trend restarts at its new level
                for past in self.history:
                    past[self._grown] = np.nan
            self.history.append(self._current)
        self._current = None

    def metrics(self) -> dict[str, float]:
        out = {"alarms": float(self.alarms)}
        latest = self._current if self._current is not None else (self.history[-1] if self.history else None)
        if latest is None:
            return out
        with np.errstate(all="ignore"), _quiet_nan_warnings():
            for layer in range(self.num_layers):
                row = latest[layer]
                if not np.isnan(row).all():
                    out[f"layer{layer}/logit_bound_max"] = float(np.exp(np.nanmax(row)))
                    out[f"layer{layer}/logit_bound_median"] = float(np.exp(np.nanmedian(row)))
                if self._measured_max is not None and np.isfinite(self._measured_max[layer]).any():
                    out[f"layer{layer}/max_logit"] = float(np.nanmax(self._measured_max[layer]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"history": [h.tolist() for h in self.history], "alarms": self.alarms}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque((np.asarray(h, dtype=np.float64) for h in state["history"]), maxlen=self.config.window)
        self.alarms = int(state["alarms"])


def _relative_drop(baseline: np.ndarray, value: np.ndarray) -> np.ndarray:
    """(baseline − value) / |baseline|, NaN where the baseline is NaN or ~0."""
    with np.errstate(all="ignore"):
        return np.where(np.abs(baseline) > 1e-12, (baseline - value) / np.abs(baseline), np.nan)


class _quiet_nan_warnings:
    """Silence numpy's all-NaN slice warnings inside a block (heads not yet measured are NaN by design)."""

    def __enter__(self) -> None:
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)


class QKSpectraFamily(FamilyBase):
    """``detectors.qk_spectra``: on when the adapter describes attention layers (Megatron)."""

    name = "qk_spectra"
    config_class = QKSpectraConfig

    def enabled(self, ctx: FamilyContext) -> bool:
        described = ctx.parts is not None and ctx.parts.num_layers > 0 and ctx.parts.num_heads > 0
        return periodic_family_enabled(ctx, self.name, described)

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        assert ctx.parts is not None
        layers, heads = ctx.parts.num_layers, ctx.parts.num_heads
        decls = [StatDecl(HEAD_ENTROPY, layers * heads, Reduce.SUM),
                 StatDecl(LAYER_SUMS, layers * len(LAYER_FIELDS), Reduce.SUM),
                 StatDecl(MEASURED, layers, Reduce.SUM), StatDecl(LOGIT_BOUND, layers * heads, Reduce.SUM)]
        if records_max_logits(ctx.parts):
            every = ctx.section.every
            decls.append(StatDecl(MAX_LOGIT, layers * heads, Reduce.MAX, due=lambda step: step % every == 0))
        return decls

    def producers(self, ctx: FamilyContext) -> list[Producer]:
        assert ctx.parts is not None
        producer = QKSpectraProducer(ctx.parts, ctx.section.every, max_logits=records_max_logits(ctx.parts))
        return [Producer("before_agreement", producer.write)]

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        assert ctx.parts is not None
        shards = ctx.parts.attention
        if not shards:
            per_rank = ctx.parts.num_heads
        elif shards[0].heads is not None:
            per_rank = shards[0].heads[1] - shards[0].heads[0]
        else:
            per_rank = shards[0].num_query_groups * shards[0].heads_per_group
        return [QKSpectraMonitor(ctx.section, ctx.parts, per_rank),
                QKLogitMonitor(ctx.section, ctx.parts, per_rank, max_logits=records_max_logits(ctx.parts))]


def records_max_logits(parts: ModelParts) -> bool:
    """Whether the model's attention records its per-head max logits (Transformer Engine's
    ``current_max_attn_logits``, present when Megatron's ``qk_clip`` or ``log_max_attention_logit`` is on)."""
    return any(internals.records_max_logits(shard.core_attention) for shard in parts.attention)

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
  only records W_{t−δ}).

The alarm is on a persistent drop of the model's attention updates, not on one head: per measurement, each layer's
median head is compared with that layer's healthy trajectory (a robust trend through the last ``window`` accepted
measurements, :mod:`arc_engine.monitors.trajectory`), the relative drops are averaged over layers, and a one-sided
CUSUM accumulates them beyond an allowance (see :class:`~arc_engine.config.QKSpectraConfig`); the event names the
layers and the heads that fell most, with their tensor-parallel ranks. Its cost is periodic: a
few small SVDs per head every δ steps (``scripts/bench_qk_cores.py``), plus a host copy of the results."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from arc_engine.config.schema import QKSpectraConfig
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
from arc_engine.monitors.spectra import HEAD_QUANTITIES, SUMMARIES, head_spectra_t, split_qkv_rows
from arc_engine.monitors.trajectory import robust_trend
from arc_engine.stats import Reduce, StatBuffer

HEAD_ENTROPY = "qk_delta2_entropy"
LAYER_SUMS = "qk_layer_sums"
MEASURED = "qk_measured"
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

    def __init__(self, parts: ModelParts, every: int) -> None:
        self.parts, self.every = parts, every
        self.shards = [s for s in parts.attention if s.owner]
        self.previous: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # layer: (step, W_q, W_k)

    @torch.no_grad()
    def write(self, buffer: StatBuffer, view: StepView) -> None:
        if view.step % self.every != 0 or not self.shards:
            return
        num_layers, num_heads = self.parts.num_layers, self.parts.num_heads
        entropy = np.zeros((num_layers, num_heads))
        sums = np.zeros((num_layers, len(LAYER_FIELDS)))
        measured = np.zeros(num_layers)
        pending = [(shard, *self._measure(shard, view.step)) for shard in self.shards]
        # one host read for every shard: [finite flag, then the heads' summaries] per shard
        flat = [torch.cat([finite.double().reshape(1), heads.reshape(-1)]) for _, finite, heads in pending]
        host = torch.cat(flat).cpu().numpy() if flat else np.zeros(0)
        offset = 0
        for shard, _, heads in pending:
            finite, values = host[offset] > 0, host[offset + 1:offset + 1 + heads.numel()]
            offset += 1 + heads.numel()
            if not finite:  # diverged weights: no spectrum, and no baseline after
                self.previous.pop(shard.layer, None)
                continue
            if heads.numel() == 0:
                continue
            heads_hqs = values.reshape(heads.shape)
            norms = heads_hqs[:, HEAD_QUANTITIES.index("delta2"), SUMMARIES.index("norm")]
            if np.all(np.isfinite(norms) & (norms > 0.0)):  # else: no update (skipped steps), or NaN
                delta2 = heads_hqs[:, HEAD_QUANTITIES.index("delta2"), SUMMARIES.index("entropy")]
                entropy[shard.layer, shard.first_head:shard.first_head + len(delta2)] = delta2
                sums[shard.layer] += _layer_values(heads_hqs).sum(axis=0)
                measured[shard.layer] += len(delta2)
        if measured.any():
            device = buffer.device
            buffer.view(HEAD_ENTROPY).add_(torch.from_numpy(entropy.reshape(-1)).to(device))
            buffer.view(LAYER_SUMS).add_(torch.from_numpy(sums.reshape(-1)).to(device))
            buffer.view(MEASURED).add_(torch.from_numpy(measured).to(device))

    def _measure(self, shard: Any, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(finite flag, ``[heads, quantities, summaries]`` of :func:`head_spectra_t`, empty when there is no
        increment of exactly δ steps) of one shard, on its device; the shard's W_q, W_k become the next
        measurement's reference. Non-finite weights are measured as zeros and dropped once the flag is read."""
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
        heads = torch.zeros((0, len(HEAD_QUANTITIES), len(SUMMARIES)), dtype=torch.float64, device=weight.device)
        previous = self.previous.get(shard.layer)
        if previous is not None and step - previous[0] == self.every:
            _, q_prev, k_prev = previous
            group = [(first + h) // shard.heads_per_group for h in range(q.shape[0])]
            try:
                heads = torch.stack([head_spectra_t(q[h], k[group[h]], q_prev[h], k_prev[group[h]])
                                     for h in range(q.shape[0])])
            except torch.linalg.LinAlgError:  # an SVD that does not converge (overflowing updates)
                heads = torch.full((q.shape[0], len(HEAD_QUANTITIES), len(SUMMARIES)), math.nan,
                                   dtype=torch.float64, device=weight.device)
        self.previous[shard.layer] = (step, q.float().clone(), k.float().clone())
        return finite, heads


class QKSpectraMonitor:
    """A persistent drop of the model's attention-update entropy below its own healthy trajectory (see
    :class:`~arc_engine.config.QKSpectraConfig`); per-head detail in the event."""

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

    def enabled(self, ctx: FamilyContext) -> bool:
        described = ctx.parts is not None and ctx.parts.num_layers > 0 and ctx.parts.num_heads > 0
        return periodic_family_enabled(ctx, self.name, described)

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        assert ctx.parts is not None
        layers, heads = ctx.parts.num_layers, ctx.parts.num_heads
        return [StatDecl(HEAD_ENTROPY, layers * heads, Reduce.SUM), StatDecl(LAYER_SUMS, layers * len(LAYER_FIELDS),
                                                                               Reduce.SUM),
                StatDecl(MEASURED, layers, Reduce.SUM)]

    def producers(self, ctx: FamilyContext) -> list[Producer]:
        assert ctx.parts is not None
        return [Producer("before_agreement", QKSpectraProducer(ctx.parts, ctx.section.every).write)]

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        assert ctx.parts is not None
        shards = ctx.parts.attention
        if not shards:
            per_rank = ctx.parts.num_heads
        elif shards[0].heads is not None:
            per_rank = shards[0].heads[1] - shards[0].heads[0]
        else:
            per_rank = shards[0].num_query_groups * shards[0].heads_per_group
        return [QKSpectraMonitor(ctx.section, ctx.parts, per_rank)]

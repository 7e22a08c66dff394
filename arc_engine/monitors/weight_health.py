"""``detectors.weight_health``: weight-matrix health and per-layer gradient statistics (ARC paper §3.2.3, §3.2.1).

Every ``every`` optimizer steps (a multiple of ``stats.interval``) the producer measures up to ``max_tensors``
weight matrices (the parameters of 2 or more dimensions, spread evenly over the model when it has more:
:func:`~arc_engine.monitors.weight_stats.tracked_indices`) inside the optimizer step, before the update, and writes
four SUM slots of the step's one agreement, sized by the config alone (T = ``max_tensors``, B = ``hist_bins``):

* ``weight_health_weight`` ``[T x 3]``: per matrix Σw², its elements, its elements with |w| < ``sparsity_eps``;
* ``weight_health_rank`` ``[T x 2]``: per matrix its effective rank exp(H(σ/Σσ)) and 1 where it was measured
  (``rank_samples`` matrices per measurement, rotating through the tracked ones);
* ``weight_health_grad`` ``[T x 3]``: per matrix Σg, Σg² and the elements of its gradient;
* ``weight_health_grad_hist`` ``[B]``: the tracked gradients' elements counted in fixed log2-magnitude bins.

Each element is counted once across the decision group. A parameter a rank holds whole (DDP, a plain module) is the
same on every rank and written by its owner only (:func:`~arc_engine.stats.partition.owned_ids` over the decision
group's ranks); a local shard (FSDP2: the adapter holds ``param.to_local()``, whose autograd input is the DTensor
parameter, where the gradient's shard is read) is written by every rank for its own shard. Where the optimizer
partitions the parameters (DeepSpeed ZeRO-1/2/3: :attr:`StepView.partition_parts`), every rank writes its
partition's part of every matrix: the fp32 master values and the gradient as DeepSpeed applies it (unscaled,
clipped). The effective rank needs a whole matrix: the owner of a replicated one computes it (ZeRO-1/2: from the
module's whole weights); sharded matrices (FSDP2, ZeRO-3) are not rank-measured. Off the schedule the slots stay
zero; the monitor reads only agreed sums.

Alarms (each measurement, while the condition holds): ‖W‖_F above ``max_norm`` or non-finite (explosion);
‖W‖_F / ‖W₀‖_F below ``collapse_ratio`` (collapse; W₀: the matrix at the family's first measurement); sparsity above
its first value + ``sparsity_increase``; effective rank below (1 − ``rank_drop``) x the largest of its last
``rank_window`` measured values (0: its first value, the paper's rule; learning itself takes an embedding's rank to
half its random initialization's in a long healthy run, so a reference that moves with the run is what tells a
collapse from training); a gradient CV above ``cv_max`` (0: off); the weight-health score below ``score_min``
(:meth:`WeightHealthMonitor.scores`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from arc_engine import internals, runtime
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
from arc_engine.monitors.weight_stats import (
    effective_rank,
    grad_sums,
    gradient_cv,
    health_score,
    log_magnitude_histogram,
    normalized_entropy,
    rank_sample,
    tracked_indices,
    weight_sums,
)
from arc_engine.stats import AgreedStats, Reduce, StatBuffer
from arc_engine.stats.grad_stats import host_to_device
from arc_engine.stats.partition import owned_ids


@dataclass(kw_only=True)
class WeightHealthConfig:
    """Weight-matrix health and per-layer gradient statistics (ARC paper §3.2.3, §3.2.1), every ``every`` optimizer
    steps (a multiple of ``stats.interval``) on up to ``max_tensors`` weight matrices (parameters of 2 or more
    dimensions, spread evenly over the model when it has more).

    Alarms, on each measurement while they hold: ‖W‖_F above ``max_norm`` or non-finite (explosion); ‖W‖_F / ‖W₀‖_F
    below ``collapse_ratio`` (W₀: the matrix at the first measurement); the fraction of |w| < ``sparsity_eps`` above
    its first value + ``sparsity_increase``; the effective rank exp(H(σ/Σσ)) of ``rank_samples`` matrices per
    measurement (rotating; 0: none) below (1 - ``rank_drop``) x the largest of its previous ``rank_window``
    measured values (0: its first value, the ARC paper's rule, which a long healthy run trips: learning compresses
    a matrix, an embedding most, well below its random initialization's rank); the weight-health score
    (``norm_weight`` x NormScore + ``rank_weight`` x RankScore + ``sparsity_weight`` x SparsityScore, normalized over
    the components available) below ``score_min``: all with ``action``. A layer's gradient coefficient of variation
    σ/|μ| above ``cv_max`` (0: off; the paper's 10 fires on every layer of a healthy model) gets ``grad_action``.
    The gradient histogram counts elements in ``hist_bins`` equal log2-magnitude bins over
    [2^``hist_min_log2``, 2^``hist_max_log2``) (its normalized entropy is a metric)."""

    enabled: bool = False
    """Weight-matrix health (Frobenius norm, effective rank, sparsity, a score) and per-layer gradient CV and histogram
    entropy (ARC paper; [detectors.md](detectors.md#weight-health))."""
    every: int = 50
    """Optimizer steps between measurements; off the schedule its slots stay zero.
    Allowed: >= 1, a multiple of `stats.interval`"""
    max_tensors: int = 64
    """Weight matrices (parameters of 2+ dimensions) tracked: all when they fit, else this many spread evenly over the
    model. Sets the slots' size (8 numbers per matrix).
    Allowed: [1, 4096]"""
    max_norm: float = 1.0e4
    """Explosion: a matrix's Frobenius norm above this (or not finite).
    Allowed: > 0"""
    collapse_ratio: float = 1.0e-3
    """Collapse: ‖W‖_F / ‖W₀‖_F below this (W₀: the matrix at the family's first measurement); 0: off.
    Allowed: [0, 1)"""
    sparsity_eps: float = 1.0e-8
    """Sparsity counts the elements with |w| below this.
    Allowed: > 0"""
    sparsity_increase: float = 0.1
    """Sparsity explosion: a matrix's sparsity above its first value plus this.
    Allowed: (0, 1]"""
    rank_samples: int = 2
    """Matrices whose effective rank (one SVD each) is computed per measurement, rotating; 0: none. Replicated matrices
    only.
    Allowed: [0, max_tensors]"""
    rank_drop: float = 0.5
    """Alarm when a matrix's effective rank falls by more than this fraction of its reference (`rank_window`).
    Allowed: (0, 1]"""
    rank_window: int = 5
    """The rank drop's reference: the largest of the matrix's last this many measured effective ranks (a collapse is a
    fall within them, not learning's slow compression); 0: its first value, the ARC paper's rule.
    Allowed: [0, 1000]"""
    cv_max: float = 0.0
    """Alarm when a layer's gradient σ/|μ| exceeds this; 0: off (the paper's 10 fires on every layer of a healthy
    model).
    Allowed: >= 0"""
    hist_bins: int = 48
    """Equal log2-magnitude bins of the gradient histogram (its normalized entropy is the metric `grad_entropy`).
    Allowed: [2, 1024]"""
    hist_min_log2: int = -40
    """Lower edge of the histogram's bins, log2|g|; smaller values (zeros too) count in the first bin.
    Allowed: < hist_max_log2"""
    hist_max_log2: int = 8
    """Upper edge of the histogram's bins, log2|g|; larger values count in the last bin.
    Allowed: > hist_min_log2"""
    norm_weight: float = 0.4
    """Weight of NormScore (the fraction of matrices with a healthy norm) in the score.
    Allowed: >= 0 (the three weights sum > 0)"""
    rank_weight: float = 0.3
    """Weight of RankScore (mean of min(1, rank / first rank)) in the score.
    Allowed: >= 0"""
    sparsity_weight: float = 0.3
    """Weight of SparsityScore (mean of 1 − sparsity rise / `sparsity_increase`, clipped to [0, 1]) in the score.
    Allowed: >= 0"""
    score_min: float = 0.5
    """Alarm when the weight-health score (in [0, 1]) falls below this; 0: off.
    Allowed: [0, 1]"""
    action: ActionName = "warn"
    """What a weight alarm (explosion, collapse, sparsity, rank drop, score) gets; the paper rolls back on a low
    score."""
    grad_action: ActionName = "warn"
    """What a gradient-CV alarm gets."""

    def __post_init__(self) -> None:
        require(self.every >= 1, "every", self.every, "must be an integer >= 1")
        require(1 <= self.max_tensors <= 4096, "max_tensors", self.max_tensors, "must be an integer in [1, 4096]")
        require(self.max_norm > 0, "max_norm", self.max_norm, "must be > 0")
        require(0 <= self.collapse_ratio < 1, "collapse_ratio", self.collapse_ratio, "must be in [0, 1)")
        require(self.sparsity_eps > 0, "sparsity_eps", self.sparsity_eps, "must be > 0")
        require(0 < self.sparsity_increase <= 1, "sparsity_increase", self.sparsity_increase, "must be in (0, 1]")
        require(0 <= self.rank_samples <= self.max_tensors, "rank_samples", self.rank_samples,
                "must be an integer in [0, max_tensors]")
        require(0 < self.rank_drop <= 1, "rank_drop", self.rank_drop, "must be in (0, 1]")
        require(0 <= self.rank_window <= 1000, "rank_window", self.rank_window, "must be an integer in [0, 1000]")
        require(self.cv_max >= 0, "cv_max", self.cv_max, "must be >= 0 (0 = off)")
        require(2 <= self.hist_bins <= 1024, "hist_bins", self.hist_bins, "must be an integer in [2, 1024]")
        require(self.hist_min_log2 < self.hist_max_log2, "hist_max_log2", self.hist_max_log2,
                "must be > hist_min_log2")
        for key in ("norm_weight", "rank_weight", "sparsity_weight"):
            require(getattr(self, key) >= 0, key, getattr(self, key), "must be >= 0")
        require(self.norm_weight + self.rank_weight + self.sparsity_weight > 0, "norm_weight", self.norm_weight,
                "norm_weight + rank_weight + sparsity_weight must be > 0")
        require(0 <= self.score_min <= 1, "score_min", self.score_min, "must be in [0, 1] (0 = off)")



WEIGHT = "weight_health_weight"
RANK = "weight_health_rank"
GRAD = "weight_health_grad"
GRAD_HIST = "weight_health_grad_hist"


def dtensor_parameter(tensor: torch.Tensor) -> DTensor | None:
    """The DTensor parameter that ``tensor`` is a local view of (FSDP2's ``param.to_local()``: the view's autograd
    input is the parameter's AccumulateGrad node), ``tensor`` itself when it is a DTensor, else None."""
    if isinstance(tensor, DTensor):
        return tensor
    node = tensor.grad_fn
    for next_node, _ in (node.next_functions if node is not None else ()):
        variable = internals.accumulate_grad_variable(next_node)
        if isinstance(variable, DTensor):
            return variable
    return None


def full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The parameter's whole shape: DeepSpeed ZeRO-3 keeps it in ``ds_shape`` (the tensor itself is empty between
    gathers)."""
    return internals.zero3_full_shape(tensor)


class TrackedMatrix:
    """One tracked weight matrix as this rank holds it: the whole tensor, or this rank's shard (``sharded``).
    ``label`` is the same on every rank (parameter index and full shape)."""

    def __init__(self, slot: int, index: int, tensor: torch.Tensor | None, label: str | None = None) -> None:
        self.slot, self.tensor = slot, tensor
        self.parameter = dtensor_parameter(tensor) if tensor is not None else None
        self.sharded = self.parameter is not None
        #: whether this rank holds the whole matrix at the step (not a DTensor shard, not a ZeRO-3 parameter)
        self.whole = tensor is not None and not self.sharded and not internals.is_zero3_param(tensor)
        if label is None:
            assert tensor is not None
            label = f"param {index} {list(self.parameter.shape if self.parameter is not None else full_shape(tensor))}"
        self.label = label

    def weight(self) -> torch.Tensor:
        """The live values this rank holds (read each time: a restore may rebind a parameter's storage)."""
        return self.tensor.to_local() if isinstance(self.tensor, DTensor) else self.tensor.detach()

    def grad(self) -> torch.Tensor | None:
        """This rank's final gradient of the matrix (its local shard under FSDP2), None when it has none."""
        grad = self.parameter.grad if self.parameter is not None else self.tensor.grad
        return grad.to_local() if isinstance(grad, DTensor) else grad


class WeightHealthProducer:
    """Writes this rank's partial sums on the measured steps (see the module docstring). Local and device-side:
    no collective, no host sync, except the effective rank's SVD (``rank_samples`` matrices per measurement),
    which synchronizes a CUDA device with the host. Writes overwrite (a re-agreement of the step writes the same)."""

    def __init__(self, config: WeightHealthConfig, parts: ModelParts | None = None) -> None:
        self.config = config
        self.parts = parts  # with ``matrices``: the whole model's list (Megatron), else this rank's parameters
        self.member, self.members = runtime.global_rank(), 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.members = torch.distributed.get_world_size()
        self.matrices: list[TrackedMatrix] = []
        self.owned: set[int] = set()  # slots this rank writes
        self._params_key: tuple[int, ...] | None = None
        self._slots: torch.Tensor | None = None  # the owned slots on the buffer's device, built once (a
        # host-to-device copy on every measurement would synchronize)

    @property
    def labels(self) -> list[str]:
        return [m.label for m in self.matrices]

    def set_group(self, ranks: list[int], rank: int) -> None:
        """The decision group's global ranks and this rank's: the owners of replicated matrices are dealt over
        them (called at start by the monitor, on every rank)."""
        self.member, self.members = sorted(ranks).index(rank), len(ranks)
        self._params_key = None

    def track(self, params: list[torch.Tensor]) -> list[TrackedMatrix]:
        """The tracked matrices of ``params`` (the same list in the same order on every rank), cached."""
        if self.parts is not None and self.parts.matrices:
            if self._params_key != ():
                entries = self.parts.matrices
                chosen = tracked_indices(len(entries), self.config.max_tensors)
                self.matrices = [TrackedMatrix(slot, c, entries[c][1], entries[c][0]) for slot, c in enumerate(chosen)]
                self.owned = {m.slot for m, c in zip(self.matrices, chosen, strict=True) if entries[c][2]}
                self._params_key, self._slots = (), None
            return self.matrices
        key = tuple(id(p) for p in params)
        if key != self._params_key:
            candidates = [(i, p) for i, p in enumerate(params) if len(full_shape(p)) >= 2]
            chosen = tracked_indices(len(candidates), self.config.max_tensors)
            self.matrices = [TrackedMatrix(slot, *candidates[c]) for slot, c in enumerate(chosen)]
            replicated = [m.tensor for m in self.matrices if not m.sharded]
            mine = owned_ids(replicated, self.member, self.members)
            self.owned = {m.slot for m in self.matrices if m.sharded or id(m.tensor) in mine}
            self._params_key, self._slots = key, None
        return self.matrices

    @torch.no_grad()
    def write(self, buffer: StatBuffer, view: StepView) -> None:
        config = self.config
        every = config.every
        if view.step % every != 0:
            return
        tracked = self.track(list(view.params))
        partitioned = view.partition_parts
        # where the optimizer partitions the parameters every rank writes its part of every tracked matrix; else
        # the owner of a replicated matrix writes it whole, and every rank its own shards
        matrices = [m for m in tracked if m.tensor is not None] if partitioned is not None else \
            [m for m in tracked if m.slot in self.owned]
        if not matrices:
            return
        device = buffer.device
        if self._slots is None or self._slots.device != device or len(self._slots) != len(matrices):
            self._slots = host_to_device([m.slot for m in matrices], torch.long, device)
        slots = self._slots
        weight_rows, grad_rows = [], []
        histogram = torch.zeros(config.hist_bins, dtype=torch.long, device=device)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        for matrix in matrices:
            if partitioned is not None:
                weights, grads = partitioned(matrix.tensor)
            else:
                grad = matrix.grad()
                weights, grads = [matrix.weight()], ([] if grad is None else [grad])
            sq, small, count = zero, zero, 0
            for weight in weights:
                part_sq, part_small = weight_sums(weight, config.sparsity_eps).to(device)
                sq, small, count = sq + part_sq, small + part_small, count + weight.numel()
            weight_rows.append(torch.stack([sq, torch.full_like(sq, count), small]))
            total, total_sq, count = zero, zero, 0
            for grad in grads:
                part_sum, part_sq = grad_sums(grad).to(device)
                total, total_sq, count = total + part_sum, total_sq + part_sq, count + grad.numel()
                histogram += log_magnitude_histogram(grad, config.hist_bins, config.hist_min_log2,
                                                     config.hist_max_log2).to(device)
            grad_rows.append(torch.stack([total, total_sq, torch.full_like(total_sq, count)]))
        buffer.view(WEIGHT).view(config.max_tensors, 3).index_copy_(0, slots, torch.stack(weight_rows))
        buffer.view(GRAD).view(config.max_tensors, 3).index_copy_(0, slots, torch.stack(grad_rows))
        buffer.view(GRAD_HIST).copy_(histogram)
        # the effective rank needs a whole matrix: its owner measures it where a rank holds it whole
        sample = set(rank_sample(len(self.matrices), view.step // every, config.rank_samples))
        ranked = [m for m in tracked if m.slot in sample and m.slot in self.owned and m.whole]
        rank_rows = buffer.view(RANK).view(config.max_tensors, 2)
        for matrix in ranked:
            rank_rows[matrix.slot, 0].copy_(effective_rank(matrix.weight()))
            rank_rows[matrix.slot, 1].fill_(1.0)


class WeightHealthMonitor(Monitor):
    """Judges the agreed weight-health sums on the measured steps (see the module docstring); keeps each matrix's
    first norm, sparsity and effective rank as its baseline, and the latest effective rank between samples."""

    name = "weight_health"

    def __init__(self, config: WeightHealthConfig, producer: WeightHealthProducer | None = None) -> None:
        self.config, self.producer = config, producer
        self.norm0: dict[int, float] = {}
        self.sparsity0: dict[int, float] = {}
        self.rank0: dict[int, float] = {}
        self.rank_latest: dict[int, float] = {}
        self.rank_recent: dict[int, deque[float]] = {}  # the last ``rank_window`` measured ranks, per slot
        self.alarms = self.measurements = 0
        self._current: dict[str, np.ndarray] | None = None
        self._values: dict[str, float] = {}
        self._flagged = False

    def on_start(self, locations: dict[int, str]) -> None:
        if self.producer is not None:
            self.producer.set_group(list(locations), runtime.global_rank())

    def required_stats(self) -> tuple[str, ...]:
        return (WEIGHT, RANK, GRAD, GRAD_HIST)

    def _label(self, slot: int) -> str:
        labels = self.producer.labels if self.producer is not None else []
        return labels[slot] if slot < len(labels) else f"matrix {slot}"

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        size = self.config.max_tensors
        weight = stats.total(WEIGHT).reshape(size, 3)
        self._flagged, self._current = False, None
        measured = weight[:, 1] > 0
        if not measured.any():
            return []
        rank, grad = stats.total(RANK).reshape(size, 2), stats.total(GRAD).reshape(size, 3)
        with np.errstate(all="ignore"):
            current = {"measured": measured, "norm": np.sqrt(weight[:, 0]), "sparsity": weight[:, 2] / weight[:, 1],
                       "ranked": rank[:, 1] > 0, "rank": rank[:, 0],
                       "cv": gradient_cv(grad[:, 0], grad[:, 1], grad[:, 2])}
        self._current = current
        scores = self.scores(current)
        entropy = normalized_entropy(stats.total(GRAD_HIST))
        self._values = {**scores, "grad_entropy": entropy, "tensors": float(measured.sum()),
                        **self._extremes(current)}
        findings = self._weight_findings(current) + self._grad_findings(current)
        if math.isfinite(scores["score"]) and scores["score"] < self.config.score_min:
            findings.append(Finding(self.name, Action.parse(self.config.action), Severity.ERROR,
                                    f"weight-health score {scores['score']:.3f} below {self.config.score_min:g}",
                                    values={k: _json(v) for k, v in self._values.items()}))
        self._flagged = bool(findings)
        return findings

    def _rank_reference(self, slot: int) -> float:
        """The rank drop's reference for ``slot``: the largest of its last ``rank_window`` measured ranks, or its
        first (``rank_window`` 0); 0 when there is none yet."""
        recent = self.rank_recent.get(slot)
        if self.config.rank_window and recent:
            return max(recent)
        return self.rank0.get(slot, 0.0)

    def _ratios(self, current: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per slot: ‖W‖/‖W₀‖, sparsity − sparsity₀, the latest effective rank / its first (the score's) and the
        rank measured now / its reference (the rank drop's) (NaN: no baseline)."""
        nan = np.full(len(current["norm"]), np.nan)
        norm_ratio, sparsity_rise, rank_ratio, rank_drop = nan.copy(), nan.copy(), nan.copy(), nan.copy()
        latest = dict(self.rank_latest)
        latest.update({s: float(current["rank"][s]) for s in np.flatnonzero(current["ranked"])})
        for slot in np.flatnonzero(current["measured"]):
            with np.errstate(all="ignore"):
                if self.norm0.get(slot, 0.0) > 0:
                    norm_ratio[slot] = current["norm"][slot] / self.norm0[slot]
                if slot in self.sparsity0:
                    sparsity_rise[slot] = current["sparsity"][slot] - self.sparsity0[slot]
                if self.rank0.get(slot, 0.0) > 0 and slot in latest:
                    rank_ratio[slot] = latest[slot] / self.rank0[slot]
        for slot in np.flatnonzero(current["ranked"]):
            reference = self._rank_reference(int(slot))
            if reference > 0:
                with np.errstate(all="ignore"):
                    rank_drop[slot] = current["rank"][slot] / reference
        return {"norm_ratio": norm_ratio, "sparsity_rise": sparsity_rise, "rank_ratio": rank_ratio,
                "rank_drop": rank_drop}

    def scores(self, current: dict[str, np.ndarray]) -> dict[str, float]:
        """The ARC score w_n NormScore + w_r RankScore + w_s SparsityScore (weights normalized over the components
        available). NormScore: the fraction of measured matrices with a healthy norm (finite, at most ``max_norm``,
        not collapsed); RankScore: the mean over rank-measured matrices of min(1, latest rank / first rank);
        SparsityScore: the mean of clip(1 − (sparsity − first sparsity) / ``sparsity_increase``, 0, 1)."""
        config, ratios = self.config, self._ratios(current)
        measured = current["measured"]
        healthy = np.isfinite(current["norm"]) & (current["norm"] <= config.max_norm) & \
            ~(ratios["norm_ratio"] < config.collapse_ratio)
        with np.errstate(all="ignore"):
            rank = np.nanmean(np.minimum(ratios["rank_ratio"], 1.0)) if np.isfinite(ratios["rank_ratio"]).any() \
                else math.nan
            rise = ratios["sparsity_rise"][np.isfinite(ratios["sparsity_rise"])]
            sparsity = float(np.mean(np.clip(1.0 - np.maximum(rise, 0.0) / config.sparsity_increase, 0, 1))) \
                if rise.size else math.nan
        components = {"norm_score": float(healthy[measured].mean()), "rank_score": float(rank),
                      "sparsity_score": sparsity}
        weights = {"norm_score": config.norm_weight, "rank_score": config.rank_weight,
                   "sparsity_score": config.sparsity_weight}
        return {"score": health_score(components, weights), **components}

    def _extremes(self, current: dict[str, np.ndarray]) -> dict[str, float]:
        ratios = self._ratios(current)
        out = {"weight_norm_max": float(np.nanmax(current["norm"][current["measured"]]))}
        for key, values, pick in (("norm_ratio_min", ratios["norm_ratio"], np.nanmin),
                                  ("sparsity_rise_max", ratios["sparsity_rise"], np.nanmax),
                                  ("rank_ratio_min", ratios["rank_ratio"], np.nanmin),
                                  ("grad_cv_max", current["cv"], np.nanmax)):
            finite = values[np.isfinite(values)]
            if finite.size:
                out[key] = float(pick(finite))
        return out

    def _weight_findings(self, current: dict[str, np.ndarray]) -> list[Finding]:
        config, ratios = self.config, self._ratios(current)
        measured, norm = current["measured"], current["norm"]
        with np.errstate(invalid="ignore"):
            checks = [
                ("explosion", measured & ~(norm <= config.max_norm), norm,
                 f"Frobenius norm above {config.max_norm:g} (or not finite)", Severity.ERROR),
                ("collapse", ratios["norm_ratio"] < config.collapse_ratio, ratios["norm_ratio"],
                 f"‖W‖/‖W₀‖ below {config.collapse_ratio:g}", Severity.ERROR),
                ("sparsity", ratios["sparsity_rise"] > config.sparsity_increase, current["sparsity"],
                 f"fraction of |w| < {config.sparsity_eps:g} up by more than {config.sparsity_increase:g}",
                 Severity.ERROR),
                ("rank_drop", current["ranked"] & (ratios["rank_drop"] < 1.0 - config.rank_drop), current["rank"],
                 f"effective rank down by more than {config.rank_drop:.0%} from "
                 + (f"the largest of its last {config.rank_window} measurements" if config.rank_window
                    else "its first value"), Severity.WARNING),
            ]
        return [self._finding(kind, hits, values, what, severity, config.action)
                for kind, hits, values, what, severity in checks if hits.any()]

    def _grad_findings(self, current: dict[str, np.ndarray]) -> list[Finding]:
        if self.config.cv_max <= 0:
            return []
        with np.errstate(invalid="ignore"):
            hits = current["cv"] > self.config.cv_max
        if not hits.any():
            return []
        return [self._finding("grad_cv", hits, current["cv"], f"gradient CV σ/|μ| above {self.config.cv_max:g}",
                              Severity.WARNING, self.config.grad_action)]

    def _finding(self, kind: str, hits: np.ndarray, values: np.ndarray, what: str, severity: Severity,
                 action: str) -> Finding:
        slots = [int(s) for s in np.flatnonzero(hits)]
        named = ", ".join(f"{self._label(s)} ({values[s]:.4g})" for s in slots[:4])
        more = f" and {len(slots) - 4} more" if len(slots) > 4 else ""
        return Finding(self.name, Action.parse(action), severity, f"weight health {kind}: {what}: {named}{more}",
                       values={"kind": kind, "matrices": [{"slot": s, "label": self._label(s),
                                                           "value": _json(values[s])} for s in slots]})

    def commit(self, step: int, applied: bool) -> None:
        current, self._current = self._current, None
        if current is None:
            return
        self.measurements += 1
        self.alarms += int(self._flagged)
        for slot in np.flatnonzero(current["measured"]).tolist():
            norm, sparsity = float(current["norm"][slot]), float(current["sparsity"][slot])
            if slot not in self.norm0 and math.isfinite(norm):
                self.norm0[slot], self.sparsity0[slot] = norm, sparsity
        for slot in np.flatnonzero(current["ranked"]).tolist():
            value = float(current["rank"][slot])
            if math.isfinite(value):
                self.rank_latest[slot] = value
                self.rank0.setdefault(slot, value)
                if self.config.rank_window:
                    self.rank_recent.setdefault(slot, deque(maxlen=self.config.rank_window)).append(value)

    def metrics(self) -> dict[str, float]:
        return {**{k: v for k, v in self._values.items() if math.isfinite(v)}, "alarms": float(self.alarms),
                "measurements": float(self.measurements)}

    def state_dict(self) -> dict[str, Any]:
        return {"norm0": _keyed(self.norm0), "sparsity0": _keyed(self.sparsity0), "rank0": _keyed(self.rank0),
                "rank_latest": _keyed(self.rank_latest), "alarms": self.alarms, "measurements": self.measurements,
                "rank_recent": {str(k): list(v) for k, v in self.rank_recent.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norm0, self.sparsity0 = _unkeyed(state["norm0"]), _unkeyed(state["sparsity0"])
        self.rank0, self.rank_latest = _unkeyed(state["rank0"]), _unkeyed(state["rank_latest"])
        window = self.config.rank_window or None
        self.rank_recent = {int(k): deque((float(x) for x in v), maxlen=window)
                            for k, v in state.get("rank_recent", {}).items()}  # absent: a state from before it
        self.alarms, self.measurements = int(state["alarms"]), int(state["measurements"])


def _json(value: float) -> float | str:
    return float(value) if math.isfinite(value) else str(float(value))


def _keyed(values: dict[int, float]) -> dict[str, float]:
    return {str(k): float(v) for k, v in values.items()}


def _unkeyed(values: dict[str, float]) -> dict[int, float]:
    return {int(k): float(v) for k, v in values.items()}


class WeightHealthFamily(FamilyBase):
    """``detectors.weight_health`` (off by default). Where the adapter describes the model (Megatron) it runs over
    the adapter's list of the whole model's matrices (:attr:`ModelParts.matrices`; off when it gives none)."""

    name = "weight_health"
    config_class = WeightHealthConfig

    def __init__(self) -> None:
        self._shared: tuple[FamilyContext, WeightHealthProducer] | None = None

    def _producer(self, ctx: FamilyContext) -> WeightHealthProducer:
        """The one producer of ``ctx``, shared with its monitor (which hands it the decision group at start)."""
        if self._shared is None or self._shared[0] is not ctx:
            self._shared = (ctx, WeightHealthProducer(ctx.section, ctx.parts))
        return self._shared[1]

    def enabled(self, ctx: FamilyContext) -> bool:
        return periodic_family_enabled(ctx, self.name, ctx.parts is None or bool(ctx.parts.matrices))

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        size = ctx.section.max_tensors
        return [StatDecl(WEIGHT, 3 * size, Reduce.SUM), StatDecl(RANK, 2 * size, Reduce.SUM),
                StatDecl(GRAD, 3 * size, Reduce.SUM), StatDecl(GRAD_HIST, ctx.section.hist_bins, Reduce.SUM)]

    def producers(self, ctx: FamilyContext) -> list[Producer]:
        return [Producer("before_agreement", self._producer(ctx).write)]

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [WeightHealthMonitor(ctx.section, self._producer(ctx))]


__all__ = ["GRAD", "GRAD_HIST", "RANK", "WEIGHT", "TrackedMatrix", "WeightHealthFamily", "WeightHealthMonitor",
           "WeightHealthProducer", "dtensor_parameter"]

"""``detectors.fisher``: Fisher-aware recovery (ARC paper §3.3 and §3.6; Algorithms 3, 7, 8).

**What each rank keeps.** The tensors its optimizer steps -- the parameters under DDP and plain modules, the local
shards under FSDP2, the fp32 master partitions under DeepSpeed ZeRO-1/2/3 -- are seen in the optimizer step of every
applied step (:meth:`FisherMonitor.before_update`, called by :func:`arc_engine.recovery.heal.heal_step`). For each
it keeps, on its device in fp32:

* F, the diagonal Fisher estimate: F ← ``decay`` g² + (1 − ``decay``) F every ``every`` applied steps, g the
  gradient the optimizer applies (after the framework's clipping and unscaling). The first update sets F = g² (an
  EMA started at zero would be biased low for 1/``decay`` updates). A skipped or rolled-back step never reaches it.
* θ*, a copy of the tensors at the newest verified-stable state (taken when recovery verifies a snapshot, and
  after every rollback; after an escape, the perturbed state).

Memory: 8 bytes per element of the rank's own part (its partition under ZeRO/FSDP2, the whole replica under DDP,
where every rank holds the same F and θ*), plus a transient copy of it during an importance-weighted rollback.
F and θ* are not part of a checkpoint: after a restart they are estimated afresh.

**What the agreement carries** on the steps ``every`` divides (one SUM slot, :data:`FISHER`): ΣF, ΣF ln F, the
element count and Σ F (θ − θ*)², each element once over the decision group (replicated tensors dealt over the ranks
with :func:`~arc_engine.stats.partition.owned_ids`, partitions and shards each on its rank). From them every rank
derives the same F̄, the Fisher's effective rank exp(H(F / ΣF)) = ΣF · exp(−ΣF ln F / ΣF) and the Fisher-Rao
distance d_FR = √Σ F (θ − θ*)² (Algorithm 3).

**What it does with them.**

* d_FR above ``drift_threshold`` or ``drift_factor`` x the median of its last ``window`` healthy values:
  ``drift_action`` (a preventive checkpoint: the next verified snapshot goes to disk and becomes the new θ*).
* Effective rank below ``min_rank_fraction`` of the element count: a warning (learning concentrated in few
  parameters).
* ``importance_rollback``: after recovery restores a snapshot, the stepped tensors become
  θ = β θ_ckpt + (1 − β) θ_cur, β = sigmoid(``sharpness`` (F / F̄ − 1)) (:func:`importance_blend`; the paper's
  λ (F − F̄) with λ = ``sharpness`` / F̄, so that the setting does not depend on the gradient's scale). A
  non-finite current value takes the checkpoint's. The backend then brings its model copies in line
  (``TrainState.masters_changed``: ZeRO gathers its bit16 parameters again).
* ``ewc_strength`` λ₀ > 0: for ``ewc_steps`` applied steps after a rollback, the gradient of the EWC penalty
  (λ_t / 2) Σ F (θ − θ*)² is added to the applied gradient: g ← g + λ_t F (θ − θ*), λ_t = λ₀ exp(−t /
  ``ewc_decay_steps``), t the steps since the rollback (:func:`ewc_penalty_gradient`). Adding it inside the
  optimizer step equals training on L + the penalty, without touching the user's loss.

Every rank computes the same verdicts (agreed sums); replicas (DDP) stay bitwise identical under the blend and the
penalty because their F, θ*, θ and gradients are.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from arc_engine import runtime
from arc_engine.config.errors import require
from arc_engine.config.schema import ActionName
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext, Producer, StatDecl, StepView, periodic_family_enabled
from arc_engine.recovery.state import local_tensor
from arc_engine.stats import AgreedStats, Reduce, StatBuffer
from arc_engine.stats.partition import owned_ids


@dataclass(kw_only=True)
class FisherConfig:
    """Fisher-aware recovery (ARC paper §3.3 and §3.6, Algorithms 3, 7, 8): a diagonal Fisher estimate F ←
    ``decay`` g² + (1 − ``decay``) F of the gradient each rank's optimizer applies to its own tensors (its partition
    under ZeRO and FSDP2, the whole replica under DDP), updated every ``every`` applied steps (a multiple of
    ``stats.interval``). On those steps the agreement carries ΣF, ΣF ln F, the element count and the Fisher-Rao
    distance d_FR = √Σ F (θ − θ*)² from the last verified-stable state θ* (recovery's snapshots). After
    ``warmup_measurements``: d_FR above ``drift_threshold`` (> 0) or above ``drift_factor`` times the median of the
    last ``window`` healthy values gets ``drift_action`` (a preventive checkpoint); the Fisher's effective rank
    exp(H(F / ΣF)) below ``min_rank_fraction`` of the element count a warning. With ``importance_rollback`` a
    rollback blends θ = β θ_ckpt + (1 − β) θ_cur, β = sigmoid(``sharpness`` (F / F̄ − 1)); with ``ewc_strength``
    λ₀ > 0 the steps after a rollback add the EWC penalty's gradient λ_t F (θ − θ*), λ_t = λ₀ exp(−t /
    ``ewc_decay_steps``), for ``ewc_steps`` applied steps."""

    enabled: bool = False
    """Fisher-aware recovery (ARC paper §3.3, §3.6; [detectors.md](detectors.md#fisher-aware-recovery)): a diagonal
    Fisher estimate of each rank's own part, the Fisher-Rao drift from the last verified state, the Fisher's effective
    rank. Memory: 8 bytes per element of the rank's own part (DDP: the whole replica)."""
    every: int = 10
    """Applied optimizer steps between Fisher updates (and its statistics).
    Allowed: >= 1, a multiple of `stats.interval`"""
    decay: float = 0.05
    """F ← decay g² + (1 − decay) F (the first update sets F = g²).
    Allowed: in (0, 1]"""
    warmup_measurements: int = 20
    """Measurements before any verdict.
    Allowed: >= 1"""
    window: int = 64
    """Healthy Fisher-Rao distances kept; their median scales `drift_factor`.
    Allowed: >= 3"""
    drift_threshold: float = 0.0
    """A Fisher-Rao distance from the last verified-stable state above this gets `drift_action`; 0: off.
    Allowed: >= 0"""
    drift_factor: float = 10.0
    """A Fisher-Rao distance above this times the median of the healthy ones gets `drift_action`; 0: off.
    Allowed: 0 or > 1"""
    drift_action: ActionName = "checkpoint"
    """What a Fisher-Rao drift gets (a preventive checkpoint: the next verified snapshot goes to disk and becomes the
    new reference)."""
    min_rank_fraction: float = 0.001
    """The Fisher's effective rank below this fraction of the parameters: a warning; 0: off.
    Allowed: in [0, 1)"""
    importance_rollback: bool = False
    """A rollback keeps θ = β θ_ckpt + (1 − β) θ_now, β = sigmoid(sharpness (F / F̄ − 1)): the important parameters
    restored, the others kept. Needs `recovery.enabled`."""
    sharpness: float = 5.0
    """The importance weights' sharpness (the paper's λ times F̄).
    Allowed: > 0"""
    ewc_strength: float = 0.0
    """λ₀ of the EWC penalty (λ_t / 2) Σ F (θ − θ*)² added after a rollback (its gradient, inside the optimizer step);
    0: off. Needs `recovery.enabled`.
    Allowed: >= 0"""
    ewc_decay_steps: float = 50.0
    """λ_t = λ₀ exp(−t / this), t the applied steps since the rollback.
    Allowed: > 0"""
    ewc_steps: int = 200
    """Applied steps the EWC penalty lasts after a rollback.
    Allowed: >= 1"""

    def __post_init__(self) -> None:
        require(self.every >= 1, "every", self.every, "must be an integer >= 1 (optimizer steps)")
        require(0 < self.decay <= 1, "decay", self.decay, "must be in (0, 1]")
        require(self.warmup_measurements >= 1, "warmup_measurements", self.warmup_measurements,
                "must be an integer >= 1")
        require(self.window >= 3, "window", self.window, "must be an integer >= 3 (measurements)")
        require(self.drift_threshold >= 0, "drift_threshold", self.drift_threshold, "must be >= 0 (0 = off)")
        require(self.drift_factor == 0 or self.drift_factor > 1, "drift_factor", self.drift_factor,
                "must be 0 (off) or > 1")
        require(0 <= self.min_rank_fraction < 1, "min_rank_fraction", self.min_rank_fraction, "must be in [0, 1)")
        require(self.sharpness > 0, "sharpness", self.sharpness, "must be > 0")
        require(self.ewc_strength >= 0, "ewc_strength", self.ewc_strength, "must be >= 0 (0 = off)")
        require(self.ewc_decay_steps > 0, "ewc_decay_steps", self.ewc_decay_steps, "must be > 0 (applied steps)")
        require(self.ewc_steps >= 1, "ewc_steps", self.ewc_steps, "must be an integer >= 1 (applied steps)")



#: [6] SUM over this rank's counted elements: ΣF, ΣF ln F, element count, ΣF (θ − θ*)², 1 where this rank has a θ*,
#: 1 where it has an F
FISHER = "fisher"


def effective_rank(total: float, total_log: float) -> float:
    """exp(H(p)), p = F / ΣF, from ΣF and ΣF ln F: H = ln ΣF − ΣF ln F / ΣF. NaN for ΣF <= 0. Pure."""
    if not total > 0 or not math.isfinite(total) or not math.isfinite(total_log):
        return math.nan
    return math.exp(math.log(total) - total_log / total)


def importance_weights(fisher: torch.Tensor, mean: float, sharpness: float) -> torch.Tensor:
    """β = sigmoid(sharpness (F / F̄ − 1)) (fp32)."""
    return torch.sigmoid((fisher.float() / mean - 1.0) * sharpness)


@torch.no_grad()
def importance_blend(restored: torch.Tensor, current: torch.Tensor, fisher: torch.Tensor, mean: float,
                     sharpness: float) -> None:
    """In place: ``restored`` (θ_ckpt) ← β θ_ckpt + (1 − β) θ_cur, β from :func:`importance_weights`; where θ_cur is
    not finite, θ_ckpt stays."""
    beta = importance_weights(fisher, mean, sharpness)
    blended = restored.float() + (1.0 - beta) * (current.float() - restored.float())
    blended = torch.where(torch.isfinite(current), blended, restored.float())
    restored.copy_(blended)


def ewc_strength(config: FisherConfig, steps_since: int) -> float:
    """λ_t = λ₀ exp(−t / ewc_decay_steps) for t in [0, ewc_steps), else 0. Pure."""
    if config.ewc_strength <= 0 or not 0 <= steps_since < config.ewc_steps:
        return 0.0
    return config.ewc_strength * math.exp(-steps_since / config.ewc_decay_steps)


@torch.no_grad()
def ewc_penalty_gradient(grad: torch.Tensor, value: torch.Tensor, anchor: torch.Tensor, fisher: torch.Tensor,
                         strength: float) -> None:
    """In place: ``grad`` += strength F (θ − θ*), the gradient of (strength / 2) Σ F (θ − θ*)²."""
    penalty = fisher * (value.float() - anchor.float())
    grad.add_(penalty.mul_(strength).to(grad.dtype))


class FisherState:
    """This rank's F and θ* for the tensors its optimizer steps (module docstring). Device-side; no collective."""

    def __init__(self, config: FisherConfig) -> None:
        self.config = config
        self.tensors: list[torch.Tensor] = []   # local views of the stepped tensors, in first-seen order
        self.fisher: list[torch.Tensor] = []
        self.anchor: list[torch.Tensor] | None = None
        self._index: dict[int, int] = {}
        self._keep: list[torch.Tensor] = []     # the stepped tensors themselves (ids stay valid)
        self._counted: tuple[int, list[int]] | None = None
        self.member, self.members = 0, 1
        self.updates = 0
        self._saved: list[torch.Tensor] | None = None  # θ_cur during a rollback's restore

    def set_group(self, ranks: list[int], rank: int) -> None:
        self.member, self.members = sorted(ranks).index(rank), len(ranks)
        self._counted = None

    @torch.no_grad()
    def update(self, params: list[torch.Tensor]) -> None:
        """F ← decay g² + (1 − decay) F for each stepped tensor with a gradient (F = g² the first time)."""
        decay = self.config.decay
        olds, grads = [], []
        for param in params:
            grad = param.grad
            if grad is None:
                continue
            index = self._index.get(id(param))
            local_grad = local_tensor(grad).detach()
            if index is None:
                self._index[id(param)] = len(self.tensors)
                self._keep.append(param)
                self.tensors.append(local_tensor(param).detach())
                self.fisher.append(local_grad.float().square())
                self._counted = None
                continue
            olds.append(self.fisher[index])
            grads.append(local_grad if local_grad.dtype == torch.float32 else local_grad.float())
        if olds:  # fused over the call's tensors
            torch._foreach_mul_(olds, 1.0 - decay)
            torch._foreach_addcmul_(olds, grads, grads, value=decay)
        self.updates += 1

    def counted(self, view: StepView) -> list[int]:
        """Indices of the tensors whose elements this rank adds to the agreement. Where the adapter names the parts
        each rank counts (:attr:`StepView.partition_parts`: ZeRO's partitions, Megatron's owned masters), the
        stepped tensors holding a counted part; FSDP2's shards; of replicated tensors, the ones this rank owns over
        the decision group."""
        if self._counted is None or self._counted[0] != len(self.tensors):
            if view.partition_parts is not None:
                starts = sorted(part.data_ptr() for param in view.params
                                for part in view.partition_parts(param)[0] if part.numel())
                mine = [i for i, t in enumerate(self.tensors) if _holds_any(t, starts)]
            else:
                replicated = [i for i, p in enumerate(self._keep) if not _is_shard(p)]
                owned = owned_ids([self.tensors[i] for i in replicated], self.member, self.members)
                others = set(replicated) - {i for i in replicated if id(self.tensors[i]) in owned}
                mine = [i for i in range(len(self.tensors)) if i not in others]
            self._counted = (len(self.tensors), mine)
        return self._counted[1]

    @torch.no_grad()
    def sums(self, view: StepView, device: torch.device) -> torch.Tensor:
        """[ΣF, ΣF ln F, count, ΣF (θ − θ*)², has θ*, 1] over the counted elements (float64, on ``device``)."""
        indices = self.counted(view)
        fisher = [self.fisher[i] for i in indices]
        zero = torch.zeros((), dtype=torch.float64, device=device)
        if not fisher:
            return torch.stack([zero, zero, zero, zero, zero + float(self.anchor is not None), zero + 1])
        total = torch.stack(torch._foreach_norm(fisher, 1)).double().sum()  # F >= 0: the 1-norm is the sum
        logs = torch._foreach_clamp_min(fisher, torch.finfo(torch.float32).tiny)  # F ln F = 0 where F = 0
        torch._foreach_log_(logs)
        torch._foreach_mul_(logs, fisher)
        total_log = torch.stack([value.sum() for value in logs]).double().sum()
        count = float(sum(f.numel() for f in fisher))
        if self.anchor is not None:
            differences = torch._foreach_sub([self.tensors[i].float() for i in indices],
                                             [self.anchor[i].float() for i in indices])
            torch._foreach_mul_(differences, differences)  # (θ − θ*)², then F (θ − θ*)² >= 0: its 1-norm the sum
            torch._foreach_mul_(differences, fisher)
            drift = torch.stack(torch._foreach_norm(differences, 1)).double().sum()
        else:
            drift = zero
        return torch.stack([total.to(device), total_log.to(device), zero + count, drift.to(device),
                            zero + float(self.anchor is not None), zero + 1])

    @torch.no_grad()
    def set_anchor(self) -> None:
        """θ* ← the stepped tensors now."""
        if not self.tensors:
            return
        if self.anchor is None or len(self.anchor) != len(self.tensors):
            self.anchor = [t.clone() for t in self.tensors]
        else:
            torch._foreach_copy_(self.anchor, self.tensors)

    @torch.no_grad()
    def save_current(self) -> None:
        self._saved = [t.clone() for t in self.tensors] if self.tensors else None

    @torch.no_grad()
    def blend(self, mean: float) -> bool:
        """θ ← β θ_ckpt + (1 − β) θ_cur on every stepped tensor (the restore wrote θ_ckpt; :meth:`save_current`
        kept θ_cur). False when nothing was blended."""
        saved, self._saved = self._saved, None
        if saved is None or len(saved) != len(self.tensors):
            return False
        for restored, current, fisher in zip(self.tensors, saved, self.fisher, strict=True):
            importance_blend(restored, current, fisher, mean, self.config.sharpness)
        return True

    def discard_saved(self) -> None:
        self._saved = None

    @torch.no_grad()
    def penalize(self, params: list[torch.Tensor], strength: float) -> None:
        """g += strength F (θ − θ*) for each stepped tensor with a gradient and a θ*."""
        if self.anchor is None:
            return
        for param in params:
            index = self._index.get(id(param))
            if index is None or param.grad is None:
                continue
            ewc_penalty_gradient(local_tensor(param.grad), self.tensors[index], self.anchor[index],
                                 self.fisher[index], strength)


def _is_shard(param: torch.Tensor) -> bool:
    return local_tensor(param) is not param


def _holds_any(tensor: torch.Tensor, starts: list[int]) -> bool:
    """Whether one of the (sorted) data pointers ``starts`` lies inside ``tensor``'s storage span."""
    begin = tensor.data_ptr()
    index = bisect.bisect_left(starts, begin)
    return index < len(starts) and starts[index] < begin + tensor.numel() * tensor.element_size()


class FisherMonitor(Monitor):
    """Judges the agreed Fisher sums and drives the recovery-shaping parts (module docstring)."""

    name = "fisher"

    def __init__(self, config: FisherConfig, state: FisherState, recovery: bool) -> None:
        self.config, self.state, self.recovery = config, state, recovery
        self.history: deque[float] = deque(maxlen=config.window)
        self.measurements = 0
        self.drifting = False
        self.collapsed = False
        self.rollback_step: int | None = None  # the step training resumed from after the last rollback
        self.mean_fisher: float | None = None   # F̄ of the newest agreement (live, not rolled back)
        self._pending: tuple[float, bool, bool] | None = None
        self._values: dict[str, float] = {}

    def on_start(self, locations: dict[int, str]) -> None:
        self.state.set_group(list(locations), runtime.global_rank())

    def required_stats(self) -> tuple[str, ...]:
        return (FISHER,)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        self._pending = None
        config = self.config
        if step % config.every:
            return []
        total, total_log, count, drift_sq, anchored, measured = (float(v) for v in stats.total(FISHER))
        if measured < len(stats.ranks) or count <= 0:
            return []
        if math.isfinite(total):
            self.mean_fisher = total / count
        rank = effective_rank(total, total_log)
        distance = math.sqrt(max(drift_sq, 0.0)) if anchored >= len(stats.ranks) else math.nan
        self._values = {"mean": total / count, "effective_rank": rank, "effective_rank_fraction": rank / count,
                        "rao_distance": distance, "ewc_lambda": self.ewc_lambda(step)}
        judged = self.measurements + 1 >= config.warmup_measurements
        findings: list[Finding] = []
        limit = self._drift_limit()
        drifting = judged and math.isfinite(distance) and limit is not None and distance > limit
        if drifting and not self.drifting:
            findings.append(Finding(self.name, Action.parse(config.drift_action), Severity.WARNING,
                                    f"Fisher-Rao drift {distance:.4g} from the last verified-stable state exceeds "
                                    f"{limit:.4g}: the parameters moved far in the directions that matter",
                                    values={**self._values, "limit": limit}))
        collapsed = judged and config.min_rank_fraction > 0 and math.isfinite(rank) and \
            rank / count < config.min_rank_fraction
        if collapsed and not self.collapsed:
            findings.append(Finding(self.name, Action.WARN, Severity.WARNING,
                                    f"Fisher effective rank {rank:.4g} is {rank / count:.3g} of the {count:.0f} "
                                    f"parameters (< {config.min_rank_fraction}): learning concentrated in few "
                                    "parameters", values=dict(self._values)))
        self._pending = (distance, drifting, collapsed)
        return findings

    def _drift_limit(self) -> float | None:
        config, limits = self.config, []
        if config.drift_threshold > 0:
            limits.append(config.drift_threshold)
        if config.drift_factor > 0 and len(self.history) >= 3:
            limits.append(config.drift_factor * statistics.median(self.history))
        return min(limits) if limits else None

    def commit(self, step: int, applied: bool) -> None:
        if self._pending is None:
            return
        distance, drifting, collapsed = self._pending
        self._pending = None
        self.drifting, self.collapsed = drifting, collapsed
        self.measurements += 1
        if applied and not drifting and math.isfinite(distance):
            self.history.append(distance)

    def ewc_lambda(self, step: int) -> float:
        if self.rollback_step is None:
            return 0.0
        return ewc_strength(self.config, step - self.rollback_step)

    # -------------------------------------------------------------- engine and recovery hooks

    def updates_on(self, step: int) -> bool:
        """Whether :meth:`before_update` has work on optimizer step ``step``: a Fisher update, or the EWC penalty."""
        return step % self.config.every == 0 or self.ewc_lambda(step) > 0

    def before_update(self, params: list[torch.Tensor], step: int) -> None:
        """In an applied optimizer step, before the update: fold the gradient into F (on the steps ``every``
        divides), then add the EWC penalty's gradient while it is active."""
        if step % self.config.every == 0:
            self.state.update(params)
        strength = self.ewc_lambda(step)
        if strength > 0:
            self.state.penalize(params, strength)

    def set_reference(self) -> None:
        """The live state is the new θ*: a snapshot recovery verified (before the update), or an escape's."""
        self.state.set_anchor()

    def before_restore(self) -> None:
        if self.config.importance_rollback:
            self.state.save_current()

    def after_restore(self, step: int) -> bool:
        """After recovery restored a snapshot (training resumes from step ``step``): the importance-weighted blend,
        then θ* ← the resumed state and the EWC clock restarts. True when the stepped tensors were edited (the
        backend must refresh its model copies); the same on every rank (config and agreed F̄)."""
        blended = False
        if self.config.importance_rollback and self.mean_fisher is not None and self.mean_fisher > 0:
            blended = self.state.blend(self.mean_fisher)
        self.state.discard_saved()
        self.state.set_anchor()
        self.rollback_step = step
        self.drifting = False
        return blended

    def metrics(self) -> dict[str, float]:
        return dict(self._values)

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "measurements": self.measurements, "drifting": self.drifting,
                "collapsed": self.collapsed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque((float(v) for v in state["history"]), maxlen=self.config.window)
        self.measurements = int(state["measurements"])
        self.drifting, self.collapsed = bool(state["drifting"]), bool(state["collapsed"])


class FisherProducer:
    """Writes this rank's Fisher sums on the steps ``every`` divides (device-side; no collective, no host sync)."""

    def __init__(self, config: FisherConfig, state: FisherState) -> None:
        self.config, self.state = config, state

    def write(self, buffer: StatBuffer, view: StepView) -> None:
        if view.step % self.config.every or not self.state.tensors:
            return
        slot = buffer.view(FISHER)
        slot.copy_(self.state.sums(view, slot.device))


class FisherFamily(FamilyBase):
    """``detectors.fisher`` (off by default): the diagonal Fisher, the Fisher-Rao drift, and the Fisher-shaped
    rollback and recovery."""

    name = "fisher"
    config_class = FisherConfig

    def __init__(self) -> None:
        self._shared: tuple[FamilyContext, FisherState] | None = None

    def _state(self, ctx: FamilyContext) -> FisherState:
        if self._shared is None or self._shared[0] is not ctx:
            self._shared = (ctx, FisherState(ctx.section))
        return self._shared[1]

    def enabled(self, ctx: FamilyContext) -> bool:
        on = periodic_family_enabled(ctx, self.name, True)
        section = ctx.section
        if on and (section.importance_rollback or section.ewc_strength > 0) and not ctx.config.recovery.enabled:
            raise ValueError("detectors.fisher.importance_rollback and ewc_strength shape rollbacks: they need "
                             "recovery.enabled: true")
        return on

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        return [StatDecl(FISHER, 6, Reduce.SUM)]

    def producers(self, ctx: FamilyContext) -> list[Producer]:
        return [Producer("before_agreement", FisherProducer(ctx.section, self._state(ctx)).write)]

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [FisherMonitor(ctx.section, self._state(ctx), ctx.config.recovery.enabled)]


__all__ = ["FISHER", "FisherFamily", "FisherMonitor", "FisherProducer", "FisherState", "effective_rank",
           "ewc_penalty_gradient", "ewc_strength", "importance_blend", "importance_weights"]

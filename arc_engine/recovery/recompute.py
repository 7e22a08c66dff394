"""Recovery from silent data corruption by localized recomputation.

The flow on one monitored step (every rank runs the same branch: each branch is chosen from gathered statistics):

1. Before the reduction, each rank's :class:`~arc_engine.monitors.sdc_local.LocalGate` withholds (zeroes) a local
   gradient slot whose norm is not finite or far above its history; the count goes into the ``sdc_withheld``
   slot of the step's single statistics gather.
2. :meth:`SDCRecompute.resolve`: each suspect's *unit* re-runs forward and backward on its own micro-batches with
   the RNG state captured at the step's start, through the user's ``recompute_fn``. A unit is the set of ranks
   that run one forward pass together (:class:`Units`): one rank under data parallelism (DDP, ZeRO); under
   Megatron, a data-parallel replica's tensor/pipeline/context-parallel peers (with expert parallelism, the
   replicas its expert-parallel peers belong to as well). The other units run nothing. One small all-reduce
   shares the verdicts: the recomputation is *healthy* when the gate would not withhold it again (a transient
   fault).
3. If it reproduces the anomaly, the lowest non-suspect unit recomputes the suspect unit's micro-batches: each of
   its ranks receives the RNG state and withheld slots of its counterpart (the rank at the same model-parallel
   position; one point-to-point message each), and one small all-reduce compares the two. Equal within
   ``peer_rtol``: the data caused it. Different: the suspect's device is faulty (quarantine file,
   ``on_faulty_device``).
4. The correction adds every withheld share back (the suspect's recomputation, or for a faulty device the
   peer's): one all-reduce per reduction group of the framework (:meth:`GradientTarget.correction_groups`),
   scaled like the framework's own reduction.
5. Every statistic the recomputation yields replaces the suspect's before any detector judges the step: its local
   gradient statistics and its loss (the mean of the losses ``record_loss`` received while ``recompute_fn`` ran,
   else of the losses it yielded; for a faulty device, its counterpart's loss on its micro-batches). A corruption
   in the forward pass -- a loss and a gradient both wrong -- is repaired, not skipped.

:meth:`SDCRecompute.recompute_all` is the fallback when only the update-RMS rule fired: every rank recomputes its
own micro-batches and the correction replaces the reduced gradient. Every collective here happens only on such
steps, every recomputation runs once per step at most, and a recomputation that raises is reported in the next
collective (never a hang): the step then falls to the ``detectors.sdc.action`` policy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.family import section_of
from arc_engine.monitors.loss_spike import LossSpikeFamily
from arc_engine.monitors.sdc import RecomputeConfig, SDCFamily
from arc_engine.monitors.sdc_local import LocalGate
from arc_engine.recovery.staging import bounded_runs
from arc_engine.stats import AgreedStats, StatBuffer, names
from arc_engine.stats.grad_stats import accumulate_grad_stats

if TYPE_CHECKING:
    from arc_engine.step_hooks import EngineAccess, Evaluate

log = logging.getLogger("arc_engine")

#: ``recompute_fn(module, data_rank)``: yield the loss of each micro-batch that rank ``data_rank`` trained on in the
#: current step (the batches at ``arc.progress.data_position``), computed with ``module`` and scaled exactly as it was
#: back-propagated. It must not call ``backward`` itself. Under Megatron it is ``recompute_fn(model_chunks,
#: data_rank)`` with ``data_rank`` the data-parallel rank, and it runs Megatron's ``forward_backward_func`` on
#: those batches itself (see :mod:`arc_engine.integrations.megatron.recompute`).
RecomputeFn = Callable[[Any, int], Iterable[torch.Tensor] | None]

QUARANTINE_FILE = "quarantine.json"


@dataclass(frozen=True)
class Units:
    """Which rows of the decision group recompute together (a *unit*), whose data each row trains on, and each
    row's position inside its unit (model-parallel coordinates: the counterpart of a row in another unit is the
    row at the same position)."""

    of_row: tuple[int, ...]
    data_rank: tuple[int, ...]       # what recompute_fn receives to recompute a row's micro-batches
    position: tuple[Any, ...]

    @classmethod
    def per_rank(cls, ranks: Iterable[int]) -> Units:
        """Data parallelism: every rank is a unit of its own and trains on its own data."""
        ranks = tuple(ranks)
        return cls(tuple(range(len(ranks))), ranks, ((),) * len(ranks))

    def rows(self, unit: int) -> list[int]:
        return [row for row, u in enumerate(self.of_row) if u == unit]

    def counterpart(self, row: int, unit: int) -> int | None:
        """The row of ``unit`` at ``row``'s position (None when there is no single one)."""
        matches = [r for r in self.rows(unit) if self.position[r] == self.position[row]]
        return matches[0] if len(matches) == 1 else None


@dataclass(frozen=True)
class CorrectionGroup:
    """One reduction of the framework: the sum over ``group`` of the ranks' contributions to the parameters at
    ``indices`` (into :attr:`GradientTarget.params`), times ``scale``, is what that reduction adds to the gradient."""

    group: dist.ProcessGroup | None
    indices: tuple[int, ...]
    scale: float


class GradientTarget(Protocol):
    """What an integration exposes to the recomputation (DDP: ``integrations/pytorch/ddp.py``; ZeRO:
    ``deepspeed/recompute.py``; Megatron: ``megatron/recompute.py``)."""

    module: Any                      # what ``recompute_fn`` runs (the unwrapped module; Megatron: the chunks)
    params: list[torch.Tensor]       # its trainable parameters, in the same order on every rank of a reduction
    loss_factor: float               # what the framework multiplies a micro-batch loss by before backward
    per_micro_batch: bool            # the gate judges each micro-batch (ZeRO) or the accumulated gradient (DDP)
    group_of_p: list[int]            # optimizer parameter group of each of ``params``
    # ``apply`` needs an entry (zeros) for every parameter of a correction, not only those some rank of its group
    # has a share of (Megatron: its post-reduction all-reduces across groups)
    dense_corrections: bool

    def slot_params(self, slot: int) -> list[int]:
        """Indices into ``params`` of a gate slot."""

    def units(self, ranks: list[int]) -> Units:
        """The recompute units of the decision group's ``ranks`` (collective at attach where it must gather)."""

    def gradients(self, recompute_fn: RecomputeFn, data_rank: int
                  ) -> Iterable[tuple[int, torch.Tensor | None, Sequence[torch.Tensor | None]]]:
        """Run ``recompute_fn`` for ``data_rank``: (micro-batch, its loss or None, gradient of each of ``params``)
        as the framework accumulates them locally, before its reduction; nothing of the framework's gradient state
        changes. A None loss: the losses come from ``record_loss`` calls made while it runs."""

    def correction_groups(self) -> list[CorrectionGroup]:
        """The framework's reductions of the gradient (collectives run by every rank in these groups)."""

    def rng_state(self) -> torch.Tensor:
        """Every RNG state a forward pass draws from, as one uint8 tensor (same size at the same position)."""

    def set_rng_state(self, state: torch.Tensor) -> None: ...

    def apply(self, reduced_p: list[torch.Tensor | None], replace: bool) -> None:
        """Add (or, ``replace``, set) ``reduced_p[i]`` -- identical on every rank of its reduction -- to the reduced
        gradient of ``params[i]`` as the optimizer will see it. Every rank calls it (it may communicate)."""

    def record_stats(self) -> None:
        """Write the reduced-gradient and optimizer statistics of the (corrected) step into the engine's buffer."""


class ReplicaTarget:
    """Defaults of :class:`GradientTarget` for data parallelism: every rank a unit, the loss of each micro-batch
    from ``recompute_fn`` differentiated with autograd, one reduction over the decision group (a mean)."""

    module: Any
    params: list[torch.Tensor]
    loss_factor: float
    engine: EngineAccess
    dense_corrections = False

    def units(self, ranks: list[int]) -> Units:
        return Units.per_rank(ranks)

    def gradients(self, recompute_fn: RecomputeFn, data_rank: int
                  ) -> Iterable[tuple[int, torch.Tensor | None, Sequence[torch.Tensor | None]]]:
        for micro_batch, loss in enumerate(recompute_fn(self.module, data_rank) or ()):
            yield micro_batch, loss, torch.autograd.grad(loss * self.loss_factor, self.params, allow_unused=True)

    def correction_groups(self) -> list[CorrectionGroup]:
        return [CorrectionGroup(self.engine.group, tuple(range(len(self.params))),
                                1.0 / self.engine.gathering.pipeline.num_ranks)]

    def rng_state(self) -> torch.Tensor:
        return rng_state(self.params[0].device if self.params else torch.device("cpu"))

    def set_rng_state(self, state: torch.Tensor) -> None:
        set_rng_state(state, self.params[0].device if self.params else torch.device("cpu"))


@dataclass
class Recomputed:
    """One local recomputation: the whole local gradient, the withheld shares, and the gate's view of them."""

    total_p: list[torch.Tensor | None]
    share_p: dict[int, torch.Tensor] = field(default_factory=dict)
    energy: float = 0.0   # Σ squared norms of the withheld observations
    healthy: bool = True  # the gate would let every withheld observation through now
    failed: bool = False  # recompute_fn raised: nothing above is usable
    loss: float | None = None  # the mean micro-batch loss of the recomputation (None: no loss recorded)
    loss_count: int = 0
    #: while recomputing: Σ squared norms and "some observation would be withheld", on the gate's device (read once,
    #: at the end of the recomputation, into ``energy`` and ``healthy``)
    energy_t: torch.Tensor | None = None
    withheld_t: torch.Tensor | None = None


#: the largest staging buffer of a gradient correction, in fp32 numbers (64 MB): a larger parameter gets its own
CHUNK_ELEMENTS = 1 << 24


def recompute_wanted(engine: EngineAccess, recompute_fn: RecomputeFn | None, backend: str, supported: bool,
                     required_group: dist.ProcessGroup | None = None) -> bool:
    """Validate the attach arguments: True when the localized recomputation should be wired up. Raises
    ValueError when it is enabled without ``recompute_fn``, on a backend that does not support it, or when the
    decision group is not ``required_group`` (the adapter's ``recompute_group``: DDP and ZeRO, whose correction
    runs over the decision group, need it to be the data-parallel group; Megatron, whose units and corrections
    span its own groups, needs the whole job); warns when ``recompute_fn`` is given but the recomputation is off."""
    sdc = section_of(engine.config, SDCFamily())
    wanted = sdc.enabled and sdc.recompute.enabled
    if wanted and not supported:
        raise ValueError(f"detectors.sdc.recompute.enabled: not supported on {backend} (DDP, DeepSpeed ZeRO-1/2 "
                         f"and megatron-core are); set detectors.sdc.recompute.enabled: false")
    if wanted and dist.is_initialized() and required_group is not None \
            and dist.get_process_group_ranks(required_group) != list(engine.gathering.pipeline.ranks):
        raise ValueError("detectors.sdc.recompute.enabled: the decision group (ranks "
                         f"{_ranks_text(engine.gathering.pipeline.ranks)}) is not the group the recomputation on "
                         f"{backend} "
                         f"runs over (ranks {_ranks_text(dist.get_process_group_ranks(required_group))}); pass "
                         "that group (or none) to attach, or set detectors.sdc.recompute.enabled: false (detection "
                         "and the agreed skip still work)")
    if wanted and recompute_fn is None:
        raise ValueError("detectors.sdc.recompute.enabled: pass recompute_fn=(module, data_rank) to attach (it "
                         "re-runs a rank's forward for the current step; see docs/recovery.md)")
    if recompute_fn is not None and not wanted:
        log.warning("arc_engine rank %d: recompute_fn has no effect: detectors.sdc.enabled and "
                    "detectors.sdc.recompute.enabled are not both true", engine.rank)
    return wanted


def _ranks_text(ranks: Any) -> str:
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= 8 else f"{ranks[:4]}... ({len(ranks)} ranks)"


def classify(suspect_energy: float, peer_energy: float, rtol: float) -> str:
    """``"data"`` when the peer reproduced the suspect's withheld gradient (both non-finite, or equal within
    ``rtol``), else ``"device"``. Pure."""
    finite = math.isfinite(suspect_energy), math.isfinite(peer_energy)
    if not all(finite):
        return "data" if not any(finite) else "device"
    return "data" if abs(suspect_energy - peer_energy) <= rtol * max(suspect_energy, peer_energy) else "device"


def rng_state(device: torch.device) -> torch.Tensor:
    """The host RNG state, plus the current CUDA generator's when ``device`` is CUDA, as one uint8 tensor."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return torch.cat(states)


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    host_size = torch.get_rng_state().numel()
    torch.set_rng_state(state[:host_size].clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[host_size:].clone(), device)


class SDCRecompute:
    """Per-rank driver of the localized recomputation (see the module docstring). Built by the integrations when
    ``detectors.sdc.recompute.enabled`` (collective: the target may gather its units); the engine knows it as a
    :class:`arc_engine.step_hooks.StatsResolver`: :meth:`on_step_start` at each step start, :meth:`judge` from
    ``decide``."""

    def __init__(self, engine: EngineAccess, config: RecomputeConfig, gate: LocalGate, target: GradientTarget,
                 recompute_fn: RecomputeFn) -> None:
        self.engine = engine
        self.config = config
        self.gate = gate
        self.target = target
        self.recompute_fn = recompute_fn
        self.units = target.units(list(engine.gathering.pipeline.ranks))
        self.my_row = list(engine.gathering.pipeline.ranks).index(engine.rank)
        self._rng: torch.Tensor | None = None
        self._own: Recomputed | None = None   # this rank's recomputation on the current step
        #: its pre-reduction gradient statistics, taken before a correction reused its gradients' memory
        self._own_stats: tuple[torch.Tensor, torch.Tensor] | None = None
        self.calls = 0                         # forward/backward passes run by recompute_fn on this rank
        self.quarantined: dict[int, dict[str, Any]] = {}

    # ------------------------------------------------------------------ per step

    def on_step_start(self, step: int) -> None:
        """At the step's first forward (every rank): remember the RNG state the step starts from."""
        self._rng = self.target.rng_state()
        self._own = None
        self._own_stats = None
        self.gate.reset_step()

    def close(self) -> None:
        """Nothing to release."""

    def judge(self, stats: AgreedStats, evaluate: Evaluate, regather: Callable[[], AgreedStats]
              ) -> tuple[AgreedStats, list[Finding], list[Finding]]:
        """Collective. Where some rank withheld its gradient: recompute there, correct, judge the corrected step.
        Where the update-RMS rule fires with nothing withheld: every rank recomputes once and the recomputed step
        is judged (the first verdict stays on record as warnings). Otherwise the monitors' verdict as it is."""
        if self.needs_resolution(stats):
            own = self.resolve(stats)
            stats = regather()
            return stats, evaluate(stats), own
        findings = evaluate(stats)
        if not self.wants_recompute_all(findings):
            return stats, findings, []
        first = [dataclasses.replace(f, action=Action.WARN, message=f"before recomputing: {f.message}")
                 for f in findings]
        own = [*first, *self.recompute_all()]
        stats = regather()
        return stats, evaluate(stats), own

    def needs_resolution(self, stats: AgreedStats) -> bool:
        """Whether some rank withheld a gradient slot this step (agreed total; no communication)."""
        return bool(stats.has(names.SDC_WITHHELD) and stats.total(names.SDC_WITHHELD)[0] > 0)

    def wants_recompute_all(self, findings: list[Finding]) -> bool:
        """Whether the update-RMS rule fired with nothing withheld: then every rank recomputes once."""
        return any(f.detector == "sdc" for f in findings)

    def resolve(self, stats: AgreedStats) -> list[Finding]:
        """Collective (every rank of the engine's group, after a gather that showed withheld slots): recompute on
        the suspects' units, classify, correct the reduced gradient. Returns the findings to report."""
        units, my_row = self.units, stats.my_row
        rows = [row for row, count in enumerate(stats.per_rank(names.SDC_WITHHELD)[:, 0]) if count > 0]
        suspect_units = sorted({units.of_row[row] for row in rows})
        runs_here = units.of_row[my_row] in suspect_units
        withheld = self.gate.withheld() if my_row in rows else {}
        if runs_here:
            self._own = self._run(units.data_rank[my_row], self._rng, withheld)
        verdict = self._share(len(stats.ranks), my_row, self._own if runs_here else None)
        failed = any(verdict[row, 0] > 0 for unit in suspect_units for row in units.rows(unit))
        healthy = {unit for unit in suspect_units
                   if all(verdict[row, 1] > 0 for row in rows if units.of_row[row] == unit)}
        classes: dict[int, tuple[str, float, float]] = {}
        peer_shares: dict[int, dict[int, torch.Tensor]] = {}
        peer_losses: dict[int, float] = {}
        peers = [unit for unit in sorted(set(units.of_row)) if unit not in suspect_units]
        for unit in (u for u in suspect_units if u not in healthy and not failed):
            unit_rows = [row for row in rows if units.of_row[row] == unit]
            if not peers:
                classes.update({row: ("unknown", float(verdict[row, 2]), math.nan) for row in unit_rows})
                continue
            peer_energy, losses, share = self._peer_check(stats, unit, peers[0], my_row, withheld)
            peer_losses.update(losses)
            for row in unit_rows:
                energy = peer_energy[row]
                kind = "unknown" if energy is None else classify(float(verdict[row, 2]), energy, self.config.peer_rtol)
                classes[row] = (kind, float(verdict[row, 2]), math.nan if energy is None else energy)
            if share is not None:
                peer_shares[share[0]] = share[1]
        if failed:  # a recomputation raised somewhere: nothing is applied, the step falls to the policy
            return self._findings(stats, rows, verdict, set(rows), classes)
        shares: dict[int, torch.Tensor] = {}
        if runs_here and self._own is not None:
            if classes.get(my_row, ("",))[0] == "device":  # its share comes from the peer; its own stats go too
                loss = peer_losses.get(my_row, math.nan)
                self._own = Recomputed(total_p=[None] * len(self.target.params),
                                       loss=None if math.isnan(loss) else loss, loss_count=1)
            shares = self._own.share_p
        for row, share in peer_shares.items():  # this rank is the counterpart of a faulty device
            if classes.get(row, ("",))[0] == "device":
                shares = {**shares, **share}
        self._correct(shares, replace=False)
        return self._findings(stats, rows, verdict, set(), classes)

    def recompute_all(self) -> list[Finding]:
        """Collective fallback when the update-RMS rule fired with nothing withheld: every rank recomputes its own
        micro-batches once and the reduced gradient is replaced by the reduction of the recomputed ones."""
        self._own = self._run(self.units.data_rank[self.my_row], self._rng, {})
        device = self.engine.gathering.pipeline.device
        flag = torch.tensor([float(self._own.failed)], dtype=torch.float64, device=device)
        self._all_reduce(flag)
        if float(flag[0]) > 0:
            action = Action.parse(section_of(self.engine.config, SDCFamily()).action)
            return [Finding("sdc_recompute", action, Severity.ERROR,
                            "recomputation of the step failed on some rank: the gradient was left as reduced", (),
                            {"classification": "failed"})]
        self._own_stats = self._grad_stats(self._own)  # the correction reduces into these gradients' memory
        self._correct({i: g for i, g in enumerate(self._own.total_p) if g is not None}, replace=True)
        return [Finding("sdc_recompute", Action.WARN, Severity.WARNING,
                        "update-RMS jump with no rank standing out: the step was recomputed on every rank", (),
                        {"recomputed_ranks": "all"})]

    def write_local_stats(self, buffer: Any) -> None:
        """After a correction, replace this rank's pre-reduction statistics -- gradient and loss -- by those of its
        recomputation (when its device was found faulty: no gradient, its own contribution was excluded, and the
        loss of its counterpart's recomputation of its micro-batches), so every detector judges the corrected step."""
        if self._own is None:
            return
        if self._own.loss is not None and names.LOSS in buffer.layout:
            buffer.put(names.LOSS, self._own.loss)
            buffer.put(names.LOSS_COUNT, float(self._own.loss_count))
            buffer.put(names.LOSS_RANKS, 1.0)
        own = self._own_stats if self._own_stats is not None else self._grad_stats(self._own)
        for slot, values in zip((names.GRAD_SQ_LOCAL, names.GRAD_NONFINITE_LOCAL), own, strict=True):
            buffer.view(slot).copy_(values)

    def _grad_stats(self, result: Recomputed) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-reduction gradient statistics (squared norm and non-finite count per parameter group) of a
        recomputation's whole local gradient, on the statistics buffer's device."""
        buffer = self.engine.buffer
        assert buffer is not None
        scratch = StatBuffer(buffer.layout, buffer.device)
        present = [(g, self.target.group_of_p[i]) for i, g in enumerate(result.total_p) if g is not None]
        if present:
            index = torch.tensor([group for _, group in present], dtype=torch.long, device=buffer.device)
            accumulate_grad_stats(scratch, [g for g, _ in present], index, names.GRAD_SQ_LOCAL,
                                  names.GRAD_NONFINITE_LOCAL)
        return scratch.view(names.GRAD_SQ_LOCAL).clone(), scratch.view(names.GRAD_NONFINITE_LOCAL).clone()

    # ------------------------------------------------------------------ pieces

    def _run(self, data_rank: int, rng: torch.Tensor | None, withheld: dict[int, int]) -> Recomputed:
        """Run ``recompute_fn`` for ``data_rank`` on this rank's module with ``rng``; never raises (a failure is
        reported as a NaN energy and an empty gradient). Restores this rank's RNG afterwards."""
        params = self.target.params
        share_from = {p: start for slot, start in withheld.items() for p in self.target.slot_params(slot)}
        result = Recomputed(total_p=[None] * len(params))
        saved = self.target.rng_state()
        yielded: list[torch.Tensor] = []
        recorded: list[torch.Tensor] = []
        try:
            if rng is not None:
                self.target.set_rng_state(rng)
            with torch.enable_grad(), self.engine.gathering.recording_recomputation() as recorded:
                for micro_batch, loss, grads in self.target.gradients(self.recompute_fn, data_rank):
                    if loss is not None:
                        yielded.append(loss.detach().float().reshape(()))
                    self._accumulate(result, micro_batch, grads, share_from)
            self.calls += 1
        except Exception as err:  # reported to every rank by the next collective
            log.warning("arc_engine rank %d: sdc recompute for data rank %d failed: %s: %s", self.engine.rank,
                        data_rank, type(err).__name__, err)
            return Recomputed(total_p=[None] * len(params), energy=math.nan, healthy=False, failed=True)
        finally:
            self.target.set_rng_state(saved)
        # the losses the training loop's own record_loss calls gave (the scale it records), else the yielded ones
        losses = recorded or yielded
        self._judge(result, withheld)
        # one host read for the whole recomputation: its mean loss, its energy and the gate's verdict
        device = self.gate.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        mean_loss = torch.stack(losses).mean().to(device, torch.float64) if losses else zero
        energy = result.energy_t if result.energy_t is not None else zero
        withheld_any = result.withheld_t.double() if result.withheld_t is not None else zero
        loss, result.energy, withheld_flag = torch.stack([mean_loss, energy, withheld_any]).tolist()
        result.healthy = withheld_flag == 0.0
        if losses:
            result.loss, result.loss_count = loss, len(losses)
        return result

    @torch.no_grad()
    def _accumulate(self, result: Recomputed, micro_batch: int, grads: Sequence[torch.Tensor | None],
                    share_from: dict[int, int]) -> None:
        for index, grad in enumerate(grads):
            if grad is None:
                continue
            total = result.total_p[index]
            result.total_p[index] = grad.detach().clone() if total is None else total.add_(grad)
            start = share_from.get(index)
            if start is not None and micro_batch >= start:
                share = result.share_p.get(index)
                result.share_p[index] = grad.detach().clone() if share is None else share.add_(grad)
                if self.target.per_micro_batch:  # the gate judged this (parameter, micro-batch) observation
                    self._observe(result, index, torch.linalg.vector_norm(grad, dtype=torch.float64).square())

    def _observe(self, result: Recomputed, slot: int, norm_sq: torch.Tensor) -> None:
        """Count one withheld observation's squared norm and the gate's verdict on it, on the device (no sync)."""
        norm_sq = norm_sq.to(self.gate.device, torch.float64)
        flag = self.gate.would_withhold_t(slot, norm_sq)
        result.energy_t = norm_sq if result.energy_t is None else result.energy_t + norm_sq
        result.withheld_t = flag if result.withheld_t is None else result.withheld_t | flag

    def _judge(self, result: Recomputed, withheld: dict[int, int]) -> None:
        if self.target.per_micro_batch:
            return
        for slot in withheld:  # the gate judged each slot's accumulated gradient
            grads = [result.total_p[p] for p in self.target.slot_params(slot) if result.total_p[p] is not None]
            norm_sq = sum((torch.linalg.vector_norm(g, dtype=torch.float64).square() for g in grads),
                          torch.zeros((), dtype=torch.float64))
            self._observe(result, slot, norm_sq)

    def _share(self, num_rows: int, my_row: int, own: Recomputed | None) -> Any:
        """All-reduce each recomputing row's [failed, healthy, recomputed energy, withheld energy] (one small
        collective)."""
        verdict = torch.zeros(num_rows, 4, dtype=torch.float64, device=self.engine.gathering.pipeline.device)
        if own is not None:
            failed = own.failed
            withheld_energy = float(self.gate.withheld_sq.sum())
            verdict[my_row] = torch.tensor([float(failed), float(own.healthy and not failed), own.energy,
                                            withheld_energy], dtype=torch.float64)
        self._all_reduce(verdict)
        return verdict.cpu().numpy()

    def _peer_check(self, stats: AgreedStats, unit: int, peer_unit: int, my_row: int, withheld: dict[int, int]
                    ) -> tuple[dict[int, float | None], dict[int, float], tuple[int, dict[int, torch.Tensor]] | None]:
        """Collective: each row of the suspect ``unit`` sends its RNG state and withheld slots to its counterpart
        in ``peer_unit`` (point to point), the peer unit recomputes the suspect unit's micro-batches, one
        all-reduce shares the counterparts' energies and losses. Returns {suspect row: the counterpart's energy over
        that row's withheld slots (None when it failed or there is no counterpart)}, {suspect row: the
        counterpart's mean loss on its micro-batches (NaN: none recorded)} and, on a counterpart, (its suspect row,
        its shares)."""
        units = self.units
        device = self.engine.gathering.pipeline.device
        pairs = {row: units.counterpart(row, peer_unit) for row in units.rows(unit)}
        if any(other is None for other in pairs.values()):  # the units differ in shape: no one-to-one check
            return {row: None for row in pairs}, {}, None
        rng_size = self.target.rng_state().numel()
        num_slots = len(self.target.params)
        package = torch.zeros(rng_size + num_slots, dtype=torch.float64, device=device)
        energy = torch.zeros(len(stats.ranks), 3, dtype=torch.float64, device=device)
        share = None
        partner = pairs.get(my_row)
        if partner is not None:  # this rank is a suspect row: tell its counterpart what to recompute
            package[:rng_size] = self._rng.double().to(device) if self._rng is not None else 0.0
            for slot, start in withheld.items():
                package[rng_size + slot] = start + 1.0
            dist.send(package, dst=stats.ranks[partner], group=self.engine.group)
        suspect = next((row for row, other in pairs.items() if other == my_row), None)
        if suspect is not None:  # this rank is a counterpart: recompute the suspect's micro-batches
            dist.recv(package, src=stats.ranks[suspect], group=self.engine.group)
            host = package.cpu()
            their_withheld = {slot: int(v) - 1 for slot, v in enumerate(host[rng_size:].tolist()) if v > 0}
            result = self._run(units.data_rank[suspect], host[:rng_size].to(torch.uint8), their_withheld)
            energy[suspect, 0], energy[suspect, 1] = result.energy, float(not result.failed)
            energy[suspect, 2] = math.nan if result.loss is None else result.loss
            share = (suspect, result.share_p)
        self._all_reduce(energy)
        host_energy = energy.cpu()
        return ({row: float(host_energy[row, 0]) if pairs[row] is not None and float(host_energy[row, 1]) > 0
                 else None for row in pairs}, {row: float(host_energy[row, 2]) for row in pairs}, share)

    def _correct(self, shares: dict[int, torch.Tensor], *, replace: bool) -> None:
        """Collective: for each of the framework's reductions, all-reduce every rank's shares (zeros elsewhere)
        over its group and scale them like the reduction, then hand them to the target (every rank).

        Memory stays bounded: an addition (``replace`` False) reduces only the parameters some rank has a share of
        (the withheld slots', agreed by one small all-reduce of flags over the correction's group; every parameter
        for a target with ``dense_corrections``), and the reduction runs through a staging
        buffer of at most :data:`CHUNK_ELEMENTS` numbers, its results written back into the shares' own fp32
        memory where they have it -- never a flat fp32 copy of the whole model."""
        params = self.target.params
        reduced: list[torch.Tensor | None] = [None] * len(params)
        for correction in self.target.correction_groups():
            communicate = dist.is_initialized() and dist.get_world_size(correction.group) > 1  # None: default group
            indices = list(correction.indices)
            if not replace and indices and not self.target.dense_corrections:
                indices = self._shared_indices(indices, shares, correction.group, communicate)
            for chunk in bounded_runs(indices, [params[i].numel() for i in indices], CHUNK_ELEMENTS):
                sizes = [params[i].numel() for i in chunk]
                flat = torch.zeros(sum(sizes), dtype=torch.float32, device=params[chunk[0]].device)
                pieces = list(flat.split(sizes))
                for piece, index in zip(pieces, chunk, strict=True):
                    share = shares.get(index)
                    if share is not None:
                        piece.copy_(share.reshape(-1))
                if communicate:
                    dist.all_reduce(flat, group=correction.group)
                flat.mul_(correction.scale)
                for piece, index in zip(pieces, chunk, strict=True):
                    share = shares.get(index)
                    own = share is not None and share.dtype == torch.float32 and share.is_contiguous() and \
                        share.device == piece.device
                    out = share if own else torch.empty(params[index].shape, dtype=torch.float32, device=piece.device)
                    out.view(-1).copy_(piece)  # type: ignore[union-attr]
                    reduced[index] = out.view_as(params[index])  # type: ignore[union-attr]
        # Every rank applies every entry (zeros where nobody had a share): the same call on every rank.
        self.target.apply(reduced, replace)

    def _shared_indices(self, indices: list[int], shares: dict[int, torch.Tensor], group: Any, communicate: bool
                        ) -> list[int]:
        """Those of a correction's ``indices`` that some rank of its reduction ``group`` (whose ranks hold the same
        parameters) has a share of: one MAX all-reduce of a flag per parameter over the group (``communicate``
        False: this rank alone)."""
        # on the parameters' device, where the correction's own all-reduce runs over the same group
        flags = torch.tensor([float(index in shares) for index in indices], dtype=torch.float32,
                             device=self.target.params[indices[0]].device)
        if communicate:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return [index for index, flag in zip(indices, flags.tolist(), strict=True) if flag > 0]

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        if self.engine.gathering.pipeline.num_ranks > 1:
            dist.all_reduce(tensor, group=self.engine.group)

    # ------------------------------------------------------------------ reporting

    def _findings(self, stats: AgreedStats, rows: list[int], verdict: Any, failed: set[int],
                  classes: dict[int, tuple[str, float, float]]) -> list[Finding]:
        sdc = section_of(self.engine.config, SDCFamily())
        findings = []
        for row in rows:
            rank = stats.ranks[row]
            where = f"rank {rank} ({self.engine.locations.get(rank, '?')})"
            values: dict[str, Any] = {"withheld_energy": float(verdict[row, 3]),
                                      "recomputed_energy": float(verdict[row, 2]),
                                      "location": self.engine.locations.get(rank, "?"),
                                      "recomputed_ranks": [stats.ranks[r] for r in
                                                           self.units.rows(self.units.of_row[row])]}
            if row in failed:
                findings.append(Finding("sdc_recompute", Action.parse(sdc.action), Severity.ERROR,
                                        f"SDC suspected on {where}: the recomputation failed", (rank,),
                                        {**values, "classification": "failed"}))
            elif row not in classes:
                findings.append(Finding("sdc_recompute", Action.WARN, Severity.WARNING,
                                        f"SDC on {where}: its gradient was withheld, recomputed on "
                                        f"{self._recomputed_on(stats, row)} and the transient fault corrected",
                                        (rank,), {**values, "classification": "transient"},
                                        hardware="sdc_transient"))
            else:
                findings.append(self._classified(rank, where, values, *classes[row]))
        return findings

    def _recomputed_on(self, stats: AgreedStats, row: int) -> str:
        unit_rows = self.units.rows(self.units.of_row[row])
        if len(unit_rows) == 1:
            return "that rank only"
        return f"its model-parallel unit only (ranks {_ranks_text(stats.ranks[r] for r in unit_rows)})"

    def _classified(self, rank: int, where: str, values: dict[str, Any], kind: str, suspect_energy: float,
                    peer_energy: float) -> Finding:
        values = {**values, "classification": kind, "peer_energy": peer_energy}
        if kind == "data":
            action = Action.parse(section_of(self.engine.config, LossSpikeFamily()).action)
            return Finding("sdc_recompute", action, Severity.WARNING,
                           f"gradient anomaly on {where} reproduced by a healthy peer on the same micro-batches: "
                           f"the data caused it, not the hardware", (rank,), values)
        if kind == "unknown":
            action = Action.parse(section_of(self.engine.config, SDCFamily()).action)
            return Finding("sdc_recompute", action, Severity.ERROR,
                           f"gradient anomaly on {where} reproduced; no healthy peer to tell data from hardware",
                           (rank,), values)
        path = self._quarantine(rank, values)
        abort = self.config.on_faulty_device == "abort"
        values = {**values, "quarantine_file": str(path)}
        if abort:
            from arc_engine.policy.decision import EXIT_FAULTY_DEVICE

            values["exit_code"] = EXIT_FAULTY_DEVICE
        outcome = "stopping every rank" if abort else "its share replaced by the peer's recomputation"
        return Finding("sdc_recompute", Action.ABORT if abort else Action.WARN, Severity.CRITICAL,
                       f"faulty device: SDC on {where} reproduced there but not by a healthy peer; quarantined "
                       f"({path}); {outcome}", (rank,), values, hardware="sdc_persistent")

    def _quarantine(self, rank: int, values: dict[str, Any]) -> Path:
        """Record ``rank``'s device in the run directory's quarantine file (the decision group's first rank writes
        it, atomically; an existing file's entries are kept). Returns the path."""
        path = self.engine.run_dir / QUARANTINE_FILE
        entry = {"rank": rank, "location": values.get("location", "?"), "step": self.engine.progress.step,
                 "iteration": self.engine.progress.iteration, "withheld_energy": values["withheld_energy"],
                 "recomputed_energy": values["recomputed_energy"], "peer_energy": values["peer_energy"]}
        self.quarantined[rank] = entry
        if self.engine.rank == self.engine.gathering.pipeline.leader:
            write_quarantine(path, entry)
        return path


def write_quarantine(path: Path, entry: dict[str, Any]) -> None:
    """Append ``entry`` to the JSON quarantine file at ``path`` (written to a temporary file, fsynced, renamed: a
    reader never sees half a file). A scheduler excludes the listed ``location`` (host:device) from the next
    allocation."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []
    if path.exists():
        try:
            entries = list(json.loads(path.read_text()).get("quarantined", []))
        except (OSError, ValueError):
            entries = []
    if any(e.get("location") == entry["location"] and e.get("rank") == entry["rank"] for e in entries):
        return
    entries.append(entry)
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as handle:
        json.dump({"quarantined": entries}, handle, indent=2, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)

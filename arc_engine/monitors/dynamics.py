"""``detectors.dynamics``: the training trajectory as a dynamical system (ARC paper §3.4).

Every ``every`` optimizer steps (a multiple of ``stats.interval``), inside the optimizer step before the update, each
rank measures how far its part of the parameters moved since the last measurement and writes Σ(θ − θ_prev)² into a
SUM slot of the step's one agreement, so the agreed velocity v = ‖θ_t − θ_{t−every}‖ is exact:

* where the optimizer partitions the parameters (DeepSpeed ZeRO, Megatron: :attr:`StepView.partition_parts`) each
  rank takes its partition's master values;
* FSDP2's local shards are each rank's own;
* replicated parameters (DDP, a plain module) are dealt over the decision group's ranks
  (:func:`~arc_engine.stats.partition.owned_ids`), each element once.

Each rank keeps a copy of its part between measurements (memory: its share of the parameters, 1/N of the model under
DDP). A step whose counter went back (a rollback restored the state) takes a fresh copy instead of a velocity.

The monitor (:func:`lyapunov`, Algorithm 4): λ̂ = mean over the last ``lyapunov_window`` velocities of
ln(v_k / v_{k−1}),
divided by ``every`` so that λ is per optimizer step whatever the schedule (a trajectory growing as e^{λt} has
consecutive ``every``-step displacements in the ratio e^{λ·every}); λ̄ ← ``ema`` λ̂ + (1 − ``ema``) λ̄. The phase
(§3.4.8, :func:`phase`): λ̄ > ``divergent`` failure (``action``), > ``warning`` warning, |λ̄| < ``marginal``
marginal, where the last ``window`` velocities are checked for an oscillation (§3.4.7, :func:`oscillation_ratio`);
λ̄ < −``warning`` convergent (a metric). A phase is reported when it begins.

With ``stabilize`` (opt-in, §3.4.6) the monitor also scales each monitored step's gradient while λ̄ > ``marginal``
(:meth:`DynamicsMonitor.gradient_coefficient`, applied by the integrations through
:func:`arc_engine.recovery.heal.gradient_coefficient`).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from arc_engine import runtime
from arc_engine.config.errors import require
from arc_engine.config.schema import ActionName
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext, Producer, StatDecl, StepView, periodic_family_enabled
from arc_engine.monitors.weight_health import dtensor_parameter
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, names
from arc_engine.stats.partition import owned_ids


@dataclass(kw_only=True)
class DynamicsConfig:
    """Training dynamics (ARC paper §3.4): every ``every`` optimizer steps (a multiple of ``stats.interval``) the
    parameter velocity v = ‖θ_t − θ_{t−every}‖ (exact: each rank adds its own part of the parameters, each element
    once over the decision group; each rank keeps a copy of its part), the online Lyapunov estimate λ̂ = mean over
    the last ``lyapunov_window`` velocities of ln(v_k / v_{k−1}) / ``every`` (per optimizer step, Algorithm 4),
    smoothed λ̄ ← ``ema`` λ̂ + (1 − ``ema``) λ̄, and the phase (§3.4.8): λ̄ above ``divergent`` is a failure
    (``action``; the paper rolls back), above ``warning`` a warning; |λ̄| below ``marginal`` checks the last
    ``window`` velocities for an oscillation (§3.4.7): the largest FFT power (the window's mean removed) above
    ``oscillation_factor`` times the
    mean power (the paper's 2 fires on white noise; see detectors.md) gets ``oscillation_action``. Each phase is
    reported when it begins; after ``warmup_measurements`` velocities. With ``stabilize`` (opt-in, §3.4.6), while
    λ̄ > ``marginal`` every monitored step's gradient g becomes g S + (1 − S) clip(g, c), S = exp(−λ̄),
    c = (1 − ``stabilize_strength``) + ``stabilize_strength`` e^{−λ̄} (a norm), from the agreed global norm.
    Attractor detection (§3.4.5): the displacements are also written as an ``attractor_sketch``-number random-sign
    sketch, whose running sum tracks the trajectory; over the last ``window`` positions, R = max ‖θ_t − θ̄‖ below
    ``attractor_radius`` (> 0) or below ``attractor_ratio`` times the path length, for ``attractor_steps``
    consecutive measurements, reports that training settled into an attractor (an info event)."""

    enabled: bool = False
    """Training dynamics (ARC paper §3.4): the parameter velocity, the online Lyapunov estimate, the phase and an FFT
    oscillation check ([detectors.md](detectors.md#training-dynamics)). Each rank keeps a copy of its part of the
    parameters (1/N of the model under DDP)."""
    every: int = 10
    """Optimizer steps between velocity measurements (v = ‖θ_t − θ_{t−every}‖).
    Allowed: >= 1, a multiple of `stats.interval`"""
    lyapunov_window: int = 8
    """Velocities whose mean log-ratio is the Lyapunov estimate (Algorithm 4's window).
    Allowed: >= 3"""
    window: int = 32
    """Velocities kept; the oscillation check's FFT window.
    Allowed: >= 4 and >= `lyapunov_window`"""
    ema: float = 0.3
    """Smoothing of the Lyapunov estimate: λ̄ ← ema λ̂ + (1 − ema) λ̄.
    Allowed: in (0, 1]"""
    divergent: float = 0.2
    """λ̄ (per optimizer step) above this: divergent, a failure that gets `action` (the paper rolls back).
    Allowed: > `warning`"""
    warning: float = 0.1
    """λ̄ above this: unstable, a warning; below minus this: convergent.
    Allowed: > 0"""
    marginal: float = 0.05
    """|λ̄| below this: marginal, and the velocity window is checked for an oscillation.
    Allowed: in (0, `warning`]"""
    oscillation_factor: float = 8.0
    """An oscillation: the largest FFT power of the velocity window (its mean removed) above this many times the mean
    power (the paper's 2 fires on white noise).
    Allowed: > 1"""
    warmup_measurements: int = 4
    """Velocities before a phase is reported.
    Allowed: >= 3"""
    stabilize: bool = False
    """Opt-in (§3.4.6): while λ̄ > `marginal`, scale each monitored step's gradient to g S + (1 − S) clip(g, c), S =
    exp(−λ̄), on every rank alike."""
    stabilize_strength: float = 0.5
    """The stabilisation's intervention strength: the clip norm c = (1 − strength) + strength e^{−λ̄}.
    Allowed: in [0, 1]"""
    attractor_sketch: int = 128
    """Numbers in the random-sign sketch of each displacement (in the step's one all-reduce) from which the trajectory's
    positions are tracked; 0: no attractor detection.
    Allowed: >= 0"""
    attractor_ratio: float = 0.05
    """An attractor (§3.4.5): over the last `window` positions, the largest distance from their centroid below this
    times the path length walked; 0: off.
    Allowed: in [0, 1)"""
    attractor_radius: float = 0.0
    """An attractor: that largest distance below this (parameter-space units, the paper's τ_attractor); 0: off.
    Allowed: >= 0"""
    attractor_steps: int = 5
    """Consecutive measurements inside the attractor rule before it is reported (an info event).
    Allowed: >= 1"""
    action: ActionName = "warn"
    """What a divergent trajectory gets."""
    oscillation_action: ActionName = "warn"
    """What an oscillation gets."""

    def __post_init__(self) -> None:
        require(self.every >= 1, "every", self.every, "must be an integer >= 1 (optimizer steps)")
        require(self.lyapunov_window >= 3, "lyapunov_window", self.lyapunov_window,
                "must be an integer >= 3 (velocities)")
        require(self.window >= max(4, self.lyapunov_window), "window", self.window,
                "must be an integer >= 4 and >= lyapunov_window (velocities)")
        require(0 < self.ema <= 1, "ema", self.ema, "must be in (0, 1]")
        require(self.divergent > self.warning > 0, "divergent", self.divergent, "must be > warning > 0")
        require(0 < self.marginal <= self.warning, "marginal", self.marginal, "must be in (0, warning]")
        require(self.oscillation_factor > 1, "oscillation_factor", self.oscillation_factor, "must be > 1")
        require(self.warmup_measurements >= 3, "warmup_measurements", self.warmup_measurements,
                "must be an integer >= 3 (two velocity ratios)")
        require(0 <= self.stabilize_strength <= 1, "stabilize_strength", self.stabilize_strength,
                "must be in [0, 1]")
        require(self.attractor_sketch >= 0, "attractor_sketch", self.attractor_sketch,
                "must be an integer >= 0 (0 = no attractor detection)")
        require(0 <= self.attractor_ratio < 1, "attractor_ratio", self.attractor_ratio, "must be in [0, 1)")
        require(self.attractor_radius >= 0, "attractor_radius", self.attractor_radius, "must be >= 0 (0 = off)")
        require(self.attractor_steps >= 1, "attractor_steps", self.attractor_steps, "must be an integer >= 1")



#: [2] SUM: Σ over this rank's part of the parameters of (θ − θ at the last measurement)², and 1 where this rank
#: measured (a copy existed and the step counter moved forward)
VELOCITY = "dynamics_velocity"

#: [attractor_sketch] SUM: this rank's random-sign sketch of its part of θ − θ_prev (bucket i mod k, a fixed random
#: sign per element); summed over the ranks, the sketch of the whole displacement
SKETCH = "dynamics_sketch"

DIVERGENT, WARNING, MARGINAL, HEALTHY, CONVERGENT = "divergent", "warning", "marginal", "healthy", "convergent"
PHASE_CODES = {CONVERGENT: -1.0, HEALTHY: 0.0, MARGINAL: 0.5, WARNING: 1.0, DIVERGENT: 2.0}


def lyapunov(velocities: list[float], every: int = 1, eps: float = 1e-12) -> float | None:
    """λ̂: the mean of ln(v_k / v_{k−1}) over consecutive velocities (a ratio is skipped where either is <= ``eps``),
    divided by ``every`` (steps between velocities); None without a usable ratio. Pure."""
    ratios = [math.log(b / a) for a, b in itertools.pairwise(velocities) if a > eps and b > eps]
    return sum(ratios) / len(ratios) / every if ratios else None


def phase(value: float, config: DynamicsConfig) -> str:
    """The paper's stability thresholds (§3.4.8), plus convergent below −``warning`` (§3.4.4). Pure."""
    if value > config.divergent:
        return DIVERGENT
    if value > config.warning:
        return WARNING
    if abs(value) < config.marginal:
        return MARGINAL
    return CONVERGENT if value < -config.warning else HEALTHY


def oscillation_ratio(series: list[float]) -> tuple[float, int]:
    """(largest power / mean power, its period in samples) of the series' FFT power spectrum, the series' mean
    removed (a positive series' zero-frequency term would otherwise always dominate) and the zero frequency left
    out. (nan, 0) for fewer than 4 values or a constant series. Pure."""
    if len(series) < 4:
        return math.nan, 0
    values = np.asarray(series, dtype=np.float64)
    power = np.abs(np.fft.rfft(values - values.mean()))[1:] ** 2
    mean = float(power.mean())
    if not mean > 0:
        return math.nan, 0
    peak = int(np.argmax(power))
    return float(power[peak] / mean), round(len(values) / (peak + 1))


def stabilisation(value: float, norm: float, strength: float) -> float:
    """The gradient factor of Lyapunov-based stabilisation (§3.4.6) at λ̄ = ``value`` > 0 and global norm ``norm``:
    S + (1 − S) min(1, c / norm), S = e^{−λ̄}, c = (1 − strength) + strength e^{−λ̄}; 1 for a non-finite or zero
    norm (other detectors judge those). Pure."""
    if not math.isfinite(norm) or norm <= 0 or value <= 0:
        return 1.0
    stability = math.exp(-value)
    limit = (1 - strength) + strength * math.exp(-value)
    return stability + (1 - stability) * min(1.0, limit / norm)


def sketch_into(total: torch.Tensor, values: torch.Tensor, signs: torch.Tensor) -> None:
    """``total`` (k numbers, float64) += the sketch of ``values``: element i, times its sign, into bucket i mod k.
    Linear, so the sketch of a sum of displacements is the sum of their sketches; E‖sketch(x)‖² = ‖x‖² (random
    signs), with a relative spread of about √(2 / k) when x's energy is spread over many elements."""
    k = total.numel()
    flat = values.reshape(-1)
    if flat.element_size() < 4:  # summed in fp32 at least: a bf16 sum over n / k elements would lose the sketch
        flat = flat.float()
    signed = flat * signs
    whole = flat.numel() // k * k
    if whole:
        total.add_(signed[:whole].view(-1, k).sum(0).to(total.dtype))
    if whole < flat.numel():
        total[: flat.numel() - whole].add_(signed[whole:].to(total.dtype))


def attractor_radius(positions: list[np.ndarray]) -> float:
    """R = max over the positions of their distance from the centroid (§3.4.5). Pure."""
    stacked = np.stack(positions)
    return float(np.linalg.norm(stacked - stacked.mean(axis=0), axis=1).max())


class VelocityProducer:
    """Writes this rank's Σ(θ − θ_prev)² on the measured steps and keeps its copy of its part (see the module
    docstring). Device-side: no collective, no host sync."""

    def __init__(self, config: DynamicsConfig) -> None:
        self.config = config
        self.member, self.members = 0, 1
        self._owned: tuple[tuple[int, ...], set[int]] | None = None
        self._copy: list[torch.Tensor] | None = None
        self._copy_step = -1
        self._written_step = -1
        self._last: torch.Tensor | None = None  # this step's written values (a re-agreement writes them again)
        self._last_sketch: torch.Tensor | None = None
        self._signs: list[torch.Tensor] = []    # the attractor sketch's signs, one int8 per element of the part

    def set_group(self, ranks: list[int], rank: int) -> None:
        self.member, self.members = sorted(ranks).index(rank), len(ranks)
        self._owned = None

    def parts(self, view: StepView) -> list[torch.Tensor]:
        """This rank's part of the parameters, each element once over the decision group."""
        if view.partition_parts is not None:
            return [part for param in view.params for part in view.partition_parts(param)[0]]
        params = list(view.params)
        key = tuple(id(p) for p in params)
        if self._owned is None or self._owned[0] != key:
            replicated = [p for p in params if dtensor_parameter(p) is None]
            self._owned = (key, owned_ids(replicated, self.member, self.members))
        owned = self._owned[1]
        return [p for p in params if id(p) in owned or dtensor_parameter(p) is not None]

    @torch.no_grad()
    def write(self, buffer: StatBuffer, view: StepView) -> None:
        if view.step % self.config.every:
            return
        slot = buffer.view(VELOCITY)
        sketch = buffer.view(SKETCH) if self.config.attractor_sketch else None
        if view.step == self._written_step:  # a re-agreement of the step (recomputation): write the same again
            if self._last is not None:
                slot.copy_(self._last)
            if sketch is not None and self._last_sketch is not None:
                sketch.copy_(self._last_sketch)
            return
        self._written_step, self._last, self._last_sketch = view.step, None, None
        parts = [p.detach() for p in self.parts(view)]
        copy = self._copy
        if copy is not None and self._copy_step < view.step and len(copy) == len(parts) and \
                all(a.shape == b.shape for a, b in zip(copy, parts, strict=True)):
            if parts:  # fused: one subtraction, one norm and one copy kernel per dtype, no float64 temporaries
                differences = torch._foreach_sub(parts, copy)
                norms = torch._foreach_norm(differences, 2, dtype=torch.float32)
                total = torch.stack(norms).double().square().sum().to(slot.device)
                if sketch is not None:
                    self._last_sketch = self._sketch(differences, sketch)
                torch._foreach_copy_(copy, parts)
            else:
                total = torch.zeros((), dtype=torch.float64, device=slot.device)
            self._last = torch.stack([total, torch.ones_like(total)])
            slot.copy_(self._last)
        else:  # the first measurement, or after a rollback or a change of the parameters: a fresh copy
            self._copy = [p.clone() for p in parts]
        self._copy_step = view.step

    def _sketch(self, differences: list[torch.Tensor], slot: torch.Tensor) -> torch.Tensor:
        """Write the sketch of this rank's displacement into ``slot``; returns it (for a re-agreement)."""
        if len(self._signs) != len(differences) or \
                any(s.numel() != d.numel() for s, d in zip(self._signs, differences, strict=True)):
            generator = torch.Generator().manual_seed(1_000_003 * runtime.global_rank() + 17)
            self._signs = [(torch.randint(0, 2, (d.numel(),), generator=generator, dtype=torch.int8) * 2 - 1)
                           .to(d.device) for d in differences]
        total = torch.zeros(slot.numel(), dtype=torch.float64, device=differences[0].device if differences
                            else slot.device)
        for difference, signs in zip(differences, self._signs, strict=True):
            sketch_into(total, difference, signs)
        total = total.to(slot.device)
        slot.copy_(total)
        return total


class DynamicsMonitor(Monitor):
    """The Lyapunov estimate, the phase and the oscillation check over the agreed velocities (module docstring)."""

    name = "dynamics"

    def __init__(self, config: DynamicsConfig, producer: VelocityProducer | None = None) -> None:
        self.config, self.producer = config, producer
        self.velocities: deque[float] = deque(maxlen=config.window)
        self.smoothed: float | None = None
        self.phase = HEALTHY
        self.measurements = 0
        self._pending: tuple[float, float | None, str] | None = None
        self._values: dict[str, float] = {}
        #: the trajectory's sketched positions (running sums of the displacement sketches) and the velocities
        #: between them; cleared where a measurement is missing (a fresh copy: the first, or after a rollback)
        self.positions: deque[np.ndarray] = deque(maxlen=config.window)
        self.steps_between: deque[float] = deque(maxlen=config.window)
        self.inside = 0          # consecutive measurements inside the attractor rule
        self.settled = False
        self._attractor: tuple[np.ndarray | None, int, bool] | None = None

    def on_start(self, locations: dict[int, str]) -> None:
        if self.producer is not None:
            self.producer.set_group(list(locations), runtime.global_rank())

    def required_stats(self) -> tuple[str, ...]:
        return (VELOCITY, SKETCH) if self.config.attractor_sketch else (VELOCITY,)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        self._pending, self._attractor = None, None
        config = self.config
        if step % config.every:
            return []
        total, measured = stats.total(VELOCITY)
        if measured < len(stats.ranks) or not math.isfinite(total):
            self._attractor = (None, 0, False)  # the trajectory restarts (a fresh copy) or is not finite
            return []  # no velocity on this step (a fresh copy), or a non-finite one (other families judge it)
        velocity = math.sqrt(max(total, 0.0))
        window = [*self.velocities, velocity]
        estimate = lyapunov(window[-config.lyapunov_window:], config.every)
        smoothed = self.smoothed
        if estimate is not None:
            smoothed = estimate if smoothed is None else config.ema * estimate + (1 - config.ema) * smoothed
        current = phase(smoothed, config) if smoothed is not None and \
            self.measurements + 1 >= config.warmup_measurements else HEALTHY
        ratio, period = oscillation_ratio(window) if current == MARGINAL else (math.nan, 0)
        oscillating = current == MARGINAL and math.isfinite(ratio) and ratio > config.oscillation_factor and \
            len(window) >= config.window
        self._values = {"velocity": velocity, "lyapunov": smoothed if smoothed is not None else math.nan,
                        "lyapunov_raw": estimate if estimate is not None else math.nan,
                        "phase": PHASE_CODES[current], "oscillation_ratio": ratio}
        label = "oscillating" if oscillating else current
        self._pending = (velocity, smoothed, label)
        findings = self._attractor_findings(stats, velocity)
        if label == self.phase:
            return findings
        values = {**self._values, "every": config.every, "window": len(window)}
        text = f"λ = {smoothed:.4g} per step" if smoothed is not None else "λ unknown"
        if label == DIVERGENT:
            return [*findings, Finding(self.name, Action.parse(config.action), Severity.ERROR,
                               f"training dynamics divergent: {text} > {config.divergent} (parameter velocity "
                               f"{velocity:.4g} over {config.every} steps, growing)", values=values)]
        if label == WARNING:
            return [*findings, Finding(self.name, Action.WARN, Severity.WARNING,
                               f"training dynamics unstable: {text} > {config.warning}", values=values)]
        if label == "oscillating":
            return [*findings, Finding(self.name, Action.parse(config.oscillation_action), Severity.WARNING,
                               f"training dynamics oscillating: {text}, the parameter velocity has a period of "
                               f"{period} measurements ({period * config.every} steps), power {ratio:.3g}x the mean",
                               values={**values, "period_measurements": period})]
        return findings

    def _attractor_findings(self, stats: AgreedStats, velocity: float) -> list[Finding]:
        """§3.4.5 on the sketched trajectory: R = max ‖θ_t − θ̄‖ over the last ``window`` positions, against
        ``attractor_radius`` and ``attractor_ratio`` x the path walked between them."""
        config = self.config
        if not config.attractor_sketch:
            return []
        displacement = stats.total(SKETCH).astype(np.float64)
        if not np.all(np.isfinite(displacement)):
            self._attractor = (None, 0, False)
            return []
        position = (self.positions[-1] if self.positions else np.zeros_like(displacement)) + displacement
        origin = [] if self.positions else [np.zeros_like(displacement)]  # where the first displacement began
        window = [*origin, *self.positions, position][-config.window:]
        walked = [*self.steps_between, velocity][-(len(window) - 1):]
        full = len(window) >= config.window
        radius = attractor_radius(window)
        path = float(sum(walked))
        ratio = radius / path if path > 0 else math.nan
        inside = full and ((config.attractor_radius > 0 and radius < config.attractor_radius) or
                           (config.attractor_ratio > 0 and math.isfinite(ratio) and ratio < config.attractor_ratio))
        count = self.inside + 1 if inside else 0
        settled = count >= config.attractor_steps
        self._values.update(attractor_radius=radius, attractor_ratio=ratio)
        self._attractor = (position, count, settled)
        if not settled or self.settled:
            return []
        return [Finding(self.name, Action.WARN, Severity.INFO,
                        f"training settled into an attractor: over the last {len(window)} measurements the "
                        f"trajectory stays within {radius:.4g} of its centroid ({ratio:.3g} of the {path:.4g} it "
                        f"walked), {count} measurements in a row", values={**self._values, "window": len(window)})]

    def gradient_coefficient(self, stats: AgreedStats) -> float:
        """§3.4.6, with ``stabilize``: while λ̄ > ``marginal`` the step's gradient g becomes g S + (1 − S) clip(g, c),
        S = exp(−λ̄), c = (1 − strength) + strength e^{−λ̄}: the factor S + (1 − S) min(1, c / ‖g‖) on the whole
        gradient, ‖g‖ the agreed pre-clip global norm. 1 otherwise (and for a non-finite norm). Pure in the monitor's
        state and ``stats``: every rank computes the same."""
        config = self.config
        if not config.stabilize or self.smoothed is None or self.smoothed <= config.marginal or \
                self.measurements < config.warmup_measurements:
            return 1.0  # (above the marginal band only: a clean run's λ̄ wanders around 0)
        return stabilisation(self.smoothed, math.sqrt(max(float(stats.total(names.GRAD_SQ).sum()), 0.0)),
                             config.stabilize_strength)

    def commit(self, step: int, applied: bool) -> None:
        attractor, self._attractor = self._attractor, None
        if attractor is not None:
            position, self.inside, self.settled = attractor
            if position is None:
                self.positions.clear()
                self.steps_between.clear()
            elif self._pending is not None:
                if not self.positions:
                    self.positions.append(np.zeros_like(position))
                self.positions.append(position)
                self.steps_between.append(self._pending[0])
        if self._pending is None:
            return
        velocity, smoothed, label = self._pending
        self.velocities.append(velocity)
        self.smoothed, self.phase = smoothed, label
        self.measurements += 1
        self._pending = None

    def metrics(self) -> dict[str, float]:
        return dict(self._values)

    def state_dict(self) -> dict[str, Any]:
        return {"velocities": list(self.velocities), "smoothed": self.smoothed, "phase": self.phase,
                "measurements": self.measurements, "positions": [p.tolist() for p in self.positions],
                "steps_between": list(self.steps_between), "inside": self.inside, "settled": self.settled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.velocities = deque((float(v) for v in state["velocities"]), maxlen=self.config.window)
        self.smoothed = None if state["smoothed"] is None else float(state["smoothed"])
        self.phase = str(state["phase"])
        self.measurements = int(state["measurements"])
        self.positions = deque((np.asarray(p, dtype=np.float64) for p in state.get("positions", [])),
                               maxlen=self.config.window)
        self.steps_between = deque((float(v) for v in state.get("steps_between", [])), maxlen=self.config.window)
        self.inside, self.settled = int(state.get("inside", 0)), bool(state.get("settled", False))


class DynamicsFamily(FamilyBase):
    """``detectors.dynamics`` (off by default): the parameter velocity every ``every`` optimizer steps."""

    name = "dynamics"
    config_class = DynamicsConfig

    def __init__(self) -> None:
        self._shared: tuple[FamilyContext, VelocityProducer] | None = None

    def _producer(self, ctx: FamilyContext) -> VelocityProducer:
        if self._shared is None or self._shared[0] is not ctx:
            self._shared = (ctx, VelocityProducer(ctx.section))
        return self._shared[1]

    def enabled(self, ctx: FamilyContext) -> bool:
        return periodic_family_enabled(ctx, self.name, True)

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        sketch = ctx.section.attractor_sketch
        return [StatDecl(VELOCITY, 2, Reduce.SUM), *([StatDecl(SKETCH, sketch, Reduce.SUM)] if sketch else [])]

    def producers(self, ctx: FamilyContext) -> list[Producer]:
        return [Producer("before_agreement", self._producer(ctx).write)]

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return [DynamicsMonitor(ctx.section, self._producer(ctx))]


__all__ = [
    "SKETCH",
    "VELOCITY",
    "DynamicsFamily",
    "DynamicsMonitor",
    "VelocityProducer",
    "attractor_radius",
    "lyapunov",
    "oscillation_ratio",
    "phase",
    "sketch_into",
    "stabilisation",
]

"""``detectors.router``: MoE router health per MoE layer over every token of the job (the family on the seam;
the statistics themselves are :mod:`arc_engine.monitors.router`).

On the steps it measures (every ``every`` optimizer steps), each rank observes every routing of its routers
(Megatron: the router's ``routing(logits)``, through :attr:`ModelParts.observe_routing`) and adds
:func:`~arc_engine.monitors.router.pack_router_partials` of its own tokens into a per-layer accumulator on the
device; tensor-parallel peers that see the same tokens (no sequence parallelism) leave them to TP rank 0. One rank
per layer copy adds the replicated weight's statistics. The accumulators travel through the one agreement as one
SUM slot ``router_sums`` ``[layers x (6 + experts + 128)]``, so every rank unpacks the same union: similarity,
conditioning ratio, entropy mean and low percentiles, tokens per expert, MaxVio, dead experts. Beside it, per layer,
one MAX slot ``router_rank_entropy`` ``[layers]`` carries a rank key (:mod:`arc_engine.stats.rank_keys`) of each
rank's own tokens' mean routing entropy, negated: the agreed value is the lowest rank's entropy with its rank, so a
collapse confined to one rank's tokens is seen whatever the number of ranks (reduced on measured steps only).

The monitor alarms against the run's own trajectory (a robust trend through the last ``window`` accepted
measurements, per layer: :mod:`arc_engine.monitors.trajectory`): the mean routing entropy falls, or the similarity
rises; the lowest rank's entropy falls (a collapse of one rank's tokens, which moves the union's mean by only that
rank's share); and an expert alive in the baseline gets no token. Events name the layer, the rank whose tokens'
entropy is lowest and its expert-parallel group, and the experts and their expert-parallel ranks."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from arc_engine import runtime
from arc_engine.config.errors import require
from arc_engine.config.schema import ActionName
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import (
    FamilyBase,
    FamilyContext,
    ModelParts,
    Producer,
    RouterShard,
    StatDecl,
    StepView,
    periodic_family_enabled,
)
from arc_engine.monitors.router import (
    pack_router_partials,
    partial_entropy_mean,
    router_partials_size,
    unpack_router_sums,
)
from arc_engine.monitors.trajectory import TrajectoryMonitorConfig, robust_trend
from arc_engine.stats import Reduce, StatBuffer
from arc_engine.stats.rank_keys import check_rank, rank_key_t, split_key


@dataclass(kw_only=True)
class RouterConfig(TrajectoryMonitorConfig):
    """MoE router health per MoE layer, over all the tokens of the job (mechanism-driven monitors; Megatron only).

    Every ``every`` optimizer steps (a multiple of ``stats.interval``): router weight similarity sim(W_R), the
    conditioning ratio ε, per-token routing entropy of the full softmax (mean and low percentiles), tokens per
    expert, MaxVio and dead experts, summed over the expert-parallel and expert-data-parallel ranks. Alarms against
    the run's own healthy trajectory (a robust trend through the last ``window`` accepted measurements, after
    ``warmup_measurements``): the mean routing entropy falls, or the similarity rises, by more than ``factor`` robust
    standard deviations of the residuals and by more than ``min_relative_change`` of the predicted value (the
    similarity, a mean cosine near 0 for a healthy router, also by ``min_similarity_change`` in absolute terms); an
    expert that received tokens in the baseline and none now (``dead_expert_action``).
    """

    enabled: bool = True
    """MoE router health per MoE layer over every token of the job (Megatron with experts; off elsewhere)."""
    every: int = 10
    """Optimizer steps between measurements.
    Allowed: a multiple of `stats.interval`"""
    warmup_measurements: int = 5
    """Accepted measurements before the alarms can fire.
    Allowed: >= 3"""
    factor: float = 6.0
    """Robust standard deviations of change (entropy down, similarity up) that alarm.
    Allowed: > 0"""
    min_relative_change: float = 0.15
    """And the fraction of the predicted value the change must exceed.
    Allowed: >= 0"""
    min_similarity_change: float = 0.05
    """And, for the similarity (a mean cosine, about 0 for a healthy router), this absolute rise.
    Allowed: [0, 2]"""
    action: ActionName = "warn"
    """What an entropy or similarity alarm gets."""
    dead_expert_action: ActionName = "warn"
    """What an expert gets that was alive in the baseline and receives no token."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.factor > 0, "factor", self.factor, "must be > 0")
        require(self.min_relative_change >= 0, "min_relative_change", self.min_relative_change, "must be >= 0")
        require(0 <= self.min_similarity_change <= 2, "min_similarity_change", self.min_similarity_change,
                "must be in [0, 2]")



ROUTER_SUMS = "router_sums"
RANK_ENTROPY = "router_rank_entropy"
#: the trajectories the alarm follows: (summary key, direction of a collapse)
WATCHED = (("entropy_mean", -1.0), ("similarity", 1.0), ("rank_min_entropy", -1.0))


class RouterObserver:
    """Accumulates this rank's router partials on measured steps and writes them at the agreement."""

    def __init__(self, parts: ModelParts, every: int, rank: int = 0,
                 current_step: Callable[[], int] = lambda: 0) -> None:
        check_rank(rank)
        self.parts, self.every, self.rank, self.current_step = parts, every, rank, current_step
        self.size = router_partials_size(parts.num_experts)
        self.accumulated: dict[int, torch.Tensor] = {}
        self.removers: list[Callable[[], None]] = []
        if parts.observe_routing is not None:
            for shard in parts.routers:
                self.removers.append(parts.observe_routing(shard, self._observer(shard)))

    def due(self) -> bool:
        return self.current_step() % self.every == 0

    def _observer(self, shard: RouterShard) -> Callable[[torch.Tensor, torch.Tensor], None]:
        @torch.no_grad()
        def observe(logits: torch.Tensor, routing_map: torch.Tensor) -> None:
            if not shard.report_tokens or not self.due():
                return
            logits = logits.detach().reshape(-1, logits.shape[-1])
            partial = pack_router_partials(logits, routing_map.reshape(logits.shape))
            held = self.accumulated.get(shard.layer)
            self.accumulated[shard.layer] = partial if held is None else held + partial

        return observe

    @torch.no_grad()
    def write(self, buffer: StatBuffer, view: StepView) -> None:
        accumulated, self.accumulated = self.accumulated, {}
        if view.step % self.every != 0:
            return
        slot = buffer.view(ROUTER_SUMS).view(self.parts.num_layers, self.size)
        keys = buffer.view(RANK_ENTROPY)
        for shard in self.parts.routers:
            partial = accumulated.get(shard.layer)
            if partial is not None:  # this rank's own tokens (report_tokens): the lowest entropy wins the MAX
                key = rank_key_t(-partial_entropy_mean(partial), self.rank).to(keys.device)
                torch.maximum(keys[shard.layer:shard.layer + 1], key, out=keys[shard.layer:shard.layer + 1])
            if shard.report_weight:
                weight_part = pack_router_partials(torch.zeros(0, self.parts.num_experts, device=shard.weight.device),
                                                   torch.zeros(0, self.parts.num_experts, dtype=torch.bool,
                                                               device=shard.weight.device),
                                                   shard.weight.detach())
                partial = weight_part if partial is None else partial + weight_part
            if partial is not None:
                slot[shard.layer].add_(partial.to(slot.device, torch.float64))


class RouterMonitor(Monitor):
    """Per MoE layer, the union's router summary against its healthy trajectory (see module docstring)."""

    name = "router"

    def __init__(self, config: RouterConfig, parts: ModelParts) -> None:
        self.config = config
        self.ep_groups = parts.ep_groups
        self.num_layers, self.num_experts = parts.num_layers, parts.num_experts
        self.experts_per_rank = max(1, parts.experts_per_rank)
        self.size = router_partials_size(parts.num_experts)
        self.history: deque[dict[int, dict[str, Any]]] = deque(maxlen=config.window)
        self.alarms = 0
        self._current: dict[int, dict[str, Any]] | None = None
        self._flagged = False

    def required_stats(self) -> tuple[str, ...]:
        return (ROUTER_SUMS, RANK_ENTROPY)

    def evaluate(self, step: int, stats: Any) -> list[Finding]:
        sums = np.asarray(stats.total(ROUTER_SUMS), dtype=np.float64).reshape(self.num_layers, self.size)
        keys = np.asarray(stats.total(RANK_ENTROPY), dtype=np.float64)
        self._flagged = False
        current = {layer: unpack_router_sums(sums[layer], self.num_experts)
                   for layer in range(self.num_layers) if sums[layer].any()}
        for layer, summary in current.items():
            value, rank = split_key(float(keys[layer]))  # (NaN, -1): no rank had tokens, or not reduced
            summary["rank_min_entropy"], summary["rank_min_rank"] = -value, rank
        self._current = current or None
        if not current or len(self.history) < self.config.warmup_measurements:
            return []
        findings = []
        for layer, summary in current.items():
            past = [h[layer] for h in self.history if layer in h]
            if len(past) < self.config.warmup_measurements:
                continue
            problems = []
            for key, direction in WATCHED:
                value = float(summary.get(key, math.nan))
                history = np.asarray([float(p.get(key, math.nan)) for p in past])
                history = history[np.isfinite(history)]
                if not math.isfinite(value) or history.size < self.config.warmup_measurements:
                    continue
                predicted, spread = (float(v[0]) for v in robust_trend(history[:, None]))
                change = direction * (value - predicted)
                threshold = max(self.config.factor * spread, self.config.min_relative_change * abs(predicted))
                if key == "similarity":  # a mean cosine, ~0 when healthy: a relative change of ~0 means nothing
                    threshold = max(threshold, self.config.min_similarity_change)
                if change > threshold:
                    problems.append({"statistic": key, "value": value, "baseline": predicted, "threshold": threshold})
            if problems:
                findings.append(self._collapse(layer, summary, problems))
            alive_before = np.mean([np.asarray(p["tokens_per_expert"]) > 0 for p in past], axis=0) == 1.0
            dead_now = [e for e in summary["dead_expert_ids"] if alive_before[e]]
            if dead_now and summary["tokens"] > 0:
                findings.append(Finding(
                    self.name, Action.parse(self.config.dead_expert_action), Severity.WARNING,
                    f"dead expert(s) in MoE layer {layer}: {dead_now} received no token "
                    f"(EP rank(s) {sorted({e // self.experts_per_rank for e in dead_now})})",
                    values={"layer": layer, "dead_expert_ids": dead_now,
                            "ep_ranks": sorted({e // self.experts_per_rank for e in dead_now}),
                            "tokens_per_expert": summary["tokens_per_expert"]}))
        self._flagged = bool(findings)
        return findings

    def _collapse(self, layer: int, summary: dict[str, Any], problems: list[dict[str, Any]]) -> Finding:
        """The finding of a router collapse: the union's statistics that left their trajectory, and where: the rank
        whose own tokens' entropy is lowest and its expert-parallel group (the only problem when the collapse is
        confined to that rank's tokens)."""
        rank = int(summary["rank_min_rank"])
        group = list(self.ep_groups.get(rank, ())) if rank >= 0 else []
        where = f"rank {rank}" + (f" (expert-parallel group {group})" if group else "")
        worst = problems[0]
        if [p["statistic"] for p in problems] == ["rank_min_entropy"]:
            message = (f"router collapse in MoE layer {layer} on the tokens of {where}: their routing entropy "
                       f"{worst['value']:.4g} vs healthy {worst['baseline']:.4g} (the job's mean "
                       f"{summary['entropy_mean']:.4g})")
        else:
            message = (f"router collapse in MoE layer {layer}: {worst['statistic']} {worst['value']:.4g} vs healthy "
                       f"{worst['baseline']:.4g}; lowest routing entropy on {where}")
        return Finding(self.name, Action.parse(self.config.action), Severity.WARNING, message,
                       ranks=(rank,) if rank >= 0 else (),
                       values={"layer": layer, "problems": problems, "rank": rank, "ep_group": group,
                               **{k: summary[k] for k in ("similarity", "conditioning_ratio", "entropy_mean",
                                                          "rank_min_entropy", "max_vio")}})

    def commit(self, step: int, applied: bool) -> None:
        if self._current is None:
            return
        if self._flagged:
            self.alarms += 1
        elif applied:
            self.history.append(self._current)

    def metrics(self) -> dict[str, float]:
        latest = self._current if self._current is not None else (self.history[-1] if self.history else None)
        out = {"alarms": float(self.alarms)}
        for layer, summary in (latest or {}).items():
            for key in ("similarity", "conditioning_ratio", "entropy_mean", "entropy_p1", "entropy_p5", "max_vio",
                        "dead_experts"):
                if key in summary:
                    out[f"layer{layer}/{key}"] = float(summary[key])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"history": [{str(k): v for k, v in h.items()} for h in self.history], "alarms": self.alarms}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(({int(k): v for k, v in h.items()} for h in state["history"]),
                             maxlen=self.config.window)
        self.alarms = int(state["alarms"])


class RouterFamily(FamilyBase):
    """``detectors.router``: on when the adapter describes MoE routers (Megatron with ``--num-experts``)."""

    name = "router"
    config_class = RouterConfig

    def enabled(self, ctx: FamilyContext) -> bool:
        return periodic_family_enabled(ctx, self.name, ctx.parts is not None and ctx.parts.num_experts > 0)

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        assert ctx.parts is not None
        every = ctx.section.every
        return [StatDecl(ROUTER_SUMS, ctx.parts.num_layers * router_partials_size(ctx.parts.num_experts),
                         Reduce.SUM),
                StatDecl(RANK_ENTROPY, ctx.parts.num_layers, Reduce.MAX, due=lambda step: step % every == 0)]

    def producers(self, ctx: FamilyContext) -> list[Producer]:
        assert ctx.parts is not None
        observer = RouterObserver(ctx.parts, ctx.section.every, runtime.global_rank(), ctx.current_step)
        return [Producer("before_agreement", observer.write)]

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        assert ctx.parts is not None
        return [RouterMonitor(ctx.section, ctx.parts)]

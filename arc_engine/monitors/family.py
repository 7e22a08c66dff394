"""The plugin seam: a monitor family declares what it needs, and the engine wires it without knowing it.

A family (one module per family: ``numerics.py``, ``loss_spike.py``, ``optimizer.py``, ``sdc.py``, or a module of
your own) says:

* its **config section** -- ``detectors.<name>`` in the YAML: the family brings its own ``config_class`` (a
  ``kw_only`` dataclass that validates itself, in the family's module), the loader parses ``detectors.<name>`` with
  it and :func:`section_of` reads it;
* its **statistics** (:class:`StatDecl`: name, size, how ranks combine it -- :class:`~arc_engine.stats.Reduce`);
* its **producers** (:class:`Producer`): which hook of the step writes which of its statistics from which tensors.
  The adapters already produce the standard slots (``arc_engine.stats.names``: loss, local and reduced gradient
  norms, optimizer statistics); a family asks for optimizer statistics on a step through
  :meth:`FamilyBase.optimizer_stats_due`, and can add producers at ``before_agreement`` that read this rank's
  parameters (:class:`StepView`);
* its **monitors** (subclasses of :class:`~arc_engine.monitors.base.Monitor`: evaluate / commit / state_dict and
  the optional hooks).

A family is a subclass of :class:`FamilyBase`, which says what a family does by default.

Register a plugin family with :func:`arc_engine.monitors.registry.register_family` before loading the config and
attaching, on every rank, in the same order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from arc_engine.config.schema import ArcConfig
from arc_engine.monitors.base import Monitor
from arc_engine.seams import check_overrides
from arc_engine.stats import Reduce, StatBuffer, names


@dataclass(frozen=True)
class StatDecl:
    """One statistic a family needs: a slot of ``size`` float64 numbers combined across ranks by ``reduce``.
    ``group``: for a SUM over the shards of a smaller group than the decision group (e.g. the tensor-parallel
    group), when every copy of that group holds the same shards: the agreed value is one copy's sum. None: each
    element is counted once across the decision group (shards, or replicated values on their owner).
    ``due`` (MAX slots only): the optimizer steps on which the slot is reduced (a function of the step, so every rank
    agrees); None: every monitored step. When no MAX slot is due, the MAX all-reduce is not made (the step keeps its
    one collective) and the MAX slots read NaN: periodic fixed-size statistics cost a second collective on their
    steps only."""

    name: str
    size: int
    reduce: Reduce
    group: dist.ProcessGroup | None = None
    due: Callable[[int], bool] | None = None

    def group_size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None and dist.is_initialized() else 0


@dataclass
class AttentionShard:
    """One attention layer's fused QKV projection as this rank holds it (a tensor-parallel shard of whole query
    groups; rows per group: its query heads, its key, its value). ``owner``: this rank writes the layer's
    statistics (one data-parallel copy per layer does)."""

    layer: int                 # global layer index (0-based, across pipeline stages)
    weight: torch.Tensor       # the live ``[groups * (heads_per_group + 2) * head_dim, hidden]`` weight
    num_query_groups: int      # query groups in ``weight``
    heads_per_group: int
    head_dim: int
    first_head: int            # global index of the first query head this rank measures
    tp_rank: int
    owner: bool
    # fewer query groups than TP ranks: the group's rows are gathered over ``gather`` (the TP ranks sharing the
    # group, in order) before the split, and this rank measures query heads ``heads[0]:heads[1]`` of the group
    gather: Any = None
    heads: tuple[int, int] | None = None
    # the layer's core attention module: where an implementation records its per-head max logits
    # (``current_max_attn_logits``, Transformer Engine >= 2.9), they are reported
    core_attention: Any = None


@dataclass
class RouterShard:
    """One MoE layer's router as this rank holds it. ``module``: the router (its ``routing`` is observed);
    ``weight``: ``[num_experts, hidden]``; ``report_weight``: this rank reports the (replicated) weight statistics;
    ``report_tokens``: this rank's tokens are its own (False on tensor-parallel peers that see the same tokens)."""

    layer: int                 # global layer index of the MoE layer
    module: torch.nn.Module
    weight: torch.Tensor
    topk: int
    ep_rank: int
    report_weight: bool
    report_tokens: bool


@dataclass
class ModelParts:
    """What an adapter knows of the model's structure, for the families that monitor a mechanism (attention,
    routers). Identical sizes on every rank; the shard lists are this rank's. Adapters that cannot describe the
    model leave it None and those families stay off."""

    num_layers: int = 0
    num_heads: int = 0          # query heads per layer, whole model
    attention: list[AttentionShard] = field(default_factory=list)
    num_experts: int = 0
    experts_per_rank: int = 0   # experts per expert-parallel rank
    routers: list[RouterShard] = field(default_factory=list)
    #: global rank -> the global ranks of its expert-parallel group (gathered once at attach; empty: not known),
    #: for naming where a router collapse is
    ep_groups: dict[int, tuple[int, ...]] = field(default_factory=dict)
    observe_routing: Callable[[RouterShard, Callable[[torch.Tensor, torch.Tensor], None]], Callable[[], None]] | \
        None = None  # observe_routing(shard, fn): call fn(logits, routing_map) at each routing; returns a remover
    #: ranks holding different shards of one replica (tensor x pipeline x context x expert parallel): above 1, a
    #: rank's local gradient is one shard of its replica's
    model_parallel_size: int = 1
    #: model-parallel positions whose ranks hold the same parameter shards (tensor x pipeline; 0: the adapter cannot
    #: tell, e.g. under expert parallelism), and this rank's: local gradients are compared within a position
    shard_positions: int = 0
    shard_position: int = 0
    #: this rank's replica (its data-parallel index: the ranks of one replica wait on each other inside the forward
    #: pass; -1: not known), its tensor-parallel rank and its pipeline stage (for naming a slow rank)
    replica: int = -1
    tensor_rank: int = 0
    pipeline_stage: int = 0
    pipeline_stages: int = 1  # the number of pipeline stages (per-stage statistics have a row per stage)
    #: the whole model's weight matrices where ranks hold different ones (pipeline stages): ``(name, this rank's
    #: parameter or None, whether this rank measures its effective rank)``, the same names in the same order on
    #: every rank; each rank's parts come from :attr:`StepView.partition_parts` (for ``detectors.weight_health``)
    matrices: list[tuple[str, torch.Tensor | None, bool]] = field(default_factory=list)


def worker_positions(parts: ModelParts | None) -> tuple[int, int] | None:
    """(positions, this rank's position) for comparing the ranks' local gradients: (1, 0) when every rank holds
    whole gradients; the model-parallel positions when the adapter names them; None when local gradients cannot
    be compared (shards without positions). Identical on every rank but the position."""
    if parts is None or parts.model_parallel_size <= 1:
        return 1, 0
    if parts.shard_positions >= 1:
        return parts.shard_positions, parts.shard_position
    return None


@dataclass
class FamilyContext:
    """What a family is built from (identical on every rank): the whole config, its own section, the optimizer's
    parameter-group names (G slots per gradient statistic), how the adapter's parameter-wise statistics combine
    (``shard_reduce``: SUM of shards / owned parts, or REPLICATED), the model's structure when the adapter
    describes it (``parts``), and whether it can take an exact gradient sketch (``exact_sketch_size``)."""

    config: ArcConfig
    section: Any
    group_names: list[str]
    shard_reduce: Reduce
    parts: ModelParts | None = None
    #: the local gradient's element count when the adapter can write it whole, each element at its own place, as
    #: the gradient sketch (DDP: the same on every rank); 0 when it cannot
    exact_sketch_size: int = 0
    #: where a tensor hook sees this rank's whole local gradient before the framework's reduction, and over which
    #: group that reduction averages (DDP, DeepSpeed ZeRO-1/2; not FSDP2's or ZeRO-3's shards); None: nowhere
    local_grads: LocalGrads | None = None
    #: the optimizer step being computed (the engine's counter; for what runs inside the forward pass)
    current_step: Callable[[], int] = lambda: 0


@dataclass(frozen=True)
class LocalGrads:
    """Parameters a tensor hook on which sees this rank's whole local gradient before the framework averages it over
    ``group`` (None: every rank of the job), and what it returns is what gets averaged. ``left_out``: the
    parameters of this rank not among them and why (e.g. DeepSpeed-MoE experts, averaged over another group)."""

    params: tuple[torch.Tensor, ...]
    group: Any = None
    left_out: str = ""


@dataclass
class StepView:
    """What a producer may read on a monitored step: the optimizer step counter, this rank's trainable
    parameters as the adapter holds them (full tensors under DDP, local shards under FSDP2/ZeRO-3), its section
    times and its count of local system events."""

    step: int
    params: Sequence[torch.Tensor] = field(default_factory=list)
    #: this rank's (forward, iteration) seconds (:class:`arc_engine.stats.timing.SectionClock`; NaN when unknown)
    times: tuple[float, float] = (math.nan, math.nan)
    #: this rank's system events so far (hang reports of the watchdog, its device's events), a running count
    local_events: int = 0
    #: this rank's local compute seconds of the sampled steps read since the last monitored step
    #: (:class:`arc_engine.stats.timing.ComputeProbe`; empty on most steps)
    compute: tuple[float, ...] = ()
    #: where the optimizer partitions the parameters (DeepSpeed ZeRO): ``partition_parts(param)`` = (this rank's
    #: parts of the parameter's master values, of its gradient as the optimizer applies it); over the ranks the
    #: parts are the whole parameter, each element once. None elsewhere (read the parameters and their ``.grad``)
    partition_parts: Callable[[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor]]] | None = None
    #: the part of ``local_events`` that the device itself reported (the engine's event sources: an injected
    #: ``hardware_events`` fault), a running count; blamed on this rank's device (docs/hardware.md)
    device_events: int = 0


@dataclass(frozen=True)
class Producer:
    """A family's own statistics writer. ``hook``: where in the step it runs; today ``"before_agreement"`` (in the
    optimizer step, after the gradients are final and before the update, right before the agreement).
    ``write(buffer, view)``: add this rank's values to the family's slots; local and device-side (no collective,
    no host sync)."""

    hook: str
    write: Callable[[StatBuffer, StepView], None]


HOOKS = ("before_agreement",)


class FamilyBase:
    """A detector family on the plugin seam (see the module docstring): subclass it and override what the family
    brings. The defaults: enabled by its section's ``enabled`` flag; no statistics, producers, monitors or
    optimizer statistics of its own. A method named like one of these but none of them (a misspelt override) is a
    TypeError when the class is defined."""

    name = ""
    #: the dataclass of the family's ``detectors.<name>`` section; None for a family without a section.
    config_class: type | None = None

    HOOKS = ("enabled", "statistics", "producers", "monitors", "optimizer_stats_due", "sketch_due")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_overrides(cls, FamilyBase, ("optimizer_", "sketch_"), FamilyBase.HOOKS)

    def enabled(self, ctx: FamilyContext) -> bool:
        return bool(ctx.section.enabled)

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        return []

    def producers(self, ctx: FamilyContext) -> list[Producer]:
        return []

    def monitors(self, ctx: FamilyContext) -> list[Monitor]:
        return []

    def optimizer_stats_due(self, ctx: FamilyContext, step: int) -> tuple[bool, bool]:
        """Whether this family needs the prospective update RMS, and the weight norms, on monitored step
        ``step`` (the adapters compute them inside the optimizer step when any family asks)."""
        return False, False

    def sketch_due(self, ctx: FamilyContext, step: int) -> bool:
        """Whether this family needs the local gradient sketch (``grad_sketch_local``, which it declares) on
        monitored step ``step`` (the adapters add it in their reduction hooks when any family asks)."""
        return False


def section_of(config: ArcConfig, family: FamilyBase) -> Any:
    """``detectors.<family.name>``: the section parsed with the family's ``config_class`` (its defaults when the
    YAML has none; None for a family without a section). The one way to read a family's section, e.g.
    ``section_of(config, SDCFamily()).action``."""
    section = config.detectors.plugins.get(family.name)
    if section is None and family.config_class is not None:
        section = family.config_class()
    return section


def replace_section(config: ArcConfig, family: FamilyBase, section: Any) -> ArcConfig:
    """A copy of ``config`` whose ``detectors.<family.name>`` is ``section`` (what :func:`section_of` then reads)."""
    plugins = {**config.detectors.plugins, family.name: section}
    return dataclasses.replace(config, detectors=dataclasses.replace(config.detectors, plugins=plugins))


def periodic_family_enabled(ctx: FamilyContext, name: str, described: bool) -> bool:
    """Whether a periodic family (``detectors.<name>.every`` steps) runs: its section is enabled and the adapter
    ``described`` what it measures. Raises ValueError when ``every`` is not a multiple of ``stats.interval``
    (measurements happen on monitored steps)."""
    on = bool(ctx.section.enabled) and described
    interval = ctx.config.stats.interval
    if on and ctx.section.every % interval:
        raise ValueError(f"detectors.{name}.every ({ctx.section.every}) must be a multiple of stats.interval "
                         f"({interval}): measurements happen on monitored steps")
    return on


def periodic_due(step: int, interval: int, every: int) -> bool:
    """Whether optimizer step ``step`` (a monitored one, every ``interval`` steps) is one of a periodic family's
    steps: every ``every`` monitored steps, not the first; never when ``every`` is 0. A function of the step, so every
    rank agrees (``StatDecl(due=...)``, a branch that makes a follow-up reduction). Pure."""
    monitored = step // interval
    return bool(every) and monitored > 0 and monitored % every == 0


def optimizer_statistics(ctx: FamilyContext) -> list[StatDecl]:
    """The per-group weight and update slots the adapters fill inside the optimizer step (shared by every family
    that reads them; the layout registers each once)."""
    size = len(ctx.group_names)
    return [StatDecl(name, size, ctx.shard_reduce) for name in (names.WEIGHT_SQ, names.UPDATE_SQ, names.UPDATE_COUNT)]


def optimizer_stats_schedule(config: ArcConfig, step: int) -> bool:
    """``stats.optimizer_stats_every``: whether monitored step ``step`` is one of the periodic optimizer-statistics
    steps (every ``interval x every`` optimizer steps; never when 0)."""
    every = config.stats.optimizer_stats_every
    return bool(every) and step % (config.stats.interval * every) == 0


__all__ = ["HOOKS", "AttentionShard", "FamilyBase", "FamilyContext", "LocalGrads", "ModelParts", "Producer",
           "RouterShard", "StatDecl", "StepView", "optimizer_statistics", "optimizer_stats_schedule", "periodic_due",
           "periodic_family_enabled", "replace_section", "section_of", "worker_positions"]

"""The enabled monitor families of one engine: their statistics in the layout, their producers and monitors, and
when they want the optional statistics (the engine asks this, never a family)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from arc_engine.config.schema import ArcConfig
from arc_engine.monitors.base import Monitor, missing_stats
from arc_engine.monitors.family import HOOKS, FamilyBase, FamilyContext, LocalGrads, ModelParts, Producer, section_of
from arc_engine.monitors.hooks import MonitorHooks
from arc_engine.monitors.registry import families
from arc_engine.stats import Reduce, StatLayout

log = logging.getLogger("arc_engine")

Wrap = Callable[[str, Callable[..., None]], Callable[..., None]]


@dataclass
class Assembly:
    """What the enabled families bring (every rank builds the same from the same config)."""

    families: list[tuple[FamilyBase, FamilyContext]] = field(default_factory=list)
    monitors: list[Monitor] = field(default_factory=list)
    producers: list[Producer] = field(default_factory=list)
    max_dues: list[Callable[[int], bool] | None] = field(default_factory=list)  # per MAX slot: its steps

    def optimizer_stats_due(self, step: int) -> tuple[bool, bool]:
        """Whether some family wants the prospective update RMS, and the weight norms, on ``step``."""
        dues = [family.optimizer_stats_due(context, step) for family, context in self.families]
        return any(due[0] for due in dues), any(due[1] for due in dues)

    def sketch_due(self, step: int) -> bool:
        """Whether some family wants the local gradient sketch on ``step``."""
        return any(family.sketch_due(context, step) for family, context in self.families)

    def start(self, layout: StatLayout, locations: dict[int, str]) -> MonitorHooks:
        """At the engine's start: a monitor whose statistics nobody produces is disabled (a warning), the others'
        optional methods gathered, their ``on_start(locations)`` called."""
        for monitor in list(self.monitors):
            lacking = missing_stats(monitor, layout)
            if lacking:
                log.warning("arc_engine: monitor %s disabled: statistics %s are not produced", monitor.name, lacking)
                self.monitors.remove(monitor)
        hooks = MonitorHooks.gather(self.monitors)
        for on_start in hooks.on_start:
            on_start(locations)
        return hooks

    def state_dict(self) -> dict[str, Any]:
        """The monitors' baselines (what a rollback restores with the training state)."""
        return {m.name: m.state_dict() for m in self.monitors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for monitor in self.monitors:
            if monitor.name in state:
                monitor.load_state_dict(state[monitor.name])

    def max_due(self, step: int) -> bool:
        """Whether ``step``'s agreement reduces the MAX slots (any of them due; a function of the step)."""
        return any(due is None or due(step) for due in self.max_dues)


def assemble(config: ArcConfig, layout: StatLayout, *, group_names: list[str], shard_reduce: Reduce,
             parts: ModelParts | None, exact_sketch_size: int, local_grads: LocalGrads | None, wrap: Wrap,
             current_step: Callable[[], int] = lambda: 0) -> Assembly:
    """Ask every registered family (:func:`~arc_engine.monitors.registry.families`) whether it is enabled; add the
    enabled ones' statistics to ``layout`` and gather their producers (each wrapped by ``wrap(name, write)``) and
    monitors."""
    assembly = Assembly()
    for family in families():
        context = FamilyContext(config, section_of(config, family), group_names, shard_reduce, parts,
                                exact_sketch_size, local_grads, current_step)
        if not family.enabled(context):
            continue
        assembly.families.append((family, context))
        for decl in family.statistics(context):
            layout.add(decl.name, decl.size, decl.reduce, decl.group_size())
            if decl.reduce is Reduce.MAX:
                assembly.max_dues.append(decl.due)
        assembly.monitors.extend(family.monitors(context))
        for producer in family.producers(context):
            if producer.hook not in HOOKS:
                raise ValueError(f"monitor family {family.name!r}: producer hook {producer.hook!r} is not one of "
                                 f"{list(HOOKS)}")
            assembly.producers.append(dataclasses.replace(
                producer, write=wrap(f"{family.name}.producer", producer.write)))
    return assembly

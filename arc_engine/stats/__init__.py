"""The per-rank statistics pipeline: named slots in one flat buffer, one collective per monitored step."""

from arc_engine.stats import names
from arc_engine.stats.layout import Reduce, StatBuffer, StatLayout, StatSpec
from arc_engine.stats.pipeline import GatheredStats, StatsPipeline, group_ranks, stats_device

__all__ = [
    "GatheredStats",
    "Reduce",
    "StatBuffer",
    "StatLayout",
    "StatSpec",
    "StatsPipeline",
    "group_ranks",
    "names",
    "stats_device",
]

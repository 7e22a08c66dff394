"""The statistics pipeline: named slots in one flat buffer per rank, one job-wide agreement per monitored step."""

from arc_engine.stats import names
from arc_engine.stats.layout import Reduce, StatBuffer, StatLayout, StatSpec
from arc_engine.stats.pipeline import AgreedStats, StatsPipeline, group_ranks, model_device, stats_device

__all__ = [
    "AgreedStats",
    "Reduce",
    "StatBuffer",
    "StatLayout",
    "StatSpec",
    "StatsPipeline",
    "group_ranks",
    "model_device",
    "names",
    "stats_device",
]

"""Detectors: one module per family (pure math + a small stateful wrapper)."""

from arc_engine.monitors.base import Monitor, missing_stats
from arc_engine.monitors.loss_spike import LossSpikeMonitor
from arc_engine.monitors.non_finite import NonFiniteMonitor
from arc_engine.monitors.numerics import GradNormMonitor
from arc_engine.monitors.optimizer import OptimizerStatsMonitor
from arc_engine.monitors.sdc import SDCMonitor

__all__ = [
    "GradNormMonitor",
    "LossSpikeMonitor",
    "Monitor",
    "NonFiniteMonitor",
    "OptimizerStatsMonitor",
    "SDCMonitor",
    "missing_stats",
]

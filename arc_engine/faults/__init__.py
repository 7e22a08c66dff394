"""Fault injection for tests and demos: inject at (rank, step), then assert on what happened."""

from arc_engine.faults.bitflip import BitFlipInjector, BitFlipSpec, flip_bits
from arc_engine.faults.injector import FaultInjector

__all__ = ["BitFlipInjector", "BitFlipSpec", "FaultInjector", "flip_bits"]

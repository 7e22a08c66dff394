"""Fault injection for tests and demos: inject at (rank, step), then assert on what happened."""

from arc_engine.faults.bitflip import BitFlipInjector, BitFlipSpec, flip_bits
from arc_engine.faults.injector import FaultInjector
from arc_engine.faults.mechanism import MechanismFault, mask_low_bits

__all__ = ["BitFlipInjector", "BitFlipSpec", "FaultInjector", "MechanismFault", "flip_bits", "mask_low_bits"]

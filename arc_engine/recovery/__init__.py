"""Recovery: the ARC self-healing loop (verified-stable snapshots in memory and on disk, rollback, heal, escape)
and the persistent sharded checkpoint store it resumes from."""

from arc_engine.recovery.controller import RecoveryController, RecoveryState
from arc_engine.recovery.snapshot import Snapshot, SnapshotRing, capture, restore, rng_state, set_rng_state
from arc_engine.recovery.state import TorchTrainState, TrainState

__all__ = ["RecoveryController", "RecoveryState", "Snapshot", "SnapshotRing", "TorchTrainState", "TrainState",
           "capture", "restore", "rng_state", "set_rng_state"]

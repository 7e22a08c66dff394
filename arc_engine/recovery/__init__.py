"""Recovery: host-memory snapshots (this module) -- the persistent checkpoint tier and the ARC rollback/heal
policy build on it."""

from arc_engine.recovery.snapshot import Snapshot, SnapshotRing, capture, restore, rng_state, set_rng_state

__all__ = ["Snapshot", "SnapshotRing", "capture", "restore", "rng_state", "set_rng_state"]

"""Replicated state in memory snapshots, once per replica group: under DDP each of 3 gloo ranks keeps a third of the
parameters and optimizer state (its share), and a restore puts them back together bitwise (all-gathers over the
data-parallel group, through a staging buffer smaller than the model)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from arc_engine.recovery import snapshot as snapshots
from arc_engine.recovery.state import TorchTrainState
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_optimizer, tiny_model_and_data

pytestmark = pytest.mark.timeout(240)


def _state_round_trip(rank: int, world: int, chunk: int) -> dict[str, Any]:
    snapshots.RESTORE_CHUNK_ELEMENTS = chunk  # small: several all-gathers, shares split across them
    model, data = tiny_model_and_data(seed=1)
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    for step in range(2):  # optimizer state exists
        ddp(*data.batch(step, rank, BATCH)).backward()
        optimizer.step()
        optimizer.zero_grad()
    replicated = TorchTrainState(ddp, optimizer, replicated=True, replica_group=None)
    whole = TorchTrainState(ddp, optimizer)
    expected = [t.clone() for t in replicated.live_tensors()]
    snap = snapshots.capture(2, replicated)
    full_bytes = snapshots.state_bytes(whole)
    with torch.no_grad():
        for tensor in replicated.live_tensors():  # the state moves on (and a rank's copy goes bad)
            if tensor.is_floating_point():
                tensor.add_(1.0 + rank)
    snapshots.restore(snap, replicated)
    restored = replicated.live_tensors()
    return {"equal": all(torch.equal(a, b) for a, b in zip(expected, restored, strict=True)),
            "snapshot_bytes": snap.nbytes, "state_bytes": snapshots.state_bytes(replicated),
            "full_bytes": full_bytes, "buffers": sum(b.numel() * b.element_size() for b in model.buffers())}


@pytest.mark.parametrize("chunk", [1 << 24, 1000])
def test_ddp_ranks_keep_a_share_each_and_restore_bitwise(chunk: int) -> None:
    results = run_ranks(_state_round_trip, 3, chunk)
    for result in results:
        assert result["equal"]
        assert result["snapshot_bytes"] == result["state_bytes"]  # the ring is sized from what is kept
        shared = result["full_bytes"] - result["buffers"]
        # a third of the replicated bytes (plus rounding), the buffers whole
        assert result["snapshot_bytes"] <= result["buffers"] + shared / 3 + 64 * 8
    assert sum(r["snapshot_bytes"] - r["buffers"] for r in results) == results[0]["full_bytes"] - results[0]["buffers"]


def test_share_bounds_cut_evenly_and_cover_every_element() -> None:
    for numel in (0, 1, 5, 6, 7, 1000):
        bounds = [snapshots.share_bounds(numel, 3, rank) for rank in range(3)]
        covered = [i for start, stop, _ in bounds for i in range(start, stop)]
        assert covered == list(range(numel))
        assert all(stop - start <= padded for start, stop, padded in bounds)

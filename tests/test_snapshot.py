"""Host-memory snapshots: a restore is bitwise, and training resumed from it retraces the original run."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from arc_engine.recovery import SnapshotRing, capture, restore
from tests.training import BATCH, make_optimizer, tiny_model_and_data


def step_once(model, optimizer, data, step: int) -> None:
    """A step that draws from every RNG (dropout-like noise from torch, numpy and Python)."""
    inputs, targets = data.batch(step, 0, BATCH)
    loss = model(inputs, targets) * (1 + 0.01 * torch.rand(()) + 0.01 * np.random.rand() + 0.01 * random.random())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def test_restore_is_bitwise_and_the_continuation_retraces_the_run() -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    for step in range(3):
        step_once(model, optimizer, data, step)
    snapshot = capture(3, model, optimizer, extra={"data_position": 3})
    params_at_snapshot = flat_params(model)
    adam_at_snapshot = {k: {n: t.clone() for n, t in v.items()} for k, v in optimizer.state_dict()["state"].items()}
    for step in range(3, 6):
        step_once(model, optimizer, data, step)
    trajectory = flat_params(model)
    assert not torch.equal(trajectory, params_at_snapshot)

    extra = restore(snapshot, model, optimizer)
    assert extra == {"data_position": 3}
    assert torch.equal(flat_params(model), params_at_snapshot)
    for key, state in optimizer.state_dict()["state"].items():
        assert all(torch.equal(state[n], adam_at_snapshot[key][n]) for n in state)
    for step in range(3, 6):  # same data, same RNG draws: the same parameters, bit for bit
        step_once(model, optimizer, data, step)
    assert torch.equal(flat_params(model), trajectory)
    # the snapshot survives its own restore and can be used again
    restore(snapshot, model, optimizer)
    assert torch.equal(flat_params(model), params_at_snapshot)


def test_snapshot_is_independent_of_live_tensors() -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    step_once(model, optimizer, data, 0)
    snapshot = capture(1, model, optimizer)
    kept = snapshot.model["ln_f.weight"].clone()
    with torch.no_grad():
        model.ln_f.weight.add_(1.0)
    assert torch.equal(snapshot.model["ln_f.weight"], kept)
    assert snapshot.nbytes >= sum(p.numel() * 4 for p in model.parameters()) * 3  # weights + two Adam moments


def test_ring_is_bounded_in_bytes_and_keeps_the_newest() -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    step_once(model, optimizer, data, 0)
    size = capture(0, model, optimizer).nbytes
    ring = SnapshotRing(max_bytes=int(size * 2.5))
    for step in range(5):
        assert ring.push(capture(step, model, optimizer))
    assert ring.steps == [3, 4] and ring.total_bytes <= ring.max_bytes
    assert ring.latest().step == 4
    assert SnapshotRing(max_bytes=size - 1).push(capture(9, model, optimizer)) is False
    with pytest.raises(ValueError):
        SnapshotRing(0)

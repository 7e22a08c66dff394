"""arc_engine's own checkpoint state as JSON (arc_engine/recovery/portable.py): exact round trips of what it holds,
and a checkpoint whose arc_engine entry is a pickle is refused without running it."""

from __future__ import annotations

import math
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from arc_engine.recovery import portable
from arc_engine.recovery.snapshot import rng_state


def test_rng_states_and_monitor_state_round_trip_exactly() -> None:
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    state = {"rng": rng_state(), "history": [[1.5, float("nan")], [float("inf"), -0.0]], "cusum": 0.25,
             "scheduler": {"last_epoch": 7, "base_lrs": [0.001, 0.002], "_step_count": 8},
             "optimizer_steps": {0: 3, 1: 4}, "flags": (True, None, "x"), "blob": b"\x00\xff",
             "tensor": torch.arange(6, dtype=torch.float64).reshape(2, 3), "bf16": torch.tensor([1.5, -2.0]).bfloat16(),
             "array": np.arange(4, dtype=np.int64), "scalar": np.float32(0.5), "dtype": torch.bfloat16,
             "__tuple__": "a key that reads like a tag"}
    data = portable.dumps(state)
    assert data.decode().startswith("{") and b"\x80" not in data[:2]  # JSON text, not a pickle
    back = portable.loads(data)
    assert back["rng"]["python"] == state["rng"]["python"]
    numpy_state, numpy_back = state["rng"]["numpy"], back["rng"]["numpy"]
    assert numpy_back[0] == numpy_state[0] and np.array_equal(numpy_back[1], numpy_state[1])
    assert numpy_back[2:] == numpy_state[2:]
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"]) and back["rng"]["torch"].dtype == torch.uint8
    random.setstate(back["rng"]["python"])
    np.random.set_state(back["rng"]["numpy"])
    torch.set_rng_state(back["rng"]["torch"])
    assert math.isnan(back["history"][0][1]) and back["history"][1] == [float("inf"), -0.0]
    assert back["optimizer_steps"] == {0: 3, 1: 4} and back["flags"] == (True, None, "x")
    assert back["blob"] == b"\x00\xff" and back["scalar"] == 0.5 and back["dtype"] is torch.bfloat16
    assert torch.equal(back["tensor"], state["tensor"]) and torch.equal(back["bf16"], state["bf16"])
    assert np.array_equal(back["array"], state["array"]) and back["array"].dtype == np.int64
    assert back["__tuple__"] == "a key that reads like a tag"


def test_what_json_cannot_hold_is_refused_at_save_naming_where() -> None:
    with pytest.raises(TypeError, match=r"state\.monitors\.hook is a builtins\.function"):
        portable.dumps({"monitors": {"hook": lambda: None}})


class _Payload:
    """What a malicious checkpoint would carry: unpickling it runs a command (here: creates a file)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.path,))


def test_a_pickled_arc_entry_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    checkpoint = tmp_path / "ckpt"
    # a DCP checkpoint whose arc_engine entry is an object that runs code when unpickled
    dcp.save({"weight": torch.ones(3), "arc_state": _Payload(marker)}, storage_writer=FileSystemWriter(checkpoint),
             no_dist=True)
    assert not marker.exists()
    template = {"weight": torch.zeros(3), "arc_state": b""}
    with pytest.raises(CheckpointException, match="refused by the weights-only loader"):
        dcp.load(template, storage_reader=FileSystemReader(checkpoint), no_dist=True,
                 planner=portable.SafeLoadPlanner())
    assert not marker.exists()
    # DCP's default planner would have run it: what SafeLoadPlanner prevents
    dcp.load(dict(template), storage_reader=FileSystemReader(checkpoint), no_dist=True)
    assert marker.exists()
    # and the JSON reader refuses pickle bytes outright
    with pytest.raises(ValueError, match=r"not UTF-8 JSON|not valid JSON"):
        portable.loads(pickle.dumps({"a": 1}))


def test_arc_json_state_travels_through_dcp_with_the_safe_planner(tmp_path: Path) -> None:
    state = {"data_position": 12, "rng": rng_state()}
    dcp.save({"weight": torch.ones(2), "arc_state": portable.dumps(state)},
             storage_writer=FileSystemWriter(tmp_path / "ok"), no_dist=True)
    template = {"weight": torch.zeros(2), "arc_state": b""}
    dcp.load(template, storage_reader=FileSystemReader(tmp_path / "ok"), no_dist=True,
             planner=portable.SafeLoadPlanner())
    back = portable.loads(template["arc_state"])
    assert back["data_position"] == 12 and torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert torch.equal(template["weight"], torch.ones(2))

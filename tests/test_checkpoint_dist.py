"""The persistent checkpoint tier on real gloo ranks and real DCP: round trip of DDP + AdamW state and a DTensor,
staging copies, retention with pins, checksum fallback, a SIGKILL mid-save, single-process use, draining at close
and at exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from arc_engine.recovery.checkpoint import CheckpointError, CheckpointManager, CommitInfo
from arc_engine.recovery.staging import assign_owners
from tests.dist_harness import free_port, run_ranks
from tests.training import make_optimizer, optimizer_steps, tiny_model_and_data

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = Path(__file__).resolve().parents[1]


def _tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside nested dicts/lists, by path, cloned."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj.detach().clone()}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    found: dict[str, torch.Tensor] = {}
    for key, value in items:
        found.update(_tensors(value, f"{prefix}/{key}"))
    return found


def _bitwise_equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


# --------------------------------------------------------------------- round trip (DDP + AdamW), staging copies

def _training_state(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(ddp, optimizer)
    return {"model": model_state, "optim": optim_state}


def _round_trip(rank: int, world: int, root: str) -> dict[str, Any]:
    model, data = tiny_model_and_data()
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    optimizer_steps(ddp, optimizer, data, None, rank, 2)
    manager = CheckpointManager(root, commit_timeout_s=60)
    state = _training_state(ddp, optimizer)
    state[f"rng/rank{rank}"] = {"torch": torch.get_rng_state(), "cursor": 100 + rank}
    state["run"] = {"name": "tiny", "tokens_seen": 4096}
    saved = _tensors(state)
    mesh = init_device_mesh("cpu", (world,))
    state["sharded"] = distribute_tensor(torch.arange(16.0), mesh, [Shard(0)])  # DTensor: each rank its shard
    manager.save_async(7, state, metadata={"loss": 1.5})
    staged_fraction = manager.last_staged_bytes / sum(t.numel() * t.element_size() for t in saved.values())
    with torch.no_grad():  # the caller mutates everything right away: the save must not see it
        for param in model.parameters():
            param.add_(1.0)
        for param_state in optimizer.state.values():
            for value in param_state.values():
                value.add_(1.0)
        state["sharded"].to_local().add_(100.0)
    state[f"rng/rank{rank}"]["cursor"] = -1
    state["run"]["tokens_seen"] = 0
    assert manager.wait(60)
    dist.barrier()  # rank 0's commit is on disk

    def build(info: CommitInfo) -> dict[str, Any]:
        live = _training_state(ddp, optimizer)
        live[f"rng/rank{rank}"] = {"torch": torch.empty_like(torch.get_rng_state()), "cursor": None}
        live["run"] = {"name": None, "tokens_seen": None}
        live["sharded"] = distribute_tensor(torch.zeros(16), mesh, [Shard(0)])
        return live

    info, loaded = manager.load_latest(build)
    set_state_dict(ddp, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    restored = _tensors(_training_state(ddp, optimizer))
    manager.close()
    return {"step": info.step, "world_size": info.world_size, "metadata": info.metadata,
            "restored_equal": _bitwise_equal(restored, {k: v for k, v in saved.items() if k.startswith(("/model",
                                                                                                     "/optim"))}),
            "rng_equal": torch.equal(loaded[f"rng/rank{rank}"]["torch"], saved[f"/rng/rank{rank}/torch"]),
            "cursor": loaded[f"rng/rank{rank}"]["cursor"], "run": loaded["run"], "num_tensors": len(restored),
            "staged_fraction": staged_fraction, "sharded": loaded["sharded"].full_tensor()}


def test_round_trip_restores_pre_mutation_state_bitwise(tmp_path: Path) -> None:
    results = run_ranks(_round_trip, 2, str(tmp_path), timeout_s=120)
    for rank, result in enumerate(results):
        assert result["step"] == 7 and result["world_size"] == 2 and result["metadata"] == {"loss": 1.5}
        assert result["num_tensors"] > 4
        assert result["restored_equal"], f"rank {rank}: model/optimizer differ from the state at save time"
        assert result["rng_equal"]
        assert result["cursor"] == 100 + rank  # per-rank objects come back per rank
        assert result["run"] == {"name": "tiny", "tokens_seen": 4096}
        assert torch.equal(result["sharded"], torch.arange(16.0))
    # Replicated DDP state is staged (and written) by one rank each, balanced by bytes.
    assert all(0.3 < result["staged_fraction"] < 0.7 for result in results), [r["staged_fraction"] for r in results]


def test_replica_owners_balance_replicated_tensors_only() -> None:
    mb = 2**20
    per_rank = [[(("w", "a"), (4,), "f32", 4 * mb), (("w", "b"), (2,), "f32", 2 * mb), (("own0",), (1,), "f32", mb),
                 (("odd",), (3,), "f32", 3)],
                [(("w", "a"), (4,), "f32", 4 * mb), (("w", "b"), (2,), "f32", 2 * mb), (("odd",), (5,), "f32", 5)]]
    owners = assign_owners(per_rank)
    assert owners == {("w", "a"): 1, ("w", "b"): 0}  # rank 0 already holds its own tensor: the big one goes to 1


# --------------------------------------------------------------------- retention and pins

def _retention(rank: int, world: int, root: str) -> dict[str, Any]:
    manager = CheckpointManager(root, keep_last=2, commit_timeout_s=60)
    if rank == 0:  # a killed save's leftover, older than what will be committed
        (Path(root) / "step_00000005").mkdir()
        (Path(root) / "step_00000005" / "__0_0.distcp").write_bytes(b"partial")
    dist.barrier()
    weights = torch.zeros(64)
    for step in (10, 20, 30, 40):
        weights.fill_(step)
        manager.save_async(step, {"weights": weights, f"own/rank{rank}": torch.full((8,), float(rank))})
        if step == 20:
            manager.pin(20)  # while in flight: applied at commit
    assert manager.wait(60)
    dist.barrier()
    result = {"committed": [(info.step, info.pinned) for info in manager.committed()],
              "dirs": sorted(os.listdir(root)), "latest": manager.latest().step,
              "latest_file": (Path(root) / "latest").read_text().strip()}
    manager.close()
    return result


def test_retention_keeps_last_k_plus_pinned(tmp_path: Path) -> None:
    for result in run_ranks(_retention, 2, str(tmp_path), timeout_s=120):
        assert result["committed"] == [(20, True), (30, False), (40, False)]
        assert result["dirs"] == ["latest", "step_00000020", "step_00000030", "step_00000040"]
        assert result["latest"] == 40 and result["latest_file"] == "step_00000040"


# --------------------------------------------------------------------- checksum mismatch falls back

def _byte_flip(rank: int, world: int, root: str) -> dict[str, Any]:
    manager = CheckpointManager(root, commit_timeout_s=60)
    for step in (1, 2):
        manager.save_async(step, {"shared": torch.full((256,), float(step)),
                                  f"own/rank{rank}": torch.full((256,), float(10 * step + rank))})
        assert manager.wait(60)
    dist.barrier()
    victim = Path(root) / "step_00000002" / "__1_0.distcp"
    if rank == 0:
        payload = bytearray(victim.read_bytes())
        payload[len(payload) // 2] ^= 0xFF
        victim.write_bytes(bytes(payload))
    dist.barrier()
    info, loaded = manager.load_latest(lambda info: {"shared": torch.zeros(256), f"own/rank{rank}": torch.zeros(256)})
    manager.close()
    return {"step": info.step, "shared": loaded["shared"].unique().tolist(),
            "own": loaded[f"own/rank{rank}"].unique().tolist(), "errors": manager.last_load_errors,
            "victim": str(victim)}


def test_corrupt_shard_falls_back_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_byte_flip, 2, str(tmp_path), timeout_s=120)
    for rank, result in enumerate(results):
        assert result["step"] == 1, f"rank {rank} loaded step {result['step']}"
        assert result["shared"] == [1.0] and result["own"] == [10.0 + rank]
        assert len(result["errors"]) == 1  # found by rank 1 (file 1 of 2), agreed on by both
        assert result["victim"] in result["errors"][0] and "checksum mismatch" in result["errors"][0]


# --------------------------------------------------------------------- SIGKILL mid-save

CRASH_NUMEL = 16 * 1024 * 1024  # 64 MB per rank: the write is still going when the ranks die


def _crash_rank(rank: int, world: int, port: int, root: str) -> None:
    """Commit step 1, start saving step 2, SIGKILL this rank as soon as its shard file exists (mid-write)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    manager = CheckpointManager(root, commit_timeout_s=30)
    manager.save_async(1, {"shared": torch.full((256,), 1.0), f"own/rank{rank}": torch.full((256,), 1.0 + rank)})
    assert manager.wait(30)
    dist.barrier()
    manager.save_async(2, {"shared": torch.full((256,), 2.0), f"own/rank{rank}": torch.full((CRASH_NUMEL,), 2.0)})
    shard = Path(root) / "step_00000002" / f"__{rank}_0.distcp"
    deadline = time.monotonic() + 20
    while not shard.exists() and time.monotonic() < deadline:
        time.sleep(0.001)
    status = {"in_flight": manager.in_flight, "shard_seen": shard.exists()}
    (Path(root).parent / f"crash_status_rank{rank}.json").write_text(json.dumps(status))
    os.kill(os.getpid(), signal.SIGKILL)


def _resume_after_crash(rank: int, world: int, root: str) -> dict[str, Any]:
    manager = CheckpointManager(root, commit_timeout_s=60)
    before = [info.step for info in manager.committed()]
    uncommitted_dir_exists = (Path(root) / "step_00000002").is_dir()

    def build(info: CommitInfo) -> dict[str, Any]:
        return {"shared": torch.zeros(256), f"own/rank{rank}": torch.zeros(256)}

    info, loaded = manager.load_latest(build)
    result = {"committed_before": before, "leftover": uncommitted_dir_exists, "step": info.step,
              "shared": loaded["shared"].unique().tolist(), "own": loaded[f"own/rank{rank}"].unique().tolist()}
    # The resumed run saves step 2 again: the killed save's leftovers are replaced, the new one commits.
    manager.save_async(2, {"shared": torch.full((256,), 3.0), f"own/rank{rank}": torch.full((256,), 3.0)})
    assert manager.wait(60)
    dist.barrier()
    again, loaded = manager.load_latest(build)
    result.update(committed_after=[i.step for i in manager.committed()], reloaded=(again.step, loaded["shared"][0]))
    manager.close()
    return result


def test_sigkill_mid_save_leaves_previous_checkpoint_loadable(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_crash_rank, args=(rank, 2, port, str(root))) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(timeout=90)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    assert [proc.exitcode for proc in procs] == [-signal.SIGKILL] * 2
    statuses = [json.loads((tmp_path / f"crash_status_rank{rank}.json").read_text()) for rank in range(2)]
    assert all(status == {"in_flight": True, "shard_seen": True} for status in statuses), statuses
    assert not (root / "step_00000002" / "COMMITTED.json").exists()

    for rank, result in enumerate(run_ranks(_resume_after_crash, 2, str(root), timeout_s=120)):
        assert result["committed_before"] == [1] and result["leftover"]
        assert result["step"] == 1 and result["shared"] == [1.0] and result["own"] == [1.0 + rank]
        assert result["committed_after"] == [1, 2] and result["reloaded"] == (2, 3.0)


# --------------------------------------------------------------------- single process (no torch.distributed)

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_round_trip_then_a_missing_file_falls_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    manager = CheckpointManager(tmp_path, keep_last=5)
    weights = torch.zeros(1000)
    for step in (1, 2, 3):
        weights.fill_(float(step))
        manager.save_async(step, {"weights": weights, "extra": {"step": step}})
        weights.fill_(-1.0)  # staged already
        assert manager.wait(30)
    assert manager.load_latest(lambda info: {"weights": torch.zeros(3)}, max_step=0) is None

    def build(info: CommitInfo) -> dict[str, Any]:
        return {"weights": torch.zeros(1000), "extra": {"step": None}}

    (tmp_path / "step_00000003" / "__0_0.distcp").unlink()
    info, loaded = manager.load_latest(build)
    assert info.step == 2 and loaded["weights"].unique().tolist() == [2.0] and loaded["extra"] == {"step": 2}
    assert "step_00000003/__0_0.distcp: missing file" in manager.last_load_errors[0]
    info, loaded = manager.load_latest(build, max_step=1)
    assert info.step == 1 and loaded["weights"].unique().tolist() == [1.0]

    marker = tmp_path / "step_00000002" / "COMMITTED.json"  # a marker naming a file DCP's metadata does not use
    record = json.loads(marker.read_text())
    del record["files"]["__0_0.distcp"]
    marker.write_text(json.dumps(record))
    info, _ = manager.load_latest(build)
    assert info.step == 1 and any("references __0_0.distcp" in e for e in manager.last_load_errors)

    def refuse(info: CommitInfo) -> dict[str, Any]:
        raise ValueError("cannot reshard from 4 to 2 ranks")

    with pytest.raises(ValueError, match="reshard"):
        manager.load_latest(refuse)
    (tmp_path / "step_00000001" / "__0_0.distcp").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"step_00000001/__0_0\.distcp"):
        manager.load_latest(build)
    manager.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_holding_entries_the_job_does_not_ask_for_is_not_a_silent_partial_load(tmp_path: Path) -> None:
    """DCP loads only the requested keys: a job whose state dict lacks some of the saved entries (say, optimizer
    moments not created yet) would keep its own values for them without a word. That checkpoint is refused and
    named like a corrupted one; the older one that matches loads."""
    manager = CheckpointManager(tmp_path, keep_last=5)
    manager.save_async(1, {"weights": torch.full((8,), 1.0)})
    assert manager.wait(30)
    manager.save_async(2, {"weights": torch.full((8,), 2.0), "moments": {"exp_avg": torch.full((8,), 3.0)},
                           "arc_rng/rank7": torch.zeros(2)})
    assert manager.wait(30)
    info, loaded = manager.load_latest(lambda info: {"weights": torch.zeros(8)})
    assert info.step == 1 and loaded["weights"].unique().tolist() == [1.0]
    problem = manager.last_load_errors[0]
    assert "step_00000002" in problem and "holds 1 entries no rank of this job loads" in problem
    assert "moments.exp_avg" in problem and "arc_rng" not in problem  # other ranks' RNG states are exempt
    info, loaded = manager.load_latest(lambda info: {"weights": torch.zeros(8), "moments": {"exp_avg": torch.zeros(8)}})
    assert info.step == 2 and loaded["moments"]["exp_avg"].unique().tolist() == [3.0]
    manager.close()


class _JsonSidecarFormat:
    """A backend format for the test: DCP for the tensors, plus a file the coordinator writes beside them."""

    name = "sidecar"
    common_files = ("sidecar.json",)

    def __init__(self) -> None:
        self.fail_load = False

    def prepare_save(self, step: int, state_dict: dict[str, Any], step_dir: Path, *, coordinator: bool,
                     stage: Any) -> tuple[dict[str, Any], None]:
        if coordinator:
            (step_dir / "sidecar.json").write_text(json.dumps({"step": step}))
        return stage({"weights": state_dict["weights"]}), None

    def load(self, path: Path, state_dict: dict[str, Any]) -> None:
        if self.fail_load:
            raise RuntimeError("the framework refused this checkpoint")
        import torch.distributed.checkpoint as dcp

        dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        state_dict["sidecar"] = json.loads((path / "sidecar.json").read_text())

    def publish(self, root: Path, committed: list[CommitInfo]) -> None:
        (root / "index.txt").write_text(" ".join(str(info.step) for info in committed))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_backend_format_is_committed_checksummed_and_falls_back_like_dcp(tmp_path: Path) -> None:
    """The seam megatron-core's dist_checkpointing format plugs into: the coordinator's extra files are part of the
    commit (checksummed, verified at load), and a failure of the format's own load falls back to an older commit."""
    fmt = _JsonSidecarFormat()
    manager = CheckpointManager(tmp_path, keep_last=5, disk_format=fmt)
    weights = torch.zeros(100)
    for step in (1, 2, 3):
        weights.fill_(float(step))
        manager.save_async(step, {"weights": weights})
        weights.fill_(-1.0)  # staged already: the write sees the value at save time
        assert manager.wait(30)
    assert "sidecar.json" in manager.latest().files and manager.last_staged_bytes == 400
    assert (tmp_path / "index.txt").read_text() == "1 2 3"  # the format's index follows each commit

    def build(info: CommitInfo) -> dict[str, Any]:
        return {"weights": torch.zeros(100)}

    info, loaded = manager.load_latest(build)
    assert info.step == 3 and loaded["weights"].unique().tolist() == [3.0] and loaded["sidecar"] == {"step": 3}
    (tmp_path / "step_00000003" / "sidecar.json").write_text(json.dumps({"step": 99}))
    info, loaded = manager.load_latest(build)
    assert info.step == 2 and loaded["sidecar"] == {"step": 2}
    assert "step_00000003/sidecar.json" in manager.last_load_errors[0]
    fmt.fail_load = True
    with pytest.raises(CheckpointError, match="sidecar load failed on rank 0: RuntimeError: the framework refused"):
        manager.load_latest(build)
    assert len(manager.last_load_errors) == 3  # step 3 (checksum), then 2 and 1 (the format's load)
    manager.close()


# --------------------------------------------------------------------- draining at close and at exit

def _close_drains(rank: int, world: int, root: str) -> dict[str, Any]:
    manager = CheckpointManager(root, commit_timeout_s=60)
    manager.save_async(3, {"weights": torch.full((1 << 20,), 3.0), f"own/rank{rank}": torch.ones(4)})
    manager.close()
    manager.close()
    dist.barrier()
    try:
        manager.save_async(4, {"weights": torch.ones(4)})
        refused = False
    except CheckpointError:
        refused = True
    return {"committed": [info.step for info in manager.committed()], "in_flight": manager.in_flight,
            "refused_after_close": refused}


def test_close_drains_the_save_in_flight(tmp_path: Path) -> None:
    for result in run_ranks(_close_drains, 2, str(tmp_path), timeout_s=120):
        assert result == {"committed": [3], "in_flight": False, "refused_after_close": True}


EXIT_WITHOUT_CLOSE = """
import sys, torch
from arc_engine.recovery.checkpoint import CheckpointManager
manager = CheckpointManager(sys.argv[1])
manager.save_async(5, {"weights": torch.full((4 << 20,), 5.0)})
"""


def test_interpreter_exit_drains_the_save_in_flight(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(tmp_path)], env=env, check=True, timeout=90,
                   capture_output=True)
    reader = CheckpointManager(tmp_path)
    committed = reader.committed()
    reader.close()
    assert [info.step for info in committed] == [5]
    assert (tmp_path / "latest").read_text().strip() == "step_00000005"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_trainers_step_resumes_that_commit_of_the_newest_history_and_the_newer_commits_go(tmp_path: Path) -> None:
    """Commits of steps 3, 5, 7 (one run), then 2, 4, 6 of a later run that did not resume them (another history):
    asked for the commit of 5 applied steps, the newest history has none, so the newest commit loads (never the
    earlier run's 5); asked for 4, its commit loads, and ``discard_after`` removes the newer one of its history and
    points ``latest`` at it. A rollback's lookups (``latest``, ``load_latest`` with the job's ``lineage``) see the
    job's own history only."""
    assert not dist.is_initialized()
    manager = CheckpointManager(tmp_path, keep_last=10)
    for lineage, steps in (("first", (3, 5, 7)), ("second", (2, 4, 6))):
        for step in steps:
            manager.save_async(step, {"weights": torch.full((4,), float(step))},
                               metadata={"applied_steps": step, "lineage": lineage})
            assert manager.wait(30)

    def build(info: CommitInfo) -> dict[str, Any]:
        return {"weights": torch.zeros(4)}

    info, _ = manager.load_latest(build, matches=lambda info: info.metadata["applied_steps"] == 5)
    assert info.step == 6
    info, loaded = manager.load_latest(build, matches=lambda info: info.metadata["applied_steps"] == 4)
    assert info.step == 4 and loaded["weights"].tolist() == [4.0] * 4
    assert [path.name for path in manager.discard_after(info)] == ["step_00000006"]
    assert not (tmp_path / "step_00000006").exists() and (tmp_path / "step_00000007").exists()
    assert manager.latest().step == 4 and (tmp_path / "latest").read_text().strip() == "step_00000004"
    # a rollback of the second run looks at its own history only, never the first run's later commits
    assert manager.latest("second").step == 4 and manager.latest("first").step == 7
    info, _ = manager.load_latest(build, max_step=6, lineage="second")
    assert info.step == 4
    assert manager.load_latest(build, max_step=3, lineage="second")[0].step == 2  # not the first run's 3
    manager.close()

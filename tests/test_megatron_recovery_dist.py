"""megatron-core on real gloo ranks: rollback and bitwise replay (TP=2 and EP=2), and pipeline parallelism with
the monitors on (PP=2). The CUDA shims are installed inside the spawned ranks only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.dist_harness import run_ranks
from tests.test_megatron_dist import SMALL, _adam_steps, _build, _params

pytest.importorskip("megatron.core")


def _recovery_yaml(path: Path, run_id: str, injections: list[dict], *, disk: bool = False) -> str:
    """Rollback on a non-finite step to the newest verified-stable memory snapshot (``disk``: no memory ring, the
    newest committed checkpoint in Megatron's format), replaying the same data at the same learning rate (no
    healing), so the replay must reproduce the fault-free run bit for bit."""
    config = {"run": {"run_id": run_id, "run_dir": str(path.parent / "runs")}, "stats": {"interval": 1},
              "sinks": {"console": {"enabled": False}},
              "detectors": {"non_finite": {"action": "rollback"}, "qk_spectra": {"every": 2},
                            "router": {"every": 2}},
              "recovery": {"enabled": True, "checkpoint_freq": 2, "memory_ring_mb": 0 if disk else 64,
                           "lr_reduction_factor": 1.0, "skip_data": "none",
                           "checkpoint": {"enabled": disk, "every_steps": 1}},
              "faults": {"injections": injections}}
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _replay(rank: int, world: int, flags: list[str], clean: str, faulty: str, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, config in (("clean", clean), ("faulty", faulty)):
        script, args, state = _build([*flags, "--arc-config", config])
        while state.arc.progress.step < steps:
            script.train_step(state, args, state.arc.progress.data_position)
        summary = state.arc.summary()
        state.arc.close()
        out[name] = {"params": _params(state), "adam_steps": sorted(set(_adam_steps(state))),
                     "recovery": summary["recovery"], "iterations": summary["iterations"],
                     "detections": summary["detections"]}
    return out


@pytest.mark.timeout(500)
@pytest.mark.parametrize("layout", ["tp2_bf16_distopt", "ep2_moe", "ep2_moe_from_disk"])
def test_rollback_replays_bitwise_under_megatron(tmp_path: Path, layout: str) -> None:
    moe = [*SMALL, "--expert-model-parallel-size", "2", "--num-experts", "4", "--use-distributed-optimizer"]
    flags = {"tp2_bf16_distopt": [*SMALL, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                                  "--bf16"],
             "ep2_moe": moe, "ep2_moe_from_disk": [*moe, "--bf16"]}[layout]
    disk = layout.endswith("from_disk")  # two optimizer members (dense, expert) through dist_checkpointing
    clean = _recovery_yaml(tmp_path / "clean.yaml", "clean", [], disk=disk)
    faulty = _recovery_yaml(tmp_path / "faulty.yaml", "faulty", [{"kind": "nan_loss", "rank": 1, "step": 5}],
                            disk=disk)
    steps = 8
    results = run_ranks(_replay, 4, flags, clean, faulty, steps, timeout_s=480)
    for rank, result in enumerate(results):
        faulty_run, clean_run = result["faulty"], result["clean"]
        assert faulty_run["recovery"]["rollbacks"] == 1, (rank, faulty_run["recovery"])
        assert faulty_run["recovery"]["restored_from_disk" if disk else "restored_from_memory"] == 1, rank
        assert faulty_run["iterations"] > steps  # the rolled-back steps were trained again
        assert faulty_run["detections"].get("non_finite") == 1, rank
        assert clean_run["recovery"]["rollbacks"] == 0, rank
        # the replay reproduces the fault-free run bit for bit: parameters, and Adam's step count
        assert torch.equal(faulty_run["params"], clean_run["params"]), rank
        assert faulty_run["adam_steps"] == clean_run["adam_steps"] == [steps], rank


# ------------------------------------------------------------------ PP=2 x DP=2 with the monitors on

def _pp2(rank: int, world: int, config: str) -> dict[str, Any]:
    from megatron.core import parallel_state

    flags = [*SMALL, "--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--overlap-grad-reduce",
             "--arc-config", config]
    script, args, state = _build(flags)
    updates, measured = [], []
    for _ in range(6):
        _, ok, _ = script.train_step(state, args, state.arc.progress.data_position)
        updates.append(ok)
        measured.append(state.arc.engine.last_stats.total("qk_measured").tolist())
    summary = state.arc.summary()
    state.arc.close()
    return {"updates": updates, "measured": measured, "detections": summary["detections"],
            "stage": parallel_state.get_pipeline_model_parallel_rank(),
            "finite": bool(torch.isfinite(_params(state)).all())}


@pytest.mark.timeout(400)
def test_pp2_overlapped_grad_reduce_monitors_on_first_stage_nan_skipped_everywhere(tmp_path: Path) -> None:
    config = tmp_path / "pp.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"run_id": "pp", "run_dir": str(tmp_path / "runs")}, "stats": {"interval": 1},
        "sinks": {"console": {"enabled": False}}, "detectors": {"qk_spectra": {"every": 2}},
        # rank 0 holds stage 0 (the embedding and layer 0); the loss lives on stage 1
        "faults": {"injections": [{"kind": "nan_grad", "rank": 0, "step": 3,
                                   "param": "decoder.layers.0.self_attention.linear_qkv.weight"}]}}))
    results = run_ranks(_pp2, 4, str(config), timeout_s=380)
    assert sorted(r["stage"] for r in results) == [0, 0, 1, 1]
    for rank, result in enumerate(results):
        assert result["updates"] == [True, True, True, False, True, True], rank
        assert result["detections"] == {"non_finite": 1}, rank
        assert result["finite"], rank
        # QK spectra of both layers (one per stage) measured on steps 2 and 4 (step 0 only keeps W_{t-δ})
        assert result["measured"][2] == [4.0, 4.0] and result["measured"][4] == [4.0, 4.0], result["measured"]
        assert result["measured"][1] == [0.0, 0.0], rank


# ------------------------------------------------------------------ the disk tier: resume after a restart

def _megatron_user_load(flags: list[str], path: Path) -> tuple[int, torch.Tensor]:
    """What a Megatron user does with one of arc_engine's checkpoints, with megatron-core's public API only (as
    Megatron-LM's ``--load``): a fresh model and optimizer, their sharded state dicts built with the checkpoint's
    content metadata, ``dist_checkpointing.load``, ``load_state_dict``. Returns the iteration and the parameters."""
    from megatron.core import dist_checkpointing, parallel_state

    from arc_engine.recovery.state import materialize_optimizer_state

    _, _, fresh = _build([*flags, "--no-arc"])
    for member in fresh.optimizer.chained_optimizers:  # megatron-core's DistributedOptimizer.state_dict() needs Adam's
        materialize_optimizer_state(member.optimizer)  # state, which torch Adam creates at its first step
    metadata = {**(dist_checkpointing.load_content_metadata(str(path)) or {}),
                "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    model = fresh.model[0].module.module  # megatron DDP -> Float16Module -> GPTModel, as Megatron-LM unwraps it
    sharded: dict[str, Any] = {"model": model.sharded_state_dict(metadata=metadata)}
    sharded["optimizer"] = fresh.optimizer.sharded_state_dict(sharded, is_loading=True, metadata=metadata)
    loaded = dist_checkpointing.load(sharded, str(path))
    fresh.model[0].load_state_dict(loaded["model"])
    with torch.no_grad():
        fresh.optimizer.load_state_dict(loaded["optimizer"])
    return int(loaded["iteration"]), _params(fresh)


def _resume(rank: int, world: int, flags: list[str], reference: str, first: str, second: str,
            fmt: str) -> dict[str, Any]:
    import torch.distributed as dist

    script, args, state = _build([*flags, "--arc-config", reference])
    by_step: dict[int, torch.Tensor] = {}
    while state.arc.progress.step < 6:
        by_step[state.arc.progress.step] = _params(state)  # the state a checkpoint of this step holds
        script.train_step(state, args, state.arc.progress.data_position)
    state.arc.close()
    clean = _params(state)
    script, args, state = _build([*flags, "--arc-config", first])  # saves to disk, "dies" after step 4
    while state.arc.progress.step < 4:
        script.train_step(state, args, state.arc.progress.data_position)
    saves = state.arc.summary()["recovery"]["disk_saves"]
    state.arc.close()  # drains the save in flight
    dist.barrier()
    committed = state.arc.engine.recovery.checkpoints.committed()
    out: dict[str, Any] = {"saves": saves, "committed": [info.step for info in committed]}
    if fmt == "megatron":
        from arc_engine.integrations.megatron import internals as mi

        layout = mi.dist_checkpoint_layout()
        assert layout is not None
        out["common_files"] = list(layout.common_files)  # common.pt and metadata.json; metadata.json from 0.19 on
        newest = committed[-1].path
        out["files"] = sorted(p.name for p in newest.iterdir())
        root = newest.parent  # found as Megatron-LM's --load finds it: the tracker file, then iter_XXXXXXX
        tracked = int((root / "latest_checkpointed_iteration.txt").read_text())
        out["megatron_lm_names"] = (tracked, sorted(p.name for p in root.glob("iter_*")))
        iteration, params = _megatron_user_load(flags, root / f"iter_{tracked:07d}")
        out["user_load"] = iteration == committed[-1].step and torch.equal(params, by_step[iteration])
        dist.barrier()
        if rank == 0:  # the newest commit's first common file goes bad: the resume must fall back to the one before
            (newest / layout.common_files[0]).write_bytes(b"not a checkpoint")
        dist.barrier()
    script, args, state = _build([*flags, "--arc-config", second])  # a new job: resumes from the commit
    out["resumed_at"] = state.arc.progress.step
    out["load_errors"] = list(state.arc.engine.recovery.checkpoints.last_load_errors)
    while state.arc.progress.step < 6:
        script.train_step(state, args, state.arc.progress.data_position)
    state.arc.close()
    out.update(equal=torch.equal(_params(state), clean), adam_steps=sorted(set(_adam_steps(state))))
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("fmt", ["megatron", "dcp"])
def test_a_megatron_job_resumes_from_its_disk_checkpoint_bitwise(tmp_path: Path, fmt: str) -> None:
    """``megatron`` (what ``auto`` picks): each checkpoint is a dist_checkpointing checkpoint that megatron-core's
    own load reads; arc_engine's checksums cover Megatron's files too (a corrupted ``common.pt``, or from
    megatron-core 0.19 on ``metadata.json``, falls back)."""
    def config(name: str, run_id: str, disk: bool) -> str:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({
            "run": {"run_id": run_id, "run_dir": str(tmp_path / "runs")}, "stats": {"interval": 1},
            "sinks": {"console": {"enabled": False}},
            "recovery": {"enabled": True, "checkpoint_freq": 1, "memory_ring_mb": 64,
                         "checkpoint": {"enabled": disk, "every_steps": 2, "resume": True,
                                        "format": "auto" if fmt == "megatron" else fmt}}}))
        return str(path)

    flags = [*SMALL, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"]
    results = run_ranks(_resume, 4, flags, config("reference", "reference", False), config("first", "job", True),
                        config("second", "job", True), fmt, timeout_s=380)
    for rank, result in enumerate(results):
        assert result["saves"] >= 2 and len(result["committed"]) >= 2, rank
        if fmt == "megatron":
            assert {*result["common_files"], ".metadata", "COMMITTED.json"} <= set(result["files"]), rank
            assert result["user_load"], rank  # megatron-core's own load: the model and optimizer of that step
            # Megatron-LM's names: the tracker names the newest commit, one iter_ link per committed checkpoint
            assert result["megatron_lm_names"] == (result["committed"][-1],
                                                   [f"iter_{step:07d}" for step in result["committed"]]), rank
            assert result["resumed_at"] == result["committed"][-2], rank  # the newest one's common file is bad
            assert any(result["common_files"][0] in error for error in result["load_errors"]), result["load_errors"]
        else:
            assert result["resumed_at"] == result["committed"][-1], rank
        assert result["equal"], rank  # resumed and continued: bitwise the uninterrupted run
        assert result["adam_steps"] == [6], rank


# ------------------------------------------------------------------ Fisher-shaped rollback under megatron-core

def _fisher_rollback(rank: int, world: int, flags: list[str], config: str, steps: int) -> dict[str, Any]:
    """Train through a rollback with the importance-weighted blend and EWC; right after the blend, how far the bf16
    model parameters are from their (blended) fp32 masters."""
    script, args, state = _build([*flags, "--arc-config", config])
    recovery_state = state.arc.engine.recovery.state
    refresh, gaps = recovery_state.masters_changed, []

    def masters_changed() -> None:
        refresh()
        for member in state.optimizer.chained_optimizers:
            for models, mains in zip(member.float16_groups, member.fp32_from_float16_groups, strict=True):
                gaps.extend(float((m.detach().float() - w.detach().to(m.dtype).float()).abs().max())
                            for m, w in zip(models, mains, strict=True))

    recovery_state.masters_changed = masters_changed
    while state.arc.progress.step < steps:
        script.train_step(state, args, state.arc.progress.data_position)
    summary = state.arc.summary()
    state.arc.close()
    return {"params": _params(state), "recovery": summary["recovery"], "gaps": gaps}


@pytest.mark.timeout(500)
def test_the_fisher_shaped_rollback_keeps_megatron_replicas_identical(tmp_path: Path) -> None:
    """TP=2 x DP=2, bf16 (fp32 masters): a NaN loss at step 5 rolls back; the importance-weighted blend edits the
    masters and Megatron's copy brings the bf16 parameters in line (exactly, at bf16); with EWC after it the run
    finishes, finite, each data-parallel replica identical to the other, and away from a plain rollback's."""
    flags = [*SMALL, "--tensor-model-parallel-size", "2", "--bf16"]
    fault = [{"kind": "nan_loss", "rank": 1, "step": 5}]
    plain = _recovery_yaml(tmp_path / "plain.yaml", "plain", fault)
    shaped = _recovery_yaml(tmp_path / "shaped.yaml", "shaped", fault)
    config = yaml.safe_load(Path(shaped).read_text())
    config["detectors"]["fisher"] = {"enabled": True, "every": 1, "importance_rollback": True, "ewc_strength": 1e3}
    Path(shaped).write_text(yaml.safe_dump(config))
    ours = run_ranks(_fisher_rollback, 4, flags, shaped, 8, timeout_s=400)
    theirs = run_ranks(_fisher_rollback, 4, flags, plain, 8, timeout_s=400)
    for rank in range(4):
        assert ours[rank]["recovery"]["rollbacks"] == 1 and theirs[rank]["recovery"]["rollbacks"] == 1
        assert ours[rank]["gaps"] and max(ours[rank]["gaps"]) == 0.0 and theirs[rank]["gaps"] == []
        assert torch.isfinite(ours[rank]["params"]).all()
        assert not torch.equal(ours[rank]["params"], theirs[rank]["params"])
    for first, second in ((0, 2), (1, 3)):  # the data-parallel replicas of each tensor-parallel shard
        assert torch.equal(ours[first]["params"], ours[second]["params"])


def _on_a_full_disk(rank: int, world: int, flags: list[str], config: str, mounted: bool) -> dict[str, Any]:
    from tests.test_recovery_dist import fill_the_disk_unless

    fill_the_disk_unless(mounted)
    script, args, state = _build([*flags, "--arc-config", config])
    while state.arc.progress.step < 8:
        script.train_step(state, args, state.arc.progress.data_position)
    summary = state.arc.summary()
    state.arc.close()
    return {"steps": summary["steps"], "saves": summary["recovery"]["checkpoint_saves"]}


@pytest.mark.timeout(400)
def test_a_full_disk_under_megatron_is_an_event_per_save_and_training_goes_on(tmp_path: Path) -> None:
    """megatron-core (TP=2), its checkpoints in Megatron's format on a 32 KB filesystem (or with injected ENOSPC
    where the test cannot mount one): every save fails as an event and training runs to the end, as under DDP,
    FSDP2 and ZeRO-2 (``tests/test_recovery_dist.py``: before, the job hung)."""
    from tests.test_recovery_dist import full_disk

    ckpt = tmp_path / "small"
    config = tmp_path / "disk.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"run_id": "disk", "run_dir": str(tmp_path / "runs")}, "stats": {"interval": 1},
        "sinks": {"console": {"enabled": False}},
        "recovery": {"enabled": True, "checkpoint_freq": 1, "memory_ring_mb": 64,
                     "checkpoint": {"enabled": True, "every_steps": 2, "dir": str(ckpt), "format": "auto"}}}))
    flags = [*SMALL, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]
    with full_disk(ckpt) as mounted:
        results = run_ranks(_on_a_full_disk, 2, flags, str(config), mounted, timeout_s=360)
        left = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.name != ".arc_shared_probe")
    assert [r["steps"] for r in results] == [8, 8]
    assert all(r["saves"]["failed"] >= 3 and r["saves"]["committed"] == 0 for r in results), results
    lines = (tmp_path / "runs" / "disk" / "events.jsonl").read_text().splitlines()
    failed = [e for e in map(yaml.safe_load, lines) if e.get("action") == "checkpoint_failed"]
    assert len({e["values"]["step"] for e in failed}) >= 3, failed  # every save (steps 1, 3, 5: verified ones)
    assert all("No space left on device" in e["message"] for e in failed), failed[0]["message"]
    assert left in ([], ["latest"]), left

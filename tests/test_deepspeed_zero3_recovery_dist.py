"""Recovery under DeepSpeed ZeRO-3 on real gloo ranks: rollback replays bitwise from the memory ring and from a
disk checkpoint, a job SIGKILLed while an async save is in flight resumes bitwise from the previous commit, and
an escape's perturbation reaches the fp32 masters, the bit16 partitions and the gathered persistent parameters;
recovery with parameter partitions offloaded (``offload_param``) is refused on every rank.

The engine trains in bf16 with fp32 masters (so the bit16 partitions are tensors of their own) and keeps the small
parameters (layer norms, biases) gathered between steps while the matrices are released: the two kinds of state
a restore must refresh. "The parameters" compared below are every rank's fp32 master partitions, its bit16
partitions and its gathered persistent parameters.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from arc_engine.config import ArcConfig
from tests.dist_harness import run_ranks, run_ranks_to_exit
from tests.test_recovery_dist import Job, _resume_run, _run, deepspeed_job, lr_spike, recovery_config, train
from tests.training import BATCH, make_optimizer, tiny_model_and_data

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.timeout(400)
PERSISTENCE = 100  # elements: layer norms and biases stay gathered between steps, matrices are released


def zero3_job(config: ArcConfig | None, rank: int, world: int, bf16: bool = True) -> tuple[Job, Any]:
    """The ZeRO-3 job with DeepSpeed's warm-up LR scheduler (``bf16=False``: the model trains in fp32, and each fp32
    master partition is the bit16 partition itself, or a separate fp32 copy on DeepSpeed 0.18.0)."""
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    import deepspeed

    from tests.test_deepspeed_dist import wait_for_zero3_gathers

    wait_for_zero3_gathers()  # DeepSpeed before 0.19.8 races on gloo otherwise
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    ds_config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 1.0, "steps_per_print": 10_000,
                 "bf16": {"enabled": bf16},  # a warm-up schedule: the learning rate differs at every step
                 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                              "warmup_num_steps": 40}},
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": PERSISTENCE}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return deepspeed_job(engine, config, lambda: zero3_state(engine), lambda x, y: engine(x, y).float()), data


def zero3_state(engine: Any) -> list[torch.Tensor]:
    """This rank's fp32 master and bit16 partitions, then its persistent parameters' gathered copies."""
    zero = engine.optimizer
    persistent = [p for p in engine.module.parameters() if p.ds_persist]
    assert persistent and all(p.numel() == p.ds_numel for p in persistent), "persistent parameters not gathered"
    assert any(not p.ds_persist for p in engine.module.parameters())
    partitions = [p.detach() for p in zero.fp32_partitioned_groups_flat + zero.fp16_partitioned_groups_flat]
    return partitions + [p.detach() for p in persistent]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------ rollback replays bitwise

@pytest.mark.parametrize("backend", ["zero3", "zero3-fp32"])
def test_zero3_rollback_replays_bitwise_from_memory_and_from_disk(tmp_path: Path, backend: str) -> None:
    """An LR x 50 spike at step 12 is rolled back to step 10; with no healing and no data skip the run then
    replays the fault-free run bit for bit -- from the memory ring, and with the ring off from the DCP checkpoint."""
    plain = ["recovery.lr_reduction_factor=1.0", "recovery.skip_data=none"]
    disk = ["recovery.memory_ring_mb=0", "recovery.checkpoint.every_steps=5",
            f"recovery.checkpoint.dir={tmp_path / 'ckpt'}"]
    clean = run_ranks(_run, 2, backend, recovery_config(tmp_path / "clean", *plain), 20)
    for tier, extra in (("memory", []), ("disk", disk)):
        faulty = run_ranks(_run, 2, backend, recovery_config(tmp_path / tier, lr_spike(12), *plain, *extra), 20)
        for rank in range(2):
            recovery = faulty[rank]["summary"]["recovery"]
            assert recovery["rollbacks"] == 1 and recovery[f"restored_from_{tier}"] == 1, (tier, recovery)
            assert faulty[rank]["iterations"] == 24  # steps 10..13 ran twice
            assert _equal(faulty[rank]["params"], clean[rank]["params"]), f"{tier}: rank {rank} diverged"
    assert not _equal(clean[0]["params"], clean[1]["params"])  # the ranks' partitions differ


# ------------------------------------------------------------------ SIGKILL during an async save, then resume

def _killed_mid_save(rank: int, world: int, config: ArcConfig, status_dir: str) -> None:
    """Train; the save of step 15 never finishes (its checksum blocks, after DCP wrote the shards), and at step 17
    -- once step 10 is committed -- this rank records what it sees and SIGKILLs itself."""
    import arc_engine.recovery.checkpoint as checkpoint

    original = checkpoint.file_checksum

    def blocked(path: Path) -> Any:
        if "step_00000015" in str(path):
            time.sleep(3600)
        return original(path)

    def kill_at_17(arc: Any) -> None:
        if arc.progress.step != 17:
            return
        manager = arc.engine.recovery.checkpoints
        deadline = time.monotonic() + 60
        while 10 not in [info.step for info in manager.committed()] and time.monotonic() < deadline:
            time.sleep(0.05)
        status = {"in_flight": manager.in_flight, "committed": [info.step for info in manager.committed()]}
        (Path(status_dir) / f"status_rank{rank}.json").write_text(json.dumps(status))
        dist.barrier()  # both ranks have looked before either dies
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.file_checksum = blocked
    job, data = zero3_job(config, rank, world)
    train(job, data, rank, 30, at_step_start=kill_at_17)


def test_zero3_job_killed_during_an_async_save_resumes_bitwise_from_the_previous_commit(tmp_path: Path) -> None:
    disk = ["recovery.checkpoint.every_steps=5", f"recovery.checkpoint.dir={tmp_path / 'ckpt'}"]
    codes = run_ranks_to_exit(_killed_mid_save, 2, recovery_config(tmp_path / "a", *disk), str(tmp_path))
    assert codes == [-signal.SIGKILL] * 2
    for rank in range(2):
        status = json.loads((tmp_path / f"status_rank{rank}.json").read_text())
        assert status == {"in_flight": True, "committed": [5, 10]}, status
    assert (tmp_path / "ckpt" / "step_00000015").is_dir()  # the killed save's leftovers
    assert not (tmp_path / "ckpt" / "step_00000015" / "COMMITTED.json").exists()

    resumed = run_ranks(_resume_run, 2, "zero3", recovery_config(tmp_path / "b", *disk), 25)
    straight = run_ranks(_resume_run, 2, "zero3", recovery_config(tmp_path / "c"), 25)
    for rank in range(2):
        assert resumed[rank]["resumed_at"] == 10
        assert _equal(resumed[rank]["params"], straight[rank]["params"]), f"rank {rank} diverged after the resume"
        assert resumed[rank]["summary"]["iterations"] == straight[rank]["summary"]["iterations"] == 25


# ------------------------------------------------------------------ escape: the perturbation reaches everything

def _perturbed(rank: int, world: int, config: ArcConfig) -> dict[str, Any]:
    job, data = zero3_job(config, rank, world)
    train(job, data, rank, 3)  # closes arc; the engine lives on
    engine_state = job.arc.engine.recovery.state
    before = [t.clone() for t in job.params()]
    engine_state.perturb(0.01, seed=7)
    after = job.params()
    zero = engine_state.zero
    # each persistent parameter's gathered copy is every rank's bit16 partition of it, concatenated
    regathered = []
    for param in (p for p in engine_state.ds_engine.module.parameters() if p.ds_persist):
        pieces = [torch.empty_like(param.ds_tensor) for _ in range(world)]
        dist.all_gather(pieces, param.ds_tensor.detach())
        regathered.append(torch.equal(torch.cat(pieces)[: param.numel()].view_as(param), param.detach()))
    count = len(zero.fp32_partitioned_groups_flat)
    return {"before": before, "after": [t.clone() for t in after], "count": count, "regathered": regathered}


def test_zero3_escape_perturbs_masters_bit16_partitions_and_gathered_parameters(tmp_path: Path) -> None:
    results = run_ranks(_perturbed, 2, recovery_config(tmp_path))
    for result in results:
        count, before, after = result["count"], result["before"], result["after"]
        fp32, bit16 = after[:count], after[count: 2 * count]
        for old, new in zip(before[:count], fp32, strict=True):
            changed = (new - old).norm() / old.norm()
            assert 0.001 < changed < 0.05, float(changed)  # scale 0.01 of each piece's RMS
        assert all(torch.equal(b, f.to(b.dtype)) for b, f in zip(bit16, fp32, strict=True))
        assert not _equal(before[2 * count:], after[2 * count:])  # the persistent copies moved
        assert result["regathered"] and all(result["regathered"])


# ------------------------------------------------------------------ what is refused

def _attach_offloaded(rank: int, world: int, config: ArcConfig) -> str:
    os.environ["LOCAL_RANK"] = str(rank)
    import deepspeed

    from arc_engine.integrations.deepspeed import attach_deepspeed

    model, _ = tiny_model_and_data()
    ds_config = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10_000,
                 "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model), config=ds_config)
    try:
        attach_deepspeed(engine, config)
    except ValueError as err:
        return str(err)
    return "attached"


def test_zero3_recovery_with_offloaded_parameters_is_refused_on_every_rank(tmp_path: Path) -> None:
    messages = run_ranks(_attach_offloaded, 2, recovery_config(tmp_path))
    assert all("offload_param" in m and "not supported" in m for m in messages), messages

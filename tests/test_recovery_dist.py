"""The ARC self-healing loop on real gloo ranks: DDP, FSDP2 and DeepSpeed ZeRO-2.

Faults are injected at (rank, iteration); the tests assert what happened after: the rollback target and tier,
bitwise replays, the healed run's final loss against a fault-free run, escape then a clean abort with exit code 4,
and a resumed job that continues exactly where the checkpoint left off.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine.config import ArcConfig
from arc_engine.sinks import read_jsonl
from tests.dist_harness import run_ranks
from tests.training import BATCH, count_c10d_ops, make_config, make_optimizer, tiny_model_and_data

pytestmark = pytest.mark.timeout(300)
EVAL_BATCHES = [(10_000 + i, r) for i in range(4) for r in range(2)]


def recovery_config(run_dir: Path, *overrides: str) -> ArcConfig:
    """Recovery on, snapshots every 5 healthy steps, loss spikes roll back; disk checkpoints off unless asked."""
    return make_config(run_dir, "recovery.enabled=true", "recovery.checkpoint_freq=5",
                       "recovery.checkpoint.every_steps=0", "detectors.loss_spike.warmup_steps=5",
                       "detectors.loss_spike.action=rollback", "stats.optimizer_stats_every=0", *overrides)


@dataclass
class Job:
    """One backend's training step, behind the same three calls."""

    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    backward_and_step: Callable[[torch.Tensor], None]
    params: Callable[[], list[torch.Tensor]]
    arc: Any


def ddp_job(config: ArcConfig | None) -> tuple[Job, Any]:
    model, data = tiny_model_and_data()
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    arc = arc_engine.attach(ddp, optimizer, config) if config is not None else None

    def backward_and_step(loss: torch.Tensor) -> None:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Job(ddp, backward_and_step, lambda: [p.detach() for p in model.parameters()], arc), data


def fsdp_job(config: ArcConfig | None) -> tuple[Job, Any]:
    from tests.test_fsdp_dist import sharded_gpt

    model, data, optimizer = sharded_gpt()
    arc = arc_engine.attach(model, optimizer, config) if config is not None else None

    def backward_and_step(loss: torch.Tensor) -> None:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Job(model, backward_and_step, lambda: [p.detach().to_local() for p in model.parameters()], arc), data


def deepspeed_job(engine: Any, config: ArcConfig | None, params: Callable[[], list[torch.Tensor]],
                  forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> Job:
    """A DeepSpeed engine's Job, arc_engine attached when ``config`` is given."""
    arc = None
    if config is not None:
        from arc_engine.integrations.deepspeed import attach_deepspeed

        arc = attach_deepspeed(engine, config)

    def backward_and_step(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    return Job(forward or engine, backward_and_step, params, arc)


def zero2_job(config: ArcConfig | None, rank: int, world: int, stage: int = 2) -> tuple[Job, Any]:
    from tests.test_deepspeed_dist import ds_engine

    engine, data = ds_engine(rank, world, stage, clip=1.0)
    return deepspeed_job(engine, config, lambda: [p.detach() for p in engine.module.parameters()]), data


def make_job(backend: str, config: ArcConfig | None, rank: int, world: int) -> tuple[Job, Any]:
    if backend == "ddp":
        return ddp_job(config)
    if backend == "fsdp":
        return fsdp_job(config)
    if backend in ("zero3", "zero3-fp32"):
        from tests.test_deepspeed_zero3_recovery_dist import zero3_job

        return zero3_job(config, rank, world, bf16=backend == "zero3")
    return zero2_job(config, rank, world, stage=1 if backend == "zero1" else 2)


def train(job: Job, data: Any, rank: int, steps: int, record_at: int | None = None,
          draw_before_forward: bool = False, at_step_start: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Train until ``steps`` optimizer steps are done, batches from the data position (arc's when attached). Each
    step draws from the torch RNG, so a replay is bitwise only if the RNG was restored; after its forward, or with
    ``draw_before_forward`` before it (as a loop that masks or augments its batch does). ``record_at``: also return
    the parameters at the start of that step (first visit). ``at_step_start(arc)``: called before each attempt."""
    arc, iteration, losses, params_at = job.arc, 0, [], None
    try:
        while (arc.progress.step if arc is not None else iteration) < steps:
            assert iteration < 4 * steps + 50, "the run does not terminate"
            if at_step_start is not None:
                at_step_start(arc)
            if params_at is None and arc is not None and arc.progress.step == record_at:
                params_at = [p.clone() for p in job.params()]
            position = arc.progress.data_position if arc is not None else iteration
            noise = torch.rand(()) if draw_before_forward else None
            loss = job.forward(*data.batch(position, rank, BATCH))
            loss = loss * (1 + 1e-3 * (noise if noise is not None else torch.rand(())))
            if arc is not None:
                loss = arc.faults.on_loss(loss)
                arc.record_loss(loss)
            losses.append(float(loss.detach()))
            job.backward_and_step(loss)
            iteration += 1
    except arc_engine.ArcAbort as abort:
        return {"aborted_at": abort.step, "exit_code": abort.exit_code, "iterations": iteration,
                "message": str(abort)}
    params = [p.clone() for p in job.params()]
    summary = arc.summary() if arc is not None else {}
    if arc is not None:
        arc.close()
    with torch.no_grad():
        eval_loss = sum(float(job.forward(*data.batch(p, r, BATCH))) for p, r in EVAL_BATCHES) / len(EVAL_BATCHES)
    return {"params": params, "params_at": params_at, "eval_loss": eval_loss, "summary": summary,
            "iterations": iteration, "losses": losses}


def _run(rank: int, world: int, backend: str, config: ArcConfig | None, steps: int,
         record_at: int | None = None) -> dict[str, Any]:
    job, data = make_job(backend, config, rank, world)
    return train(job, data, rank, steps, record_at)


def events(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "test" / "events.jsonl")


def lr_spike(at: int, scale: float = 50.0) -> str:
    return f"faults.injections=[{{kind: lr_scale, rank: -1, step: {at}, scale: {scale}}}]"


# ------------------------------------------------------------------ bitwise rollback (memory and disk tiers)

@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_rollback_restores_state_and_rng_bitwise(tmp_path: Path, tier: str) -> None:
    """No healing, no data skip: after the rollback the run replays the fault-free run bit for bit, which holds
    only if parameters, Adam state, RNG, data position and detector baselines were all restored exactly."""
    plain = ["recovery.lr_reduction_factor=1.0", "recovery.skip_data=none"]
    if tier == "disk":
        plain += ["recovery.memory_ring_mb=0", "recovery.checkpoint.every_steps=5"]
    config = recovery_config(tmp_path / "faulty", lr_spike(12), *plain)
    faulty = run_ranks(_run, 2, "ddp", config, 20)
    clean = run_ranks(_run, 2, "ddp", recovery_config(tmp_path / "clean", *plain), 20)
    for rank in range(2):
        recovery = faulty[rank]["summary"]["recovery"]
        assert recovery["rollbacks"] == 1
        assert recovery[f"restored_from_{tier}"] == 1
        assert faulty[rank]["iterations"] > 20  # steps were replayed
        assert all(torch.equal(a, b) for a, b in zip(faulty[rank]["params"], clean[rank]["params"], strict=True))
    actions = [e for e in events(tmp_path / "faulty") if e["kind"] == "action" and e["detector"] == "recovery"]
    assert [(e["action"], e["values"]["target_step"]) for e in actions] == [("rollback", 10)]


def _slow_save_of_step_10(rank: int, world: int, config: ArcConfig, steps: int) -> dict[str, Any]:
    from arc_engine.recovery import checkpoint

    finish = checkpoint.CheckpointManager._finish_save

    def slow(manager: Any, job: Any) -> None:  # the save of step 10 takes 12 s in the background, on every rank
        if job.step == 10:
            time.sleep(12.0)
        finish(manager, job)

    checkpoint.CheckpointManager._finish_save = slow
    return _run(rank, world, "ddp", config, steps)


def test_a_disk_rollback_waits_for_the_save_in_flight_with_the_watchdog_paused(tmp_path: Path) -> None:
    """The rollback of step 12 goes to disk (no memory ring) while the save of step 10 is still being written: it
    drains that save (12 s) in the optimizer step's hooks. Before: the drain counted toward a hang, and the
    watchdog (4 s timeout, abort after 2) ended every rank with exit code 6 mid-drain. Now the drain is a known
    phase: the rollback restores step 10 and training goes on, with no hang reported."""
    config = recovery_config(tmp_path, lr_spike(12), "recovery.lr_reduction_factor=1.0", "recovery.skip_data=none",
                             "recovery.memory_ring_mb=0", "recovery.checkpoint.every_steps=5",
                             "watchdog.initial_timeout_s=4", "watchdog.warmup_steps=1000", "watchdog.action=abort",
                             "watchdog.abort_after=2")
    results = run_ranks(_slow_save_of_step_10, 2, config, 20, timeout_s=240)
    for result in results:
        recovery = result["summary"]["recovery"]
        assert recovery["rollbacks"] == 1 and recovery["restored_from_disk"] == 1, recovery
    assert not [e for e in events(tmp_path) if e["detector"] == "hang"]
    actions = [e for e in events(tmp_path) if e["kind"] == "action" and e["detector"] == "recovery"]
    assert [(e["action"], e["values"]["target_step"]) for e in actions] == [("rollback", 10)]


@pytest.mark.parametrize("interval", [1, 2, 5])
def test_snapshots_stay_verified_at_any_interval_after_a_skip(tmp_path: Path, interval: int) -> None:
    """Monitored every ``interval`` steps, a snapshot due every 5 healthy steps: a NaN skipped at step 10 moves the
    healthy count, and a 6-step LR x 50 spike from step 30 is rolled back. Before: a due capture was taken at the
    next step, monitored or not; an unmonitored one is never verified, and after the skip every capture fell on such
    steps (interval 5), so the rollback went back to step 5. Now a due capture waits for a monitored step: the
    rollback restores a snapshot verified after the skip."""
    spike = "{kind: lr_scale, rank: -1, step: 30, steps: 6, scale: 50.0}"
    config = recovery_config(tmp_path, f"faults.injections=[{{kind: nan_loss, rank: 0, step: 10}}, {spike}]",
                             f"stats.interval={interval}", "detectors.loss_spike.warmup_steps=4")
    results = run_ranks(_run, 2, "ddp", config, 45)
    for result in results:
        recovery = result["summary"]["recovery"]
        assert recovery["rollbacks"] >= 1 and recovery["restored_from_memory"] >= 1, recovery
    decided = [e for e in events(tmp_path) if e["kind"] == "action" and e["detector"] in ("recovery", "non_finite")]
    assert any(e["action"] == "skip" and e["step"] == 10 for e in events(tmp_path)), decided
    rollbacks = [e for e in decided if e["action"] == "rollback"]
    assert rollbacks and 20 <= rollbacks[0]["values"]["target_step"] <= 30, rollbacks
    assert not [e for e in events(tmp_path) if e["detector"] == "rollback_failed"]


# ------------------------------------------------------------------ end to end: LR x 50 spike, healed

@pytest.mark.parametrize("backend", ["ddp", "fsdp", "zero2"])
def test_lr_spike_is_rolled_back_and_healed(tmp_path: Path, backend: str) -> None:
    steps, spike_at = 60, 25
    heal = "recovery.lr_recovery_steps=20"  # back to the scheduled rate 20 healthy steps after the rollback
    faulty = run_ranks(_run, 2, backend, recovery_config(tmp_path / "faulty", lr_spike(spike_at), heal), steps)
    clean = run_ranks(_run, 2, backend, recovery_config(tmp_path / "clean"), steps)
    unprotected = run_ranks(_run, 2, backend, make_config(tmp_path / "off", lr_spike(spike_at),
                                                         "detectors.loss_spike.enabled=false"), steps)
    for rank in range(2):
        assert faulty[rank]["summary"]["recovery"]["rollbacks"] == 1
        assert faulty[rank]["eval_loss"] == pytest.approx(clean[rank]["eval_loss"], rel=0.05)
        # the fault does real damage when nothing intervenes
        assert unprotected[rank]["eval_loss"] > clean[rank]["eval_loss"] * 1.05
    found = events(tmp_path / "faulty")
    spike = [e for e in found if e["detector"] == "loss_spike"]
    assert spike and spike[0]["action"] == "rollback" and spike[0]["iteration"] == spike_at + 1
    rollback = next(e for e in found if e["detector"] == "recovery")
    assert rollback["values"]["target_step"] == 25 and rollback["values"]["lr_factor"] == 0.5
    assert rollback["values"]["data_position"] == spike_at + 2  # the failing batch is skipped


# ------------------------------------------------------------------ a NaN burst: one transaction, on every backend

NAN_AT, NAN_STEPS = 8, 3  # a NaN gradient on rank 1 at attempts 8, 9, 10: two skips, then a rollback to step 7


def _nan_burst(rank: int, world: int, backend: str, config: ArcConfig, steps: int) -> dict[str, Any]:
    """Train through the burst; also what every rank holds when the optimizer step (DeepSpeed's ``engine.step()``)
    that decided the rollback returns."""
    job, data = make_job(backend, config, rank, world)
    step_and_return, returned = job.backward_and_step, {}

    def stepping(loss: torch.Tensor) -> None:
        rollbacks = job.arc.progress.rolled_back
        step_and_return(loss)
        if job.arc.progress.rolled_back > rollbacks and not returned:
            returned.update(step=job.arc.progress.step, data_position=job.arc.progress.data_position,
                            params=[p.clone() for p in job.params()])

    job.backward_and_step = stepping
    result = train(job, data, rank, steps, record_at=NAN_AT - 1)
    return {**result, "returned": returned}


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "zero1", "zero2", "zero3"])
def test_a_nan_burst_is_rolled_back_in_one_transaction_and_training_goes_on(tmp_path: Path, backend: str) -> None:
    """NaN gradients on one rank for three attempts, two skips allowed: the third attempt rolls back to the snapshot
    of step 7, and when the optimizer step that decided it returns every rank already holds that snapshot's
    parameters bitwise with the step counter and data position rewound (under DeepSpeed its own step counter too,
    so none of its overflow skips is closed twice); training then reaches its step target with equal, finite
    replicas, and the NaN steps are the only non-finite findings."""
    steps = 16
    kind = "nan_loss" if backend == "fsdp" else "nan_grad"  # (FSDP2's sharded parameters fire no tensor hooks)
    config = recovery_config(tmp_path / "burst", "recovery.checkpoint_freq=1", "policy.max_consecutive_skips=2",
                             f"faults.injections=[{{kind: {kind}, rank: 1, step: {NAN_AT}, steps: {NAN_STEPS}}}]")
    results = run_ranks(_nan_burst, 2, backend, config, steps, timeout_s=280)
    found = events(tmp_path / "burst")
    rollback = next(e for e in found if e["detector"] == "recovery" and e["action"] == "rollback")
    assert rollback["values"]["target_step"] == NAN_AT - 1 and rollback["step"] == NAN_AT + NAN_STEPS - 1, rollback
    nonfinite = {e["step"] for e in found if e["detector"] in ("non_finite", "deepspeed_overflow")}
    assert nonfinite == set(range(NAN_AT, NAN_AT + NAN_STEPS)), sorted(nonfinite)
    for rank in range(2):
        result = results[rank]
        assert "aborted_at" not in result, result
        returned = result["returned"]
        assert returned["step"] == NAN_AT - 1 and returned["data_position"] == NAN_AT + NAN_STEPS, returned
        for restored, snapshot in zip(returned["params"], result["params_at"], strict=True):
            assert torch.equal(restored, snapshot)
        assert result["summary"]["recovery"]["rollbacks"] == 1 and result["summary"]["steps"] == steps
        assert all(torch.isfinite(p).all() for p in result["params"])
    if backend not in ("fsdp", "zero3"):  # (there the parameters compared are each rank's own shards)
        for mine, theirs in zip(results[0]["params"], results[1]["params"], strict=True):
            assert torch.equal(mine, theirs)


# ------------------------------------------------------------------ forwards between steps

def _probed(rank: int, world: int, config: ArcConfig, steps: int, probe: bool) -> dict[str, Any]:
    """Train under DDP; with ``probe``, rank 0 alone runs a forward without gradients (an evaluation, a generation
    in a callback) before every step attempt, on the module inside DDP, counting the collectives it issues."""
    job, data = make_job("ddp", config, rank, world)
    inner, counts = job.forward.module, []

    def at_step_start(arc: Any) -> None:
        if probe and rank == 0:
            def forward() -> None:
                with torch.no_grad():
                    inner(*data.batch(50_000 + arc.progress.step, rank, BATCH))
            counts.append(count_c10d_ops(forward))

    result = train(job, data, rank, steps, at_step_start=at_step_start)
    return {**result, "counts": counts}


def test_a_forward_between_steps_on_one_rank_opens_no_step_and_changes_nothing(tmp_path: Path) -> None:
    """A forward without gradients between steps is not a step: on rank 0 only, before every attempt (snapshot
    captures due, the first one sizing the ring collectively, and a rolled-back spike among them) it issues no
    collective, and the run ends bitwise where the same run without those forwards ends, with the same decisions."""
    steps, spike = 16, lr_spike(9)
    probed = run_ranks(_probed, 2, recovery_config(tmp_path / "probed", spike), steps, True)
    plain = run_ranks(_probed, 2, recovery_config(tmp_path / "plain", spike), steps, False)
    assert len(probed[0]["counts"]) == probed[0]["iterations"] > steps  # (the rollback repeats attempts)
    assert set(probed[0]["counts"]) == {0}, probed[0]["counts"]
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(probed[rank]["params"], plain[rank]["params"], strict=True))
        assert probed[rank]["summary"]["recovery"]["rollbacks"] == plain[rank]["summary"]["recovery"]["rollbacks"] == 1
    assert [e["action"] for e in events(tmp_path / "probed") if e["kind"] == "action"] == \
        [e["action"] for e in events(tmp_path / "plain") if e["kind"] == "action"]


# ------------------------------------------------------------------ persistent fault: escape, then a clean stop

def test_persistent_fault_escapes_then_stops_with_exit_code_4(tmp_path: Path) -> None:
    fault = "faults.injections=[{kind: loss_scale, rank: -1, step: 12, steps: 100000, scale: 50.0}]"
    config = recovery_config(tmp_path, fault, "recovery.max_consecutive_rollbacks=2", "recovery.max_escapes=1")
    results = run_ranks(_run, 2, "ddp", config, 60)
    assert {r["exit_code"] for r in results} == {arc_engine.EXIT_RECOVERY_EXHAUSTED}
    assert len({r["aborted_at"] for r in results}) == 1  # every rank stops at the same step
    # 2 rollbacks, an escape, 2 rollbacks, then the stop: one failing attempt each, bounded
    assert all(r["iterations"] <= 12 + 6 for r in results)
    assert "recovery exhausted" in results[0]["message"]
    actions = [e["action"] for e in events(tmp_path) if e["kind"] == "action" and e["detector"] == "recovery"]
    assert actions == ["rollback", "rollback", "escape", "rollback", "rollback"]


# ------------------------------------------------------------------ resume after a restart

def _resume_run(rank: int, world: int, backend: str, config: ArcConfig, steps: int,
                draw_before_forward: bool = False) -> dict[str, Any]:
    job, data = make_job(backend, config, rank, world)
    resumed_at = job.arc.progress.step
    out = train(job, data, rank, steps, draw_before_forward=draw_before_forward)
    out["resumed_at"] = resumed_at
    return out


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "zero2"])
def test_relaunched_job_resumes_from_the_newest_committed_checkpoint(tmp_path: Path, backend: str) -> None:
    disk = ["recovery.checkpoint.every_steps=5", f"recovery.checkpoint.dir={tmp_path / 'ckpt'}"]
    first = run_ranks(_resume_run, 2, backend, recovery_config(tmp_path / "a", *disk), 18)  # "crashes" at 18
    assert first[0]["resumed_at"] == 0
    second = run_ranks(_resume_run, 2, backend, recovery_config(tmp_path / "b", *disk), 25)
    straight = run_ranks(_resume_run, 2, backend, recovery_config(tmp_path / "c"), 25)
    for rank in range(2):
        assert second[rank]["resumed_at"] == 15  # newest committed, verified-stable checkpoint
        assert all(torch.equal(a, b) for a, b in zip(second[rank]["params"], straight[rank]["params"], strict=True))


@pytest.mark.parametrize("backend", ["ddp", "zero2"])
def test_resume_is_bitwise_when_the_loop_draws_random_numbers_before_its_forward(tmp_path: Path,
                                                                                 backend: str) -> None:
    """The snapshot records the RNG at the end of the previous step (what the data position stands for), not at
    the forward: a loop that draws before its forward resumes on the same draws. The step attempt counter
    (``iteration``) is the snapshot's too."""
    disk = ["recovery.checkpoint.every_steps=5", f"recovery.checkpoint.dir={tmp_path / 'ckpt'}"]
    run_ranks(_resume_run, 2, backend, recovery_config(tmp_path / "a", *disk), 18, True)  # "crashes" at 18
    second = run_ranks(_resume_run, 2, backend, recovery_config(tmp_path / "b", *disk), 25, True)
    straight = run_ranks(_resume_run, 2, backend, recovery_config(tmp_path / "c"), 25, True)
    for rank in range(2):
        assert second[rank]["resumed_at"] == 15
        assert all(torch.equal(a, b) for a, b in zip(second[rank]["params"], straight[rank]["params"], strict=True))
        assert second[rank]["summary"]["iterations"] == straight[rank]["summary"]["iterations"] == 25


def _resume_alone(rank: int, world: int, backend: str, config: ArcConfig) -> Any:
    try:
        job, _ = make_job(backend, config, rank, world)
    except ValueError as err:
        return str(err)
    return [p.clone() for p in job.params()], job.arc.progress.step


def test_world_size_change_reshards_ddp_and_fsdp_and_refuses_zero(tmp_path: Path) -> None:
    for backend in ("ddp", "fsdp", "zero2"):
        disk = ["recovery.checkpoint.every_steps=5", f"recovery.checkpoint.dir={tmp_path / backend}"]
        saved = run_ranks(_run, 2, backend, recovery_config(tmp_path / f"{backend}-a", *disk), 11, 10)
        alone = run_ranks(_resume_alone, 1, backend, recovery_config(tmp_path / f"{backend}-b", *disk))[0]
        if backend != "zero2":
            params, step = alone
            assert step == 10
            expected = saved[0]["params_at"]
            if backend == "fsdp":  # one rank now holds whole tensors: the two ranks' dim-0 shards, concatenated
                expected = [torch.cat([a, b]) for a, b in zip(saved[0]["params_at"], saved[1]["params_at"],
                                                               strict=True)]
            assert all(torch.equal(a, b) for a, b in zip(params, expected, strict=True))
        else:
            assert "written by 2 ranks; this job has 1" in alone and "cannot be resharded" in alone



def _attach_with_local_dir(rank: int, world: int, run_dir: Path) -> str:
    config = recovery_config(run_dir / f"node{rank}", "recovery.checkpoint.every_steps=5")  # not shared
    try:
        ddp_job(config)
    except ValueError as err:
        return str(err)
    return "attached"


def test_a_checkpoint_dir_not_shared_by_every_rank_is_refused(tmp_path: Path) -> None:
    messages = run_ranks(_attach_with_local_dir, 2, tmp_path)
    assert all("is not shared: ranks [1]" in m for m in messages), messages


# ------------------------------------------------------------------ checkpoint I/O failures are events

def _attach_and_train(rank: int, world: int, config: ArcConfig, steps: int, fail_checksum_at: int | None = None,
                      failing_rank: int = 1) -> Any:
    """A DDP job for ``steps`` steps; ``fail_checksum_at``: on ``failing_rank``, the checksum of that step's shard
    raises (a disk error in the middle of a save: DCP has written its shards, the rank cannot report them), and the
    other ranks report that save a second late."""
    if fail_checksum_at is not None:
        import arc_engine.recovery.checkpoint as checkpoint

        original = checkpoint.file_checksum

        def failing(path: Path) -> Any:
            if f"step_{fail_checksum_at:08d}" in str(path):
                if rank == failing_rank:
                    raise OSError(28, "No space left on device", str(path))
                time.sleep(1.0)
            return original(path)

        checkpoint.file_checksum = failing
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            job, data = make_job("ddp", config, rank, world)
    except SystemExit as exit:  # a job that cannot start: exit code 2, one line on the first rank
        return {"exit_code": exit.code, "stderr": stderr.getvalue()}
    return train(job, data, rank, steps)["summary"]


def test_an_unwritable_checkpoint_dir_is_one_clear_error_or_with_continue_an_event(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    disk = ["recovery.checkpoint.every_steps=5", f"recovery.checkpoint.dir={blocker / 'ckpt'}"]
    ended = run_ranks(_attach_and_train, 2, recovery_config(tmp_path / "a", *disk), 8)
    assert [e["exit_code"] for e in ended] == [2, 2], ended  # every rank ends, with the bad-config code
    line = ended[0]["stderr"]
    assert line.startswith("arc_engine: cannot start: recovery.checkpoint.dir") and "is not writable" in line, line
    assert line.count("\n") == 1 and "on_error: continue" in line and ended[1]["stderr"] == "", ended
    setup = [e for e in events(tmp_path / "a") if e.get("action") == "setup_failed"]
    assert setup and setup[0]["severity"] == "error" and setup[0]["values"]["exit_code"] == 2, setup
    summaries = run_ranks(_attach_and_train, 2, recovery_config(tmp_path / "b", *disk,
                                                                "recovery.checkpoint.on_error=continue"), 8)
    assert all(s["steps"] == 8 and s["recovery"]["checkpoint_saves"] == {} for s in summaries)
    disabled = [e for e in events(tmp_path / "b") if e.get("action") == "checkpoint_disabled"]
    assert disabled and disabled[0]["severity"] == "error" and "not writable" in disabled[0]["message"]


@contextlib.contextmanager
def full_disk(path: Path, size: str = "32k") -> Any:
    """A filesystem of ``size`` mounted at ``path`` (a tmpfs, where this process may mount one: root with
    CAP_SYS_ADMIN): True. Elsewhere an empty folder, and False: the ranks then inject ENOSPC themselves."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, check=False).returncode == 0 if shutil.which("mount") else False
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill_the_disk_unless(mounted: bool) -> None:
    """In a rank: where :func:`full_disk` could mount no small filesystem, every small file a save writes into a
    checkpoint's directory fails as on a full disk (ENOSPC)."""
    if mounted:
        return
    from arc_engine.recovery import commit

    write_atomic = commit.write_atomic

    def no_space(path: Path, payload: bytes) -> None:
        if "step_" in str(path):
            raise OSError(28, "No space left on device", str(path))
        write_atomic(path, payload)

    commit.write_atomic = no_space


def _on_a_full_disk(rank: int, world: int, backend: str, config: ArcConfig, steps: int, mounted: bool) -> Any:
    fill_the_disk_unless(mounted)
    return _run(rank, world, backend, config, steps)


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "zero2"])
def test_a_full_disk_is_an_event_per_save_and_training_goes_on(tmp_path: Path, backend: str) -> None:
    """The checkpoint directory on a 32 KB filesystem: every save fails with ENOSPC. Before: a rank that could not
    write its report left rank 0 waiting for it until the save's deadline (600 s), the next save waited for that
    one, and the job hung, its event log holding only the start event, the failed step's files left behind. Now a
    report that cannot be written goes through the job's store: each save fails at once as an event on every rank,
    its files are removed, and training runs to the end."""
    ckpt = tmp_path / "small"
    with full_disk(ckpt) as mounted:
        config = recovery_config(tmp_path, "recovery.checkpoint.every_steps=5", f"recovery.checkpoint.dir={ckpt}",
                                 "recovery.memory_ring_mb=0")
        results = run_ranks(_on_a_full_disk, 2, backend, config, 25, mounted, timeout_s=240)
        left = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.name != ".arc_shared_probe")
    for result in results:
        assert result["summary"]["steps"] == 25
        assert result["summary"]["recovery"]["checkpoint_saves"]["failed"] >= 3, result["summary"]["recovery"]
    failed = [e for e in events(tmp_path) if e.get("action") == "checkpoint_failed"]
    assert sorted({e["values"]["step"] for e in failed}) >= [5, 10, 15], failed  # (20: drained at close)
    assert all("No space left on device" in e["message"] for e in failed), failed[0]["message"]
    assert left in ([], ["latest"]), left  # every failed save's files removed, no temporary file left


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_a_save_failing_mid_run_is_an_event_counted_and_cleaned_up(tmp_path: Path, failing_rank: int) -> None:
    ckpt = tmp_path / "ckpt"
    disk = ["recovery.checkpoint.every_steps=5", f"recovery.checkpoint.dir={ckpt}"]
    # 13 steps: no commit after the failed save, whose retention pass would hide a leftover of it
    summaries = run_ranks(_attach_and_train, 2, recovery_config(tmp_path / "a", *disk), 13, 10, failing_rank)
    # (the summaries are taken before close drains the save of step 10: the events below come after it)
    assert [s["recovery"]["checkpoint_saves"]["started"] for s in summaries] == [2, 2], summaries
    # the partial shards and every rank's report are gone, the late rank's too
    assert not (ckpt / "step_00000010").exists(), sorted(p.name for p in (ckpt / "step_00000010").iterdir())
    assert (ckpt / "step_00000005" / "COMMITTED.json").exists()
    failed = [e for e in events(tmp_path / "a") if e.get("action") == "checkpoint_failed"]
    assert failed and failed[0]["severity"] == "error" and failed[0]["values"]["step"] == 10
    assert "No space left on device" in failed[0]["message"] and "its files were removed" in failed[0]["message"]


def test_a_fallback_at_resume_is_an_event_naming_the_skipped_checkpoint(tmp_path: Path) -> None:
    disk = ["recovery.checkpoint.every_steps=5", f"recovery.checkpoint.dir={tmp_path / 'ckpt'}"]
    run_ranks(_resume_run, 2, "ddp", recovery_config(tmp_path / "a", *disk), 18)  # commits 5, 10, 15
    shard = sorted((tmp_path / "ckpt" / "step_00000015").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated on disk
    second = run_ranks(_resume_run, 2, "ddp", recovery_config(tmp_path / "b", *disk), 12)
    assert [r["resumed_at"] for r in second] == [10, 10]
    found = events(tmp_path / "b")
    fallback = [e for e in found if e.get("action") == "checkpoint_fallback"]
    assert fallback and fallback[0]["severity"] == "error" and fallback[0]["values"]["step"] == 15
    assert shard.name in fallback[0]["message"]
    resume = next(e for e in found if e["detector"] == "resume")
    assert resume["values"]["step"] == 10 and any(shard.name in problem for problem in resume["values"]["skipped"])

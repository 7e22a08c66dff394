"""The Hugging Face Trainer with arc_engine's one callback (``examples/hf_trainer.py``), on 2 real gloo ranks under
torchrun, with DDP and DeepSpeed ZeRO-1, 2 and 3: faults injected at (rank, step), then the Trainer's own counters,
LR schedule, logs and parameters are checked against what arc_engine decided, on every rank."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from arc_engine.data_ledger import DataLedger
from tests.trainer_runs import (
    PERSISTENT_FAULT,
    assert_stopped_at_step_3_with_exit_code_3,
    decisions,
    run_example,
)

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = {"ddp": ((), "DDP"),
              "zero1": (("--deepspeed", str(ROOT / "examples" / "ds_zero1.json")), "DeepSpeed ZeRO-1"),
              "zero2": (("--deepspeed", str(ROOT / "examples" / "ds_zero2.json")), "DeepSpeed ZeRO-2"),
              "zero3": (("--deepspeed", str(ROOT / "examples" / "ds_zero3.json")), "DeepSpeed ZeRO-3"),
              # the common HF DeepSpeed configs: the optimizer and the LR scheduler in the DeepSpeed config
              "zero2-sections": (("--deepspeed", str(ROOT / "examples" / "ds_zero2_scheduler.json")),
                                 "DeepSpeed ZeRO-2")}
STEPS = 10
NAN_STEP, SPIKE_STEP = 3, 6  # arc_engine's steps (0-based attempts)
FAULTS = (f"--arc.faults.injections=[{{kind: nan_loss, rank: 0, step: {NAN_STEP}}}, "
          f"{{kind: loss_scale, rank: -1, step: {SPIKE_STEP}, scale: 30.0}}]")
RECOVERY = ("--arc.recovery.enabled=true", "--arc.recovery.checkpoint_freq=1",
            "--arc.detectors.loss_spike.action=rollback", "--arc.detectors.loss_spike.warmup_steps=3")


def _train(tmp_path: Path, name: str, *args: str, expect: int = 0) -> dict[str, Any]:
    return run_example(tmp_path, "hf_trainer.py", name, STEPS, *args, expect=expect)


def _train_logs(outcome: dict) -> list[dict]:
    return [entry for entry in outcome["log_history"] if "loss" in entry]


def _clean_learning_rates(steps: int, lr: float = 3e-3) -> dict[int, float]:
    """The learning rate a clean run's Trainer logs at each global step: its cosine schedule without warm-up over
    ``steps`` (``examples/hf_trainer.py``, ``--lr`` 3e-3), built by transformers' own ``get_scheduler``; the Trainer
    logs global step g with the rate that step trained at, before its scheduler steps (a clean run launched for it
    gives the same numbers, at two more processes per framework)."""
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=0, num_training_steps=steps)
    rates = {}
    for step in range(1, steps + 1):
        rates[step] = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("framework", ["ddp", "zero2"])
def test_clean_training_is_bitwise_unchanged_by_the_callback(tmp_path: Path, framework: str) -> None:
    extra, adapter = FRAMEWORKS[framework]
    plain = _train(tmp_path, "plain", "--no-arc", "--grad-accum", "2", *extra)
    watched = _train(tmp_path, "arc", "--grad-accum", "2", "--arc.sinks.metrics_interval=1", *extra)
    for rank in range(2):
        assert watched["ranks"][rank]["adapter"] == adapter
        assert torch.equal(plain["ranks"][rank]["params"], watched["ranks"][rank]["params"]), rank
        assert watched["ranks"][rank]["global_step"] == plain["ranks"][rank]["global_step"] == STEPS
    assert torch.equal(watched["ranks"][0]["params"], watched["ranks"][1]["params"])
    # under gradient accumulation (2 micro-batches a step) the loss arc_engine judged is the loss the Trainer
    # logged: the mean over ranks of each step's mean micro-batch loss (not divided by the accumulation steps)
    logs = _train_logs(watched["ranks"][0])
    assert len(logs) == STEPS and all(entry["arc_steps_not_applied"] == 0 for entry in logs)
    metrics = watched["dir"] / "run" / "metrics.jsonl.rank0"
    judged = {int(m["step"]): m["arc/loss_spike/loss"] for m in map(json.loads, metrics.read_text().splitlines())
              if "arc/loss_spike/loss" in m}
    assert all(math.isclose(judged[entry["step"] - 1], entry["loss"], rel_tol=1e-4) for entry in logs), \
        (judged, [entry["loss"] for entry in logs])


@pytest.mark.parametrize("framework", ["ddp", "zero1", "zero2", "zero3"])
def test_a_nan_is_skipped_and_a_spike_rolled_back_with_the_trainers_counters_true(tmp_path: Path,
                                                                                 framework: str) -> None:
    """A NaN loss on rank 0 at step 3 is skipped and a 30x loss spike at step 6 rolled back (memory snapshot of
    step 5), on both ranks alike. The Trainer's global_step counts applied steps only (it reaches max_steps after
    STEPS + 2 attempts), its scheduler stepped once per applied step, every logged loss is finite and the learning
    rate it logs at each global step is a clean run's at that step (the cosine never rises), and both ranks end
    with the same finite parameters."""
    extra, adapter = FRAMEWORKS[framework]
    faulted = _train(tmp_path, "faulted", FAULTS, *RECOVERY, *extra)
    assert decisions(faulted["events"][0]) == decisions(faulted["events"][1]), "ranks disagree"
    decided = {(step, detector, action) for step, detector, action in decisions(faulted["events"][0])}
    assert (NAN_STEP, "non_finite", "skip") in decided and (SPIKE_STEP, "loss_spike", "rollback") in decided
    rollback = next(e for e in faulted["events"][0] if e["detector"] == "recovery" and e["action"] == "rollback")
    assert rollback["values"]["target_step"] == SPIKE_STEP - 1 and "cannot seek" in rollback["message"]
    summary = next(e for e in faulted["events"][0] if e["kind"] == "lifecycle" and e["detector"] == "summary")
    clean_lr = _clean_learning_rates(STEPS)
    for rank in range(2):
        outcome = faulted["ranks"][rank]
        assert outcome["adapter"] == adapter
        assert outcome["global_step"] == STEPS and outcome["scheduler_last_epoch"] == STEPS, rank
        logs = _train_logs(outcome)
        assert all(math.isfinite(entry["loss"]) and entry["loss"] < 10 for entry in logs), logs
        assert all(entry["learning_rate"] == clean_lr[entry["step"]] for entry in logs), logs
        assert logs[-1]["arc_steps_not_applied"] == 2 and logs[-1]["arc_rolled_back"] == 1, logs[-1]
        assert logs[-1]["arc_applied_steps"] == STEPS
        assert torch.isfinite(outcome["params"]).all()
    assert torch.equal(faulted["ranks"][0]["params"], faulted["ranks"][1]["params"])
    assert summary["values"]["steps"] == STEPS + 1  # arc's step: the rolled-back attempt was rewound


def test_a_persistent_fault_stops_every_rank_with_the_documented_exit_code(tmp_path: Path) -> None:
    """NaN losses on rank 1 at steps 2 and 3, one skip allowed: every rank decides to stop at step 3, the first rank
    to exit does so with exit code 3 (torchrun then ends the others and exits 1 itself), and the Trainer, saving
    every step, saves the two applied steps only (nothing for the skip or the stop). A relaunch from the last
    checkpoint, the fault gone, trains on from its step to max_steps."""
    stopped = _train(tmp_path, "stopped", *PERSISTENT_FAULT, "--save-steps", "1", expect=1)
    assert_stopped_at_step_3_with_exit_code_3(stopped)
    saved = sorted(path.name for path in (tmp_path / "stopped" / "trainer").glob("checkpoint-*"))
    assert saved == ["checkpoint-1", "checkpoint-2"], saved
    resumed = _train(tmp_path, "resumed", "--resume-from", str(tmp_path / "stopped" / "trainer" / "checkpoint-2"))
    for rank in range(2):
        outcome = resumed["ranks"][rank]
        assert outcome["global_step"] == STEPS and outcome["scheduler_last_epoch"] == STEPS, rank
        # the history checkpoint-2 carried (steps 1, 2), then the resumed steps: each step logged once
        assert [entry["step"] for entry in _train_logs(outcome)] == list(range(1, STEPS + 1)), rank


SAVE_STEPS, BURST = 4, (5, 3)  # a NaN gradient on rank 1 at attempts 5, 6 and 7
NAN_BURST = (f"--arc.faults.injections=[{{kind: nan_grad, rank: 1, step: {BURST[0]}, steps: {BURST[1]}}}]",
             "--arc.recovery.enabled=true", "--arc.recovery.checkpoint_freq=1", "--arc.policy.max_consecutive_skips=2",
             "--save-steps", str(SAVE_STEPS), "--logging-steps", "2", "--eval-steps", str(SAVE_STEPS),
             "--generate-steps", "2")


@pytest.mark.parametrize("framework", ["ddp", "zero2", "zero2-sections"])
def test_a_nan_burst_rolls_back_onto_a_save_step_and_trains_on_without_saving_the_rejected_state(
        tmp_path: Path, framework: str) -> None:
    """A NaN gradient on rank 1 for three attempts, two skips allowed: the third rolls back to a verified snapshot
    whose global step is a save step, and training goes on to max_steps (under DeepSpeed too: its own step counter
    and overflow skips are restored with the tensors, so no skip is counted twice). Every Trainer checkpoint on disk
    holds the weights the surviving run had at that global step (none of the rejected state), no global step is
    logged or evaluated twice (evaluation every 4 steps), and the healed learning rate is in the logs. Rank 0 alone
    generates from the model every 2 steps (no gradients, between steps): the run is the same."""
    extra, _ = FRAMEWORKS[framework]
    run = _train(tmp_path, "burst", *NAN_BURST, "--steps", "12", *extra)
    events = run["events"][0]
    assert decisions(events) == decisions(run["events"][1]), "ranks disagree"
    rollback = next(e for e in events if e["detector"] == "recovery" and e["action"] == "rollback")
    target = rollback["values"]["target_step"]
    assert target % SAVE_STEPS == 0 and rollback["step"] == sum(BURST) - 1, rollback
    # one finding per faulted attempt: DeepSpeed's own skips are not closed again after the rollback
    nonfinite = [e for e in events if e["detector"] in ("non_finite", "deepspeed_overflow")]
    assert {e["step"] for e in nonfinite} <= set(range(BURST[0], sum(BURST))), nonfinite
    assert len({e["step"] for e in nonfinite}) == BURST[1], nonfinite
    for rank in range(2):
        outcome = run["ranks"][rank]
        assert outcome is not None and outcome["global_step"] == 12, rank
        assert outcome["scheduler_last_epoch"] == 12, rank  # stepped once per applied step (DeepSpeed's own too)
        steps = [entry["step"] for entry in _train_logs(outcome)]
        assert steps == sorted(set(steps)), steps
        evaluated = [entry["step"] for entry in outcome["log_history"] if "eval_loss" in entry]
        assert evaluated == [4, 8, 12], evaluated  # not again at step 4 after the skips and the rollback
        assert (outcome["generations"] > 0) == (rank == 0), outcome["generations"]
        last = _train_logs(outcome)[-1]
        assert 0.5 <= last["arc_lr_factor"] < 1 and last["arc_rolled_back"] == 1, last  # healing: x 0.5, rising
    from safetensors.torch import load_file

    timeline = run["ranks"][0]["timeline"]
    saved = sorted(run["dir"].glob("trainer/checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    assert [int(path.name.split("-")[1]) for path in saved] == [4, 8, 12], saved
    for path in saved:
        written = load_file(str(path / "model.safetensors"))
        expected = timeline[int(path.name.split("-")[1])]
        assert len(written.keys() & expected.keys()) == len(expected), (sorted(written), sorted(expected))
        for name in expected:  # (DeepSpeed writes the tied lm_head too)
            assert torch.equal(written[name].float(), expected[name]), (path.name, name)


def test_a_relaunch_resumes_one_state_arc_engines_checkpoint_of_the_trainers_step_or_refuses(tmp_path: Path) -> None:
    """A run with the Trainer's checkpoints every step and arc_engine's disk checkpoints every 2 (it keeps those of
    steps 3, 5 and 7), a loss spike on the attempt after the step-4 save rolled back to step 3 (checkpoint-4
    removed, saved again when reached, every checkpoint the surviving run's weights). Relaunched without the
    Trainer's checkpoint while arc_engine has its own: every rank stops with exit code 2 before training, naming
    both steps and the flag. Relaunched from the Trainer's checkpoint-5: arc_engine takes its own checkpoint of step
    5 (not its newest), removes the newer one, and the run goes on from one state to max_steps. With the flag
    (``recovery.checkpoint.resume=false``) a relaunch from checkpoint-4 resumes the Trainer's state alone."""
    disk = ("--arc.recovery.enabled=true", "--arc.recovery.checkpoint_freq=1",
            "--arc.recovery.checkpoint.every_steps=2", "--save-steps", "1", "--data-steps", "12")
    first = _train(tmp_path, "resume", *disk, "--steps", "8", "--arc.detectors.loss_spike.action=rollback",
                   "--arc.detectors.loss_spike.warmup_steps=3",
                   "--arc.faults.injections=[{kind: loss_scale, rank: -1, step: 4, scale: 30.0}]")
    assert first["ranks"][0]["global_step"] == 8
    # the spike on the attempt after the step-4 save rolls back to step 3: checkpoint-4 held the undone state
    assert (4, "loss_spike", "rollback") in set(decisions(first["events"][0]))
    removed = [e for e in first["events"][0] if e["kind"] == "lifecycle" and e["detector"] == "checkpoints_removed"]
    assert [Path(p).name for e in removed for p in e["values"]["paths"]] == ["checkpoint-4"], removed
    from safetensors.torch import load_file

    for step in range(1, 9):  # (checkpoint-4 saved again when reached) the surviving run's weights
        written = load_file(str(first["dir"] / "trainer" / f"checkpoint-{step}" / "model.safetensors"))
        assert all(torch.equal(written[name].float(), tensor)
                   for name, tensor in first["ranks"][0]["timeline"][step].items()), step
    first_batches = [{position: tokens for position, _, tokens in first["ranks"][rank]["batches"]}
                     for rank in range(2)]
    assert sorted(first_batches[0]) == list(range(10))  # 10 attempts (two rolled back): 10 batches
    # the Trainer's newest checkpoint-8 is newer than arc_engine's newest (step 7): the Trainer's state, one event
    newer = _train(tmp_path, "resume", *disk, "--steps", "9", "--resume-from",
                   str(first["dir"] / "trainer" / "checkpoint-8"))
    chosen = [e for e in newer["events"][0] if e["kind"] == "lifecycle" and e["detector"] == "resume_agreed"]
    assert [(e["values"]["chosen"], e["values"]["arc_engine_step"], e["values"]["data_position"])
            for e in chosen] == [("trainer", 7, 8)], chosen
    assert not [e for e in newer["events"][0] if e["kind"] == "lifecycle" and e["detector"] == "resume"]
    for rank in range(2):
        assert newer["ranks"][rank]["global_step"] == 9, rank
        # data position 8 is the batch the first run read at its position 8 (the Trainer's resumed loader)
        assert [(p, t) for p, _, t in newer["ranks"][rank]["batches"]] == [(8, first_batches[rank][8])], rank
    # bad data recorded at position 7 (as detectors.data records it): a resume from checkpoint-5 must skip the batch
    # the first run read there, not the one the Trainer's count of steps points at
    ledger = DataLedger()
    ledger.open(first["dir"] / "run" / "data_ledger.jsonl")
    ledger.record(first=7, step=7, iteration=7, action="skip", bad_data=True, ranks=[1], detectors=["data"],
                  reason="bad data on rank 1 (test)")
    refused = _train(tmp_path, "resume", *disk, "--steps", "12", expect=1)
    output = refused["output"]
    assert "two resumes disagree" in output and "the Trainer (resume_from_checkpoint) starts from step 0" in output, \
        output[-3000:]
    assert "--arc.recovery.checkpoint.resume=false" in output
    assert re.search(r"Root Cause.*?exitcode\s*:\s*2 ", output, re.S), output[-3000:]
    agreed = _train(tmp_path, "resume", *disk, "--steps", "12", "--resume-from",
                    str(first["dir"] / "trainer" / "checkpoint-5"))
    lifecycle = {e["detector"]: e for e in agreed["events"][0] if e["kind"] == "lifecycle"}
    assert lifecycle["resume_agreed"]["values"] == {"step": 5, "chosen": "both", "arc_engine_step": 5,
                                                    "data_position": 5}, lifecycle
    discarded = [Path(path).name for path in lifecycle["checkpoints_discarded"]["values"]["paths"]]
    assert discarded[0] == "step_00000007", discarded  # the first run's commits past step 5 (and the relaunch's)
    skipped = [e["values"]["data_position"] for e in agreed["events"][0]
               if e["kind"] == "detection" and e["detector"] == "data_ledger"]
    assert skipped == [7], skipped
    for rank in range(2):
        outcome = agreed["ranks"][rank]
        assert outcome["global_step"] == 12 and outcome["scheduler_last_epoch"] == 12, rank
        seen = {position: tokens for position, _, tokens in outcome["batches"]}
        assert sorted(seen) == list(range(5, 13)), sorted(seen)  # 8 attempts, one skipped: 7 applied
        assert all(seen[position] == first_batches[rank][position] for position in range(5, 10)), rank
    # the flag the refusal names: arc_engine's checkpoints left alone, the Trainer's checkpoint-4 resumed
    picked = _train(tmp_path, "resume", *disk, "--steps", "12", "--resume-from",
                    str(first["dir"] / "trainer" / "checkpoint-4"), "--arc.recovery.checkpoint.resume=false")
    def resumes(run: dict) -> list[dict]:  # (the run directory's event log holds every launch's events)
        return [e for e in run["events"][0] if e["kind"] == "lifecycle" and e["detector"].startswith("resume")]

    assert resumes(picked) == resumes(agreed)  # none more
    for rank in range(2):
        assert picked["ranks"][rank]["global_step"] == 12, rank

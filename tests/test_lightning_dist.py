"""PyTorch Lightning with arc_engine's one callback (``examples/lightning_trainer.py``), on 2 real gloo ranks under
torchrun with the DDP strategy (Lightning runs DeepSpeed on CUDA GPUs only): faults injected at (rank, step), then
Lightning's step counter, LR schedule and parameters are checked against what arc_engine decided, on every rank."""

from __future__ import annotations

import csv
import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer_runs import (
    PERSISTENT_FAULT,
    assert_stopped_at_step_3_with_exit_code_3,
    decisions,
    run_example,
)

pytest.importorskip("lightning")
pytestmark = pytest.mark.timeout(600)

STEPS = 10
NAN_STEP, SPIKE_STEP = 3, 6


def _train(tmp_path: Path, name: str, *args: str, expect: int = 0) -> dict[str, Any]:
    return run_example(tmp_path, "lightning_trainer.py", name, STEPS, *args, expect=expect)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_clean_training_is_bitwise_unchanged_by_the_callback(tmp_path: Path, precision: str) -> None:
    """fp32, and fp16 autocast with Lightning's GradScaler (on CPU ranks too): parameters and the learning rate of
    every step bitwise as without the callback."""
    plain = _train(tmp_path, "plain", "--no-arc", "--precision", precision)
    watched = _train(tmp_path, "arc", "--precision", precision)
    for rank in range(2):
        assert watched["ranks"][rank]["adapter"] == "DDP"
        assert torch.equal(plain["ranks"][rank]["params"], watched["ranks"][rank]["params"]), rank
        assert watched["ranks"][rank]["global_step"] == plain["ranks"][rank]["global_step"] == STEPS
        assert watched["ranks"][rank]["lrs"] == plain["ranks"][rank]["lrs"]
    assert torch.equal(watched["ranks"][0]["params"], watched["ranks"][1]["params"])


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_a_nan_is_skipped_and_a_spike_rolled_back_with_lightnings_counters_true(tmp_path: Path,
                                                                                precision: str) -> None:
    """A NaN loss on rank 0 at step 3 is skipped and a 30x loss spike at step 6 rolled back, on both ranks alike;
    Lightning's global_step reaches max_steps counting applied steps only, its scheduler stepped once per applied
    step, the learning rate never rises (the step after the skip reuses it; the rollback cuts it), and both ranks
    end with the same finite parameters."""
    faults = (f"--arc.faults.injections=[{{kind: nan_loss, rank: 0, step: {NAN_STEP}}}, "
              f"{{kind: loss_scale, rank: -1, step: {SPIKE_STEP}, scale: 30.0}}]")
    faulted = _train(tmp_path, "faulted", faults, "--arc.recovery.enabled=true", "--arc.recovery.checkpoint_freq=1",
                     "--arc.detectors.loss_spike.action=rollback", "--arc.detectors.loss_spike.warmup_steps=3",
                     "--precision", precision, "--csv-log", str(tmp_path / "csv"))
    assert decisions(faulted["events"][0]) == decisions(faulted["events"][1]), "ranks disagree"
    decided = set(decisions(faulted["events"][0]))
    assert (NAN_STEP, "non_finite", "skip") in decided and (SPIKE_STEP, "loss_spike", "rollback") in decided
    for rank in range(2):
        outcome = faulted["ranks"][rank]
        assert outcome["global_step"] == STEPS and outcome["scheduler_last_epoch"] == STEPS, rank
        lrs = outcome["lrs"]
        assert len(lrs) == STEPS + 3  # the skip, the rolled-back step, the step the rollback undid
        assert all(later <= earlier for earlier, later in itertools.pairwise(lrs)), lrs
        assert lrs[NAN_STEP + 1] == lrs[NAN_STEP]  # no scheduler step for the skipped one
        assert torch.isfinite(outcome["params"]).all()
    assert torch.equal(faulted["ranks"][0]["params"], faulted["ranks"][1]["params"])
    # the CSVLogger's rows are numbered by applied steps (the last is the last applied step's, not 3 batches later),
    # one row per applied step: none for the skip or the rolled-back attempt, the step the rollback undid twice
    with (tmp_path / "csv" / "metrics.csv").open() as rows:
        steps = [int(row["step"]) for row in csv.DictReader(rows) if row.get("train_loss")]
    assert max(steps) == steps[-1] == STEPS - 1 and len(steps) == STEPS + 1, steps
    assert sorted(set(steps)) == list(range(STEPS)), steps


def test_an_epoch_scheduler_steps_once_per_epoch_when_the_epochs_last_batch_is_skipped(tmp_path: Path) -> None:
    """Epochs of 4 batches, an LR that halves at every epoch end, a NaN skipped on the first epoch's last batch:
    the scheduler still steps at that epoch's end (it follows epochs, not applied steps): the 11 batches of 10
    applied steps make two whole epochs and part of a third (which max_steps ends, with no epoch-end step), so it
    stepped twice and the third epoch trains at a quarter of the first's LR, on both ranks."""
    skipped = _train(tmp_path, "epochs", "--arc.faults.injections=[{kind: nan_loss, rank: 0, step: 3}]",
                     "--epoch-batches", "4", "--scheduler-interval", "epoch")
    assert (3, "non_finite", "skip") in set(decisions(skipped["events"][0]))
    for rank in range(2):
        outcome = skipped["ranks"][rank]
        assert outcome["global_step"] == STEPS, outcome["global_step"]
        assert outcome["scheduler_last_epoch"] == 2, outcome["scheduler_last_epoch"]
        assert outcome["lrs"] == [3e-3] * 4 + [1.5e-3] * 4 + [7.5e-4] * 3, outcome["lrs"]


def test_a_persistent_fault_stops_every_rank_with_the_documented_exit_code(tmp_path: Path) -> None:
    """A stop with ``min_steps`` beyond it, validation after every batch and a ModelCheckpoint every step: every
    rank ends with exit code 3, no traceback from the loop (min_steps does not hold it open); the checkpoints and
    validations are those of the applied steps 1 and 2 only (none for the skipped step, none after the stop)."""
    stopped = _train(tmp_path, "stopped", *PERSISTENT_FAULT, "--min-steps", str(STEPS), "--val-every", "1",
                     "--checkpoint-every", "1", "--checkpoint-dir", str(tmp_path / "ckpt"), "--csv-log",
                     str(tmp_path / "csv"), expect=1)
    assert_stopped_at_step_3_with_exit_code_3(stopped)
    assert 'lightning_trainer.py", line' not in stopped["output"], stopped["output"][-3000:]  # no rank's traceback
    assert sorted(path.name for path in (tmp_path / "ckpt").glob("*.ckpt")) == ["step=1.ckpt", "step=2.ckpt"]
    with (tmp_path / "csv" / "metrics.csv").open() as rows:
        validated = [int(row["step"]) for row in csv.DictReader(rows) if row.get("val_loss")]
    assert len(validated) == 2, validated


def test_a_relaunch_with_ckpt_path_resumes_arc_engines_checkpoint_of_that_step_or_refuses(tmp_path: Path) -> None:
    """A run with a ModelCheckpoint every 4 steps and arc_engine's disk checkpoints every 3, a loss spike at the
    attempt after the step-4 save rolled back to step 3 (the newest verified state): the rollback removes the
    step-4 file (it held the undone state) and the step is saved again when reached, so every checkpoint holds the
    surviving run's weights at its step. Relaunched without ``ckpt_path`` while arc_engine has its own checkpoints:
    every rank stops with exit code 2 before training, naming both steps and the flag. Relaunched with
    ``ckpt_path`` at step 4: arc_engine takes its own checkpoint of step 4 (not its newest) and the run goes on from
    one state to max_steps."""
    disk = ("--arc.recovery.enabled=true", "--arc.recovery.checkpoint_freq=1",
            "--arc.recovery.checkpoint.every_steps=3", "--arc.detectors.loss_spike.action=rollback",
            "--arc.detectors.loss_spike.warmup_steps=3", "--checkpoint-every", "4",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--data-steps", "16")
    first = _train(tmp_path, "resume", *disk, "--steps", "8",
                   "--arc.faults.injections=[{kind: loss_scale, rank: -1, step: 4, scale: 30.0}]")
    assert (4, "loss_spike", "rollback") in set(decisions(first["events"][0]))
    assert first["ranks"][0]["global_step"] == 8
    removed = [e for e in first["events"][0] if e["kind"] == "lifecycle" and e["detector"] == "checkpoints_removed"]
    assert [Path(p).name for e in removed for p in e["values"]["paths"]] == ["step=4.ckpt"], removed
    timeline = first["ranks"][0]["timeline"]
    saved = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert [path.name for path in saved] == ["step=4.ckpt", "step=8.ckpt"], saved
    for path in saved:
        written = torch.load(path, weights_only=False)
        expected = timeline[written["global_step"]]
        assert all(torch.equal(written["state_dict"][name], tensor) for name, tensor in expected.items()), path
    refused = _train(tmp_path, "resume", *disk, "--steps", "12", expect=1)
    output = refused["output"]
    assert "two resumes disagree" in output and "Lightning (ckpt_path) starts from step 0" in output, output[-3000:]
    assert "--arc.recovery.checkpoint.resume=false" in output
    assert re.search(r"Root Cause.*?exitcode\s*:\s*2 ", output, re.S), output[-3000:]
    agreed = _train(tmp_path, "resume", *disk, "--steps", "12", "--ckpt-path", str(tmp_path / "ckpt" / "step=4.ckpt"))
    lifecycle = {e["detector"]: e for e in agreed["events"][0] if e["kind"] == "lifecycle"}
    # Lightning restarts a plain DataLoader at the epoch's first batch: data positions follow it
    assert lifecycle["resume_agreed"]["values"] == {"step": 4, "chosen": "both", "arc_engine_step": 4,
                                                    "data_position": 0}, lifecycle
    for rank in range(2):
        outcome = agreed["ranks"][rank]
        assert outcome["global_step"] == 12 and outcome["scheduler_last_epoch"] == 12, rank
        assert len(outcome["lrs"]) == 8  # the steps from 4 to 12 only
        # each data position is the batch the first run read there (what the data ledger's positions name)
        before = {position: tokens for position, _, tokens in first["ranks"][rank]["batches"]}
        seen = {position: tokens for position, _, tokens in outcome["batches"]}
        assert sorted(seen) == list(range(8)) and sorted(before) == list(range(10)), (sorted(seen), sorted(before))
        assert all(seen[position] == before[position] for position in seen), rank
    # the newest ModelCheckpoint (step 12) is newer than arc_engine's newest: Lightning's state, one event
    newer = _train(tmp_path, "resume", *disk, "--steps", "13", "--ckpt-path", str(tmp_path / "ckpt" / "step=12.ckpt"))
    chosen = [e["values"] for e in newer["events"][0] if e["kind"] == "lifecycle" and e["detector"] == "resume_agreed"]
    assert chosen[-1]["chosen"] == "trainer" and chosen[-1]["step"] == 12 and chosen[-1]["arc_engine_step"] < 12, \
        chosen
    assert [outcome["global_step"] for outcome in newer["ranks"]] == [13, 13]

"""The fault-injection campaign: its plan and arms (arc_engine/campaign/plan.py), its scoring on hand-made records
(scoring.py), and the quick profile end to end on real DDP ranks (what CI runs)."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from arc_engine.campaign.plan import PROFILES, PROTECT, backend_plan, observe_config
from arc_engine.campaign.scoring import ARC, detection_step, score, table
from arc_engine.campaign.worker import lr_factor
from arc_engine.config import load_config
from arc_engine.device_ledger import DEVICES_FILE, assess, read_devices
from arc_engine.monitors.conformal import ConformalFamily
from arc_engine.monitors.family import section_of
from arc_engine.monitors.fisher import FisherFamily
from arc_engine.monitors.non_finite import NonFiniteFamily
from arc_engine.monitors.numerics import GradNormFamily
from arc_engine.monitors.sdc import SDCFamily

ROOT = Path(__file__).resolve().parents[1]


def _record(fault: str, arm: str, losses: list[float], *, seed: int = 0, fault_step: int | None = 5,
            terminal: int | None = None, events: tuple = (), completed: bool = True, eval_loss: float = 2.0,
            attempts: int | None = None, skipped: int = 0, eval_at: dict | None = None) -> dict:
    return {"name": f"ddp/{fault}/s{seed}/{arm}", "backend": "ddp", "fault": fault, "seed": seed, "arm": arm,
            "fault_step": fault_step, "steps_target": 10, "attempts": attempts or len(losses),
            "steps_done": len(losses), "completed": completed, "aborted": None, "terminal_step": terminal,
            "losses": losses, "grad_norms": [1.0] * len(losses), "eval_loss": eval_loss, "eval_at": eval_at or {},
            "step_ms_median": 10.0, "skipped_by_policy": skipped, "recovery": {"rollbacks": 1}, "events": list(events)}


def _detection(iteration: int, severity: str = "error", action: str = "warn") -> dict:
    return {"kind": "detection", "detector": "non_finite", "action": action, "severity": severity,
            "step": iteration, "iteration": iteration}


def test_observe_arm_turns_every_action_into_a_warning_and_recovery_off() -> None:
    observe = load_config(base=observe_config(PROTECT))
    assert not observe.recovery.enabled and load_config(base=PROTECT).recovery.enabled
    assert section_of(observe, NonFiniteFamily()).action == "warn"
    assert section_of(observe, GradNormFamily()).explosion_action == "warn"
    fisher = section_of(observe, FisherFamily())
    assert section_of(observe, ConformalFamily()).forecast_action == "warn" and fisher.drift_action == "warn"
    assert fisher.min_rank_fraction == section_of(load_config(base=PROTECT), FisherFamily()).min_rank_fraction
    assert not section_of(observe, SDCFamily()).recompute.enabled


def test_the_plan_runs_clean_arms_first_then_each_fault_in_both_arms(tmp_path: Path) -> None:
    profile = PROFILES["quick"]
    plan = backend_plan(profile, "ddp", tmp_path, faults=("nan_bomb", "router_imbalance"))
    names = [run["name"] for run in plan["runs"]]
    assert names == ["ddp/clean/s0/bare", "ddp/clean/s0/observe", "ddp/clean/s0/protect",
                     "ddp/nan_bomb/s0/observe", "ddp/nan_bomb/s0/protect"]  # the GPT has no router: not run
    faulted = plan["runs"][3]
    assert faulted["config"]["faults"]["injections"][0]["kind"] == "nan_loss"
    assert faulted["config"]["faults"]["injections"][0]["step"] == profile.fault_step
    for run in plan["runs"][1:]:
        load_config(base=run["config"])  # every arm's config is valid


def test_every_run_shares_one_cosine_schedule_over_the_faulted_runs_length(tmp_path: Path) -> None:
    profile = PROFILES["full"]
    plan = backend_plan(profile, "ddp", tmp_path, faults=("nan_bomb",))
    assert plan["schedule"] == {"decay_steps": profile.steps, "min_ratio": profile.min_lr_ratio}
    clean = [run for run in plan["runs"] if run["fault"] == "clean"]
    assert max(run["steps"] for run in clean) > profile.steps  # the 2,000-step clean runs train on at the floor
    factors = [lr_factor(step, profile.steps, 0.1) for step in range(0, 3 * profile.steps, 7)]
    assert factors[0] == 1.0 and all(a >= b for a, b in itertools.pairwise(factors))
    assert lr_factor(profile.steps // 2, profile.steps, 0.1) == pytest.approx(0.55)
    assert lr_factor(profile.steps, profile.steps, 0.1) == pytest.approx(0.1)
    assert lr_factor(5 * profile.steps, profile.steps, 0.1) == pytest.approx(0.1)


def test_detection_counts_alarms_from_the_fault_to_the_terminal_failure_only() -> None:
    losses = [2.0] * 10
    crashed = _record("nan_bomb", "observe", losses, fault_step=5, terminal=7)
    assert detection_step([3, 6], crashed) == 6  # the alarm before the fault does not count
    assert detection_step([3, 8], crashed) is None  # after the crash: too late
    assert detection_step([7], crashed) == 7  # at the crash itself: lead 0
    degraded = _record("data_corruption", "observe", losses, fault_step=5, terminal=None)
    assert detection_step([9], degraded) == 9  # no crash: up to the run's end


def test_scoring_lead_recovery_and_the_verdict_against_the_best_baseline() -> None:
    clean = [2.0 + 0.01 * (-1) ** k for k in range(10)]
    crash = [2.0] * 5 + [2.0, 2.1, math.nan, math.nan, math.nan]  # terminal at 7
    records = [
        _record("clean", "observe", clean, fault_step=None, eval_at={"10": 2.0}),
        _record("clean", "protect", clean, fault_step=None, events=(_detection(4, "warning"),)),
        _record("nan_bomb", "observe", crash, terminal=7, events=(_detection(6),), completed=False),
        _record("nan_bomb", "protect", clean, events=(_detection(6, action="skip"),), attempts=12, skipped=1,
                eval_loss=2.09),
    ]
    scores = score(records)
    row = scores["rows"][0]
    assert row["crashed"] == 1 and row["detectors"][ARC] == {"detected": 1, "lead_mean": 1.0, "chance": 0.0}
    consecutive = row["detectors"]["3 consecutive loss increases"]
    assert consecutive["chance"] == 0.0  # no false alarm on the clean run: no chance detection either
    assert row["recovered"] == 1 and row["unprotected_ok"] == 0  # 2.09 is within 5% of 2.0
    assert row["steps_lost"] == 3  # 2 extra attempts + 1 skipped update
    assert row["verdict"] == "yes"  # the z-score sees the NaN at 7 only: lead 0 < 1
    assert row["arc_ranks"] == [[]]  # the first alarm named no rank
    named = [dict(r, events=[{**_detection(6), "ranks": [1]}]) if r["arm"] == "observe" and r["fault"] != "clean"
             else r for r in records]
    assert score(named)["rows"][0]["arc_ranks"] == [[1]]
    assert scores["clean"]["backends"]["ddp"]["arc_warnings"] == 1
    assert scores["clean"]["backends"]["ddp"]["false_interventions"] == 0
    assert scores["crash_recovery"] == {"recovered": 1, "crash_runs": 1}
    assert scores["clean"]["arc_alarms_by_detector"] == {"clean_steps": 10, "alarms": {}}
    noisy = [dict(r, events=[_detection(3, "warning")]) if r["fault"] == "clean" and r["arm"] == "observe" else r
             for r in records]
    assert score(noisy)["clean"]["arc_alarms_by_detector"]["alarms"] == {"non_finite": 1}
    assert score(noisy)["detectors"][ARC]["false_alarms_per_1000"] == 100.0
    # 0.1 false alarms per step over the window of steps 5..7 (the crash): 1 - 0.9^3 chance detections
    assert score(noisy)["rows"][0]["detectors"][ARC]["chance"] == pytest.approx(1 - 0.9**3)
    late = [dict(r, events=[]) if r["arm"] == "observe" and r["fault"] == "nan_bomb" else r for r in records]
    row = score(late)["rows"][0]
    assert row["detectors"][ARC]["detected"] == 0 and row["verdict"] == "no: fewer detections"
    worse = [dict(r, eval_loss=2.2) if r["arm"] == "protect" and r["fault"] == "nan_bomb" else r for r in records]
    assert score(worse)["rows"][0]["recovered"] == 0
    assert "| ddp | nan_bomb |" in table(scores)


def test_quick_campaign_end_to_end(tmp_path: Path) -> None:
    """CI's campaign: the ARC stress scenarios on 2 DDP ranks, observed and protected. The NaN, Inf and 100,000x
    learning-rate faults crash the unprotected run, the others leave it worse; arc_engine flags each one (no later
    than the crash), recovers every one, and intervenes nowhere on the clean run."""
    out = tmp_path / "campaign"
    proc = subprocess.run([sys.executable, "-m", "arc_engine", "campaign", "--profile", "quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.count("runs ") >= len(PROFILES["quick"].faults) * 2 + 3  # a progress line per run
    scores = json.loads((out / "scores.json").read_text())
    rows = {row["fault"]: row for row in scores["rows"]}
    assert set(rows) == set(PROFILES["quick"].faults)
    crashing = {name for name, row in rows.items() if row["crashed"]}
    assert {"nan_bomb", "inf_nuke", "catastrophic_lr"} <= crashing, crashing
    for row in rows.values():  # the others degrade the unprotected run: its held-out loss ends > 5% above
        assert row["detectors"][ARC]["detected"] == row["runs"], row
        assert row["recovered"] == row["runs"] and row["crash_recovered"] == row["crashed"], row
        assert row["unprotected_ok"] == 0, row
    assert scores["clean"]["backends"]["ddp"]["false_interventions"] == 0
    assert (out / "table.md").read_text().startswith("| backend | fault |")
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert all((Path(out) / "runs" / r["name"].replace("/", "-") / "events.jsonl").is_file()
               for r in records if r["arm"] != "bare")
    # The device ledger (docs/hardware.md): the clean runs blame no device, and a NaN or Inf on one rank once (its
    # data or its device) is recorded without a verdict. Timing evidence (a straggler) aside: this test shares two
    # cores with the other test worker, and a rank slowed by it is named as a straggler would be.
    untimed = [r for r in read_devices(out / "runs" / DEVICES_FILE)[0] if r["evidence"] != "straggler"]
    assert not [r for r in untimed if "-clean-" in r["run"]], untimed
    assert {r["evidence"] for r in untimed} <= {"non_finite"}, untimed
    assert {v.verdict for v in assess(untimed).values()} <= {"ok"}, [v.to_dict() for v in assess(untimed).values()]


def test_megatron_tp2_campaign_backend(tmp_path: Path) -> None:
    """The campaign on megatron-core (TP=2, the reference script's GPT on 2 CPU ranks): the NaN bomb crashes the
    unprotected run; arc_engine flags it at the crash, the protected run recovers, the clean run sees no
    intervention."""
    out = tmp_path / "campaign"
    proc = subprocess.run([sys.executable, "-m", "arc_engine", "campaign", "--profile", "quick", "--backends",
                           "megatron_tp2", "--faults", "nan_bomb", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    scores = json.loads((out / "scores.json").read_text())
    (row,) = scores["rows"]
    assert (row["backend"], row["fault"], row["crashed"]) == ("megatron_tp2", "nan_bomb", 1), row
    assert row["detectors"][ARC]["detected"] == 1 and "non_finite" in row["arc_detectors"]
    assert row["crash_recovered"] == 1 and row["unprotected_ok"] == 0
    assert scores["clean"]["backends"]["megatron_tp2"]["false_interventions"] == 0


def test_the_verdict_counts_a_baseline_only_beyond_what_its_false_alarms_give() -> None:
    """A baseline that caught 1 of 3 runs where its clean-run false alarms alone would catch 2.5 is not a detector of
    the fault: no best baseline, and arc_engine with no detection on a fault that crashes nothing is not behind. One
    that caught 3 with 0.5 by chance is: arc_engine's 2 (none by chance) are fewer."""
    from arc_engine.campaign.scoring import _best_baseline, _verdict

    row = {"crashed": 0, "detectors": {ARC: {"detected": 0, "lead_mean": None, "chance": 0.1},
                                       "noisy": {"detected": 1, "lead_mean": None, "chance": 2.5}}}
    assert _best_baseline(row) is None and _verdict(row, None) == "yes"
    row["detectors"]["sharp"] = {"detected": 3, "lead_mean": None, "chance": 0.5}
    row["detectors"][ARC]["detected"] = 2
    assert _best_baseline(row) == "sharp" and _verdict(row, "sharp") == "no: fewer detections"
    row["detectors"][ARC]["detected"] = 3
    assert _verdict(row, "sharp") == "yes"


def test_the_realtext_profile_trains_on_per_rank_shards_of_real_text_and_evaluates_on_held_out_documents(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from arc_engine.campaign import worker
    from arc_engine.demo.realtext import MixedText, build_corpus

    plan = backend_plan(PROFILES["realtext"], "ddp", tmp_path)
    assert plan["data"] == "realtext" and backend_plan(PROFILES["quick"], "ddp", tmp_path)["data"] == "generated"
    assert {run["fault"] for run in plan["runs"]} == {"clean", "data_corruption", "lr_spike", "gradient_explosion"}
    (tmp_path / "code").mkdir()
    (tmp_path / "prose").mkdir()
    for index in range(20):  # every document's text its own: a window tells which document it came from
        (tmp_path / "code" / f"m{index}.py").write_text(f"x{index:03d} = [{index:03d}]\n" * 8)
        (tmp_path / "prose" / f"doc{index}").write_text(f"<prose {index:03d}> " * 8)
    small = build_corpus({"code": ((str(tmp_path / "code"), "*.py"),), "prose": ((str(tmp_path / "prose"), "*"),)})
    monkeypatch.setattr(worker, "build_corpus", lambda: small)
    data = worker.training_data({"model": {"seq_len": 16}, "data": "realtext"})
    assert isinstance(data, MixedText) and data.vocab_size == 256
    assert b"x000 = [000]" in bytes(data.streams["code"].tolist()) + bytes(data.held_out["code"].tolist())
    assert data.kinds_of(3, 0, 4) == ["code"] * 4 and data.kinds_of(3, 1, 4) == ["prose"] * 4  # rank 0 code, 1 prose
    held = worker.HeldOut(data, 16, 2)
    seen = b"".join(bytes(x.flatten().tolist()) for x, _ in held.batches)
    train = bytes(torch.cat(list(data.streams.values())).tolist())
    assert seen and all(bytes(x[0].tolist()) not in train for x, _ in held.batches[:2])  # held-out documents only


def test_a_profile_of_real_text_on_a_megatron_backend_is_refused_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from arc_engine.campaign.runner import main

    with pytest.raises(SystemExit) as stopped:
        main(["--profile", "realtext", "--backends", "ddp", "megatron_tp2", "--out", str(tmp_path / "out")])
    assert stopped.value.code == 2 and not (tmp_path / "out").exists()
    assert "realtext text, which the demo GPT backends (ddp, zero2) read and megatron_tp2 does not" in \
        capsys.readouterr().err

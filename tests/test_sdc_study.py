"""The SDC study's pure parts (``arc_engine/campaign/sdc_study.py``): the faults it plans per site and bit class, the
Wilson interval, and harm / detection / false alarms scored from run records (no training here; the study itself
runs with ``scripts/sdc_study.py``, docs/sdc.md)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from arc_engine.campaign import sdc_study
from arc_engine.config import load_config


def test_each_site_and_bit_class_plans_a_valid_fault_after_the_warm_up(tmp_path: Path) -> None:
    plan = sdc_study.study_plan("ddp", (0, 1, 2), tmp_path)
    runs = plan["runs"]
    assert [r["fault"] for r in runs[:3]] == ["clean"] * 3 and all(not r["config"]["faults"]["injections"]
                                                                    for r in runs[:3])
    studied = runs[3:]
    assert len(studied) == len(sdc_study.SITES) * len(sdc_study.BIT_CLASSES) * 3
    for run in studied:
        (spec,) = run["config"]["faults"]["injections"]
        assert spec["bit"] in sdc_study.BIT_CLASSES[run["bit_class"]]
        assert spec["step"] == run["fault_step"] >= 150 and spec["rank"] in (0, 1)
        assert run["config"]["recovery"]["enabled"] is False  # the observe arm: the run is what it would be
        load_config(base=run["config"])  # a valid configuration, faults included
    kinds = {run["site"]: run["config"]["faults"]["injections"][0]["kind"] for run in studied}
    assert kinds == {"forward": "bitflip", "backward": "bitflip", "weight_grad": "bitflip",
                     "reduced_grad": "collective_corruption", "optimizer_state": "optimizer_state"}
    with pytest.raises(ValueError, match="unknown site"):
        sdc_study.flip_spec("register", "exponent", 0, 2)


def test_wilson_intervals() -> None:
    assert sdc_study.wilson(0, 0) == (0.0, 1.0)
    low, high = sdc_study.wilson(0, 10)
    assert low == 0.0 and 0.25 < high < 0.32
    low, high = sdc_study.wilson(10, 10)
    assert 0.68 < low < 0.75 and math.isclose(high, 1.0)
    low, high = sdc_study.wilson(5, 10)
    assert low < 0.5 < high and math.isclose(low + high, 1.0)


def _record(fault: str, seed: int, eval_loss: float, *, alarms: tuple[int, ...] = (), terminal: int | None = None,
            steps: int = 300, fired: int = 1) -> dict:
    return {"backend": "ddp", "fault": fault, "seed": seed, "fault_step": 160 if fault != "clean" else None,
            "eval_loss": eval_loss, "eval_at": {"300": eval_loss}, "terminal_step": terminal,
            "losses": [2.0] * steps, "faults_fired": fired,
            "events": [{"kind": "detection", "detector": "sdc", "severity": "warning", "iteration": step}
                       for step in alarms]}


def test_harm_is_beyond_the_seed_spread_or_divergence_and_detection_is_on_the_flip_or_next_step() -> None:
    clean = [_record("clean", 0, 1.00, steps=700, alarms=(400,)), _record("clean", 1, 1.10, steps=700)]
    spread = 0.1 / math.sqrt(2)  # the standard deviation of 1.00 and 1.10
    records = [
        *clean,
        _record("backward-exponent_msb", 0, math.nan, terminal=161, alarms=(160,)),  # diverged, caught
        _record("backward-exponent_msb", 1, 1.10 + 2 * spread),                     # harmful, missed
        _record("backward-exponent", 0, 1.00 + 0.5 * spread, alarms=(161,)),       # harmless, caught next step
        _record("backward-exponent", 1, 1.10, alarms=(170,)),                      # harmless, late alarm: missed
        _record("reduced_grad-mantissa", 0, 1.0, fired=0),                          # nothing flipped: left out
    ]
    scores = sdc_study.score_study(records)
    assert math.isclose(scores["spread"]["ddp"], spread)
    assert scores["not_fired"] == 1
    by_seed = {(r["bit_class"], r["seed"]): r for r in scores["runs"]}
    assert by_seed[("exponent_msb", 0)]["harmful"] and by_seed[("exponent_msb", 0)]["diverged"]
    assert by_seed[("exponent_msb", 0)]["detected"] and by_seed[("exponent_msb", 0)]["detectors"] == ["sdc"]
    assert by_seed[("exponent_msb", 1)]["harmful"] and not by_seed[("exponent_msb", 1)]["detected"]
    assert not by_seed[("exponent", 0)]["harmful"] and by_seed[("exponent", 0)]["detected"]
    assert not by_seed[("exponent", 1)]["detected"]
    cell = scores["cells"]["backward/exponent_msb"]
    assert (cell["harmful"], cell["harmful_detected"], cell["diverged"]) == (2, 1, 1)
    assert scores["cells"]["all/all"]["harmless"] == 2 and scores["cells"]["all/all"]["harmless_detected"] == 1
    assert scores["clean"]["steps"] == 1400 and scores["clean"]["alarms"] == 1
    assert math.isclose(scores["clean"]["per_1000"], 1000 / 1400)
    table = sdc_study.study_table(scores)
    assert "| backward | exponent_msb | 2 of 2 (1) | 1/2 = 50% [" in table
    assert table.splitlines()[2].endswith("| sdc 1 |")  # backward/exponent_msb: the detectors of the detected runs
    assert "1 alarms in 1400 steps" in table and "left out): 1" in table

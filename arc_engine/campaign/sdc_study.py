"""The SDC study: how often arc_engine detects a bit flip that harms training, how often one that does not, and how
often it alarms on clean steps (issue: SDC figures with a definition of harm).

    python scripts/sdc_study.py --seeds 8 --out arc_campaign/sdc     # docs/sdc.md#detection-against-harm

Per backend (``ddp``, ``zero2``: the campaign's demo GPT, fp32), per seed, one transient fault on one rank at one
step in the ``observe`` arm (arc_engine attached with its default rules, every action a warning: the run is what it
would be unprotected), for each flip *site* and *bit class*:

* sites: ``forward`` / ``backward`` / ``weight_grad``: 4 elements of one GEMM's output, its input gradient or its
  weight gradient (before the reduction; :mod:`arc_engine.faults.bitflip`); ``reduced_grad``: 1 element of the
  reduced gradient on one rank, after arc_engine's checks and before the update; ``optimizer_state``: 1 element of
  Adam's first or second moment (alternating over seeds), before the update
  (:mod:`arc_engine.faults.state_faults`);
* bit classes (fp32): ``exponent_msb`` (bit 30: a value below 2 in magnitude grows by 2^128, to Inf above 1, the
  SDC paper's NaN-prone bits), ``exponent`` (one of bits 23-29, drawn per run: a factor 2^±1 to 2^±64) and
  ``mantissa`` (one of the high mantissa bits 16-22: a relative change of 2^-7 to 2^-1).

and clean ``observe`` runs per seed, long enough for the false-alarm figure.

Definitions:

* **harmful**: the run diverged (a loss above 100 or non-finite, :func:`~arc_engine.campaign.worker.terminal`), or
  its held-out loss at the last step exceeds the clean run's of the same backend and seed (the same data and
  initialization) by more than the clean runs' seed-to-seed standard deviation.
* **detected**: an arc_engine alarm (a detection event of severity warning or above, any detector) at the flipped
  step or the next one (the sites acting after arc_engine's checks can show only from the next step on), before
  any divergence.
* **false alarms**: alarms per 1,000 steps of the clean runs (Poisson 95% upper bound when there are none).

Rates carry Wilson 95% intervals. The records, ``scores.json`` and ``table.md`` go to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import shutil
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from arc_engine.campaign.plan import PROFILES, PROTECT, fault_rank, run_spec
from arc_engine.campaign.scoring import arc_alarms
from arc_engine.campaign.worker import terminal
from arc_engine.config import FaultSpec

BACKENDS = ("ddp", "zero2")
SITES = ("forward", "backward", "weight_grad", "reduced_grad", "optimizer_state")
BIT_CLASSES: dict[str, tuple[int, ...]] = {"exponent_msb": (30,), "exponent": tuple(range(23, 30)),
                                           "mantissa": tuple(range(16, 23))}
GEMMS = ("*blocks.*.mlp.0", "*blocks.*.mlp.2", "*blocks.*.attn.qkv", "*blocks.*.attn.proj")
GEMM_ELEMENTS = 4
STEPS = 300
FAULT_STEP = 150
JITTER = 60
CLEAN_STEPS = 700
Z95 = 1.959964


def flip_step(seed: int) -> int:
    """After the SDC rule's warm-up (100 applied steps), at a seed-dependent step."""
    return FAULT_STEP + (seed * 7919) % JITTER


def flip_spec(site: str, bit_class: str, seed: int, world: int) -> FaultSpec:
    """The fault of one study run: its bit drawn from the class, its GEMM (GEMM sites) or moment (optimizer state)
    rotating over the seeds."""
    draw = random.Random(f"{site}/{bit_class}/{seed}")
    bit = draw.choice(BIT_CLASSES[bit_class])
    common: dict[str, Any] = {"rank": fault_rank(dataclasses.replace(PROFILES["full"], world=world), seed),
                              "step": flip_step(seed), "bit": bit, "seed": seed}
    if site in ("forward", "backward", "weight_grad"):
        return FaultSpec(kind="bitflip", where=site, pattern=GEMMS[seed % len(GEMMS)], count=GEMM_ELEMENTS, **common)
    if site == "reduced_grad":
        return FaultSpec(kind="collective_corruption", count=1, **common)
    if site == "optimizer_state":
        return FaultSpec(kind="optimizer_state", count=1, state_key=("exp_avg", "exp_avg_sq")[seed % 2], **common)
    raise ValueError(f"unknown site {site!r}; known: {', '.join(SITES)}")


def study_plan(backend: str, seeds: tuple[int, ...], out: Path, world: int = 2,
               sites: tuple[str, ...] = SITES, clean_steps: int = CLEAN_STEPS) -> dict[str, Any]:
    """The worker's plan (:mod:`arc_engine.campaign.worker`) for one backend: a clean run per seed (evaluated at
    ``STEPS``), then one run per site, bit class and seed, all in the ``observe`` arm."""
    run_dir = out / "runs"
    runs = [run_spec(f"{backend}/clean/s{seed}/observe", "observe", backend, "clean", seed, clean_steps, None, [],
                     run_dir, eval_at=(STEPS,), base=PROTECT) for seed in seeds]
    for site in sites:
        for bit_class in BIT_CLASSES:
            for seed in seeds:
                spec = flip_spec(site, bit_class, seed, world)
                run = run_spec(f"{backend}/{site}-{bit_class}/s{seed}/observe", "observe", backend,
                               f"{site}-{bit_class}", seed, STEPS, spec.step, [dataclasses.asdict(spec)], run_dir,
                               end=spec.step, base=PROTECT)
                run["site"], run["bit_class"], run["bit"] = site, bit_class, spec.bit
                runs.append(run)
    model = PROFILES["full"].model
    return {"backend": backend, "model": model, "schedule": {"decay_steps": STEPS, "min_ratio": 0.1},
            "results": str(out / "results.jsonl"), "runs": runs}


def wilson(hits: int, total: int) -> tuple[float, float]:
    """The Wilson score 95% interval of a proportion (``(0, 1)`` for no trials)."""
    if total == 0:
        return 0.0, 1.0
    p = hits / total
    denominator = 1 + Z95**2 / total
    centre = (p + Z95**2 / (2 * total)) / denominator
    half = Z95 * math.sqrt(p * (1 - p) / total + Z95**2 / (4 * total**2)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def diverged(record: dict[str, Any]) -> bool:
    return record.get("terminal_step") is not None or not math.isfinite(record["eval_loss"]) or \
        any(terminal(loss) for loss in record["losses"])


def detected(record: dict[str, Any]) -> bool:
    """An alarm at the flipped step or the next, before any divergence."""
    start = record["fault_step"]
    stop = start + 1
    if record.get("terminal_step") is not None:
        stop = min(stop, record["terminal_step"])
    return any(start <= step <= stop for step in arc_alarms(record))


def score_study(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Harm, detection and false alarms from the run records (pure, no torch)."""
    clean = {(r["backend"], r["seed"]): r for r in records if r["fault"] == "clean"}
    spread: dict[str, float] = {}
    for backend in sorted({b for b, _ in clean}):
        values = [r["eval_at"][str(STEPS)] for (b, _), r in clean.items() if b == backend]
        spread[backend] = statistics.stdev(values) if len(values) > 1 else math.nan
    runs = []
    not_fired = 0
    for record in records:
        if record["fault"] == "clean":
            continue
        if record.get("faults_fired") == 0:  # nothing was flipped (not a study run)
            not_fired += 1
            continue
        site, bit_class = record["fault"].rsplit("-", 1)
        reference = clean[(record["backend"], record["seed"])]["eval_at"][str(STEPS)]
        excess = record["eval_loss"] - reference
        gone = diverged(record)
        runs.append({"backend": record["backend"], "site": site, "bit_class": bit_class, "seed": record["seed"],
                     "excess": excess if math.isfinite(excess) else None, "diverged": gone,
                     "harmful": gone or excess > spread[record["backend"]], "detected": detected(record),
                     "detectors": sorted({e["detector"] for e in record["events"] if e["kind"] == "detection"
                                          and int(e["iteration"]) in (record["fault_step"],
                                                                      record["fault_step"] + 1)})})
    cells: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for run in runs:
        for key in ((run["site"], run["bit_class"]), ("all", run["bit_class"]), ("all", "all")):
            cell = cells[key]
            kind = "harmful" if run["harmful"] else "harmless"
            cell[kind] += 1
            cell[f"{kind}_detected"] += run["detected"]
            cell["diverged"] += run["diverged"]
            for detector in run["detectors"] if run["detected"] else ():
                cell[f"by:{detector}"] += 1
    clean_steps = sum(len(r["losses"]) for r in clean.values())
    clean_alarms = sum(len(arc_alarms(r)) for r in clean.values())
    per_1000 = 1000 * clean_alarms / clean_steps if clean_steps else math.nan
    upper = 1000 * (3.0 if clean_alarms == 0 else clean_alarms + Z95 * math.sqrt(clean_alarms)) / clean_steps \
        if clean_steps else math.nan
    return {"spread": spread, "runs": runs, "not_fired": not_fired,
            "cells": {f"{site}/{bit_class}": dict(cell) for (site, bit_class), cell in cells.items()},
            "clean": {"steps": clean_steps, "alarms": clean_alarms, "per_1000": per_1000,
                      "per_1000_upper95": upper,
                      "detectors": sorted({e["detector"] for r in clean.values() for e in r["events"]
                                           if e["kind"] == "detection"})}}


def _rate(hits: int, total: int) -> str:
    if total == 0:
        return "-"
    low, high = wilson(hits, total)
    return f"{hits}/{total} = {hits / total:.0%} [{low:.0%}, {high:.0%}]"


def study_table(scores: dict[str, Any]) -> str:
    """Markdown: per site and bit class, the harmful and harmless runs and the share detected; then false alarms."""
    lines = ["| site | bits | harmful (diverged) | detected, harmful | detected, harmless | by |",
             "|---|---|---|---|---|---|"]
    order = [f"{site}/{bits}" for site in (*SITES, "all") for bits in (*BIT_CLASSES, "all")]
    for key in order:
        cell = scores["cells"].get(key)
        if not cell:
            continue
        site, bits = key.split("/")
        harmful, harmless = cell.get("harmful", 0), cell.get("harmless", 0)
        by = ", ".join(f"{key[3:]} {count}" for key, count in sorted(cell.items()) if key.startswith("by:"))
        lines.append(f"| {site} | {bits} | {harmful} of {harmful + harmless} ({cell.get('diverged', 0)}) | "
                     f"{_rate(cell.get('harmful_detected', 0), harmful)} | "
                     f"{_rate(cell.get('harmless_detected', 0), harmless)} | {by or '-'} |")
    clean = scores["clean"]
    spread = ", ".join(f"{backend} {value:.4f}" for backend, value in scores["spread"].items())
    lines += ["", f"Clean: {clean['alarms']} alarms in {clean['steps']} steps = {clean['per_1000']:.2f} per 1,000 "
              f"(95% upper bound {clean['per_1000_upper95']:.2f}); detectors: {', '.join(clean['detectors']) or '-'}.",
              f"Harm threshold (seed-to-seed std of the clean held-out loss at step {STEPS}): {spread}.",
              f"Runs whose fault did not fire (left out): {scores.get('not_fired', 0)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from arc_engine.campaign.runner import ProgressBar, run_plans

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--seeds", type=int, default=8, help="seeds per site and bit class (default 8)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--sites", nargs="+", choices=SITES, default=list(SITES))
    parser.add_argument("--clean-steps", type=int, default=CLEAN_STEPS)
    parser.add_argument("--out", type=Path, default=Path("arc_campaign/sdc"))
    args = parser.parse_args(argv)
    if args.clean_steps < STEPS:
        parser.error(f"--clean-steps must be >= {STEPS} (the clean runs are the harm reference at that step)")
    out: Path = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    seeds = tuple(range(args.seeds))
    plans = [study_plan(backend, seeds, out, sites=tuple(args.sites), clean_steps=args.clean_steps)
             for backend in args.backends]
    bar = ProgressBar(sum(len(plan["runs"]) for plan in plans))
    records = run_plans(plans, out, bar, 2, tag="sdc-study")
    if records is None:
        return 1
    scores = score_study(records)
    (out / "scores.json").write_text(json.dumps(scores, indent=1))
    text = study_table(scores)
    (out / "table.md").write_text(text)
    print(text, flush=True)
    return 0


__all__ = ["BIT_CLASSES", "SITES", "flip_spec", "score_study", "study_plan", "study_table", "wilson"]

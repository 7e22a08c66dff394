"""The campaign's table from its run records (:mod:`arc_engine.campaign.worker`): pure functions, no torch.

Definitions (the R-Metric paper's Appendix F.3 where it gives one):

* **terminal failure**: the first step whose loss (the ranks' mean) is above 100 or non-finite; a faulted run
  whose ``observe`` arm (unprotected) reaches one is *crash-inducing*.
* **alarm**: for arc_engine, a detection event of severity warning or above; for a baseline, a step its rule flags
  when the ``observe`` run's loss and gradient-norm series is replayed through it from step 0.
* **detected**: an alarm from the fault's first step to ``GRACE`` steps after its last one (a persistent fault is
  judged on its first ``WINDOW`` steps), and no later than the terminal failure. **lead time**: terminal step minus
  the first such alarm, on crash-inducing runs (0 = flagged at the crash itself, as a reactive check does).
* **false alarms**: alarms per 1000 steps of the clean ``observe`` runs; **false interventions**: skips,
  rollbacks, recomputations or aborts in the clean ``protect`` runs.
* **recovered**: the ``protect`` run completed its steps (no abort, no crash) and its held-out loss is at most 5%
  above the clean run's at the same step (same backend and seed).
* **steps lost**: step attempts beyond the target plus skipped updates, in the ``protect`` run.
* **overhead**: the median step time of the clean ``protect`` run over the clean ``bare`` run's (no arc_engine),
  minus 1: one run each per seed on a shared machine, so a rough figure (``scripts/bench_overhead.py`` measures it
  properly).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from arc_engine.campaign.baselines import Baseline, all_baselines
from arc_engine.faults.library import LIBRARY

ARC = "arc_engine"
ALARM_SEVERITIES = frozenset({"warning", "error", "critical"})
INTERVENTIONS = frozenset({"skip", "rollback", "recompute", "abort", "escape"})
RECOVERY_TOLERANCE = 0.05
GRACE = 10
"""Steps after a fault's last one in which an alarm still counts as its detection."""


def arc_alarms(record: dict[str, Any]) -> list[int]:
    """Step attempts at which arc_engine raised an alarm (detection events of severity warning or above)."""
    return sorted({int(e["iteration"]) for e in record["events"]
                   if e["kind"] == "detection" and e.get("severity") in ALARM_SEVERITIES})


def baseline_alarms(record: dict[str, Any], make: Callable[[], Baseline]) -> list[int]:
    """Steps a fresh baseline rule flags on the run's loss and gradient-norm series."""
    rule = make()
    norms = record.get("grad_norms") or [math.nan] * len(record["losses"])
    return [k for k, (loss, norm) in enumerate(zip(record["losses"], norms, strict=False))
            if rule.observe(loss, norm if norm is not None else math.nan)]


def window(record: dict[str, Any]) -> tuple[int, int]:
    """The steps in which an alarm detects the run's fault: from its first step to ``GRACE`` steps after its last,
    and no later than the terminal failure or the run's last step."""
    start = record["fault_step"]
    fault_end = record.get("fault_end")
    end = min((fault_end if fault_end is not None else start) + GRACE, len(record["losses"]) - 1)
    if record["terminal_step"] is not None:
        end = min(end, record["terminal_step"])
    return start, end


def detection_step(alarms: Iterable[int], record: dict[str, Any]) -> int | None:
    """The first alarm in the fault's :func:`window`."""
    start, end = window(record)
    return next((a for a in sorted(alarms) if start <= a <= end), None)


def chance_detections(records: list[dict[str, Any]], false_alarm_rate: float | None) -> float:
    """How many of ``records`` a rule alarming at random at ``false_alarm_rate`` per step (its rate on the clean
    runs) would "detect": the sum over runs of 1 - (1 - rate)^(window length)."""
    if not false_alarm_rate:
        return 0.0
    rate = min(1.0, false_alarm_rate)
    return sum(1 - (1 - rate) ** (end - start + 1) for start, end in map(window, records))


def detectors() -> dict[str, Callable[[dict[str, Any]], list[int]]]:
    """arc_engine and every baseline, each as (record -> alarm steps)."""
    found: dict[str, Callable[[dict[str, Any]], list[int]]] = {ARC: arc_alarms}
    for baseline in all_baselines():
        if baseline.name != "no monitoring":
            found[baseline.name] = _replay(type(baseline))
    return found


def _replay(kind: Callable[[], Baseline]) -> Callable[[dict[str, Any]], list[int]]:
    return lambda record: baseline_alarms(record, kind)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _recovered(record: dict[str, Any], reference: float | None) -> bool:
    loss = record["eval_loss"]
    return bool(record["completed"] and reference is not None and math.isfinite(loss) and
                loss <= reference * (1 + RECOVERY_TOLERANCE))


def score(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The campaign's numbers: one row per (backend, fault), the detectors' totals, the clean runs per backend."""
    by_arm: dict[tuple[str, str, int, str], dict[str, Any]] = {
        (r["backend"], r["fault"], r["seed"], r["arm"]): r for r in records}
    faulted_steps = {r["backend"]: r["steps_target"] for r in records if r["fault"] != "clean"}
    references = {(backend, seed): r["eval_at"].get(str(faulted_steps.get(backend, r["steps_target"])))
                  for (backend, fault, seed, arm), r in by_arm.items() if fault == "clean" and arm == "observe"}
    rules = detectors()
    rows: list[dict[str, Any]] = []
    totals: dict[str, dict[str, list]] = {name: defaultdict(list) for name in rules}
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for backend, fault, seed, arm in by_arm:
        if fault != "clean" and arm == "observe":
            groups[(backend, fault)].append(seed)
    for (backend, fault), seeds in sorted(groups.items(), key=lambda item: (item[0][0], _order(item[0][1]))):
        observed = [by_arm[(backend, fault, seed, "observe")] for seed in sorted(seeds)]
        protected = [by_arm.get((backend, fault, seed, "protect")) for seed in sorted(seeds)]
        crashed = [r for r in observed if r["terminal_step"] is not None]
        row: dict[str, Any] = {"backend": backend, "fault": fault, "family": LIBRARY[fault].family if fault in
                               LIBRARY else "", "runs": len(observed), "crashed": len(crashed), "detectors": {}}
        first_arc = [detection_step(arc_alarms(r), r) for r in observed]
        row["arc_detectors"] = sorted({e["detector"] for r, at in zip(observed, first_arc, strict=True)
                                       for e in r["events"] if at is not None and e["kind"] == "detection" and
                                       e["iteration"] == at and e.get("severity") in ALARM_SEVERITIES})
        # the ranks arc_engine's first alarm in the window named, per seed (empty: none, or the whole job)
        row["arc_ranks"] = [sorted({rank for e in r["events"] if at is not None and e["kind"] == "detection" and
                                    e["iteration"] == at and e.get("severity") in ALARM_SEVERITIES
                                    for rank in e.get("ranks") or ()})
                            for r, at in zip(observed, first_arc, strict=True)]
        for name, alarms_of in rules.items():
            steps = [detection_step(alarms_of(r), r) for r in observed]
            leads = [r["terminal_step"] - s for r, s in zip(observed, steps, strict=True)
                     if s is not None and r["terminal_step"] is not None]
            row["detectors"][name] = {"detected": sum(s is not None for s in steps), "lead_mean": _mean(leads)}
            totals[name]["detected"].append(sum(s is not None for s in steps))
            totals[name]["runs"].append(len(observed))
            totals[name]["leads"].extend(leads)
            totals[name]["crash_detected"].append(sum(s is not None for r, s in zip(observed, steps, strict=True)
                                                      if r["terminal_step"] is not None))
            totals[name]["crash_runs"].append(len(crashed))
        done = [r for r in protected if r is not None]
        row["recovered"] = sum(_recovered(r, references.get((backend, r["seed"]))) for r in done)
        row["crash_recovered"] = sum(_recovered(p, references.get((backend, p["seed"])))
                                     for o, p in zip(observed, protected, strict=True)
                                     if p is not None and o["terminal_step"] is not None)
        row["unprotected_ok"] = sum(_recovered(r, references.get((backend, r["seed"]))) for r in observed)
        row["protected_runs"] = len(done)
        row["steps_lost"] = _mean([r["attempts"] - r["steps_target"] + r["skipped_by_policy"] for r in done])
        row["rollbacks"] = _mean([r["recovery"].get("rollbacks", 0) for r in done])
        row["aborted"] = sum(r["aborted"] is not None for r in done)
        rows.append(row)
    crash_rows = [row for row in rows if row["crashed"]]
    summary = {
        name: {"detected": sum(t["detected"]), "runs": sum(t["runs"]), "crash_detected": sum(t["crash_detected"]),
               "crash_runs": sum(t["crash_runs"]), "lead_mean": _mean(t["leads"])}
        for name, t in totals.items()}
    clean = _clean(records, rules)
    for name, numbers in clean.pop("false_alarms").items():
        summary[name].update(numbers)
    for row in rows:  # what each detector's false alarms alone would have "detected" in these windows
        observed = [by_arm[(row["backend"], row["fault"], seed, "observe")] for seed in groups[(row["backend"],
                                                                                                  row["fault"])]]
        for name, stats in row["detectors"].items():
            per_1000 = summary[name].get("false_alarms_per_1000")
            stats["chance"] = chance_detections(observed, None if per_1000 is None else per_1000 / 1000)
        best = _best_baseline(row)
        row["best_baseline"] = best
        row["verdict"] = _verdict(row, best)
    return {"rows": rows, "detectors": summary, "clean": clean,
            "crash_recovery": {"recovered": sum(row["crash_recovered"] for row in crash_rows),
                               "crash_runs": sum(row["crashed"] for row in crash_rows)}}


def _order(fault: str) -> int:
    names = list(LIBRARY)
    return names.index(fault) if fault in names else len(names)


def _beyond_chance(stats: dict[str, Any]) -> float:
    """Detections beyond what the rule's clean-run false alarms alone would give in these windows."""
    return stats["detected"] - stats.get("chance", 0.0)


def _best_baseline(row: dict[str, Any]) -> str | None:
    """The baseline with the most detections beyond chance (then the longest lead); None when none has any."""
    candidates = [(_beyond_chance(stats), stats["lead_mean"] if stats["lead_mean"] is not None else -math.inf, name)
                  for name, stats in row["detectors"].items() if name != ARC]
    beyond, _, name = max(candidates, default=(0.0, -math.inf, None))
    return name if beyond > 0 else None


def _verdict(row: dict[str, Any], best: str | None) -> str:
    """Whether arc_engine's detections are at least the best baseline's beyond chance, and its lead time at least
    that baseline's, on this fault (a baseline whose detections are no more than its false alarms would make is not
    a detector of it)."""
    arc = row["detectors"][ARC]
    if best is None:
        return "yes" if arc["detected"] or not row["crashed"] else "no baseline detects it"
    other = row["detectors"][best]
    if arc["detected"] < _beyond_chance(other) - 1e-9:
        return "no: fewer detections"
    if other["lead_mean"] is not None and (arc["lead_mean"] is None or arc["lead_mean"] < other["lead_mean"]):
        return "no: shorter lead"
    return "yes"


def _clean(records: list[dict[str, Any]], rules: dict[str, Callable[[dict[str, Any]], list[int]]]
           ) -> dict[str, Any]:
    out: dict[str, Any] = {"backends": {}, "false_alarms": {}}
    observe = [r for r in records if r["fault"] == "clean" and r["arm"] == "observe"]
    steps = sum(len(r["losses"]) for r in observe)
    by_detector: dict[str, int] = {}
    for record in observe:
        for event in record["events"]:
            if event["kind"] == "detection" and event.get("severity") in ALARM_SEVERITIES:
                by_detector[event["detector"]] = by_detector.get(event["detector"], 0) + 1
    out["arc_alarms_by_detector"] = {"clean_steps": steps, "alarms": dict(sorted(by_detector.items()))}
    for name, alarms_of in rules.items():
        count = sum(len(alarms_of(r)) for r in observe)
        out["false_alarms"][name] = {"false_alarms": count, "clean_steps": steps,
                                     "false_alarms_per_1000": 1000 * count / steps if steps else None}
    for backend in sorted({r["backend"] for r in records}):
        mine = [r for r in records if r["backend"] == backend and r["fault"] == "clean"]
        protect = [r for r in mine if r["arm"] == "protect"]
        bare = {r["seed"]: r for r in mine if r["arm"] == "bare"}
        ratios = [r["step_ms_median"] / bare[r["seed"]]["step_ms_median"] - 1 for r in protect
                  if r["seed"] in bare and r["step_ms_median"] and bare[r["seed"]]["step_ms_median"]]
        out["backends"][backend] = {
            "clean_runs": len(protect), "clean_steps": sum(r["attempts"] for r in protect),
            "false_interventions": sum(1 for r in protect for e in r["events"]
                                       if e["kind"] == "action" and e.get("action") in INTERVENTIONS),
            "arc_warnings": sum(len(arc_alarms(r)) for r in protect),
            "overhead": _mean(ratios)}
    return out


def _pct(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.0f}%)" if whole else "-"


def _lead(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(scores: dict[str, Any]) -> str:
    """The campaign's tables in Markdown."""
    lines = ["| backend | fault | class | crashes unprotected | arc_engine detected | by | lead | best baseline | "
             "its detections (by chance) | lead | arc_engine >= best | recovered (arc_engine) | "
             "recovered (unprotected) | steps lost | rollbacks |", "|" + "---|" * 15]
    for row in scores["rows"]:
        arc = row["detectors"][ARC]
        best = row["best_baseline"]
        other = row["detectors"][best] if best else {"detected": 0, "lead_mean": None, "chance": 0.0}
        lines.append(
            f"| {row['backend']} | {row['fault']} | {row['family']} | {_pct(row['crashed'], row['runs'])} | "
            f"{_pct(arc['detected'], row['runs'])} | {', '.join(row['arc_detectors']) or '-'} | "
            f"{_lead(arc['lead_mean'])} | {best or '-'} | "
            f"{_pct(other['detected'], row['runs'])} ({other['chance']:.1f}) | {_lead(other['lead_mean'])} | "
            f"{row['verdict']} | "
            f"{_pct(row['recovered'], row['protected_runs'])} | {_pct(row['unprotected_ok'], row['runs'])} | "
            f"{_lead(row['steps_lost'])} | {_lead(row['rollbacks'])} |")
    lines += ["", "| detector | detected (all faulted runs) | detected (crash-inducing runs) | mean lead (steps) | "
              "false alarms per 1000 clean steps |", "|---|---|---|---|---|"]
    for name, stats in scores["detectors"].items():
        per_1000 = stats.get("false_alarms_per_1000")
        lines.append(f"| {name} | {_pct(stats['detected'], stats['runs'])} | "
                     f"{_pct(stats['crash_detected'], stats['crash_runs'])} | {_lead(stats['lead_mean'])} | "
                     f"{'-' if per_1000 is None else f'{per_1000:.2f}'} |")
    lines += ["", "| backend | clean protected runs | their steps | false interventions | arc_engine warnings | "
              "overhead (median step, vs no arc_engine) |", "|---|---|---|---|---|---|"]
    for backend, stats in scores["clean"]["backends"].items():
        overhead = stats["overhead"]
        lines.append(f"| {backend} | {stats['clean_runs']} | {stats['clean_steps']} | {stats['false_interventions']} "
                     f"| {stats['arc_warnings']} | {'-' if overhead is None else f'{100 * overhead:+.1f}%'} |")
    crash = scores["crash_recovery"]
    lines += ["", f"Recovery on crash-inducing runs: {_pct(crash['recovered'], crash['crash_runs'])}."]
    clean = scores["clean"].get("arc_alarms_by_detector")
    if clean:
        alarms = ", ".join(f"{name} {count}" for name, count in clean["alarms"].items()) or "none"
        lines.append(f"arc_engine's alarms on the clean observe runs ({clean['clean_steps']} steps), by detector: "
                     f"{alarms} (a detector not named raised none, `sdc` included when absent).")
    return "\n".join(lines) + "\n"


__all__ = ["ARC", "arc_alarms", "baseline_alarms", "detection_step", "detectors", "score", "table"]

"""Why the run stopped: ``stop.json`` in the run directory, written at every exit arc_engine makes or sees.

One JSON object: ``exit_code``, ``cause`` (``completed``, ``abort``, ``recovery_exhausted``, ``faulty_device``,
``hang``, ``relaunch``, ``terminated``, ``error`` and ``interrupted`` (the training loop raised, or was interrupted,
while it closed arc_engine: ``arc.close()`` in a ``finally`` or the ``with`` block's exit); ``running`` while a
launch runs: a file still saying so after the job ended
means it died without a word, a kill or a crash outside arc_engine), ``step``, ``message``, the ``ranks`` and
``devices`` blamed, the ``evidence`` (each blaming finding: detector, message, hardware evidence kind), the
``excluded_hosts`` of the device ledger at that moment and the ``suggested`` action. ``arc-engine report`` shows it
first; W&B gets it as one alert (a ``stop`` event). Written by the decision group's first rank, atomically.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from arc_engine.events import Action, Finding
from arc_engine.policy.decision import (
    EXIT_ABORT,
    EXIT_FAULTY_DEVICE,
    EXIT_HANG,
    EXIT_RECOVERY_EXHAUSTED,
    EXIT_RELAUNCH,
    Decision,
)

STOP_FILE = "stop.json"
EXIT_TERMINATED = 128 + 15  # the default action of SIGTERM, as a shell reports it
EXIT_ERROR = 1  # Python's exit code for an uncaught exception
EXIT_INTERRUPTED = 128 + 2  # the default action of SIGINT (Ctrl-C: KeyboardInterrupt), as a shell reports it
CAUSES = {0: "completed", EXIT_ABORT: "abort", EXIT_RECOVERY_EXHAUSTED: "recovery_exhausted",
          EXIT_FAULTY_DEVICE: "faulty_device", EXIT_HANG: "hang", EXIT_RELAUNCH: "relaunch",
          EXIT_TERMINATED: "terminated", EXIT_ERROR: "error", EXIT_INTERRUPTED: "interrupted"}
#: the detectors whose stop asks for a lower learning rate (the optimisation diverged, not the data or a device)
DIVERGED = ("loss_spike", "grad_norm", "numerics", "dynamics", "weight_health", "conformal", "r_metric", "recovery",
            "policy")


def running(step: int) -> dict[str, Any]:
    return {"exit_code": None, "cause": "running", "step": step, "time": time.time(),
            "message": "the run has not stopped, or it died without a word (killed, or a crash outside arc_engine)",
            "ranks": [], "evidence": [], "suggested": "if the job has ended: read its log; resume from the last "
                                                       "checkpoint"}


def completed(step: int) -> dict[str, Any]:
    return {"exit_code": 0, "cause": "completed", "step": step, "time": time.time(), "message": "the run completed",
            "ranks": [], "evidence": [], "suggested": "nothing to do"}


def at_close(step: int, error: BaseException | None) -> dict[str, Any]:
    """The stop record of a close: completed, or what the training loop raised while it closed arc_engine (a
    ``SystemExit`` with code 0 or None is a completed run; with another code, that code)."""
    if error is None or (isinstance(error, SystemExit) and error.code in (0, None)):
        return completed(step)
    if isinstance(error, SystemExit):
        code = error.code if isinstance(error.code, int) else EXIT_ERROR
        return {"exit_code": code, "cause": CAUSES.get(code, "exit"), "step": step, "time": time.time(),
                "message": f"the training loop exited with code {error.code!r}", "ranks": [], "evidence": [],
                "suggested": "read the job's log; resume from the last checkpoint"}
    interrupted = isinstance(error, KeyboardInterrupt)
    code = EXIT_INTERRUPTED if interrupted else EXIT_ERROR
    text = f"{type(error).__name__}: {error}".rstrip(": ")
    return {"exit_code": code, "cause": CAUSES[code], "step": step, "time": time.time(),
            "message": f"the training loop {'was interrupted' if interrupted else 'raised'} ({text[:500]})",
            "ranks": [], "evidence": [],
            "suggested": "resume from the last checkpoint" if interrupted else
                         "read the traceback in the job's log; resume from the last checkpoint"}


def on_decision(decision: Decision, reason: str) -> dict[str, Any]:
    """The stop record of an ABORT decision (identical on every rank)."""
    blaming = [f for f in decision.findings if f.action >= Action.SKIP or f.hardware or f.bad_data or f.data_suspect]
    ranks = sorted({r for f in blaming for r in f.ranks})
    return {"exit_code": decision.exit_code, "cause": CAUSES.get(decision.exit_code, "abort"), "step": decision.step,
            "time": time.time(), "message": reason, "ranks": ranks, "evidence": [_evidence(f) for f in blaming],
            "suggested": _suggest(decision.exit_code, blaming)}


def on_hang(values: dict[str, Any], step: int) -> dict[str, Any]:
    """The stop record of a rank the watchdog ends (a hang, a lost peer) or a launcher's SIGTERM."""
    terminated = values.get("error") == "SIGTERM" and not values.get("abort")
    code = EXIT_TERMINATED if terminated else int(values.get("exit_code") or EXIT_HANG)
    ranks = sorted(values.get("hardware_ranks") or ())
    evidence = [{"detector": "hang", "hardware": values.get("hardware", ""), "ranks": ranks,
                 "message": str(values.get("error") or "no step completed")}]
    suggested = ("resume from the last checkpoint (the job was stopped by its launcher)" if terminated and not ranks
                 else f"resume from the last checkpoint; rank(s) {ranks} stopped answering: a host lost twice is "
                      "excluded by the device ledger (arc-engine hosts)" if ranks
                 else "resume from the last checkpoint; read the stack dumps (stacks/ in the run directory)")
    return {"exit_code": code, "cause": CAUSES.get(code, "hang"), "step": step,
            "time": time.time(), "message": evidence[0]["message"], "ranks": ranks, "evidence": evidence,
            "suggested": suggested}


def _evidence(finding: Finding) -> dict[str, Any]:
    item: dict[str, Any] = {"detector": finding.detector, "message": finding.message, "ranks": list(finding.ranks)}
    if finding.hardware:
        item["hardware"] = finding.hardware
    if finding.bad_data or finding.data_suspect:
        item["data_position"] = finding.values.get("data_position")
    return item


def _suggest(exit_code: int, blaming: list[Finding]) -> str:
    hardware = sorted({f.hardware for f in blaming if f.hardware})
    if exit_code == EXIT_FAULTY_DEVICE or "sdc_persistent" in hardware:
        return ("resume without the faulty host: `arc-engine hosts RUN_ROOT --format slurm-exclude` (SLURM) or "
                "`--format hostfile` (DeepSpeed); launch/slurm.sbatch and launch/torchrun.sh leave it out")
    if exit_code == EXIT_RELAUNCH:
        return "relaunch from the newest checkpoint: relaunch.json in the run directory names the batches to skip"
    if any(f.bad_data or f.data_suspect for f in blaming):
        return "inspect the data positions (`arc-engine data-ledger RUN_DIR`), then resume: the ledger skips them"
    if hardware:
        return (f"resume; the device ledger holds the evidence ({', '.join(hardware)}): `arc-engine hosts RUN_ROOT` "
                "says whether a host is to be left out")
    if any(f.detector in DIVERGED for f in blaming):
        return "resume from the last verified checkpoint with a lower learning rate"
    return "resume from the last checkpoint; `arc-engine report RUN_DIR` shows the events"


def complete(record: dict[str, Any], locations: dict[int, str], excluded: list[str]) -> dict[str, Any]:
    """``record`` with the blamed ranks' devices and the device ledger's excluded hosts."""
    return {**record, "devices": [locations.get(r, "?") for r in record.get("ranks", ())],
            "excluded_hosts": excluded}


def write(run_dir: Path, record: dict[str, Any]) -> None:
    """Atomically (a temporary file, then a rename). Raises OSError."""
    from arc_engine.watchdog import write_atomically

    write_atomically(run_dir / STOP_FILE, json.dumps(record, indent=1, sort_keys=True, default=str) + "\n")


def read(run_dir: Path) -> dict[str, Any] | None:
    """The run's stop record (None: none, or unreadable)."""
    try:
        record = json.loads((run_dir / STOP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def describe(record: dict[str, Any]) -> str:
    """Two lines for a person. Pure."""
    devices = ", ".join(record.get("devices") or ()) or "-"
    return (f"stopped: {record.get('cause')} (exit code {record.get('exit_code')}) at step {record.get('step')}: "
            f"{record.get('message')}; blamed ranks {record.get('ranks') or '-'} ({devices})\n"
            f"suggested: {record.get('suggested')}")


__all__ = ["CAUSES", "STOP_FILE", "at_close", "complete", "completed", "describe", "on_decision", "on_hang", "read",
           "running", "write"]

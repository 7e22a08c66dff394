"""The device ledger: which hosts and devices hurt the job, on what evidence, kept across launches.

Every finding that blames the device of some ranks (not their data, not the whole job) carries its evidence kind
(:attr:`arc_engine.events.Finding.hardware`, one of :data:`EVIDENCE`); the watchdog's reports name the ranks lost or
stopped. The decision group's first rank appends one line per blamed rank to ``<run.run_dir>/devices.jsonl``: the
run root, shared by every run id, so the ledger outlives restarts, relaunches and rollbacks
(:class:`arc_engine.sinks.devices.DeviceLedgerSink`). Pure Python: the launchers read it without importing torch.

**The rule** (:func:`assess`, documented in docs/hardware.md), per ``host:device``:

- ``sdc_persistent`` (SDC reproduced on the device by its own recomputation and not by a healthy peer's): exclude.
- ``sdc_transient`` (SDC corrected by a recomputation): suspect; a second one within :data:`TRANSIENT_WINDOW_STEPS`
  training steps of another: exclude.
- ``straggler`` (slow for ``persist_reports`` reports in a row), ``lost`` (named lost by the survivors), ``hung``
  (stopped behind the others), ``replica_divergence`` (its replica's weights differ), ``hardware_event`` (NVML ECC,
  XID or clock-slowdown events of the device): suspect; seen in :data:`LAUNCHES_TO_EXCLUDE` launches: exclude.
- ``non_finite`` (a non-finite loss or gradient on some ranks only: their data or their device): suspect once at two
  data positions. Never exclude by itself: only a recomputation on a peer tells a bad batch from a bad device (the
  ``sdc_recompute`` verdicts above). A position non-finite at two step attempts is the data's and is not counted.

A host is excluded when one of its devices is. ``arc-engine hosts RUN_DIR --clear HOST`` (after a repair) appends a
``clear`` line: the host's earlier entries no longer count. Findings that the data explains (``bad_data``, a spike
every rank shared, an SDC recomputation that a peer reproduced) carry no evidence and are never written here.

**Crash-safe**: one ``write`` per line on an append-only file, flushed to disk; a line torn by a kill is skipped when
read (and reported), and the next writer starts on a new line.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEVICES_FILE = "devices.jsonl"
#: evidence kind -> what it means (``Finding.hardware``)
EVIDENCE: dict[str, str] = {
    "sdc_persistent": "SDC reproduced by the device's own recomputation, not by a healthy peer's",
    "sdc_transient": "SDC corrected by a recomputation (a one-off fault)",
    "non_finite": "a non-finite loss or gradient on this device only (its data or the device)",
    "straggler": "slower than its peers for several reports in a row",
    "lost": "named lost by the surviving ranks (no heartbeat)",
    "hung": "stopped behind the other ranks (hang report)",
    "replica_divergence": "its data-parallel replica's weights differ from the others'",
    "hardware_event": "NVML ECC, XID or clock-slowdown events reported by the device",
}
#: two transient SDC verdicts on one device within this many training steps exclude it
TRANSIENT_WINDOW_STEPS = 10_000
#: straggler, lost, hung, replica_divergence, hardware_event: excluded once seen in this many launches
LAUNCHES_TO_EXCLUDE = 2
#: non_finite: suspect once seen at this many data positions (never excluded by itself)
NON_FINITE_POSITIONS = 2
VERDICTS = ("ok", "suspect", "exclude")


def devices_file(path: Path) -> Path:
    """The ledger of ``path``: a ledger file, a run root (``run.run_dir``) or a run's own directory (its parent's)."""
    if path.suffix == ".jsonl" or path.is_file():
        return path
    if not (path / DEVICES_FILE).exists() and (path.parent / DEVICES_FILE).exists():
        return path.parent / DEVICES_FILE
    return path / DEVICES_FILE


def append_line(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line with one ``write`` and flush it to disk; a torn last line (a writer killed
    in its write) is first ended, so it stays one unreadable line. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size:
            with path.open("rb") as existing:
                existing.seek(size - 1)
                if existing.read(1) != b"\n":
                    data = b"\n" + data
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_devices(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The ledger's records and the number of unreadable lines skipped (a torn write). Missing file: ``([], 0)``."""
    if not path.exists():
        return [], 0
    records, skipped = [], 0
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(record, dict) and ("clear" in record or {"host", "evidence"} <= record.keys()):
            records.append(record)
        else:
            skipped += 1
    return records, skipped


def clear_host(path: Path, host: str) -> None:
    """Forget ``host``'s evidence from now on (a repaired or replaced node): appends a ``clear`` line."""
    append_line(path, {"clear": host, "time": time.time()})


@dataclass
class DeviceVerdict:
    """One device's standing: its evidence by kind, the verdict (``ok``, ``suspect``, ``exclude``) and why."""

    host: str
    device: str
    counts: dict[str, int] = field(default_factory=dict)
    verdict: str = "ok"
    reasons: list[str] = field(default_factory=list)
    last_seen: dict[str, Any] = field(default_factory=dict)  # time, run, step of its newest entry

    @property
    def location(self) -> str:
        return f"{self.host}:{self.device}"

    def raise_to(self, verdict: str, reason: str) -> None:
        self.reasons.append(reason)
        if VERDICTS.index(verdict) > VERDICTS.index(self.verdict):
            self.verdict = verdict

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "device": self.device, "verdict": self.verdict, "counts": dict(self.counts),
                "reasons": list(self.reasons), "last_seen": dict(self.last_seen)}


def assess(records: Iterable[dict[str, Any]]) -> dict[str, DeviceVerdict]:
    """``{"host:device": verdict}`` by the module's rule, from the records in file order (a ``clear`` forgets its
    host's earlier entries). Pure."""
    by_device: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if "clear" in record:
            host = str(record["clear"])
            for location in [loc for loc, entries in by_device.items() if entries[0]["host"] == host]:
                del by_device[location]
            continue
        by_device.setdefault(f"{record['host']}:{record.get('device', '?')}", []).append(record)
    return {location: _judge(entries) for location, entries in sorted(by_device.items())}


def _judge(entries: list[dict[str, Any]]) -> DeviceVerdict:
    first, newest = entries[0], max(entries, key=lambda e: float(e.get("time", 0.0)))
    verdict = DeviceVerdict(str(first["host"]), str(first.get("device", "?")),
                            last_seen={k: newest.get(k) for k in ("time", "run", "step")})
    kinds: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        kinds.setdefault(str(entry["evidence"]), []).append(entry)
    verdict.counts = {kind: len(found) for kind, found in sorted(kinds.items())}
    for kind, found in sorted(kinds.items()):
        steps = sorted(int(e.get("step", 0)) for e in found)
        launches = {str(e.get("launch", "")) for e in found}
        if kind == "sdc_persistent":
            verdict.raise_to("exclude", f"SDC reproduced on this device at step {steps[0]}")
        elif kind == "sdc_transient":
            close = any(b - a <= TRANSIENT_WINDOW_STEPS for a, b in itertools.pairwise(steps))
            verdict.raise_to("exclude" if close else "suspect",
                             f"{len(steps)} transient SDC (steps {_listed(steps)})" +
                             (f", two within {TRANSIENT_WINDOW_STEPS} steps" if close else ""))
        elif kind == "non_finite":
            positions = _device_positions(found)
            if len(positions) >= NON_FINITE_POSITIONS:
                verdict.raise_to("suspect", f"non-finite values on this device only at data positions "
                                            f"{_listed(positions)}")
        else:
            many = len(launches) >= LAUNCHES_TO_EXCLUDE
            verdict.raise_to("exclude" if many else "suspect",
                             f"{kind} in {len(launches)} launch(es) (steps {_listed(steps)})")
    return verdict


def _device_positions(found: list[dict[str, Any]]) -> list[int]:
    """The data positions of non-finite evidence that the data does not explain: a position met at two step
    attempts is the batch's (its NaN came back), not the device's."""
    attempts: dict[int, set[int]] = {}
    for entry in found:
        if entry.get("data_position") is not None:
            attempts.setdefault(int(entry["data_position"]), set()).add(int(entry.get("iteration", -1)))
    return sorted(p for p, seen in attempts.items() if len(seen) < 2)


def _listed(numbers: list[int], limit: int = 6) -> str:
    shown = ", ".join(map(str, numbers[:limit]))
    return shown + (f", ... ({len(numbers)} in all)" if len(numbers) > limit else "")


def excluded_hosts(verdicts: dict[str, DeviceVerdict]) -> list[str]:
    """The hosts with an excluded device, sorted. Pure."""
    return sorted({v.host for v in verdicts.values() if v.verdict == "exclude"})


def host_evidence(verdicts: dict[str, DeviceVerdict], host: str) -> str:
    """One line: why ``host`` is excluded (empty when it is not). Pure."""
    return "; ".join(f"{v.location}: {', '.join(v.reasons)}" for v in verdicts.values()
                     if v.host == host and v.verdict == "exclude")


def table(verdicts: dict[str, DeviceVerdict]) -> str:
    """The human table: host, device, findings by kind, verdict, last seen. Pure."""
    rows = [("host", "device", "findings", "verdict", "last seen")]
    for v in verdicts.values():
        found = ", ".join(f"{kind} x{count}" for kind, count in v.counts.items())
        seen = v.last_seen
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(float(seen["time"]))) if seen.get("time") else "-"
        rows.append((v.host, v.device, found, v.verdict, f"{when} run {seen.get('run')} step {seen.get('step')}"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(4)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
                     for row in rows)


def slurm_exclude(verdicts: dict[str, DeviceVerdict]) -> str:
    """``--exclude=HOST,...`` for srun/sbatch (empty when no host is excluded). Pure."""
    hosts = excluded_hosts(verdicts)
    return f"--exclude={','.join(hosts)}" if hosts else ""


def filter_hostfile(text: str, verdicts: dict[str, DeviceVerdict]) -> tuple[str, list[str]]:
    """A DeepSpeed/MPI hostfile (``HOST slots=N`` lines, ``#`` comments) without the excluded hosts; and the hosts
    left out. Pure."""
    excluded = set(excluded_hosts(verdicts))
    kept, dropped = [], []
    for line in text.splitlines():
        host = line.split("#", 1)[0].split()
        if host and host[0] in excluded:
            dropped.append(host[0])
            continue
        kept.append(line)
    return "\n".join(kept) + ("\n" if kept else ""), dropped


__all__ = ["DEVICES_FILE", "EVIDENCE", "DeviceVerdict", "append_line", "assess", "clear_host",
           "devices_file", "excluded_hosts", "filter_hostfile", "host_evidence", "read_devices", "slurm_exclude",
           "table"]

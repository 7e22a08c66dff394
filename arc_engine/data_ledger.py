"""The data ledger: which batches a run skipped or suspected, and why.

A data position is the global batch index an optimizer step consumes (:attr:`ArcEngine.data_position`: one per
step, counted from 0 over the run, carried by checkpoints and rollbacks). The engine records an entry for every step
that was not applied (a skip of any cause, a rollback) and for every step a ``bad_data`` finding blamed on its batch
(:class:`~arc_engine.events.Finding`; ``detectors.data`` names the rank whose batch it was), and for the positions a
rollback does not replay (``recovery.skip_data: window``). Entries go to ``data_ledger.jsonl`` in the run directory
(written by the decision group's first rank; an unwritable file is reported once and the ledger stays in memory)
and into the engine's counters (checkpoints carry them; a rollback keeps them).

**A resumed run honours it**: at start the group's first rank reads the run directory's ledger and shares it; a
monitored step whose data position a ``bad_data`` entry skipped before is skipped again (the ``data_ledger``
finding), so a run relaunched from a checkpoint older than the bad shard does not train on it.
A ``suspect`` entry (a ``data_suspect`` finding: a non-finite loss on some ranks, their data or their device) is
honoured only once the same position was suspected at two step attempts (a replay or a resume met it again): a
transient fault of a device leaves the batch to be trained on, a bad batch is skipped from its second time on.

**Export** (``arc-engine data-ledger RUN_DIR``): the bad-data positions as Megatron-LM's ``--iterations-to-skip``
(arc_engine's data position p is Megatron-LM's iteration p + 1 of a run with one global batch per iteration) or as
a ``skip_batches.json`` of global batch indices (for a Lightning or Hugging Face data pipeline that skips by index).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from arc_engine.events import Action, Finding, Severity

if TYPE_CHECKING:
    from arc_engine.policy import Decision

log = logging.getLogger(__name__)

LEDGER_FILE = "data_ledger.jsonl"
SKIP_BATCHES_FILE = "skip_batches.json"
#: the ``action`` of the entries whose positions a resumed run skips again: a ``bad_data`` finding's skip, and a
#: step applied without the blamed rank's share (``dropped``, :attr:`arc_engine.events.Finding.data_dropped`)
HONOURED_ACTIONS = ("skip", "rollback", "dropped")
#: the actions of the entries whose batches were not applied (the others were only blamed: ``warn``, ``none``...)
NOT_APPLIED = ("skip", "rollback", "abort", "not_replayed")


class DataLedger:
    """The run's ledger (see the module docstring). Entries are JSON objects: ``first`` and ``last`` data position
    (inclusive), ``step``, ``iteration``, ``action`` (``skip``, ``rollback``, ``warn``...), ``bad_data``, ``ranks``,
    ``detectors`` and ``reason``."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self._keys: set[tuple[int, int, int, str]] = set()
        self._bad: dict[int, dict[str, Any]] = {}  # honoured position -> its first entry
        self._suspected: dict[int, set[int]] = {}  # suspect position -> the step attempts that suspected it
        self.path: Path | None = None
        self._warned = False

    def open(self, path: Path | None) -> None:
        """Write new entries to ``path`` (None: memory only, e.g. not the group's first rank)."""
        self.path = path

    def open_shared(self, path: Path, *, leader: bool, group: dist.ProcessGroup | None, num_ranks: int) -> None:
        """Collective over ``group``: the leader reads ``path`` (a relaunch continues it; unreadable: a warning and
        a new ledger beside it) and shares it with every rank; the leader writes the new entries there."""
        entries: list[Any] = [[]]
        if leader:
            try:
                entries[0] = read_ledger(path)
            except (OSError, ValueError) as err:
                log.warning("arc_engine: the data ledger %s is unreadable (%s): not honoured", path, err)
        if num_ranks > 1:
            dist.broadcast_object_list(entries, group_src=0, group=group)
        self.merge(entries[0])
        self.open(path if leader else None)

    def with_position(self, findings: list[Finding], position: int) -> list[Finding]:
        """``bad_data`` findings with the data position the step consumed (``hardware`` ones too, in their values,
        for the device ledger); plus, where this ledger skipped
        ``position`` for bad data before (a resumed or replaying run), the finding that skips it again."""
        out = [dataclasses.replace(f, message=f"{f.message} (data position {position})",
                                   values={**f.values, "data_position": position})
               if f.bad_data or f.data_suspect else
               dataclasses.replace(f, values={**f.values, "data_position": position}) if f.hardware else f
               for f in findings]
        known = self.bad(position)
        if known is not None and not any(f.bad_data or f.data_suspect for f in out):
            ranks = tuple(known["ranks"])
            whose = f" on rank {', '.join(map(str, ranks))}" if ranks else ""
            out.append(Finding("data_ledger", Action.SKIP, Severity.WARNING,
                               f"data position {position} was skipped for bad data{whose} at step {known['step']} "
                               f"(data ledger): skipped again", ranks=ranks, bad_data=True,
                               values={"data_position": position, "first_step": known["step"]}))
        return out

    def record_decision(self, decision: Decision, *, position: int, iteration: int) -> None:
        """Record the step's batch when its update is not applied or a finding blames it (``bad_data``, or
        ``data_suspect``: a bad-data entry as well) (identical on every rank)."""
        blamed = [f for f in decision.findings if f.bad_data or f.data_suspect]
        if decision.applies_update and not blamed:
            return
        causes = [f for f in decision.findings if f.action >= Action.SKIP] or blamed
        dropped = decision.applies_update and any(f.data_dropped for f in blamed)
        self.record(first=position, step=decision.step, iteration=iteration,
                    action="dropped" if dropped else decision.action.name.lower(), bad_data=bool(blamed),
                    ranks=[r for f in blamed for r in f.ranks], detectors=[f.detector for f in causes],
                    reason=(blamed or causes)[0].message if (blamed or causes) else "",
                    suspect=bool(blamed) and not any(f.bad_data for f in blamed))

    def record(self, *, first: int, last: int | None = None, step: int, iteration: int, action: str,
               bad_data: bool = False, ranks: Iterable[int] = (), detectors: Iterable[str] = (),
               reason: str = "", suspect: bool = False) -> dict[str, Any] | None:
        """Add an entry (ignored when the same positions, iteration and action are already in); returns it.
        ``suspect`` (with ``bad_data``): the batch is suspected, not known, to be bad (a ``data_suspect`` finding)."""
        entry = {"first": int(first), "last": int(first if last is None else last), "step": int(step),
                 "iteration": int(iteration), "action": action, "bad_data": bool(bad_data),
                 "ranks": sorted({int(r) for r in ranks}), "detectors": sorted(set(detectors)), "reason": reason}
        if suspect:
            entry["suspect"] = True
        if not self._add(entry):
            return None
        self._write(entry)
        return entry

    def _add(self, entry: dict[str, Any]) -> bool:
        key = (int(entry["first"]), int(entry["last"]), int(entry["iteration"]), str(entry["action"]))
        if key in self._keys:
            return False
        self._keys.add(key)
        self.entries.append(entry)
        if entry.get("bad_data") and entry.get("action") in HONOURED_ACTIONS:
            for position in range(int(entry["first"]), int(entry["last"]) + 1):
                if entry.get("suspect"):  # honoured once the same batch was suspected at two step attempts
                    self._suspected.setdefault(position, set()).add(int(entry["iteration"]))
                    if len(self._suspected[position]) < 2:
                        continue
                self._bad.setdefault(position, entry)
        return True

    def _write(self, entry: dict[str, Any]) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(entry) + "\n")
        except OSError as err:
            if not self._warned:
                self._warned = True
                log.warning("arc_engine: the data ledger %s cannot be written (%s): it stays in memory and in "
                            "checkpoints", self.path, err)

    def bad(self, position: int) -> dict[str, Any] | None:
        """The entry that skipped ``position`` for bad data (None: none did)."""
        return self._bad.get(int(position))

    def merge(self, entries: Iterable[dict[str, Any]]) -> int:
        """Add entries known elsewhere (a checkpoint, the run directory's file); returns how many were new."""
        return sum(self._add(dict(entry)) for entry in entries)

    def bad_positions(self) -> list[int]:
        return sorted(self._bad)

    def state_dict(self) -> dict[str, Any]:
        return {"entries": [dict(e) for e in self.entries]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Merge (never forget: a rollback or a resume keeps what was learned since)."""
        self.merge(state.get("entries", ()))


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """The entries of a ``data_ledger.jsonl`` (an empty list when absent). Raises ValueError naming the line of a
    malformed one."""
    if not path.exists():
        return []
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            int(entry["first"]), int(entry["last"])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{number}: not a data-ledger entry ({err})") from None
        entries.append(entry)
    return entries


def ledger_of(entries: Iterable[dict[str, Any]]) -> DataLedger:
    ledger = DataLedger()
    ledger.merge(entries)
    return ledger


def megatron_iterations(entries: Iterable[dict[str, Any]]) -> list[int]:
    """Megatron-LM's ``--iterations-to-skip`` for the bad-data positions (position p is iteration p + 1). Pure."""
    return [position + 1 for position in ledger_of(entries).bad_positions()]


def skip_batches(entries: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The ``skip_batches.json`` document: the bad-data global batch indices and, per index, the ranks whose batch
    it was. Pure."""
    ledger = ledger_of(entries)
    positions = ledger.bad_positions()
    return {"skip_batches": positions,
            "ranks": {str(p): ledger.bad(p)["ranks"] for p in positions if ledger.bad(p)["ranks"]}}  # type: ignore[index]


def describe(entries: list[dict[str, Any]]) -> str:
    """A short human summary of a ledger. Pure."""
    bad = ledger_of(entries).bad_positions()
    skipped = sum(1 for e in entries if e.get("action") in NOT_APPLIED)
    span = f"{bad[0]}..{bad[-1]}" if bad else "-"
    dropped = sum(1 for e in entries if e.get("action") == "dropped")
    return (f"{len(entries)} entries ({skipped} not applied, {dropped} applied without the blamed rank's share); "
            f"{len(bad)} positions skipped for bad data (span {span})")


__all__ = ["LEDGER_FILE", "SKIP_BATCHES_FILE", "DataLedger", "describe", "ledger_of", "megatron_iterations",
           "read_ledger", "skip_batches"]

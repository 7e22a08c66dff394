"""The on-disk commit protocol of the persistent checkpoint tier: layout, atomic small files, checksums, markers,
the rank-0 commit and retention.

Layout under the checkpoint root (a filesystem every rank sees)::

    <root>/step_00000120/.metadata               DCP's global metadata (written by the coordinator, rank 0)
    <root>/step_00000120/__<r>_<i>.distcp        DCP's data files of checkpoint-group rank r
    <root>/step_00000120/checksums.rank<r>.json  rank r's report: {file: crc32} of the files it wrote, or its error
    <root>/step_00000120/COMMITTED.json          the commit marker (rank 0, last): the checkpoint exists iff this does
    <root>/latest                                the newest committed directory's name, for tools and people

Every small file is written to a temporary name, fsynced, renamed over the target and the directory fsynced, so a
process killed at any instant leaves either the old or the new file, never a torn one. A checkpoint is deleted by
first removing its marker (un-commit, atomic), then its files, so a crash mid-delete never leaves a committed-looking
partial directory.

Committed checkpoints are ordered by the marker's ``sequence`` (a commit counter rank 0 increments), not by step:
after a rollback the run re-saves lower steps, and the newest commit is the one to resume from even when an
abandoned timeline left committed checkpoints with higher steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader

logger = logging.getLogger("arc_engine")

MARKER_NAME = "COMMITTED.json"
LATEST_NAME = "latest"
DCP_METADATA_NAME = ".metadata"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_CHUNK_BYTES = 8 << 20
_MARKER_FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, committed or loaded; the message names the directory and the file."""


@dataclass(frozen=True)
class CommitInfo:
    """One committed checkpoint, as its marker describes it."""

    step: int
    path: Path
    world_size: int
    pinned: bool
    metadata: dict
    files: dict[str, str]
    sequence: int = 0
    created_unix: float = field(default=0.0, compare=False)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def dir_step(path: Path) -> int | None:
    """The step a ``step_XXXXXXXX`` directory holds, or None for any other name."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def report_name(rank: int) -> str:
    return f"checksums.rank{rank}.json"


def file_checksum(path: Path) -> str:
    """CRC-32 of a file, 8 hex digits.

    CRC-32 because the threat is torn writes and bit rot, not an adversary: zlib's CRC-32 runs at several GB/s
    (about 4 GB/s here, against ~1.8 GB/s for SHA-1 and ~0.7 GB/s for MD5) and releases the GIL on large buffers,
    so checksumming in the background barely competes with the training thread.
    """
    crc = 0
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, payload: bytes) -> None:
    """Replace ``path`` with ``payload`` atomically and durably: tmp file, fsync, rename, fsync of the directory."""
    tmp_path = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp_path, "wb") as stream:
            stream.write(payload)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp_path, path)
    except BaseException:  # a full disk, an I/O error: no temporary file is left behind
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, record: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(record, indent=1, sort_keys=True).encode())


# ------------------------------------------------------------------------------------------------ rank reports

def write_rank_report(step_dir: Path, rank: int, save_id: str | None, files: dict[str, str] | None,
                      error: str | None = None) -> None:
    """Rank ``rank``'s part of the commit: checksums of the files it wrote, or the error that stopped it. Local."""
    write_json_atomic(step_dir / report_name(rank), {"rank": rank, "save_id": save_id, "files": files,
                                                    "error": error})


#: Where a rank's report is when it could not be written to disk (a full disk): ``elsewhere(rank)``, or None.
ReportsElsewhere = Callable[[int], "dict[str, Any] | None"]


def await_rank_reports(step_dir: Path, world_size: int, deadline: float,
                       elsewhere: ReportsElsewhere | None = None) -> dict[int, dict[str, Any]]:
    """Rank 0: poll (bounded by the ``time.monotonic()`` ``deadline``) until every rank's report is on disk, or
    ``elsewhere`` (the job's store: a rank that could not write its report file posts its error there); the reports
    that arrived, by rank. Waiting for all of them, a failed save's directory is removed only once no rank will
    write into it any more (else a late rank's report would outlive the removal). No collectives."""
    reports: dict[int, dict[str, Any]] = {}
    pause_s = 0.01
    while len(reports) < world_size:
        for rank in range(world_size):
            path = step_dir / report_name(rank)
            if rank not in reports and path.exists():
                reports[rank] = json.loads(path.read_text())
            elif rank not in reports and elsewhere is not None and (posted := elsewhere(rank)) is not None:
                reports[rank] = posted
        if len(reports) < world_size:
            if time.monotonic() > deadline:
                break
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, 0.5)
    return reports


def gather_rank_reports(step_dir: Path, world_size: int, save_id: str | None, deadline: float,
                        elsewhere: ReportsElsewhere | None = None) -> dict[str, str]:
    """Rank 0: every rank's report (:func:`await_rank_reports`); the union of their checksums. Raises
    CheckpointError naming the directory when a rank reported an error, a report belongs to another save, or ranks
    are still missing at the deadline. Reads files only, no collectives."""
    reports = await_rank_reports(step_dir, world_size, deadline, elsewhere)
    checksums: dict[str, str] = {}
    for rank, report in sorted(reports.items()):
        path = step_dir / report_name(rank)
        if report.get("error"):
            raise CheckpointError(f"{path}: rank {rank} failed to write its shard: {report['error']}")
        if report.get("save_id") != save_id:
            raise CheckpointError(f"{path}: report of another save ({report.get('save_id')} != {save_id})")
        checksums.update(report["files"])
    missing = sorted(set(range(world_size)) - set(reports))
    if missing:
        raise CheckpointError(f"{step_dir}: timed out waiting for the shard reports of ranks {missing}; "
                              "checkpoint not committed")
    return checksums


# ------------------------------------------------------------------------------------------------ markers

def marker_record(info: CommitInfo) -> dict[str, Any]:
    record = asdict(info)
    record["path"] = info.path.name
    record["format"] = _MARKER_FORMAT
    return record


def read_marker(step_dir: Path) -> CommitInfo | None:
    """The checkpoint committed in ``step_dir``, or None when it has no (valid) marker. Local; a marker that does not
    parse or names another step is logged and treated as absent."""
    path = step_dir / MARKER_NAME
    try:
        record = json.loads(path.read_text())
        info = CommitInfo(step=int(record["step"]), path=step_dir, world_size=int(record["world_size"]),
                          pinned=bool(record["pinned"]), metadata=dict(record["metadata"]),
                          files=dict(record["files"]), sequence=int(record["sequence"]),
                          created_unix=float(record.get("created_unix", 0.0)))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        logger.error("checkpoint %s: unreadable marker %s (%s); treating the checkpoint as not committed",
                     step_dir, path, err)
        return None
    if info.step != dir_step(step_dir):
        logger.error("checkpoint %s: marker %s names step %d; treating the checkpoint as not committed",
                     step_dir, path, info.step)
        return None
    return info


def write_marker(info: CommitInfo) -> None:
    write_json_atomic(info.path / MARKER_NAME, marker_record(info))


def step_dirs(root: Path) -> list[Path]:
    """Every ``step_*`` directory under ``root``, committed or not, by step."""
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if dir_step(path) is not None and path.is_dir()]
    return sorted(found, key=lambda path: dir_step(path) or 0)


def list_committed(root: Path) -> list[CommitInfo]:
    """Committed checkpoints under ``root``, oldest commit first. Local: reads the markers."""
    infos = [info for path in step_dirs(root) if (info := read_marker(path)) is not None]
    return sorted(infos, key=lambda info: info.sequence)


def remove_checkpoint(step_dir: Path) -> None:
    """Un-commit (remove the marker, durably) then delete ``step_dir``. Rank 0 only."""
    marker = step_dir / MARKER_NAME
    if marker.exists():
        marker.unlink()
        fsync_dir(step_dir)
    shutil.rmtree(step_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ commit

def commit_checkpoint(step_dir: Path, *, step: int, world_size: int, checksums: dict[str, str], expected: set[str],
                      pinned: bool, metadata: dict) -> CommitInfo:
    """Rank 0, with every rank's reported ``checksums`` (``gather_rank_reports``): check they cover the files DCP's
    metadata references (``expected``, ``.metadata`` included), write the marker, then move ``latest``.

    Raises CheckpointError (nothing committed, the previous checkpoint stays the newest) when a file is unreported.
    """
    unreported = sorted(expected - checksums.keys())
    if unreported:
        raise CheckpointError(f"{step_dir}: no rank reported a checksum for {unreported}; checkpoint not committed")
    files = {name: checksums[name] for name in sorted(expected)}
    previous = list_committed(step_dir.parent)
    sequence = 1 + max((info.sequence for info in previous), default=0)
    info = CommitInfo(step=step, path=step_dir, world_size=world_size, pinned=pinned, metadata=metadata,
                      files=files, sequence=sequence, created_unix=time.time())
    write_marker(info)
    write_atomic(step_dir.parent / LATEST_NAME, f"{step_dir.name}\n".encode())
    return info


def apply_retention(root: Path, keep_last: int, newest: CommitInfo) -> list[Path]:
    """Rank 0, right after committing ``newest``: delete committed checkpoints beyond the ``keep_last`` most recent
    commits unless pinned, and uncommitted directories of steps below ``newest.step`` (leftovers of killed saves;
    a save in flight on another rank always has a step dir at or above it). Returns the deleted directories."""
    committed = list_committed(root)
    keep = {info.path for info in committed[-keep_last:]} | {info.path for info in committed if info.pinned}
    keep.add(newest.path)
    committed_paths = {info.path for info in committed}
    doomed = [info.path for info in committed if info.path not in keep]
    doomed += [path for path in step_dirs(root)
               if path not in committed_paths and (dir_step(path) or 0) < newest.step]
    for path in doomed:
        remove_checkpoint(path)
    if doomed:
        fsync_dir(root)
        logger.info("checkpoint retention removed %s", ", ".join(path.name for path in doomed))
    return doomed


def verify_files(info: CommitInfo, names: list[str]) -> list[str]:
    """Check the named files of ``info`` against the marker's checksums. Local. Returns one problem per bad file,
    each naming the file's path (empty when all match)."""
    problems = []
    for name in names:
        path = info.path / name
        try:
            actual = file_checksum(path)
        except FileNotFoundError:
            problems.append(f"{path}: missing file")
            continue
        except OSError as err:
            problems.append(f"{path}: unreadable ({err})")
            continue
        if actual != info.files[name]:
            problems.append(f"{path}: checksum mismatch (marker {info.files[name]}, file {actual})")
    return problems


def referenced_files(dcp_metadata: Any) -> set[str]:
    """The data files DCP's metadata points into (relative names)."""
    return {storage.relative_path for storage in dcp_metadata.storage_data.values()}


def metadata_problems(info: CommitInfo) -> list[str]:
    """Check ``.metadata`` (checksum, then contents) against the marker: every data file it references is listed,
    and written by a rank below the marker's world size. Local."""
    path = info.path / DCP_METADATA_NAME
    if DCP_METADATA_NAME not in info.files:
        return [f"{info.path}: marker lists no {DCP_METADATA_NAME}"]
    problems = verify_files(info, [DCP_METADATA_NAME])
    if problems:
        return problems
    try:
        referenced = referenced_files(FileSystemReader(info.path).read_metadata())
    except Exception as err:
        return [f"{path}: unreadable DCP metadata ({err})"]
    problems = [f"{path}: references {name}, which the marker does not list"
                for name in sorted(referenced - info.files.keys())]
    for name in sorted(referenced):
        writer = name[2:].split("_", 1)[0]
        if writer.isdigit() and int(writer) >= info.world_size:
            problems.append(f"{info.path / name}: written by rank {writer}, marker says world_size "
                            f"{info.world_size}")
    return problems

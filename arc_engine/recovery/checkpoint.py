"""Persistent, sharded, asynchronous, crash-safe checkpoints on torch.distributed.checkpoint (DCP).

``CheckpointManager.save_async`` copies the state to host buffers (``arc_engine.recovery.staging``; training may
mutate its tensors as soon as it returns), runs ``dcp.save`` in a background thread on a dedicated gloo group
(DCP's collectives must never interleave with training collectives on the default group), and hands the commit
to a worker thread: each rank checksums the files it wrote and reports them; rank 0 waits (bounded)
for every report, writes the commit marker and moves ``latest`` (``arc_engine.recovery.commit``: the layout and
the protocol). A checkpoint is visible only once its marker exists, so a process killed mid-save leaves the
previous checkpoint the newest one.

``load_latest`` verifies the newest commit's checksums (the files spread over the ranks, one agreed verdict) and
loads it in place with ``dcp.load``, falling back to older commits on any mismatch.

The files inside a checkpoint directory are DCP's by default (keys chosen by the backend's ``TrainState``); a
backend may bring its own :class:`DiskFormat` (megatron-core: ``dist_checkpointing``'s format, which Megatron
users load with their own tools). The commit protocol around it is the same.

Multi-node: DCP's ``FileSystemWriter`` writes one directory from every rank, so ``root`` must be on a filesystem
that every rank sees (NFS, Lustre, GPFS, ...), as must the markers this module reads.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import functools
import json
import logging
import queue
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner

from arc_engine import internals, runtime
from arc_engine.recovery.commit import (
    DCP_METADATA_NAME,
    LATEST_NAME,
    CheckpointError,
    CommitInfo,
    apply_retention,
    await_rank_reports,
    commit_checkpoint,
    file_checksum,
    fsync_dir,
    gather_rank_reports,
    list_committed,
    metadata_problems,
    read_marker,
    referenced_files,
    remove_checkpoint,
    step_dir_name,
    verify_files,
    write_atomic,
    write_marker,
    write_rank_report,
)
from arc_engine.recovery.portable import SafeLoadPlanner
from arc_engine.recovery.staging import HostStager, ReplicaOwners

__all__ = ["CheckpointError", "CheckpointManager", "CommitInfo", "DiskFormat"]

logger = logging.getLogger("arc_engine")



class DiskFormat(Protocol):
    """A backend's own layout inside a checkpoint directory, written by DCP on the checkpoint group.

    ``prepare_save`` runs on the caller's thread of every rank (it may be collective over the whole job, as the
    save itself is): it returns the DCP state dict to write -- its tensors copied to host memory by ``stage`` (a
    :meth:`HostStager.stage`), so training may change them as soon as ``save_async`` returns -- and the planner.
    The coordinator also writes the files ``common_files`` names into ``step_dir`` (created already), which it
    then checksums with its shards.
    ``load`` loads the checkpoint at ``path`` into the live state (collective over the job) and puts into
    ``state_dict`` -- what the recovery tier asked for -- the entries that are not the model or optimizer.
    ``publish`` runs on the coordinator after each commit and retention pass, with every committed checkpoint
    (oldest first): it keeps the backend's own index of the root up to date (e.g. the names its loader looks for);
    an OSError there is logged, the commit stands."""

    name: str
    common_files: tuple[str, ...]

    def prepare_save(self, step: int, state_dict: dict[str, Any], step_dir: Path, *, coordinator: bool,
                     stage: Callable[[dict], dict]) -> tuple[dict[str, Any], SavePlanner | None]: ...

    def load(self, path: Path, state_dict: dict[str, Any]) -> None: ...

    def publish(self, root: Path, committed: list[CommitInfo]) -> None: ...


@dataclass
class _SaveJob:
    """One save in flight on this rank: DCP's upload future, and ``finished`` once the worker has reported (and on
    rank 0 committed) it."""

    step: int
    step_dir: Path
    pinned: bool
    metadata: dict
    upload: Any  # concurrent.futures.Future[Metadata]
    number: int = 0  # the how-manyth save of this manager: equal on every rank (save_async is collective)
    finished: threading.Event = field(default_factory=threading.Event)
    expected_files: set[str] = field(default_factory=set)
    commit: CommitInfo | None = None

    def done(self) -> bool:
        return self.upload.done() and self.finished.is_set()


class CheckpointManager:
    """Sharded asynchronous checkpoints under ``root`` with a commit protocol, retention and verified loading.

    Construction is collective when torch.distributed is initialized: every rank creates the dedicated gloo group
    (``dist.new_group``, so every rank must construct its managers in the same order as its other groups), unless
    ``process_group`` is given. Without torch.distributed the manager runs single-process and issues no collectives.
    ``commit_timeout_s`` bounds every wait: for the upload, for the ranks' reports, for the previous save, and is
    the timeout of the dedicated group's collectives. ``keep_last`` committed checkpoints are kept, plus pinned ones.
    """

    def __init__(self, root: str | Path, *, keep_last: int = 3, process_group: dist.ProcessGroup | None = None,
                 commit_timeout_s: float = 600.0, disk_format: DiskFormat | None = None,
                 on_event: Callable[[str, str, dict[str, Any]], None] | None = None) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: must be >= 1")
        if commit_timeout_s <= 0:
            raise ValueError(f"commit_timeout_s={commit_timeout_s}: must be > 0")
        self.root = Path(root)
        self.keep_last = keep_last
        self.commit_timeout_s = commit_timeout_s
        self.disk_format = disk_format
        self._group = self._checkpoint_group(process_group)
        self.rank = dist.get_rank(self._group) if self._group is not None else 0
        self.world_size = dist.get_world_size(self._group) if self._group is not None else 1
        if self.rank < 0:
            raise ValueError("this rank is not a member of the checkpoint process_group")
        self.root.mkdir(parents=True, exist_ok=True)
        self._stager = HostStager()
        self._owners = ReplicaOwners(self._group, self.rank, self.world_size) if self._group is not None else None
        self._job: _SaveJob | None = None
        self._jobs: queue.SimpleQueue[_SaveJob | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None  # started at the first save
        # runs each save's dcp.save, one at a time: one thread for the manager's life (dcp.async_save starts one
        # per save, inside the caller's stall), started at the first save
        self._uploader: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # marker rewrites (pin) vs. commit + retention on rank 0
        self._closed = False
        self.last_stall_s = 0.0  # wall time the last save_async blocked the caller
        self.last_staged_bytes = 0  # tensor bytes the last save_async copied on this rank
        self.last_save_error: BaseException | None = None
        self.last_load_errors: list[str] = []
        # what happened to the saves this rank started (rank 0 alone knows which committed)
        self.saves = {"started": 0, "committed": 0, "failed": 0}
        self.on_event = on_event  # (what, message, values): a failed save, cleanup or fallback, for the sinks
        # a rank that cannot write its report file (a full disk) posts it here: the job's store, and this rank's own
        self._store = runtime.default_store() if self._group is not None else None
        self._store_prefix = f"arc/checkpoint/{zlib.crc32(str(self.root.resolve()).encode()):08x}/"
        self._own_posts: dict[int, dict[str, Any]] = {}
        self._atexit_hook = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._atexit_hook)

    def _checkpoint_group(self, process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if process_group is not None:
            return process_group
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=self.commit_timeout_s))

    @property
    def in_flight(self) -> bool:
        """Whether this rank still has work of a save pending (its upload, its report, on rank 0 the commit)."""
        return self._job is not None and not self._job.done()

    # -------------------------------------------------------------------------------------------- saving

    def save_async(self, step: int, state_dict: dict[str, Any], *, pinned: bool = False,
                   metadata: dict | None = None, stable: Collection[torch.Tensor] = ()) -> None:
        """Start saving ``state_dict`` as checkpoint ``step``. Collective over the checkpoint group: every rank calls
        it with the same step. Returns once every tensor this rank writes is copied to host memory (a replicated
        tensor is copied and written by one rank, see ``staging``); the write, the checksums and the commit
        continue in the background (``wait``, ``close``). First waits, bounded by ``commit_timeout_s``,
        for the previous save; raises CheckpointError if it is still running (this save is then not started).

        ``state_dict``: nested dicts/lists of tensors (plain or DTensor) and picklable objects, as ``dcp.save``
        takes; per-rank entries need per-rank keys, equal keys across ranks are one replicated entry.
        ``metadata``: JSON-able, stored in the commit marker. ``stable``: host tensors of ``state_dict`` that the
        caller keeps unchanged until this save is done (``in_flight`` is False): written as they are, not copied
        (e.g. a verified snapshot's copies of the live state; only with DCP's own format). A committed checkpoint of
        the same step (a re-save after a rollback) is replaced."""
        started = time.perf_counter()
        self._check_open()
        metadata = dict(metadata or {})
        try:
            json.dumps(metadata)
        except TypeError as err:
            raise ValueError(f"save_async(metadata=...): must be JSON-serialisable ({err})") from None
        if not self.wait(self.commit_timeout_s):
            raise CheckpointError(f"{self._job.step_dir}: previous save still in flight after "
                                  f"{self.commit_timeout_s}s; not starting step {step}")
        step_dir = self.root / step_dir_name(step)
        if self.rank == 0 and step_dir.exists():
            self._clear_step_dir(step_dir)
        planner: SavePlanner | None = None
        if self.disk_format is not None:
            if self.rank == 0:
                step_dir.mkdir(parents=True, exist_ok=True)
            staged, planner = self.disk_format.prepare_save(step, state_dict, step_dir, coordinator=self.rank == 0,
                                                            stage=self._stager.stage)
        else:
            skipped = self._owners.skipped(state_dict) if self._owners is not None else frozenset()
            staged = self._stager.stage(state_dict, skipped, frozenset(id(t) for t in stable))
        self.last_staged_bytes = self._stager.nbytes
        if self._worker is None:  # before the upload's thread exists: starting it then would wait for the GIL
            self._worker = threading.Thread(target=self._work, name="arc-checkpoint-commit", daemon=True)
            self._worker.start()
            self._uploader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="arc-checkpoint-upload")
        assert self._uploader is not None
        # staged already: DCP's own save in the background, on the checkpoint group (what dcp.async_save does, less
        # its staging and its thread per save)
        upload = self._uploader.submit(dcp.save, staged, storage_writer=FileSystemWriter(step_dir, sync_files=True),
                                       planner=planner, process_group=self._group, no_dist=self._group is None)
        self._job = _SaveJob(step=step, step_dir=step_dir, pinned=pinned, metadata=metadata, upload=upload,
                             number=self.saves["started"])
        self.saves["started"] += 1
        self._jobs.put(self._job)
        self.last_stall_s = time.perf_counter() - started

    def _clear_step_dir(self, step_dir: Path) -> None:
        """Rank 0, before DCP starts: remove a killed save's leftovers or a committed checkpoint of the same step.
        Safe against other ranks: none writes into the directory before DCP's planning collective, which needs
        rank 0, and rank 0 joins it only after this returns."""
        previous = read_marker(step_dir)
        if previous is not None:
            logger.warning("checkpoint %s: replacing the committed checkpoint of step %d%s", step_dir,
                           previous.step, " (pinned)" if previous.pinned else "")
        remove_checkpoint(step_dir)

    def _work(self) -> None:
        """The worker thread: finish the saves handed over, one at a time, until ``close`` sends None."""
        while (job := self._jobs.get()) is not None:
            try:
                self._finish_save(job)
            finally:
                job.finished.set()

    def _finish_save(self, job: _SaveJob) -> None:
        """Worker thread: wait for DCP's upload, report this rank's checksums, and on rank 0 commit. Never
        raises and issues no collectives; a failure is logged and leaves the checkpoint uncommitted."""
        deadline = time.monotonic() + self.commit_timeout_s  # bounds the upload and the commit together
        try:
            save_id = self._report(job, deadline)
            if self.rank == 0:
                self._commit(job, save_id, deadline)
                self.saves["committed"] += 1
        except BaseException as err:
            self.last_save_error = err
            self.saves["failed"] += 1
            reason = _failure_reason(err)
            logger.error("checkpoint %s: save of step %d failed, not committed: %s", job.step_dir, job.step, reason)
            cleanup = ""
            if self.rank == 0:  # the partial shards and the ranks' checksum reports go; the previous commit stays
                try:
                    # no rank writes there after (a rank whose disk is full has posted its report instead)
                    await_rank_reports(job.step_dir, self.world_size, deadline, self._posted_reports(job))
                    remove_checkpoint(job.step_dir)
                    cleanup = "; its files were removed"
                except OSError as clean_err:
                    cleanup = f"; removing its files failed too: {clean_err}"
            self._emit("checkpoint_failed", f"checkpoint of step {job.step} failed on rank {self.rank}, not "
                       f"committed ({reason}){cleanup}; the newest committed checkpoint stays the one to load",
                       {"step": job.step, "path": str(job.step_dir), "reason": reason, "rank": self.rank,
                        "saves": dict(self.saves)})

    def _emit(self, what: str, message: str, values: dict[str, Any]) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(what, message, values)
        except Exception as err:  # reporting must never break a save or a load
            logger.warning("checkpoint %s: reporting %s failed: %s", self.root, what, err)

    def _report(self, job: _SaveJob, deadline: float) -> str | None:
        """Wait for the upload, then write this rank's report; on failure report the error and re-raise."""
        save_id = None
        try:
            dcp_metadata = job.upload.result(timeout=max(0.0, deadline - time.monotonic()))
            if internals.dcp_storage_data_missing(dcp_metadata):  # torch < 2.10 fills in a copy: read what it wrote
                dcp_metadata = FileSystemReader(job.step_dir).read_metadata()
            save_id = internals.dcp_save_id(dcp_metadata)
            job.expected_files = {DCP_METADATA_NAME, *referenced_files(dcp_metadata), *self._common_files()}
            checksums = {name: file_checksum(job.step_dir / name) for name in self._own_files(job.expected_files)}
        except BaseException as err:
            # rank 0 removes a failed save's directory only after every report arrived (or its deadline passed;
            # a report later than that is removed by the next commit's retention)
            self._write_report(job, save_id, None, error=f"{type(err).__name__}: {err}")
            raise
        self._write_report(job, save_id, checksums)
        return save_id

    def _write_report(self, job: _SaveJob, save_id: str | None, files: dict[str, str] | None,
                      error: str | None = None) -> None:
        """This rank's report, on disk; where that fails (a full disk, an unwritable directory) it is posted as an
        error to the job's store (and kept here for rank 0's own wait), so rank 0 learns of the failure at once
        instead of waiting for a file until the save's deadline. Raises the write's error when it failed."""
        try:
            job.step_dir.mkdir(parents=True, exist_ok=True)
            write_rank_report(job.step_dir, self.rank, save_id, files, error=error)
        except OSError as err:
            why = f"{type(err).__name__}: {err}"
            record = {"rank": self.rank, "save_id": save_id, "files": None,
                      "error": f"{error}; writing its report failed too: {why}" if error else
                      f"writing its report failed: {why}"}
            self._own_posts[job.number] = record
            if self._store is not None:
                with contextlib.suppress(Exception):
                    self._store.set(f"{self._store_prefix}{job.number}/{self.rank}", json.dumps(record))
            if error is None:
                raise

    def _posted_reports(self, job: _SaveJob) -> Callable[[int], dict[str, Any] | None]:
        """Rank 0's look-up of a report posted instead of written (:meth:`_write_report`): never blocks."""
        def posted(rank: int) -> dict[str, Any] | None:
            if rank == self.rank:
                return self._own_posts.get(job.number)
            if self._store is None:
                return None
            key = f"{self._store_prefix}{job.number}/{rank}"
            try:
                return json.loads(self._store.get(key)) if self._store.check([key]) else None
            except Exception:  # the store is an aid to a failed save's report, never a new way to fail
                return None
        return posted

    def _own_files(self, expected: set[str]) -> list[str]:
        """The files this rank wrote: DCP prefixes them ``__<group rank>_``; the coordinator adds ``.metadata``."""
        prefix = f"__{self.rank}_"
        owned = sorted(name for name in expected if name.startswith(prefix))
        return [DCP_METADATA_NAME, *self._common_files(), *owned] if self.rank == 0 else owned

    def _common_files(self) -> tuple[str, ...]:
        return self.disk_format.common_files if self.disk_format is not None else ()

    def _commit(self, job: _SaveJob, save_id: str | None, deadline: float) -> None:
        """Rank 0: gather the reports (no lock held: ``pin`` must not block on the poll), then commit and apply
        retention under the lock that ``pin`` takes."""
        checksums = gather_rank_reports(job.step_dir, self.world_size, save_id, deadline, self._posted_reports(job))
        with self._lock:
            info = commit_checkpoint(job.step_dir, step=job.step, world_size=self.world_size, checksums=checksums,
                                     expected=job.expected_files, pinned=job.pinned, metadata=job.metadata)
            job.commit = info
            logger.info("checkpoint %s committed (step %d, %d files)", info.path, info.step, len(info.files))
            try:
                apply_retention(self.root, self.keep_last, info)
            except OSError as err:  # the commit stands; old checkpoints stay until the next retention pass
                logger.warning("checkpoint %s: retention failed: %s", self.root, err)
            self._publish()

    def _publish(self) -> None:
        """Rank 0, under the lock: the backend's own index of the root, from the committed checkpoints. An OSError
        is logged: the commits stand, and the index is fixed at the next commit."""
        if self.disk_format is not None:
            try:
                self.disk_format.publish(self.root, list_committed(self.root))
            except OSError as err:
                logger.warning("checkpoint %s: publishing for %s failed: %s", self.root, self.disk_format.name, err)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until this rank's save in flight (upload, report, and on rank 0 the commit) is done. Local. True if
        nothing is left in flight. ``None`` waits as long as the save's own bounds (``commit_timeout_s``) allow.
        After rank 0's ``wait`` returns True its commit is on disk; other ranks see it after syncing with rank 0."""
        job = self._job
        if job is None:
            return True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        job.finished.wait(timeout=timeout_s)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            job.upload.exception(timeout=remaining)
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            return False
        return job.done()

    def close(self) -> None:
        """Drain the save in flight (bounded by ``commit_timeout_s``) and release the manager. Local, idempotent,
        safe at interpreter exit (it also runs from an ``atexit`` hook). The dedicated group is destroyed with the
        default group by the caller's ``destroy_process_group()``."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit_hook)
        drained = self.wait(self.commit_timeout_s)
        if not drained:
            logger.error("checkpoint %s: save still in flight at close after %ss; it stays uncommitted",
                         self._job.step_dir, self.commit_timeout_s)
        if self._worker is not None:
            self._jobs.put(None)
            if drained:
                self._worker.join(timeout=self.commit_timeout_s)
        if self._uploader is not None:
            self._uploader.shutdown(wait=False)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self.root}: checkpoint manager is closed")

    # -------------------------------------------------------------------------------------------- inspecting

    def committed(self) -> list[CommitInfo]:
        """Committed checkpoints on disk, oldest commit first. Local (reads the markers)."""
        return list_committed(self.root)

    def latest(self, lineage: str | None = None) -> CommitInfo | None:
        """The newest commit, which the ``latest`` file names (of that ``lineage`` if given: one run's history).
        Local. Decided by the markers' commit sequence, not the pointer file, so a crash between marker and pointer
        cannot hide a commit."""
        committed = [info for info in self.committed() if lineage is None or info.metadata.get("lineage") == lineage]
        return committed[-1] if committed else None

    def agreed(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank of the checkpoint group (itself without one). Collective."""
        if self._group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._group, 0), group=self._group)
        return box[0]

    def pin(self, step: int) -> None:
        """Mark checkpoint ``step`` pinned: retention never deletes it. Call on any ranks; only rank 0 acts: it
        rewrites the marker atomically, or, for the save still in flight, pins it at commit. Raises ValueError on
        rank 0 when ``step`` is neither committed nor in flight."""
        if self.rank != 0:
            return
        with self._lock:
            job = self._job
            if job is not None and job.step == step and job.commit is None and not job.done():
                job.pinned = True
                return
            info = read_marker(self.root / step_dir_name(step))
            if info is None:
                raise ValueError(f"pin({step}): no committed checkpoint in {self.root / step_dir_name(step)}")
            if not info.pinned:
                write_marker(replace(info, pinned=True))

    # -------------------------------------------------------------------------------------------- loading

    def load_latest(self, build_state_dict: Callable[[CommitInfo], dict[str, Any]], *,
                    max_step: int | None = None, matches: Callable[[CommitInfo], bool] | None = None,
                    lineage: str | None = None) -> tuple[CommitInfo, dict[str, Any]] | None:
        """Load the newest committed checkpoint (of step <= ``max_step`` if given) that verifies. Collective over the
        checkpoint group; every rank takes the same checkpoint.

        Rank 0's list of commits is broadcast; for each, newest first, the ranks verify the files' checksums (file
        i by rank i % world) and rank 0 checks DCP's ``.metadata`` against the marker, one ``all_gather_object``
        agrees on the verdict, then ``state_dict = build_state_dict(info)`` is loaded in place by ``dcp.load``.
        A bad file or a ``dcp.load`` failure is logged (naming the file), recorded in ``last_load_errors`` on every
        rank, and the next older commit is tried. A ValueError from ``build_state_dict`` (e.g. an impossible
        reshard) propagates. Returns None when nothing is committed; raises CheckpointError when nothing loads.
        ``matches``: only the commits it accepts (e.g. those of a trainer's resumed step) in the newest commit's
        history (its ``lineage``: a run that did not resume the directory's commits starts another), where there
        are some; else every commit. ``lineage``: only the commits of that history (a rollback's: the
        running job's own)."""
        self._check_open()
        if not self.wait(self.commit_timeout_s):
            raise CheckpointError(f"{self._job.step_dir}: a save is still in flight; not loading")
        self.last_load_errors = []
        candidates = self._agreed_candidates(max_step)
        if lineage is not None:
            candidates = [info for info in candidates if info.metadata.get("lineage") == lineage]
        if matches is not None and candidates:
            lineage = candidates[0].metadata.get("lineage")
            candidates = [info for info in candidates if matches(info)
                          and info.metadata.get("lineage") == lineage] or candidates
        for info in candidates:
            problems = self._agreed_problems(info)
            if not problems:
                state_dict = build_state_dict(info)
                problem = self._load_into(info, state_dict)
                if problem is None:
                    return info, state_dict
                problems = [problem]
            self._record_fallback(info, problems)
        if not candidates:
            return None
        raise CheckpointError(f"{self.root}: no committed checkpoint loads: {'; '.join(self.last_load_errors)}")

    def discard_after(self, info: CommitInfo) -> list[Path]:
        """Remove the commits made after ``info`` (a resume went back to it: they hold a run that went past it),
        point ``latest`` at ``info`` and refresh the backend's index. Collective over the checkpoint group (rank
        0's list is everyone's); rank 0 removes. Returns the removed directories, on every rank."""
        self._check_open()
        newer = [other.path for other in self._agreed_candidates(None) if other.sequence > info.sequence]
        if self.rank == 0 and newer:
            with self._lock:
                for path in newer:
                    remove_checkpoint(path)
                write_atomic(self.root / LATEST_NAME, f"{info.path.name}\n".encode())
                fsync_dir(self.root)
                self._publish()
        return newer

    def _agreed_candidates(self, max_step: int | None) -> list[CommitInfo]:
        candidates = [info for info in reversed(self.committed()) if max_step is None or info.step <= max_step]
        if self._group is None:
            return candidates
        box = [candidates]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._group, 0), group=self._group)
        return box[0]

    def _agreed_problems(self, info: CommitInfo) -> list[str]:
        """This rank's share of the verification, then one all_gather_object: every rank gets every problem."""
        data_files = sorted(name for name in info.files if name != DCP_METADATA_NAME)
        problems = verify_files(info, data_files[self.rank::self.world_size])
        if self.rank == 0:
            problems = metadata_problems(info) + problems
        if self._group is None:
            return problems
        gathered: list[list[str] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, problems, group=self._group)
        return [problem for rank_problems in gathered for problem in rank_problems or []]

    def _load_into(self, info: CommitInfo, state_dict: dict[str, Any]) -> str | None:
        """dcp.load in place (or the backend's format); the problem on failure, else None. DCP raises on every rank;
        a format's load is agreed: a failure on any rank is every rank's."""
        if self.disk_format is None:
            planner = SafeLoadPlanner()
            try:
                dcp.load(state_dict, storage_reader=FileSystemReader(info.path), process_group=self._group,
                         no_dist=self._group is None, planner=planner)
            except (Exception, CheckpointException) as err:
                return f"{info.path}: dcp.load failed: {_first_lines(str(err))}"
            return self._unloaded_entries(info, planner)
        problem = None
        try:
            self.disk_format.load(info.path, state_dict)
        except (Exception, CheckpointException) as err:
            problem = f"{info.path}: {self.disk_format.name} load failed on rank {self.rank}: " \
                      f"{_first_lines(f'{type(err).__name__}: {err}')}"
        if self._group is None:
            return problem
        gathered: list[str | None] = [None] * self.world_size
        dist.all_gather_object(gathered, problem, group=self._group)
        failed = [p for p in gathered if p is not None]
        return "; ".join(failed) if failed else None

    def _unloaded_entries(self, info: CommitInfo, planner: Any) -> str | None:
        """The problem when the checkpoint holds entries that no rank of this job asked for (DCP loads only the
        requested keys and skips the others without a word: a state dict that lacks, say, optimizer moments
        would leave them as they are); None when every entry was loaded by some rank. Other ranks' RNG states
        are exempt (not restored after a world-size change, by design). Collective over the checkpoint group
        (one ``all_gather_object`` of the requested keys, at load only)."""
        requested = set(planner.state_dict)
        if self._group is not None:
            gathered: list[list[str] | None] = [None] * self.world_size
            dist.all_gather_object(gathered, sorted(requested), group=self._group)
            requested = {key for keys in gathered for key in keys or ()}
        unloaded = sorted(key for key in planner.metadata.state_dict_metadata
                          if key not in requested and not key.startswith("arc_rng/"))
        if not unloaded:
            return None
        return (f"{info.path}: holds {len(unloaded)} entries no rank of this job loads (the training state "
                f"differs from the one saved: another model, optimizer or layout?), e.g. {', '.join(unloaded[:3])}")

    def _record_fallback(self, info: CommitInfo, problems: list[str]) -> None:
        self.last_load_errors.extend(problems)
        if self.rank == 0:
            for problem in problems:
                logger.error("checkpoint of step %d unusable: %s; falling back to an older commit", info.step,
                             problem)
        self._emit("checkpoint_fallback", f"checkpoint of step {info.step} ({info.path}) skipped: "
                   f"{_first_lines('; '.join(problems), 400)}; trying an older commit",
                   {"step": info.step, "path": str(info.path), "problems": problems})


def _failure_reason(err: BaseException) -> str:
    """What made a save fail, in one line: DCP's ``CheckpointException`` by each failing rank's own error (a full
    disk reads ``rank 1: OSError: [Errno 28] No space left on device``), anything else by its first lines."""
    if isinstance(err, CheckpointException) and err.failures:
        parts = []
        for rank, (cause, _trace) in sorted(err.failures.items()):
            parts.append(f"rank {rank}: {type(cause).__name__}: {str(cause).strip().splitlines()[0][:200]}"
                         if str(cause).strip() else f"rank {rank}: {type(cause).__name__}")
        return _first_lines("; ".join(parts), 400)
    return _first_lines(f"{type(err).__name__}: {err}", 400)


def _first_lines(text: str, limit: int = 800) -> str:
    return text if len(text) <= limit else f"{text[:limit]} ..."


def _close_at_exit(manager_ref: weakref.ref) -> None:
    manager = manager_ref()
    if manager is not None:
        manager.close()

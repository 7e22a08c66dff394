"""Recovery: verified-stable snapshots (memory ring, then disk), rollback, heal and escape, resume after restart.

How a step flows (every rank, same order, driven by agreed decisions only):

1. **step start** (:meth:`Recovery.on_step_start`, a forward pre-hook: nothing of the step has run yet). When
   ``checkpoint_freq`` healthy steps have passed, a *candidate* snapshot of this state is taken (after the loop
   stepped its scheduler: the state the next step starts from).
2. **decision** (:meth:`Recovery.on_decision`, inside the optimizer step, before anything is applied). The
   candidate is verified-stable if this step, computed from exactly that state, is healthy: it enters the ring,
   and every ``checkpoint.every_steps`` it is also saved to disk (async: the live tensors are staged, the write
   runs in the background). A ROLLBACK decision is resolved into rollback / escape / abort here.
3. **step end** (:meth:`Recovery.on_step_end`, after the optimizer step). For a rollback it picks the target;
   :meth:`Recovery.settle` then carries it out where the framework's own step has returned (the torch optimizer's
   step post-hook, megatron-core's ``optimizer.step()``, DeepSpeed's ``engine.step()``): every state tensor is
   copied back in place (memory ring, else the newest committed disk checkpoint, loaded collectively there), with
   RNG, scheduler, framework counters and the detectors' baselines, and the engine's step and data position are
   set together with them, so nothing outside arc_engine (a trainer's save, log or evaluation) ever sees a rewound
   counter beside the rejected tensors. An escape then perturbs the weights. A restore not settled by the step's
   end (an adapter that cannot tell it) is carried out at the next step start as a fallback.

The healing learning-rate factor and the optional tighter clipping are applied by the integrations around each
optimizer step (:attr:`Recovery.lr_factor`, :meth:`Recovery.clip_coefficient`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
import uuid
import weakref
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from arc_engine import runtime
from arc_engine.config.errors import ArcSetupError
from arc_engine.events import Action, Finding, Severity
from arc_engine.policy.decision import EXIT_RELAUNCH, Decision
from arc_engine.recovery import portable
from arc_engine.recovery.checkpoint import CheckpointManager, CommitInfo, DiskFormat
from arc_engine.recovery.controller import RecoveryController
from arc_engine.recovery.snapshot import (
    Snapshot,
    SnapshotRing,
    capture,
    from_snapshot,
    restore,
    ring_budget_bytes,
    ring_capacity,
    rng_state,
    set_rng_state,
    state_bytes,
)
from arc_engine.recovery.state import TrainState
from arc_engine.stats import names

if TYPE_CHECKING:
    from arc_engine.step_hooks import EngineAccess

log = logging.getLogger("arc_engine")

#: What ``recovery.rollback: relaunch`` writes in the run directory before every rank stops with exit code 7.
RELAUNCH_FILE = "relaunch.json"


@dataclass
class PendingRestore:
    """A rollback planned at step end, carried out when the framework's step has returned (:meth:`Recovery.settle`)."""

    snapshot: Snapshot | None  # memory tier; None: disk tier
    disk_step: int | None
    escape: bool
    data_position: int         # where the data resumes (independent of the restored state)
    step: int                  # the restored state's step
    applied_steps: int | None  # the restored state's applied steps (where it recorded them)


class Recovery:
    """Per-rank recovery for one engine (:class:`arc_engine.step_hooks.Recovering`). Construct on every rank, then
    :meth:`start` (collective)."""

    def __init__(self, engine: EngineAccess, state: TrainState) -> None:
        self.engine = engine
        self.config = engine.config.recovery
        self.state = state
        #: the history this job's commits belong to, agreed at start: a new one unless a resume continues one (None:
        #: it resumed a commit written before histories were recorded; its rollbacks then consider every commit)
        self.lineage: str | None = uuid.uuid4().hex
        #: at a resume: arc_engine's newest commit where a trainer resumed a newer step of its own (not loaded)
        self.trainer_newer: CommitInfo | None = None
        self.controller = RecoveryController(self.config)
        self.ring = SnapshotRing(1, busy=self._saving_from)  # sized at the first capture, agreed across ranks
        # the snapshot whose host copies the last disk save writes (weak: an evicted one is not kept alive)
        self._disk_source: weakref.ref[Snapshot] | None = None
        self._ring_sized = False
        self.group: dist.ProcessGroup | None = None
        self.checkpoints: CheckpointManager | None = None
        self.candidate: Snapshot | None = None
        self.pending: PendingRestore | None = None
        self.capture_due = False
        self.force_disk = False  # a preventive checkpoint (Action.CHECKPOINT): the next verified snapshot to disk
        # The RNG a snapshot records: the state at the end of the previous optimizer step (the point its data
        # position and weights stand for), not at the next forward -- a loop that draws before its forward
        # (masking, noise) would otherwise resume one step's draws ahead.
        self._step_end_rng = rng_state()
        self.last_disk_step: int | None = None
        self.disk_saves = 0
        self.restores = {"memory": 0, "disk": 0}

    # ------------------------------------------------------------------ setup

    def start(self) -> None:
        """Collective (once, after the engine started): the dedicated gloo group, the checkpoint store, and the
        resume from its newest committed checkpoint when ``checkpoint.resume``."""
        if dist.is_initialized():
            timeout = timedelta(seconds=self.config.checkpoint.commit_timeout_s)
            ranks = dist.get_process_group_ranks(self.engine.group) if self.engine.group is not None else None
            if ranks is None or len(ranks) == dist.get_world_size():
                self.group = runtime.new_gloo_group("checkpoint", timeout)
            else:  # one of several data-parallel groups (e.g. beside tensor parallelism): only its members call
                self.group = runtime.new_gloo_group("checkpoint", timeout, ranks=ranks,
                                                    use_local_synchronization=True)
        ckpt = self.config.checkpoint
        if ckpt.enabled:
            root = Path(ckpt.dir) if ckpt.dir else self.engine.run_dir / "checkpoints"
            if not self._check_shared(root):
                return  # recovery.checkpoint.on_error: continue -- the disk tier is off, the memory tier stays
            self.checkpoints = CheckpointManager(root, keep_last=ckpt.keep_last, process_group=self.group,
                                                 commit_timeout_s=ckpt.commit_timeout_s,
                                                 disk_format=self._disk_format(), on_event=self._checkpoint_event)
            self.lineage = self.checkpoints.agreed(self.lineage)
            if ckpt.resume:
                self._resume()

    def _disk_format(self) -> DiskFormat | None:
        """The format ``recovery.checkpoint.format`` asks for: the backend's own (``native_disk_format``) for
        ``auto`` where it has one, None (arc_engine's DCP layout) otherwise. A backend format loads and saves
        through the whole job's collectives (megatron-core's ``dist_checkpointing``): the decision group must then
        be the whole job."""
        wanted = self.config.checkpoint.format
        fmt = self.state.native_disk_format() if wanted != "dcp" else None
        if wanted not in ("auto", "dcp") and (fmt is None or fmt.name != wanted):
            raise ValueError(f"arc_engine: recovery.checkpoint.format: {wanted} is not available for "
                             f"{type(self.state).__name__} (use auto or dcp)")
        if fmt is not None and self.group is not None and dist.get_world_size(self.group) != dist.get_world_size():
            if wanted == "auto":
                return None
            raise ValueError(f"arc_engine: recovery.checkpoint.format: {wanted} needs the decision group to be the "
                             "whole job (its saves and loads are collective over every rank); use dcp")
        return fmt

    def _check_shared(self, root: Path) -> bool:
        """Collective: the checkpoint directory must be writable, and every rank must see the same one (DCP writes
        one directory from all ranks; a node-local path would leave every commit waiting for shards it cannot see).
        Rank 0 writes a probe file, every rank reads it back. Raises ValueError on every rank, in one line, naming
        the directory and the reason (not writable) or the ranks that cannot see it. A directory rank 0 cannot
        write to, with ``checkpoint.on_error: continue``: an error event and False (the disk tier is off)."""
        leader = self.group is None or dist.get_rank(self.group) == 0
        probe = root / ".arc_shared_probe"
        token: list[str | None] = [f"{self.engine.run_id}-{time.time_ns()}" if leader else None]
        if leader:
            try:
                root.mkdir(parents=True, exist_ok=True)
                probe.write_text(token[0] or "")
            except OSError as err:
                token[0] = f"!{err.strerror or type(err).__name__}" + (f": {err.filename}" if err.filename else "")
        if self.group is not None:
            dist.broadcast_object_list(token, group_src=0, group=self.group)
        if token[0] is not None and token[0].startswith("!"):
            reason = f"recovery.checkpoint.dir {root} is not writable ({token[0][1:]})"
            if self.config.checkpoint.on_error == "continue":
                self.engine.emit_action(self.engine.progress.step, "checkpoint_disabled", Severity.ERROR,
                                        f"{reason}: disk checkpoints are off for this run (on_error: continue); "
                                        "rollbacks use the memory tier only", {"dir": str(root), "reason": reason},
                                        detector="checkpoint")
                return False
            raise ArcSetupError(f"{reason}; fix its permissions, choose another directory, or set "
                                "recovery.checkpoint.on_error: continue to train without disk checkpoints")
        if self.group is None:
            return True
        seen = False
        for _ in range(20):  # bounded: network filesystems may show a new file after a moment
            seen = probe.exists() and probe.read_text() == token[0]
            if seen:
                break
            time.sleep(0.1)
        ranks_seeing = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(ranks_seeing, (runtime.global_rank(), seen), group=self.group)
        blind = [rank for rank, ok in ranks_seeing if not ok]
        if blind:
            raise ValueError(f"arc_engine: recovery.checkpoint.dir {root} is not shared: ranks {blind} do not see "
                             "the file rank 0 wrote there; use a filesystem every rank sees (and the same path)")
        return True

    def _checkpoint_event(self, what: str, message: str, values: dict[str, Any]) -> None:
        """A failed save, its cleanup or a fallback at load (from the checkpoint worker thread or a load): an
        error event through every sink of this rank (W&B alert, console, JSONL)."""
        step = int(values.get("step", self.engine.progress.step))
        self.engine.emit_action(step, what, Severity.ERROR, message, values,
                                detector="checkpoint")

    def _resume(self) -> None:
        assert self.checkpoints is not None
        wanted = self.config.checkpoint.resume_step  # the trainer's resumed step, where a trainer callback set it
        counter = self.config.checkpoint.resume_counter

        def count(info: CommitInfo) -> int | None:  # the commit's step in the trainer's counting
            return info.step if counter == "step" else info.metadata.get("applied_steps")

        # (wanted is the config's, the same on every rank: the agreement below is made by all or none)
        newest = self.checkpoints.agreed(self.checkpoints.latest()) if wanted is not None else None
        newest_count = count(newest) if newest is not None else None
        if wanted is not None and newest_count is not None and newest_count < wanted:
            # the trainer's checkpoint is the newer state, and it holds everything arc_engine's would restore
            # (weights, optimizer, scheduler, counters; the data ledger is the run directory's): train on from it
            self.lineage = newest.metadata.get("lineage")  # the same history: older commits stay rollback targets
            self.trainer_newer = newest
            return
        loaded = self.checkpoints.load_latest(self._build_disk_state,
                                              matches=None if wanted is None else lambda info: count(info) == wanted)
        if loaded is None:
            return
        info, state_dict = loaded
        skipped = list(self.checkpoints.last_load_errors)
        self._apply_disk_state(info, state_dict, full=True)
        self.lineage = info.metadata.get("lineage")  # this job continues that history
        if wanted is not None and count(info) == wanted:
            discarded = self.checkpoints.discard_after(info)
            if discarded:
                self.engine.emit_lifecycle(
                    "checkpoints_discarded", f"resumed the checkpoint of the trainer's step {wanted}: removed the "
                    f"{len(discarded)} newer checkpoint(s) of the run that went past it "
                    f"({', '.join(path.name for path in discarded)})",
                    {"trainer_step": wanted, "paths": [str(path) for path in discarded]})
        self._step_end_rng = rng_state()  # the checkpoint's: what the next snapshot must record
        note = f"; {len(skipped)} newer checkpoint problem(s) skipped: {'; '.join(skipped)[:400]}" if skipped else ""
        self.engine.emit_lifecycle("resume", f"resumed from the checkpoint of step {info.step} ({info.path}){note}",
                                   {"step": info.step, "path": str(info.path), "skipped": skipped})

    # ------------------------------------------------------------------ step start

    def on_step_start(self, step: int) -> None:
        """At the first forward of step ``step`` (every rank). Takes the candidate snapshot when one is due and the
        step is monitored (or carries out a rollback that no :meth:`settle` did). May be collective (the first
        capture sizes the ring with one all-reduce)."""
        if self.pending is not None:
            self.settle()
        elif self.capture_due and self.engine.is_monitored():
            # a candidate is verified by its own step's decision: taken on a monitored step only (a due capture
            # waits for one), whatever the interval and wherever a skip or a rollback moved the healthy count
            self.capture_due = False
            with self.engine.own_work.section("recovery.snapshot"):
                if not self._ring_sized:
                    self._size_ring(state_bytes(self.state))
                # with no memory tier (capacity 0) only the python state is kept, for the disk save
                step = self.engine.progress.step
                self.candidate = capture(step, self.state, self._arc_extra(), rng=self._step_end_rng,
                                         into=self.ring.spare_buffers(), tensors=self.ring.capacity > 0)

    def _arc_extra(self) -> dict[str, Any]:
        return {"data_position": self.engine.progress.data_position,
                "monitors": self.engine.gathering.assembly.state_dict(),
                "step": self.engine.progress.step, "iteration": self.engine.progress.iteration,
                "applied_steps": self.engine.progress.applied_steps}

    def _size_ring(self, local_bytes: int) -> None:
        if self._ring_sized:
            return
        largest = torch.tensor([float(local_bytes)], dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)
        largest_bytes = int(largest.item())
        budget = ring_budget_bytes(self.config.memory_ring_mb, largest_bytes, runtime.host_memory_bytes(),
                                   runtime.local_world_size())
        self.ring = SnapshotRing(ring_capacity(budget, largest_bytes), busy=self._saving_from)
        self._ring_sized = True
        if self.ring.capacity == 0 and self.config.memory_ring_mb != 0:  # (0: the disk tier was asked for)
            # the budget is agreed (the largest rank's size, the same setting): every rank emits the same event
            where = "the disk tier" if self.config.checkpoint.every_steps else "nothing (no disk tier configured)"
            self.engine.emit_action(
                self.engine.progress.step, "memory_ring_off", Severity.WARNING,
                f"a snapshot ({largest_bytes / 2**20:.1f} MB on the largest rank) does not fit the memory ring's "
                f"{budget / 2**20:.1f} MB (recovery.memory_ring_mb = {self.config.memory_ring_mb}): rollbacks "
                f"restore from {where}", {"snapshot_mb": largest_bytes / 2**20, "budget_mb": budget / 2**20})

    # ------------------------------------------------------------------ decision

    def has_target(self) -> bool:
        """Whether a verified-stable state exists to roll back to (agreed: built from agreed decisions)."""
        return len(self.ring) > 0 or self.disk_saves > 0

    def on_decision(self, decision: Decision) -> Decision:
        """Resolve a rollback, then verify or drop the candidate. Call on every rank with the agreed decision,
        before the optimizer applies anything. May start an async disk save (collective on the checkpoint group)."""
        decision = self.controller.resolve(decision, has_target=self.has_target())
        if decision.action == Action.ROLLBACK and self.config.rollback == "relaunch":
            decision = self._relaunch(decision)
        candidate, self.candidate = self.candidate, None
        if candidate is not None:
            candidate.fence()  # CUDA: the update is queued after the snapshot's copies (no host sync)
        if candidate is None or candidate.step != self.engine.progress.step:
            self.ring.recycle(candidate)
            return decision
        if decision.applies_update:
            self.ring.push(candidate)
            self.controller.on_verified()
            self.engine.hooks.set_reference()
            self._maybe_save(candidate)
        else:
            self.ring.recycle(candidate)
        return decision

    def _maybe_save(self, verified: Snapshot) -> None:
        every = self.config.checkpoint.every_steps
        forced, self.force_disk = self.force_disk, False
        if self.checkpoints is None or not (every or forced):
            return
        if not forced and self.last_disk_step is not None and verified.step - self.last_disk_step < every:
            return
        with self.engine.own_work.section("recovery.checkpoint_save"):
            state_dict = self._disk_state(verified)
            stable: list[torch.Tensor] = []
            if verified.has_tensors and self.checkpoints.disk_format is None:
                # the live state still equals the verified snapshot: write its host copies, staging nothing again
                verified.wait()
                state_dict["train"], stable = from_snapshot(state_dict["train"], self.state.live_tensors(),
                                                            verified.tensors)
            metadata = {"data_position": verified.extra["data_position"], "world_size": self._world(),
                        "run_id": self.engine.run_id, "applied_steps": verified.extra.get("applied_steps"),
                        "lineage": self.lineage}
            with self.engine.paused():  # may first drain the previous save (bounded by commit_timeout_s)
                self.checkpoints.save_async(verified.step, state_dict, metadata=metadata, stable=stable)
            self._disk_source = weakref.ref(verified) if stable else None
        self.last_disk_step = verified.step
        self.disk_saves += 1

    def _saving_from(self, snapshot: Snapshot) -> bool:
        """Whether a disk save still in flight writes ``snapshot``'s host copies (the ring must not reuse them)."""
        source = self._disk_source() if self._disk_source is not None else None
        return snapshot is source and self.checkpoints is not None and self.checkpoints.in_flight

    def _disk_state(self, verified: Snapshot) -> dict[str, Any]:
        """The live tensors (equal to the verified snapshot's: nothing was applied since; :meth:`_maybe_save` swaps
        them for the snapshot's host copies when it has them) plus the snapshot's
        python state as JSON (:mod:`arc_engine.recovery.portable`, never pickle): replicated under one key, this
        rank's RNG under a rank key."""
        shared = {"framework": verified.framework, "arc": verified.extra,
                  "controller": self.controller.state_dict(), "engine": self.engine.counters_state_dict()}
        return {"train": self.state.dcp_state_dict(), "arc_state": portable.dumps(shared),
                f"arc_rng/rank{runtime.global_rank()}": portable.dumps(verified.rng)}

    # ------------------------------------------------------------------ step end

    def on_step_end(self, decision: Decision | None) -> None:
        """After the optimizer step (applied, skipped or not applied for a rollback). Local, except a rollback with
        an empty memory ring, which agrees on the disk target (drain in-flight saves, one broadcast)."""
        if decision is not None and decision.action == Action.ROLLBACK:
            self._plan_rollback(decision)
        elif decision is None or decision.applies_update:
            preventive = decision is not None and decision.action == Action.CHECKPOINT
            self.capture_due = self.controller.on_healthy_step() or self.capture_due or preventive
            if preventive:  # a monitor sees trouble coming: snapshot now, and to disk whatever the schedule
                self.force_disk = True
                self.engine.emit_action(decision.step, "checkpoint", Severity.INFO,
                                        "preventive checkpoint: a snapshot at the next step, saved to disk when "
                                        "that step is verified", {}, detector="recovery")
            if self.capture_due:
                self._step_end_rng = rng_state()
        else:
            self.controller.on_unhealthy_step()

    def _plan_rollback(self, decision: Decision) -> None:
        failed_position = self.engine.progress.data_position - 1  # the batch this step consumed (already counted)
        self.controller.on_rollback(decision)
        self.ring.recycle(self.candidate)
        self.capture_due, self.candidate = False, None
        snapshot = self.ring.latest()
        if snapshot is not None:
            step, data_position, disk_step = snapshot.step, snapshot.extra["data_position"], None
            applied = snapshot.extra.get("applied_steps")
        else:
            info = self._agreed_disk_latest()
            if info is None:
                self.engine.emit_lifecycle("rollback_failed", "no verified-stable state could be found (memory "
                                           "ring empty, no committed checkpoint): continuing without rollback")
                return
            step, data_position, disk_step = info.step, int(info.metadata["data_position"]), info.step
            applied = info.metadata.get("applied_steps")
        stream = self.config.skip_data == "stream"  # the loader cannot seek: it goes on with its next batch
        first_skipped = data_position  # the restored state's next batch
        if self.config.skip_data in ("window", "stream"):
            data_position = failed_position + 1
        if decision.escape and not stream:
            data_position += self.config.skip_ahead_steps
        if data_position > first_skipped and not stream:  # batches trained on, undone, and not replayed
            self.engine.ledger.record(first=first_skipped, last=data_position - 1, step=decision.step,
                                      iteration=self.engine.progress.iteration, action="not_replayed",
                                      detectors=[f.detector for f in decision.findings if f.action >= Action.SKIP],
                                      reason=f"rolled back to step {step} and resumed the data at {data_position}")
        data = "the data goes on with the loader's next batch (it cannot seek)" if stream else \
            f"data resumes at batch {data_position}"
        self.pending = PendingRestore(snapshot, disk_step, decision.escape, data_position, step, applied)
        where = f"memory snapshot of step {step}" if snapshot is not None else f"disk checkpoint of step {step}"
        kind = "escape" if decision.escape else "rollback"
        self.engine.emit_action(decision.step, kind, Severity.ERROR,
                                f"{kind}: every rank returns to the {where}, {data}, "
                                f"learning rate x {self.controller.lr_factor:.3g}"
                                + (f", weights perturbed x {self.config.perturbation_scale}" if decision.escape
                                   else ""),
                                {"target_step": step, "data_position": data_position,
                                 "tier": "memory" if snapshot is not None else "disk",
                                 "lr_factor": self.controller.lr_factor, "rollbacks": self.controller.rollbacks,
                                 "escapes": self.controller.escapes})

    def _relaunch(self, decision: Decision) -> Decision:
        """``recovery.rollback: relaunch``: the rollback is a stop with :data:`EXIT_RELAUNCH` once the newest disk
        checkpoint is committed (in-flight saves drained, the target agreed), and ``relaunch.json`` (written by the
        group's first rank) says what the relaunch loads and which steps' batches it skips. Collective (every rank
        calls it with the same decision)."""
        info = self._agreed_disk_latest()
        failed = self.engine.progress.step
        if info is None:
            note = Finding("recovery", Action.ABORT, Severity.CRITICAL,
                           "rollback by relaunch: no committed disk checkpoint to relaunch from "
                           "(recovery.checkpoint.every_steps, recovery.checkpoint.dir): stopping (exit code 3)")
            return dataclasses.replace(decision, action=Action.ABORT, findings=(*decision.findings, note))
        skip = [] if self.config.skip_data == "none" else list(range(info.step, failed + 1))
        plan = {"checkpoint_dir": str(info.path.parent), "checkpoint": str(info.path), "checkpoint_step": info.step,
                "failed_step": failed, "skip_steps": skip, "exit_code": EXIT_RELAUNCH}
        if self.group is None or dist.get_rank(self.group) == 0:
            path = self.engine.run_dir / RELAUNCH_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(plan, indent=1) + "\n")
            os.replace(tmp, path)
        batches = f"skipping the batches of steps {skip[0]}..{skip[-1]}" if skip else "replaying the same batches"
        note = Finding("recovery", Action.ABORT, Severity.ERROR,
                       f"rollback by relaunch: every rank stops (exit code {EXIT_RELAUNCH}); relaunch loading the "
                       f"checkpoint of step {info.step} ({info.path}) and {batches} ({RELAUNCH_FILE} in the run "
                       "directory)", values=plan)
        return dataclasses.replace(decision, action=Action.ABORT, exit_code=EXIT_RELAUNCH,
                                   findings=(*decision.findings, note))

    def _agreed_disk_latest(self) -> CommitInfo | None:
        if self.checkpoints is None:
            return None
        with self.engine.paused():  # the drain of an in-flight save, on every rank alike (bounded: commit_timeout_s)
            self.checkpoints.wait(self.config.checkpoint.commit_timeout_s)
        latest = [self.checkpoints.latest(self.lineage)]  # this job's history: never a run it did not resume
        if self.group is not None:
            dist.broadcast_object_list(latest, group_src=0, group=self.group)
        return latest[0]

    # ------------------------------------------------------------------ carrying out

    def settle(self) -> None:
        """Carry out the rollback planned in this step, where the framework's step has returned: tensors, python
        state and the engine's counters together (see the module docstring). Every rank, at the same point; a
        disk-tier restore is collective (DCP or the backend's format). Nothing to do without a pending rollback."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        with self.engine.own_work.section("recovery.restore"):
            self._carry_out(pending)

    def _carry_out(self, pending: PendingRestore) -> None:
        self.engine.hooks.before_restore()
        if pending.snapshot is not None:
            extra = restore(pending.snapshot, self.state)
            self.engine.gathering.assembly.load_state_dict(extra["monitors"])
            self.engine.rewind(pending.step, pending.data_position, pending.applied_steps)
            self.restores["memory"] += 1
        else:
            assert self.checkpoints is not None
            loaded = self.checkpoints.load_latest(self._build_disk_state, max_step=pending.disk_step,
                                                  lineage=self.lineage)
            if loaded is None:
                self.engine.emit_lifecycle("rollback_failed", "the disk checkpoint could not be loaded: continuing "
                                           "from the current state")
                return
            info, state_dict = loaded
            self._apply_disk_state(info, state_dict, full=False)
            self.checkpoints.pin(info.step)
            self.engine.rewind(info.step, pending.data_position)
            self.restores["disk"] += 1
        # an importance-weighted rollback edited the tensors
        if self.engine.hooks.after_restore(self.engine.progress.step):
            self.state.masters_changed()
        if pending.escape:
            self.state.perturb(self.config.perturbation_scale, self.config.seed * 1_000_003 + self.controller.rollbacks)
            self.engine.hooks.set_reference()  # the escaped state, not the restored one, is what EWC holds to

    def _build_disk_state(self, info: CommitInfo) -> dict[str, Any]:
        world = self._world()
        if info.world_size != world and not self.state.reshardable:
            raise ValueError(f"arc_engine: the checkpoint of step {info.step} ({info.path}) was written by "
                             f"{info.world_size} ranks; this job has {world} and {type(self.state).__name__} "
                             "state cannot be resharded: relaunch with the same world size")
        state_dict: dict[str, Any] = {"train": self.state.dcp_state_dict(), "arc_state": b""}
        if info.world_size == world:
            state_dict[f"arc_rng/rank{runtime.global_rank()}"] = b""
        return state_dict

    def _apply_disk_state(self, info: CommitInfo, state_dict: dict[str, Any], *, full: bool) -> None:
        self.state.after_dcp_load(state_dict["train"])
        shared = portable.loads(state_dict["arc_state"])
        self.state.load_extra_state(shared["framework"])
        rng_key = f"arc_rng/rank{runtime.global_rank()}"
        if rng_key in state_dict:
            set_rng_state(portable.loads(state_dict[rng_key]))
        else:
            log.warning("arc_engine: world size changed (%d -> %d): RNG states are not restored",
                        info.world_size, self._world())
        self.engine.gathering.assembly.load_state_dict(shared["arc"]["monitors"])
        applied = shared["arc"].get("applied_steps")
        if not full:
            self.engine.rewind(self.engine.progress.step, self.engine.progress.data_position, applied)
        else:  # a restart: everything, including the counters a rollback keeps
            self.controller.load_state_dict(shared["controller"])
            self.engine.load_counters_state_dict(shared["engine"])
            iteration = shared["arc"].get("iteration")  # the step attempt of the snapshot, not of the later save
            self.engine.rewind(info.step, int(shared["arc"]["data_position"]), applied, iteration)
            self.last_disk_step = info.step
            self.disk_saves = 1

    def _world(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    # ------------------------------------------------------------------ heal

    @property
    def lr_factor(self) -> float:
        return self.controller.lr_factor

    @property
    def rollbacks(self) -> int:
        """Rollbacks (escapes included) carried out so far."""
        return self.controller.rollbacks

    def clip_coefficient(self) -> float:
        """The extra gradient scale for this step (1 unless healing with ``heal_clip_grad_norm``), from the
        gathered pre-clip global norm (no communication)."""
        max_norm = self.config.heal_clip_grad_norm
        stats, decision = self.engine.last_stats, self.engine.last_decision
        if max_norm is None or self.lr_factor >= 1.0 or stats is None or decision is None \
                or decision.step != self.engine.progress.step:
            return 1.0
        norm = math.sqrt(max(float(stats.total(names.GRAD_SQ).sum()), 0.0))
        return min(1.0, max_norm / (norm + 1e-6)) if math.isfinite(norm) else 1.0

    def summary(self) -> dict[str, Any]:
        return {"rollbacks": self.controller.rollbacks, "escapes": self.controller.total_escapes,
                "restored_from_memory": self.restores["memory"], "restored_from_disk": self.restores["disk"],
                "disk_saves": self.disk_saves, "ring_steps": self.ring.steps, "state": self.controller.state.value,
                "checkpoint_saves": dict(self.checkpoints.saves) if self.checkpoints is not None else {}}

    def close(self) -> None:
        """Drain the in-flight disk save (bounded) and release the store. Local, idempotent."""
        if self.checkpoints is not None:
            self.checkpoints.close()

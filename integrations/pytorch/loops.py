"""What the trainer callbacks (``hf``, ``lightning``) and the Megatron-LM launcher share: loops arc_engine does not
own, whose loader cannot seek, whose own checkpoint resume must agree with arc_engine's, and whose stop must end the
process with arc_engine's exit code."""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import TYPE_CHECKING, NoReturn

from arc_engine.compat import Capabilities
from arc_engine.config import EXIT_BAD_CONFIG, ArcConfig
from arc_engine.events import Severity
from arc_engine.policy.decision import ArcAbort

if TYPE_CHECKING:
    from arc_engine.wiring import Arc

log = logging.getLogger(__name__)


def stream_config(config: ArcConfig) -> ArcConfig:
    """``config`` for a loop whose loader cannot seek: rollbacks go on with the loader's next batches
    (``recovery.skip_data: stream``). ValueError where it asks for the batches to be replayed (``none``)."""
    recovery = config.recovery
    if recovery.skip_data == "none":
        raise ValueError("arc_engine: recovery.skip_data: none replays the batches since the snapshot, but this "
                         "trainer's data loader cannot seek; use window or stream (the default here)")
    if recovery.skip_data == "stream":
        return config
    return dataclasses.replace(config, recovery=dataclasses.replace(recovery, skip_data="stream"))


def resume_at(config: ArcConfig, trainer_step: int, counter: str = "applied_steps") -> ArcConfig:
    """``config`` for a trainer that resumed its own checkpoint of ``trainer_step`` (0: none), which counts
    ``counter`` (``applied_steps``, or ``step``: every step, applied or not): arc_engine's resume takes its
    checkpoint of that step when it committed one (``recovery.checkpoint.resume_step``), so that both resume one
    state, and none when the trainer's is newer than its newest; :func:`one_resume` checks the outcome."""
    if trainer_step <= 0 or not config.recovery.checkpoint.resume:
        return config
    checkpoint = dataclasses.replace(config.recovery.checkpoint, resume_step=trainer_step, resume_counter=counter)
    return dataclasses.replace(config, recovery=dataclasses.replace(config.recovery, checkpoint=checkpoint))


def report_capabilities(arc: Arc, found: Capabilities) -> None:
    """One ``compatibility`` event naming the trainer features whose internals are missing (and an untested
    release); nothing when the release is tested and everything is there. Local (every rank finds the same)."""
    report = found.report()
    if report is not None:
        arc.engine.emit_lifecycle("compatibility", *report)


def one_resume(arc: Arc, trainer_step: int, resumed_by: str, data_position: int,
               counter: str = "applied_steps") -> None:
    """At a trainer callback's start, after attach: the trainer's step counter (``trainer_step``, the step its own
    checkpoint resumed, 0 for none) against what arc_engine's own resume restored (``recovery.checkpoint.resume``:
    its applied steps, 0 for none). The run continues from one state, named in one ``resume_agreed`` event: both at
    the same step (:func:`resume_at` makes arc_engine take its checkpoint of the trainer's step where it has one), or
    the trainer's when it is newer than arc_engine's newest checkpoint (which then holds nothing the trainer's lacks:
    arc_engine loads none, its detectors warm up again). Any other pair ends every rank with exit code 2 and one
    message naming both steps and the flag that picks one (the counters are the same on every rank, so every rank
    refuses alike). The trainer resuming alone (arc_engine had no checkpoint) is the trainer's resume.

    ``data_position``: where the trainer's loader reads next, in data positions (one per optimizer step, counted
    over epochs as the trainer skips them at a resume). arc_engine's data positions follow it from here, so the data
    ledger's positions are the batches a resume from the trainer's checkpoint reads (the run's skipped and
    rolled-back attempts consumed batches too: arc_engine's own checkpoint counts them, the trainer does not).
    ``counter``: what the trainer's step counts, as in :func:`resume_at`."""
    restored = arc.progress.applied_steps if counter == "applied_steps" else arc.engine.progress.step
    recovery = arc.engine.recovery
    newer = recovery.trainer_newer if recovery is not None else None
    position = arc.engine.progress.data_position
    arc.engine.progress.data_position = data_position
    if restored == 0 and newer is None:
        return
    data = "" if position == data_position else (
        f"; data positions follow {resumed_by}'s loader: its next batch is position {data_position} (arc_engine "
        f"counted {position}, with the batches of the steps it did not apply)")
    if newer is not None:
        newest = newer.metadata["applied_steps"] if counter == "applied_steps" else newer.step
        arc.engine.emit_lifecycle(
            "resume_agreed", f"{resumed_by} resumed step {trainer_step}, newer than arc_engine's newest checkpoint "
            f"(step {newest}), which holds nothing the trainer's lacks: the run goes on from the trainer's state "
            f"(arc_engine's detectors warm up again){data}",
            {"step": trainer_step, "chosen": "trainer", "arc_engine_step": newest, "data_position": data_position})
        return
    if restored == trainer_step:
        arc.engine.emit_lifecycle("resume_agreed", f"arc_engine's checkpoint and {resumed_by} resumed the same "
                                  f"step {restored}: one state{data}",
                                  {"step": restored, "chosen": "both", "arc_engine_step": restored,
                                   "data_position": data_position})
        return
    message = (f"arc_engine: two resumes disagree: arc_engine resumed its checkpoint of step {restored} (it "
               f"committed none of step {trainer_step}) and "
               + (f"{resumed_by} resumed step {trainer_step}" if trainer_step else f"{resumed_by} starts from step 0")
               + ": the weights, optimizer and scheduler would be arc_engine's, the step counter and the data "
               f"position the trainer's. Resume from one state: {resumed_by} from its checkpoint of step {restored}, "
               "or arc_engine's checkpoints off for this run (--arc.recovery.checkpoint.resume=false, "
               "recovery.checkpoint.resume: false) to train on from the trainer's")
    arc.engine.emit_action(arc.engine.progress.step, "resume_refused", Severity.ERROR, message,
                           {"arc_engine_step": restored, "trainer_step": trainer_step,
                            "exit_code": EXIT_BAD_CONFIG}, detector="setup")
    arc.close()
    if arc.engine.rank == arc.engine.gathering.pipeline.leader:
        print(message, file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_CONFIG)


def end_with(abort: ArcAbort, *, exit_on_abort: bool) -> NoReturn:
    """After the trainer wound down from ``abort``: end the process with its exit code, or raise it."""
    if not exit_on_abort:
        raise abort
    log.error("%s (exit code %d)", abort, abort.exit_code)
    raise SystemExit(abort.exit_code)


__all__ = ["end_with", "one_resume", "report_capabilities", "resume_at", "stream_config"]

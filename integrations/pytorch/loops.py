"""What the trainer callbacks (``hf``, ``lightning``) share: loops arc_engine does not own, whose loader cannot
seek and whose stop must end the process with arc_engine's exit code."""

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


def resume_at(config: ArcConfig, trainer_step: int) -> ArcConfig:
    """``config`` for a trainer that resumed its own checkpoint of ``trainer_step`` (0: none): arc_engine's resume
    takes its checkpoint of that step when it committed one (``recovery.checkpoint.resume_step``), so that both
    resume one state; :func:`one_resume` checks the outcome."""
    if trainer_step <= 0 or not config.recovery.checkpoint.resume:
        return config
    checkpoint = dataclasses.replace(config.recovery.checkpoint, resume_step=trainer_step)
    return dataclasses.replace(config, recovery=dataclasses.replace(config.recovery, checkpoint=checkpoint))


def report_capabilities(arc: Arc, found: Capabilities) -> None:
    """One ``compatibility`` event naming the trainer features whose internals are missing (and an untested
    release); nothing when the release is tested and everything is there. Local (every rank finds the same)."""
    report = found.report()
    if report is not None:
        arc.engine.emit_lifecycle("compatibility", *report)


def one_resume(arc: Arc, trainer_step: int, resumed_by: str) -> None:
    """At a trainer callback's start, after attach: the trainer's step counter (``trainer_step``, the step its own
    checkpoint resumed, 0 for none) against what arc_engine's own resume restored (``recovery.checkpoint.resume``:
    its applied steps, 0 for none). Where both resumed, or arc_engine alone, the run must continue from one state:
    the same step is one event (:func:`resume_at` makes arc_engine take its checkpoint of the trainer's step where it
    has one); another step ends every rank with exit code 2 and one message naming both steps and
    the flag that picks one (the two counters are the same on every rank, so every rank refuses alike). The trainer
    resuming alone (arc_engine had no checkpoint) is the trainer's resume."""
    restored = arc.applied_steps
    if restored == 0:
        return
    if restored == trainer_step:
        arc.engine.emit_lifecycle("resume_agreed", f"arc_engine's checkpoint and {resumed_by} resumed the same "
                                  f"step {restored}: one state", {"step": restored})
        return
    message = (f"arc_engine: two resumes disagree: arc_engine resumed its checkpoint of step {restored} (it "
               f"committed none of step {trainer_step}) and "
               + (f"{resumed_by} resumed step {trainer_step}" if trainer_step else f"{resumed_by} starts from step 0")
               + ": the weights, optimizer and scheduler would be arc_engine's, the step counter and the data "
               f"position the trainer's. Resume from one state: {resumed_by} from its checkpoint of step {restored}, "
               "or arc_engine's checkpoints off for this run (--arc.recovery.checkpoint.resume=false, "
               "recovery.checkpoint.resume: false) to train on from the trainer's")
    arc.engine.emit_action(arc.engine.step, "resume_refused", Severity.ERROR, message,
                           {"arc_engine_step": restored, "trainer_step": trainer_step,
                            "exit_code": EXIT_BAD_CONFIG}, detector="setup")
    arc.close()
    if arc.engine.rank == arc.engine.pipeline.leader:
        print(message, file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_CONFIG)


def end_with(abort: ArcAbort, *, exit_on_abort: bool) -> NoReturn:
    """After the trainer wound down from ``abort``: end the process with its exit code, or raise it."""
    if not exit_on_abort:
        raise abort
    log.error("%s (exit code %d)", abort, abort.exit_code)
    raise SystemExit(abort.exit_code)


__all__ = ["end_with", "one_resume", "report_capabilities", "resume_at", "stream_config"]

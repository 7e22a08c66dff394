"""What the trainer callbacks (``hf``, ``lightning``) share: loops arc_engine does not own, whose loader cannot
seek and whose stop must end the process with arc_engine's exit code."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, NoReturn

from arc_engine.compat import Capabilities
from arc_engine.config import ArcConfig
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


def report_capabilities(arc: Arc, found: Capabilities) -> None:
    """One ``compatibility`` event naming the trainer features whose internals are missing (and an untested
    release); nothing when the release is tested and everything is there. Local (every rank finds the same)."""
    report = found.report()
    if report is not None:
        arc.engine.emit_lifecycle("compatibility", *report)


def end_with(abort: ArcAbort, *, exit_on_abort: bool) -> NoReturn:
    """After the trainer wound down from ``abort``: end the process with its exit code, or raise it."""
    if not exit_on_abort:
        raise abort
    log.error("%s (exit code %d)", abort, abort.exit_code)
    raise SystemExit(abort.exit_code)


__all__ = ["end_with", "report_capabilities", "stream_config"]

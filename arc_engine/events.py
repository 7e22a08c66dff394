"""What monitors find, what the policy decides, and the structured events sinks receive."""

from __future__ import annotations

import enum
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy
import torch


class Severity(enum.IntEnum):
    DEBUG = 10
    INFO = 20
    WARNING = 30
    ERROR = 40
    CRITICAL = 50

    @classmethod
    def parse(cls, name: str) -> Severity:
        return cls[name.upper()]


class Action(enum.IntEnum):
    """What every rank does with the current step; a larger value wins when monitors disagree.

    ``CHECKPOINT`` applies the step like ``WARN`` and asks recovery for a preventive checkpoint: a snapshot at the
    next step (verified by that step's decision) saved to disk whatever the schedule (a warning without recovery).
    ``ROLLBACK`` is the seam for the recovery subsystem: without one attached it escalates to ``ABORT``.
    """

    NONE = 0
    WARN = 1
    CHECKPOINT = 2
    SKIP = 3
    ROLLBACK = 4
    ABORT = 5

    @classmethod
    def parse(cls, name: str) -> Action:
        return cls[name.upper()]


@dataclass(frozen=True)
class Finding:
    """One monitor's verdict on one step, computed from the gathered statistics (identical on all ranks).

    ``ranks``: global ranks implicated (empty when the finding is about the global state).
    ``values``: the numbers that tripped the monitor, JSON-serialisable.
    ``by_framework``: a fact rather than a request: the training framework already skipped the step itself (e.g. a
    loss scaler's overflow), so its ``action`` stands even where arc_engine only observes.
    ``bad_data``: the finding blames the step's input batch (on ``ranks``): the engine adds the data position to its
    values and to the data ledger, and the policy counts the skips apart (``policy.max_consecutive_data_skips``).
    ``data_dropped`` (with ``bad_data``): the blamed ranks' share of the gradient was left out of this step, which is
    applied without it; the ledger records the position as ``dropped`` (a resumed run skips it, the exports list it).
    ``data_suspect``: the finding suspects the batch of ``ranks`` without being sure it is the data (a non-finite
    loss on some ranks: their data, or their device): the data ledger records the position as suspect bad data
    (skipped again once suspected twice), and the policy counts the skip as an ordinary one
    (``policy.max_consecutive_skips``).
    ``hardware``: the finding blames the devices of ``ranks``, on this evidence (a kind of
    :data:`arc_engine.device_ledger.EVIDENCE`: ``sdc_persistent``, ``sdc_transient``, ``non_finite``, ``straggler``,
    ``replica_divergence``...): the device ledger records it per host and device. Empty: not the hardware's (the
    data's, the model's, the whole job's).
    """

    detector: str
    action: Action
    severity: Severity
    message: str
    ranks: tuple[int, ...] = ()
    values: dict[str, Any] = field(default_factory=dict)
    by_framework: bool = False
    bad_data: bool = False
    data_dropped: bool = False
    data_suspect: bool = False
    hardware: str = ""


@dataclass(frozen=True)
class Event:
    """A structured record delivered to every sink.

    ``kind``: ``detection`` (a finding), ``action`` (what the engine did), ``lifecycle`` (start/summary).
    ``action``: the action taken for the step (lower-case :class:`Action` name).
    ``step``: the optimizer step of the training state; ``iteration``: the step attempt (monotonic; it differs
    from ``step`` once a rollback has replayed steps).
    """

    run_id: str
    step: int
    kind: str
    detector: str
    severity: Severity
    action: str
    message: str
    ranks: tuple[int, ...] = ()
    values: dict[str, Any] = field(default_factory=dict)
    iteration: int = -1
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["severity"] = self.severity.name.lower()
        record["ranks"] = list(self.ranks)
        record["values"] = json_safe(self.values)
        return record

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False)


def json_safe(value: Any) -> Any:
    """Recursively make ``value`` strict-JSON: NaN/Inf floats become the strings ``"nan"``/``"inf"``."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, numpy.generic) or (isinstance(value, torch.Tensor) and value.numel() == 1):  # scalars
        return json_safe(value.item())
    return value

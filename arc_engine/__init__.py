"""arc_engine: detect, agree on, and recover from training faults in distributed LLM pretraining.

The public names below are imported on first use, so that a command that needs none of them (``arc-engine hosts``,
run by a launcher on every node before it joins) starts without importing torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from arc_engine.attach import Arc, attach
    from arc_engine.config import ArcConfig, ConfigError, add_arc_args, config_from_args, load_config, pop_arc_args
    from arc_engine.engine import ArcEngine
    from arc_engine.events import Action, Event, Finding, Severity
    from arc_engine.policy import EXIT_ABORT, EXIT_FAULTY_DEVICE, EXIT_RECOVERY_EXHAUSTED, ArcAbort, Decision

__version__ = "0.1.0"

_WHERE = {
    "Arc": "arc_engine.attach", "attach": "arc_engine.attach",
    "ArcConfig": "arc_engine.config", "ConfigError": "arc_engine.config", "add_arc_args": "arc_engine.config",
    "config_from_args": "arc_engine.config", "load_config": "arc_engine.config", "pop_arc_args": "arc_engine.config",
    "ArcEngine": "arc_engine.engine",
    "Action": "arc_engine.events", "Event": "arc_engine.events", "Finding": "arc_engine.events",
    "Severity": "arc_engine.events",
    "EXIT_ABORT": "arc_engine.policy", "EXIT_FAULTY_DEVICE": "arc_engine.policy",
    "EXIT_RECOVERY_EXHAUSTED": "arc_engine.policy", "ArcAbort": "arc_engine.policy", "Decision": "arc_engine.policy",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'arc_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


class _Package(types.ModuleType):
    """This package's module type. Importing a submodule binds it as an attribute of its package, and the submodule
    ``arc_engine.attach`` has the name of the function ``attach``: imported first by anyone (``from
    arc_engine.attach import Arc``), it would hide the function, and ``arc_engine.attach(model, optimizer)`` would
    call a module. The function is kept in its place."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "attach" and isinstance(value, types.ModuleType):
            value = value.attach
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "EXIT_ABORT",
    "EXIT_FAULTY_DEVICE",
    "EXIT_RECOVERY_EXHAUSTED",
    "Action",
    "Arc",
    "ArcAbort",
    "ArcConfig",
    "ArcEngine",
    "ConfigError",
    "Decision",
    "Event",
    "Finding",
    "Severity",
    "__version__",
    "add_arc_args",
    "attach",
    "config_from_args",
    "load_config",
    "pop_arc_args",
]

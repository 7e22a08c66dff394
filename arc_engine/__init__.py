"""arc_engine: detect, agree on, and recover from training faults in distributed LLM pretraining."""

from arc_engine.attach import Arc, attach
from arc_engine.config import ArcConfig, ConfigError, add_arc_args, config_from_args, load_config, pop_arc_args
from arc_engine.engine import ArcEngine
from arc_engine.events import Action, Event, Finding, Severity
from arc_engine.policy import EXIT_ABORT, EXIT_FAULTY_DEVICE, EXIT_RECOVERY_EXHAUSTED, ArcAbort, Decision

__version__ = "0.1.0"

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

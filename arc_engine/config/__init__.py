"""Typed configuration: schema, YAML loader, command-line glue."""

from arc_engine.config.cli_args import EXIT_BAD_CONFIG, add_arc_args, config_from_args, pop_arc_args
from arc_engine.config.errors import ArcSetupError, ConfigError
from arc_engine.config.loader import from_dict, load_config, to_dict
from arc_engine.config.schema import (
    ArcConfig,
    ConsoleSinkConfig,
    DetectorsConfig,
    FaultsConfig,
    FaultSpec,
    JsonlSinkConfig,
    PolicyConfig,
    RunConfig,
    SinksConfig,
    StatsConfig,
)

__all__ = [
    "EXIT_BAD_CONFIG",
    "ArcConfig",
    "ArcSetupError",
    "ConfigError",
    "ConsoleSinkConfig",
    "DetectorsConfig",
    "FaultSpec",
    "FaultsConfig",
    "JsonlSinkConfig",
    "PolicyConfig",
    "RunConfig",
    "SinksConfig",
    "StatsConfig",
    "add_arc_args",
    "config_from_args",
    "from_dict",
    "load_config",
    "pop_arc_args",
    "to_dict",
]

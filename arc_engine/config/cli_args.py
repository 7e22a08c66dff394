"""argparse glue: ``--arc-config PATH`` and ``--arc.<dotted.key>=VALUE`` on any training script.

Usage, next to ``deepspeed.add_config_arguments(parser)``::

    parser = argparse.ArgumentParser()
    arc_engine.add_arc_args(parser)
    args = parser.parse_args()
    config = arc_engine.config_from_args(args)   # exits with code 2 and one message on a bad config

Scripts that parse ``sys.argv`` their own way (nanoGPT's configurator, fire, hydra) take arc_engine's arguments out
first: ``config = arc_engine.pop_arc_args()``.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

from arc_engine.config.errors import ConfigError
from arc_engine.config.loader import describe_type, did_you_mean, leaf_keys, load_config
from arc_engine.config.schema import ArcConfig

EXIT_BAD_CONFIG = 2
_OVERRIDE_DEST = "arc_overrides"


class _OverrideAction(argparse.Action):
    """Collects ``--arc.KEY VALUE`` / ``--arc.KEY=VALUE`` pairs in order into ``args.arc_overrides``."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        overrides = list(vars(namespace).get(_OVERRIDE_DEST) or [])
        overrides.append(f"{self.metavar}={values}")
        setattr(namespace, _OVERRIDE_DEST, overrides)


def add_arc_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--arc-config`` and one ``--arc.<key>`` option per config leaf to ``parser``; returns it.

    An unknown ``--arc.*`` option exits with code 2 and the nearest allowed key ("did you mean ...?") instead of
    argparse's bare "unrecognized arguments" (``parser.error`` is wrapped for it; other errors are argparse's).
    Create ``parser`` with ``allow_abbrev=False`` so that a misspelt prefix (``--arc.stats.int``) is not silently
    expanded.
    """
    group = parser.add_argument_group("arc_engine")
    group.add_argument("--arc-config", "--arc_config", dest="arc_config", default=None, metavar="PATH",
                       help="arc_engine YAML config (defaults apply when omitted)")
    parser.set_defaults(**{_OVERRIDE_DEST: []})
    keys = []
    for key, hint in leaf_keys(ArcConfig):
        keys.append(key)
        group.add_argument(f"--arc.{key}", action=_OverrideAction, metavar=key, default=argparse.SUPPRESS,
                           help=f"override {key} ({describe_type(hint)})")
    argparse_error = parser.error

    def error(message: str) -> NoReturn:
        unknown = re.findall(r"--arc\.([^\s=]+)", message) if message.startswith("unrecognized arguments") else []
        if unknown:
            key = unknown[0]
            print(f"arc_engine: invalid config: --arc.{key}: unknown key{did_you_mean(key, keys)}; "
                  f"`arc-engine show-config` lists every key", file=sys.stderr)
            sys.exit(EXIT_BAD_CONFIG)
        argparse_error(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


def config_from_args(args: argparse.Namespace, *, exit_on_error: bool = True,
                     default: dict | None = None) -> ArcConfig:
    """The :class:`ArcConfig` named by parsed ``args`` (file, then overrides).

    ``default``: the nested mapping to start from when no ``--arc-config`` is given (else dataclass defaults).

    With ``exit_on_error`` (the default, for CLI entry points) a bad config prints one line to stderr and
    exits with code 2; otherwise :class:`ConfigError` / ``FileNotFoundError`` propagate.
    """
    given = vars(args)  # a namespace without the arc options (a parser add_arc_args did not see): the defaults
    path = given.get("arc_config")
    overrides = given.get(_OVERRIDE_DEST) or []
    try:
        return load_config(path, overrides, base=None if path else default)
    except (ConfigError, OSError, UnicodeDecodeError) as err:
        if not exit_on_error:
            raise
        exit_with_config_error(err)


def pop_arc_args(argv: list[str] | None = None, *, exit_on_error: bool = True) -> ArcConfig:
    """Remove ``--arc-config PATH`` (or ``=PATH``) and every ``--arc.<key>=VALUE`` (or ``--arc.<key> VALUE``) from
    ``argv`` (default: ``sys.argv``, edited in place, so the script's own parser never sees them) and return the
    config they name (the file, then the overrides in order). A bad config exits with code 2 and one message, as
    :func:`config_from_args` (``exit_on_error=False``: ConfigError / OSError propagate); so does an option missing
    its value."""
    argv = sys.argv if argv is None else argv
    path: str | None = None
    overrides: list[str] = []
    kept: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in ("--arc-config", "--arc_config") or name.startswith("--arc."):
            if not eq:
                if i + 1 >= len(argv):
                    error = ConfigError(name.removeprefix("--arc."), None, "a value after the option")
                    if exit_on_error:
                        exit_with_config_error(error)
                    raise error
                value, i = argv[i + 1], i + 1
            if name.startswith("--arc."):
                overrides.append(f"{name.removeprefix('--arc.')}={value}")
            else:
                path = value
        else:
            kept.append(arg)
        i += 1
    argv[:] = kept
    try:
        return load_config(path, overrides)
    except (ConfigError, OSError, UnicodeDecodeError) as err:
        if not exit_on_error:
            raise
        exit_with_config_error(err)


def exit_with_config_error(err: Exception) -> NoReturn:
    """Print ``err`` as one line prefixed ``arc_engine: invalid config:`` and exit with code 2."""
    if isinstance(err, FileNotFoundError):
        detail = f"{err.filename}: file not found"
    elif isinstance(err, OSError):
        detail = f"{err.filename}: cannot read ({err.strerror})"
    else:
        detail = str(err)
    print(f"arc_engine: invalid config: {detail}", file=sys.stderr)
    sys.exit(EXIT_BAD_CONFIG)

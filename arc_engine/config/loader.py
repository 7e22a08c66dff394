"""Build the typed config from YAML and dotted command-line overrides.

Precedence (later wins): dataclass defaults < the YAML file < ``--arc.<dotted.key>=VALUE`` overrides.
Unknown keys, wrong types and out-of-range values raise :class:`ConfigError` naming the source, the key,
the value and what is allowed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

from arc_engine.config.errors import ConfigError
from arc_engine.config.schema import ArcConfig

T = TypeVar("T")
_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                base: Mapping[str, Any] | None = None) -> ArcConfig:
    """Load an :class:`ArcConfig` from an optional YAML file plus ``KEY=VALUE`` overrides.

    ``base``: a nested mapping used instead of the file when ``path`` is None (an embedded default).

    ``overrides`` are dotted keys relative to the root (``detectors.loss_spike.factor=8``); each value is
    parsed as a YAML scalar or flow collection. Raises :class:`ConfigError` on any bad input, or
    ``FileNotFoundError`` when ``path`` does not exist.
    """
    raw: dict[str, Any] = copy.deepcopy(dict(base or {}))
    source = "<defaults>" if base is None else "<embedded default>"
    if path is not None:
        source = str(path)
        raw = _read_yaml(Path(path))
    for item in overrides:
        _apply_override(raw, item)
        source = f"{source} + command line" if "command line" not in source else source
    return from_dict(ArcConfig, raw, source=source)


def from_dict(cls: type[T], data: Mapping[str, Any], *, source: str | None = None, prefix: str = "") -> T:
    """Build dataclass ``cls`` from a nested mapping, validating every key (raises :class:`ConfigError`)."""
    if not isinstance(data, Mapping):
        raise ConfigError(prefix or "<root>", data, f"expected a mapping of {cls.__name__} keys", source)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    plugin_field = next((f.name for f in fields.values() if f.metadata.get("plugin_sections")), None)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if plugin_field is not None and (key == plugin_field or key not in fields):
            sections = value if key == plugin_field else {key: value}
            kwargs.setdefault(plugin_field, {}).update(_plugin_sections(sections, prefix, source))
            continue
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            raise ConfigError(dotted, value, f"unknown key{did_you_mean(str(key), fields)}; allowed keys here: "
                              f"{allowed}", source)
        kwargs[key] = _coerce(hints[key], value, dotted, source)
    if plugin_field in kwargs:  # a section equal to its defaults is kept as absent (the family reads its defaults)
        kwargs[plugin_field] = {name: section for name, section in kwargs[plugin_field].items()
                                if not _is_default(section)}
    missing = [
        name for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        key = f"{prefix}.{missing[0]}" if prefix else missing[0]
        raise ConfigError(key, None, "required key is missing", source)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.with_context(prefix=prefix, source=source) from None


def did_you_mean(key: str, allowed: Iterable[str]) -> str:
    """``" (did you mean `x`?)"`` for the allowed name closest to ``key`` (difflib), or ``""``."""
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _plugin_sections(sections: Any, prefix: str, source: str | None) -> dict[str, Any]:
    """Parse ``{family name: section}`` with each family's config class, built-in or plugin (ConfigError for a name
    that no family has)."""
    from arc_engine.monitors.registry import section_class, sectioned_names

    if not isinstance(sections, Mapping):
        raise ConfigError(prefix or "<root>", sections, "expected a mapping of plugin family sections", source)
    parsed: dict[str, Any] = {}
    for name, value in sections.items():
        dotted = f"{prefix}.{name}" if prefix else str(name)
        family_class = section_class(str(name))
        if family_class is None:
            known = ", ".join(sectioned_names())
            raise ConfigError(dotted, value, f"unknown key{did_you_mean(str(name), sectioned_names())}; not a "
                              f"built-in section nor a registered monitor family (the families: {known})", source)
        parsed[str(name)] = value if isinstance(value, family_class) else \
            from_dict(family_class, {} if value is None else value, source=source, prefix=dotted)
    return parsed


def _is_default(section: Any) -> bool:
    try:
        return bool(section == type(section)())
    except (TypeError, ValueError, ConfigError):  # a config class with required keys
        return False


def to_dict(config: Any) -> dict[str, Any]:
    """The plain nested-dict form of a config dataclass (what :func:`from_dict` accepts back); the sections of
    families with a config class of their own are written where the YAML has them (``detectors.<name>``), every
    registered one, its defaults where the config has none."""
    return _lift_sections(config, dataclasses.asdict(config))


def _lift_sections(config: Any, plain: dict[str, Any]) -> dict[str, Any]:
    from arc_engine.monitors.registry import section_class, sectioned_names

    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.metadata.get("plugin_sections"):
            given = plain.pop(field.name)
            for name in sectioned_names():  # in the families' order
                if name in given:
                    plain[name] = given.pop(name)
                    continue
                with contextlib.suppress(TypeError, ValueError, ConfigError):  # (a class with required keys)
                    plain[name] = dataclasses.asdict(section_class(name)())  # type: ignore[misc]
            plain.update(given)
        elif dataclasses.is_dataclass(value):
            _lift_sections(value, plain[field.name])
    return plain


def leaf_keys(cls: type = ArcConfig, prefix: str = "") -> list[tuple[str, Any]]:
    """Every dotted leaf key of dataclass ``cls`` with its type hint (used to build ``--arc.*`` options)."""
    out: list[tuple[str, Any]] = []
    plugin_fields = {f.name for f in dataclasses.fields(cls) if f.metadata.get("plugin_sections")}
    for name, hint in get_type_hints(cls).items():
        if name in plugin_fields:  # each registered plugin family's keys, under its own section name
            from arc_engine.monitors.registry import section_class, sectioned_names

            for family in sectioned_names():
                out.extend(leaf_keys(section_class(family), f"{prefix}.{family}" if prefix else family))
            continue
        dotted = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(hint):
            out.extend(leaf_keys(hint, dotted))  # type: ignore[arg-type]
        else:
            out.append((dotted, hint))
    return out


def describe_type(hint: Any) -> str:
    """A short human description of a type hint (for error messages and the config reference)."""
    origin = get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in get_args(hint))
    if origin is list:
        (item,) = get_args(hint)
        return f"a list of {describe_type(item)}"
    if hint is type(None):
        return "null"
    if dataclasses.is_dataclass(hint):
        return f"a mapping ({hint.__name__})"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def _coerce(hint: Any, value: Any, key: str, source: str | None) -> Any:
    origin = get_origin(hint)
    if dataclasses.is_dataclass(hint):
        # An empty section (every child commented out) reads as None in YAML: it means "all defaults".
        return from_dict(hint, {} if value is None else value, source=source, prefix=key)  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        options = get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, key, source)
            except ConfigError:
                continue
        raise ConfigError(key, value, f"expected {describe_type(hint)}", source)
    if origin is Literal:
        if value in get_args(hint) and not isinstance(value, bool):
            return value
        raise ConfigError(key, value, f"expected {describe_type(hint)}", source)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, value, f"expected {describe_type(hint)}", source)
        (item,) = get_args(hint)
        return [_coerce(item, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    return _coerce_scalar(hint, value, key, source)


def _coerce_scalar(hint: Any, value: Any, key: str, source: str | None) -> Any:
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
        return float(value)  # PyYAML (YAML 1.1) reads 1e4 and 1.0e4 as strings
    if hint is str and isinstance(value, str):
        return value
    raise ConfigError(key, value, f"expected {describe_type(hint)}", source)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("<file>", str(path), f"not UTF-8 text ({err.reason} at byte {err.start})",
                          str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:  # a parse error: where, and what
        mark = err.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError("<file>", str(path), f"not valid YAML{where}: {err.problem or err}", str(path)) from None
    except yaml.YAMLError as err:
        raise ConfigError("<file>", str(path), f"not valid YAML: {err}", str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("<root>", data, "the file must hold a mapping of arc_engine sections", str(path))
    return data


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    key = key.strip().removeprefix("--").removeprefix("arc.")
    if not sep or not key:
        raise ConfigError(item, None, "overrides are written KEY=VALUE, e.g. detectors.loss_spike.factor=8",
                          "command line")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(key, text, f"'{part}' is not a section", "command line")
        node = child
    node[parts[-1]] = value

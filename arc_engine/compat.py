"""The framework releases arc_engine is tested with, and how an integration reports what it cannot read.

Each framework's internals module (``integrations/deepspeed/internals.py``, ``integrations/megatron/internals.py``)
checks at attach what it reads (attributes, signatures, shapes), never a version string; a release outside its
:class:`TestedRange` only gets a warning. What it found is a :class:`Capabilities`: the features that are off, each
with what is missing, reported once as a ``compatibility`` lifecycle event. docs/compatibility.md has the matrix.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from arc_engine.monitors.family import FamilyBase, replace_section, section_of
from arc_engine.monitors.registry import families


def release(version: str) -> tuple[int, int, int] | None:
    """``"0.19.8+a1b2c3d"`` -> (0, 19, 8); ``"0.20.0rc1"`` -> (0, 20, 0); ``"2.9"`` -> (2, 9, 0); None when the text
    does not start with a release number."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3] or 0))


@dataclass(frozen=True)
class TestedRange:
    """The releases of ``package`` an integration is tested with: ``floor`` <= version < ``ceiling``."""

    __test__ = False  # not a pytest test class

    package: str  # as pip names it: "deepspeed", "megatron-core", "torch"
    floor: str
    ceiling: str
    reads: str  # where the integration reads that package's internals, for the warning

    def contains(self, version: str) -> bool:
        """Whether ``version`` (a local "+..." suffix ignored) is inside the range."""
        found, floor, ceiling = release(version), release(self.floor), release(self.ceiling)
        return found is not None and floor is not None and ceiling is not None and floor <= found < ceiling

    def text(self) -> str:
        """The range as people write it: ``"0.18.0 .. 0.19.x"``."""
        ceiling = release(self.ceiling)
        assert ceiling is not None and ceiling[1] > 0, self.ceiling
        return f"{self.floor} .. {ceiling[0]}.{ceiling[1] - 1}.x"

    def check(self, version: str, category: type[Warning]) -> str | None:
        """Warn (``category``) when ``version`` is outside the range and return the warning's text; None inside it.
        Never raises. Local."""
        if self.contains(version):
            return None
        message = (f"{self.package} {version} is outside the range arc_engine is tested with ({self.text()}); it "
                   f"reads internals that change between releases ({self.reads}): what it needs is checked at "
                   f"attach, and each feature whose internals are missing is turned off and reported in a "
                   f"'compatibility' event")
        warnings.warn(message, category, stacklevel=3)
        return message


@dataclass
class Capabilities:
    """What an integration's capability check found for one installed release: the features that are off, each
    with what is missing. ``described``: each feature's name -> (what it does, what being off means)."""

    tested: TestedRange
    version: str
    described: dict[str, tuple[str, str]]
    off: dict[str, list[str]] = field(default_factory=dict)
    config_off: list[str] = field(default_factory=list)  # the config keys effective_config turned off

    @property
    def in_tested_range(self) -> bool:
        return self.tested.contains(self.version)

    def has(self, feature: str) -> bool:
        return feature not in self.off

    def effective_config(self, config: Any, switches: Mapping[str, tuple[str, ...]]) -> Any:
        """``config`` (an ArcConfig) with the boolean keys that ``switches`` names for each feature that is off set
        to False: a copy, or the same object when nothing changes. Remembers the keys for :meth:`report`. Local."""
        self.config_off = [key for name in self.off for key in switches.get(name, ()) if _value(config, key)]
        for key in self.config_off:
            family, path = _family_key(key)
            if family is None:
                config = _turned_off(config, path)
            else:
                config = replace_section(config, family, _turned_off(section_of(config, family), path))
        return config

    def report(self) -> tuple[str, dict[str, Any]] | None:
        """The ``compatibility`` event's message and values; None when the release is tested and nothing is off."""
        if self.in_tested_range and not self.off:
            return None
        parts = [f"{name} off ({self.described[name][0]}: missing {', '.join(what)}; {self.described[name][1]})"
                 for name, what in self.off.items()]
        head = f"{self.tested.package} {self.version}" + (
            "" if self.in_tested_range else f", outside the tested range {self.tested.text()}")
        message = head + (": " + "; ".join(parts) if parts else ": every feature's internals are present")
        return message, {self.tested.package.replace("-", "_"): self.version, "tested_range": self.tested.text(),
                         "in_tested_range": self.in_tested_range, "features_off": dict(self.off),
                         "config_off": list(self.config_off)}


def _family_key(key: str) -> tuple[FamilyBase | None, list[str]]:
    """(the monitor family, the dotted path inside its section) for a key under ``detectors.<family>``; else (None,
    the key's path from the root)."""
    parts = key.split(".")
    if parts[0] == "detectors" and len(parts) > 2:
        family = next((f for f in families() if f.name == parts[1]), None)
        if family is not None:
            return family, parts[2:]
    return None, parts


def _value(config: Any, key: str) -> Any:
    family, path = _family_key(key)
    node = config if family is None else section_of(config, family)
    for part in path:
        node = getattr(node, part)
    return node


def _turned_off(section: Any, path: list[str]) -> Any:
    """A copy of the config ``section`` with the boolean at the dotted ``path`` set to False."""
    head, *rest = path
    return dataclasses.replace(section, **{head: False if not rest else _turned_off(getattr(section, head), rest)})


#: The torch releases arc_engine is tested with (docs/compatibility.md).
TORCH = TestedRange("torch", "2.9", "2.16", "integrations/pytorch/amp.py, arc_engine/recovery/checkpoint.py")


class UntestedTorchVersion(UserWarning):
    """The installed torch is outside :data:`TORCH` (a warning category, never raised)."""

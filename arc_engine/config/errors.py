"""Configuration errors: one message that names the source, the key, the value and what is allowed."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value is wrong.

    The message names the source (file or command line), the dotted key, the offending value and what
    would have been accepted, e.g.::

        configs/arc.yaml: detectors.loss_spike.factor = -1: must be > 0
    """

    def __init__(self, key: str, value: Any, allowed: str, source: str | None = None) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        where = f"{self.source}: " if self.source else ""
        return f"{where}{self.key} = {self.value!r}: {self.allowed}"

    def with_context(self, *, prefix: str = "", source: str | None = None) -> ConfigError:
        """Return a copy whose key is prefixed with ``prefix`` and whose source is ``source``."""
        key = f"{prefix}.{self.key}" if prefix and self.key else (prefix or self.key)
        return ConfigError(key, self.value, self.allowed, source or self.source)


class ArcSetupError(ValueError):
    """The job cannot start with this configuration on this machine, found at attach: e.g. a checkpoint directory
    that cannot be written. Raised on every rank of the decision group at once (the check is agreed); ``attach``
    turns it into one line on the group's first rank and exit code 2, as a bad config ends a launch."""


def require(condition: bool, key: str, value: Any, allowed: str) -> None:
    """Raise :class:`ConfigError` for ``key`` unless ``condition`` holds (used in ``__post_init__``)."""
    if not condition:
        raise ConfigError(key, value, allowed)

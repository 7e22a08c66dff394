"""What the base classes of arc_engine's seams share (:class:`~arc_engine.adapter.Adapter`,
:class:`~arc_engine.monitors.base.Monitor`, :class:`~arc_engine.monitors.family.FamilyBase`,
:class:`~arc_engine.sinks.base.Sink`): optional hooks are methods with no-op defaults that the callers call
directly, and a subclass method that looks like a hook but is none (a misspelt override, which would never run)
fails when the class is defined."""

from __future__ import annotations

import difflib


def check_overrides(cls: type, base: type, prefixes: tuple[str, ...], hooks: tuple[str, ...] = ()) -> None:
    """TypeError where ``cls`` defines a public method that is not a member of ``base`` but looks like one: its
    name starts with one of ``prefixes``, or is one or two letters off a public member of ``base`` (``hooks``, for
    the message: the members a subclass overrides)."""
    members = set(dir(base))
    public = sorted(member for member in members if not member.startswith("_") and member not in vars(object))
    for name, value in vars(cls).items():
        if name.startswith("_") or name in members or not callable(value):
            continue
        close = difflib.get_close_matches(name, public, n=1, cutoff=0.85)
        if name.startswith(prefixes) or close:
            known = ", ".join(hooks or [m for m in public if callable(getattr(base, m)) and m.isidentifier()
                                        and not m.isupper()])
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{cls.__module__}.{cls.__qualname__}.{name} is not a hook of {base.__name__}{hint}: "
                            f"it would never be called. The hooks are: {known}")

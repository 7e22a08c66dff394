"""The configuration reference page, generated from the schema's field docstrings.

``python -m arc_engine.config.docs > docs/configuration.md`` regenerates the committed page; ``tests/test_docs.py``
fails when the committed page differs from :func:`render`. The walk starts at
:class:`~arc_engine.config.schema.ArcConfig` and lists every dotted key with its type, default and allowed values.
A key's description is its field's attribute docstring: the string literal on the line right after the field in
the class body, read from the source with :mod:`ast`. Its last line, when it starts with ``Allowed:``, names the
values that ``__post_init__`` accepts where the type does not say them (ranges, formats); ``Literal`` choices and
booleans are read from the type hints. A key whose field has no docstring is an error naming the class and the
field, so a new key cannot ship undocumented (a field holding a section needs none: its class docstring's first
sentence introduces the section).

:func:`field_docs` and :func:`render_sections` take any config dataclass, a plugin family's ``config_class``
included (``render_sections(WeightGuardConfig, "detectors.weight_guard")``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import sys
import textwrap
import types
import typing
from typing import Any, Literal, NamedTuple, get_args, get_origin, get_type_hints

from arc_engine.config.schema import ArcConfig

REGENERATE = "python -m arc_engine.config.docs > docs/configuration.md"
ALLOWED = "Allowed:"

# The manual page of each section (relative to docs/); a subsection without an entry takes its parent's.
SECTION_PAGES: dict[str, str] = {
    "run": "events.md",
    "stats": "architecture.md",
    "detectors": "detectors.md",
    "detectors.sdc": "sdc.md",
    "policy": "detectors.md",
    "sinks": "events.md",
    "sinks.wandb": "wandb.md",
    "faults": "faults.md",
    "recovery": "recovery.md",
    "watchdog": "watchdog.md",
}

INTRO = f"""\
<!-- Generated from arc_engine/config/schema.py by `{REGENERATE}`. Do not edit by hand: \
tests/test_docs.py fails when this page is stale. -->

# Configuration reference

One typed tree of dataclasses (`arc_engine/config/schema.py`), loaded from YAML with `--arc-config PATH`.
Precedence, later wins: the schema's defaults < the file < `--arc.<key>=VALUE` overrides. Override values are
parsed as YAML, so `--arc.faults.injections='[{{kind: nan_loss, rank: 0, step: 5}}]'` works. Environment
variables set nothing but the run id: `arc_engine/runtime.py`, the one place that reads the environment, takes it
from `TORCHELASTIC_RUN_ID` when `run.run_id` is null (a config value wins) and names devices by `LOCAL_RANK`; W&B
reads its own variables (`WANDB_MODE`, `WANDB_API_KEY`, ...). Unknown keys, wrong types
and out-of-range values are errors that name the file, the key, the value and what is allowed (exit code 2):

```
$ arc-engine validate-config bad.yaml
arc_engine: invalid config: bad.yaml: detectors.loss_spike.factr = 3: unknown key (did you mean `factor`?); \
allowed keys here: action, enabled, factor, min_relative_increase, warmup_steps, window
$ echo $?
2
$ python train.py --arc.detectors.loss_spike.factr=3      # a training script with arc_engine.add_arc_args
arc_engine: invalid config: --arc.detectors.loss_spike.factr: unknown key (did you mean \
`detectors.loss_spike.factor`?); `arc-engine show-config` lists every key
```

`arc-engine show-config [--arc-config F] [--arc.key=value ...]` prints the effective configuration;
`python -m arc_engine ...` is the same command line as `arc-engine ...`. Shipped,
commented examples: [`configs/default.yaml`](../configs/default.yaml) (every key at its default),
[`configs/demo.yaml`](../configs/demo.yaml), [`configs/monitoring_only.yaml`](../configs/monitoring_only.yaml)
(report only, never intervene), [`configs/aggressive_recovery.yaml`](../configs/aggressive_recovery.yaml) (tight
thresholds, short fuse).

Actions (`action` keys): `warn` reports and applies the step; `checkpoint` applies it and takes a preventive
checkpoint (a snapshot at the next step, saved to disk when verified; a warning without `recovery.enabled`); `skip`
applies nothing on any rank; `rollback`
returns every rank to the newest verified-stable state and heals (needs `recovery.enabled`, else it aborts);
`abort` stops every rank with exit code 3 ([events.md](events.md)).
"""


class SchemaKey(NamedTuple):
    key: str
    type_text: str
    default: str
    allowed: str
    text: str


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _declared_docs(cls: type) -> dict[str, str]:
    """The docstrings of the fields declared in ``cls``'s own body (not its bases'), by field name."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError) as exc:
        raise RuntimeError(f"cannot read the source of {_qualified_name(cls)} ({exc}): its field docstrings are "
                           f"read from it") from exc
    class_def = ast.parse(source).body[0]
    assert isinstance(class_def, ast.ClassDef), f"the source of {_qualified_name(cls)} is not a class"
    docs = {}
    for stmt, following in itertools.pairwise(class_def.body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(following.value.value)
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """The docstrings of ``cls``'s fields (cleaned of indentation), by field name, in field order; a field without
    one is left out. A field that a subclass redeclares without a docstring takes the nearest base class's, as
    attribute lookup would. Raises RuntimeError when the source of ``cls`` cannot be read."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"field_docs needs a dataclass, got {cls!r}")
    declared = [_declared_docs(base) for base in cls.__mro__ if dataclasses.is_dataclass(base)]
    docs = {}
    for field in dataclasses.fields(cls):
        doc = next((own[field.name] for own in declared if own.get(field.name)), None)
        if doc is not None:
            docs[field.name] = doc
    return docs


def _split_allowed(doc: str) -> tuple[str, str | None]:
    """(the description on one line, the ``Allowed:`` line's value or None)."""
    *lines, last = doc.splitlines()
    if last.startswith(ALLOWED):
        return " ".join(" ".join(lines).split()), last.removeprefix(ALLOWED).strip()
    return " ".join(doc.split()), None


def _origin_args(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    origin = get_origin(hint)
    if origin is types.UnionType:
        origin = typing.Union
    return origin, get_args(hint)


def _without_none(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (hint, False)."""
    origin, args = _origin_args(hint)
    if origin is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        assert len(rest) == 1, f"unsupported union {hint}"
        return rest[0], True
    return hint, False


def _list_item(hint: Any) -> Any:
    """The item type of ``list[X]``, else None."""
    origin, args = _origin_args(hint)
    return args[0] if origin is list else None


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    return str(value)


def _describe_type(hint: Any) -> tuple[str, str | None]:
    """(type text, allowed values when the type itself says them)."""
    inner, nullable = _without_none(hint)
    suffix = " or null" if nullable else ""
    origin, args = _origin_args(inner)
    if origin is Literal:
        choices = ", ".join(f"`{a}`" for a in args) + (", null" if nullable else "")
        return "choice" + suffix, choices
    if inner is bool:
        return "bool" + suffix, "`true`, `false`"
    if origin is list:
        (item,) = args
        return f"list of {item.__name__}", None
    return inner.__name__ + suffix, None


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return f"`{_yaml_value(field.default)}`"
    if field.default_factory is not dataclasses.MISSING:
        return f"`{_yaml_value(field.default_factory())}`"
    return "required"


def _row(cls: type, field: dataclasses.Field, hint: Any, key: str, doc: str | None) -> SchemaKey:
    where = f"{_qualified_name(cls)}.{field.name}"
    if doc is None:
        raise RuntimeError(f"{where} has no docstring: write one as a string literal on the line after the field "
                           f"(its last line `{ALLOWED} ...` where the type does not say which values are valid), "
                           f"then run `{REGENERATE}`")
    text, allowed = _split_allowed(doc)
    if not text:
        raise RuntimeError(f"{where}: the docstring has no description before its `{ALLOWED}` line")
    if field.metadata.get("plugin_sections"):  # no key of its own: each plugin family reads <prefix>.<name>
        return SchemaKey(key.rsplit(".", 1)[0] + ".<family>", "mapping", "none", allowed or "any", text)
    type_text, derived = _describe_type(hint)
    if derived is not None and allowed is not None:
        raise RuntimeError(f"{where}: the docstring's `{ALLOWED}` line repeats what the type says ({derived}): "
                           f"remove it")
    if _without_none(hint)[0] in (int, float) and allowed is None:
        raise RuntimeError(f"{where}: a number's docstring needs a last line `{ALLOWED} ...` naming the range that "
                           f"__post_init__ checks")
    return SchemaKey(key, type_text, _default_text(field), derived or allowed or "any", text)


def _sections(cls: type, prefix: str) -> list[tuple[str, type, list[SchemaKey]]]:
    """One ``(dotted prefix, dataclass, rows)`` per dataclass of the tree, depth first, parents before children.

    A field holding a dataclass is a section of its own; one holding a list of dataclasses is a key, and its items'
    fields are the section ``<key>[]``.
    """
    rows: list[SchemaKey] = []
    children: list[tuple[str, type, list[SchemaKey]]] = []
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    for field in dataclasses.fields(cls):
        key = f"{prefix}.{field.name}" if prefix else field.name
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            children += _sections(hint, key)
            continue
        rows.append(_row(cls, field, hint, key, docs.get(field.name)))
        if dataclasses.is_dataclass(_list_item(hint)):
            children += _sections(_list_item(hint), f"{key}[]")
    own = [(prefix, cls, rows)] if prefix else []
    return own + children


def _section_intro(cls: type) -> str:
    """The first sentence of the class docstring, as Markdown (empty when there is none)."""
    doc = (cls.__doc__ or "").strip()
    if not doc or doc.startswith(f"{cls.__name__}("):  # dataclass's generated signature
        return ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    end = paragraph.find(". ")
    sentence = paragraph if end < 0 else paragraph[: end + 1]
    return sentence.replace("``", "`")


def _table(rows: list[SchemaKey]) -> list[str]:
    lines = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    lines += [f"| `{r.key}` | {r.type_text} | {r.default} | {r.allowed} | {r.text} |" for r in rows]
    return lines


def _section(title: str, cls: type, rows: list[SchemaKey], pages: dict[str, str]) -> list[str]:
    lines = [f"## `{title}`", ""]
    intro = _section_intro(cls)
    prefix = title.removesuffix("[]")
    while prefix not in pages and "." in prefix:
        prefix = prefix.rsplit(".", 1)[0]
    page = pages.get(prefix)
    if page:
        intro = f"{intro} Manual: [{page}]({page}).".strip()
    if intro:
        lines += [intro, ""]
    return [*lines, *_table(rows), ""]


def render_sections(cls: type, prefix: str, pages: dict[str, str] | None = None) -> str:
    """The Markdown sections of config dataclass ``cls`` read under the dotted ``prefix``: a heading, the first
    sentence of the class docstring and a table of its keys, then the same for each dataclass below it. ``pages``
    maps a dotted prefix to the manual page its sections link to (a subsection takes its parent's). Raises
    RuntimeError when a key's field has no docstring, or its ``Allowed:`` line is missing (a number) or repeats the
    type (a choice, a bool)."""
    return _render(_sections(cls, prefix), pages or {})


def _render(sections: list[tuple[str, type, list[SchemaKey]]], pages: dict[str, str]) -> str:
    lines: list[str] = []
    for title, section_cls, rows in sections:
        if rows:
            lines += _section(title, section_cls, rows, pages)
    return "\n".join(lines)


def render() -> str:
    """The whole page (docs/configuration.md): the schema's sections, with the sections of the built-in families
    (each family's ``config_class``, in :func:`~arc_engine.monitors.registry.builtin_families` order) right after
    the ``detectors`` one. Raises RuntimeError as :func:`render_sections` does."""
    from arc_engine.monitors.registry import builtin_families

    sections = _sections(ArcConfig, "")
    after = next(i for i, (title, _, _) in enumerate(sections) if title == "detectors") + 1
    own = [section for family in builtin_families() if family.config_class is not None
           for section in _sections(family.config_class, f"detectors.{family.name}")]
    sections[after:after] = own
    return "\n".join([INTRO, _render(sections, SECTION_PAGES)]).rstrip("\n") + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The README and the manual in docs/: the configuration page is the generator's output (every key documented by
its field's docstring), and every link resolves to a file (and heading) of this repository."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from arc_engine.config.docs import REGENERATE, field_docs, render, render_sections

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCED_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def links(markdown: str) -> list[str]:
    """Targets of the inline links and images, outside code."""
    prose = INLINE_CODE.sub("", FENCED_BLOCK.sub("", markdown))
    return LINK.findall(prose)


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    anchors: set[str] = set()
    for heading in HEADING.findall(FENCED_BLOCK.sub("", markdown)):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        candidate, repeat = slug, 0
        while candidate in anchors:
            repeat += 1
            candidate = f"{slug}-{repeat}"
        anchors.add(candidate)
    return anchors


def test_configuration_page_equals_the_generated_reference() -> None:
    committed = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == render(), f"docs/configuration.md is stale: regenerate it with `{REGENERATE}`"


@dataclass(kw_only=True)
class GuardConfig:
    """A plugin family's config section."""

    enabled: bool = True
    """Watch the weights."""
    threshold: float = 1.0e3
    """Largest absolute weight that
    passes.
    Allowed: > 0"""


@dataclass(kw_only=True)
class StrictGuardConfig(GuardConfig):
    threshold: float = 10.0
    patience: int = 2


def test_field_docs_reads_each_fields_docstring_and_the_allowed_line() -> None:
    assert field_docs(GuardConfig) == {"enabled": "Watch the weights.",
                                       "threshold": "Largest absolute weight that\npasses.\nAllowed: > 0"}
    page = render_sections(GuardConfig, "detectors.guard", {"detectors": "families.md"})
    assert page.splitlines()[:3] == ["## `detectors.guard`", "", "A plugin family's config section. Manual: "
                                     "[families.md](families.md)."]
    assert "| `detectors.guard.threshold` | float | `1000.0` | > 0 | Largest absolute weight that passes. |" in page
    assert "| `detectors.guard.enabled` | bool | `true` | `true`, `false` | Watch the weights. |" in page


def test_a_field_without_a_docstring_is_an_error_naming_class_and_field() -> None:
    assert list(field_docs(StrictGuardConfig)) == ["enabled", "threshold"]  # a redeclared field keeps its base's
    with pytest.raises(RuntimeError, match=r"test_docs\.StrictGuardConfig\.patience has no docstring"):
        render_sections(StrictGuardConfig, "detectors.guard")


def test_the_docs_have_a_readme_an_index_and_pages() -> None:
    names = {path.name for path in DOC_FILES}
    assert {"README.md", "configuration.md", "testing.md"} <= names
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 200, "keep README.md short"


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda path: str(path.relative_to(REPO)))
def test_every_link_points_to_a_file_or_heading_inside_the_repository(doc: Path) -> None:
    problems = []
    for target in links(doc.read_text(encoding="utf-8")):
        path_part, _, anchor = target.partition("#")
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", path_part) or path_part.startswith(("/", "\\", "~")):
            problems.append(f"{target}: leaves the repository (a URL or an absolute path)")
            continue
        resolved = (doc.parent / path_part).resolve() if path_part else doc
        if not resolved.is_relative_to(REPO) or ".git" in resolved.relative_to(REPO).parts:
            problems.append(f"{target}: resolves outside the repository ({resolved})")
        elif not resolved.exists():
            problems.append(f"{target}: no such file ({resolved.relative_to(REPO)})")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text("utf-8")):
            problems.append(f"{target}: no heading with anchor #{anchor} in {resolved.relative_to(REPO)}")
    assert not problems, f"{doc.relative_to(REPO)}:\n" + "\n".join(problems)


def test_link_checker_sees_links_only_outside_code() -> None:
    text = "see [a](a.md) and `[b](b.md)`\n```\n[c](c.md)\n```\n![d](img/d.png \"title\")"
    assert links(text) == ["a.md", "img/d.png"]
    assert heading_anchors("# FSDP2 (`fully_shard`)\n## DeepSpeed ZeRO-1/2/3\n## `sinks.wandb`\n# A\n# A") == {
        "fsdp2-fully_shard", "deepspeed-zero-123", "sinkswandb", "a", "a-1"}


def test_the_family_example_in_families_md_is_the_non_finite_module() -> None:
    """docs/families.md shows ``arc_engine/monitors/non_finite.py`` as the shape of a family: every line of its
    example is a line of the module, in the module's order (bodies left out)."""
    page = (REPO / "docs" / "families.md").read_text(encoding="utf-8")
    section = page.split("## A family in one module: `non_finite`", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    module = (REPO / "arc_engine" / "monitors" / "non_finite.py").read_text(encoding="utf-8").splitlines()
    position = 0
    for line in (line for line in example.splitlines() if line.strip()):
        try:
            position = module.index(line, position) + 1
        except ValueError:
            pytest.fail(f"docs/families.md's non_finite example: {line!r} is not the module's next such line")

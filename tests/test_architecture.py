"""The shape of the code, checked: no import cycle among arc_engine's modules (the integrations included, lazy and
type-checking imports too), an engine under 400 lines with no ``hasattr``/``getattr`` dispatch, no optional-member
probe outside the ``*internals.py`` modules (the seams are base classes whose hooks are called directly), the
configuration reference generated from the schema (no hand-kept module). Read from the source, nothing imported;
the seams' misspelt-override check is the one test here that imports them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ((ROOT / "arc_engine", "arc_engine"), (ROOT / "integrations", "arc_engine.integrations"))


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of arc_engine as installed."""
    out = {}
    for base, prefix in PACKAGES:
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = path
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The arc_engine modules ``name`` imports anywhere in its source (``from package import module`` counts as the
    module; ``from module import name`` as the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
    return {module for module in found if module in known and module != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_arc_engine_modules() -> None:
    known = module_files()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert graph["arc_engine.engine"], "the import reader found nothing: it is broken"
    assert cycles(graph) == []


def test_the_engine_dispatches_on_no_attribute_lookup() -> None:
    source = (ROOT / "arc_engine" / "engine.py").read_text(encoding="utf-8")
    calls = [node.func.id for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    assert "hasattr" not in calls and "getattr" not in calls


def probes(path: Path) -> list[str]:
    """``hasattr(...)`` and ``getattr(obj, name, default)`` calls in ``path``: asking an object whether it has a
    member (a 2-argument ``getattr`` reads one that must be there, and fails loudly where it is not)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and (node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) >= 3))]


def test_no_optional_member_is_probed_outside_the_internals_modules() -> None:
    """arc_engine's own seams (adapter, monitor, family, sink, train state) are base classes with no-op hooks, called
    directly; what arc_engine reads of objects it does not own (torch, DeepSpeed, megatron-core, transformers,
    Lightning, W&B, NVML) where a release may lack it is read in ``arc_engine/internals.py`` and the integrations'
    ``internals.py`` modules only."""
    files = [path for path in module_files().values() if not path.name.endswith("internals.py")]
    assert len(files) > 100 and any(path.name == "wiring.py" for path in files)
    found = [probe for path in files for probe in probes(path)]
    assert found == [], "\n".join(found)
    internals = [path for path in module_files().values() if path.name.endswith("internals.py")]
    assert sum(len(probes(path)) for path in internals) > 20  # the reader finds them where they are


def test_a_misspelt_hook_fails_when_the_class_is_defined() -> None:
    """A subclass method that looks like a hook of its seam but is none would silently never run: it is a
    TypeError naming the hook it resembles. Real hooks and helpers of other names are accepted."""
    import pytest

    from arc_engine.adapter import Adapter
    from arc_engine.monitors.base import Monitor
    from arc_engine.monitors.family import FamilyBase
    from arc_engine.recovery.state import TrainState
    from arc_engine.sinks import Sink

    with pytest.raises(TypeError, match=r"before_step_strat is not a hook of Adapter.*'before_step_start'"):
        type("Misspelt", (Adapter,), {"before_step_strat": lambda self: None})
    with pytest.raises(TypeError, match=r"evalute is not a hook of Monitor.*'evaluate'"):
        type("Misspelt", (Monitor,), {"evalute": lambda self, step, stats: []})
    with pytest.raises(TypeError, match="on_stat is not a hook of Monitor"):
        type("Misspelt", (Monitor,), {"on_stat": lambda self, locations: None})
    with pytest.raises(TypeError, match="sketch_dues is not a hook of FamilyBase"):
        type("Misspelt", (FamilyBase,), {"sketch_dues": lambda self, ctx, step: True})
    with pytest.raises(TypeError, match=r"log_rank is not a hook of Sink.*'log_ranks'"):
        type("Misspelt", (Sink,), {"log_rank": lambda self, *args: None})
    with pytest.raises(TypeError, match="forward_writen is not a hook of TrainState"):
        type("Misspelt", (TrainState,), {"forward_writen": lambda self: []})
    fine = type("Fine", (Monitor,), {"observe": lambda self, decision: None, "baseline": lambda self: 0.0})
    assert fine.observe is not Monitor.observe


def test_the_configuration_reference_is_generated_from_the_schema() -> None:
    assert not (ROOT / "arc_engine" / "config" / "reference.py").exists()
    assert (ROOT / "arc_engine" / "config" / "docs.py").exists()


def test_the_engine_is_small_enough_to_hold_in_ones_head() -> None:
    lines = (ROOT / "arc_engine" / "engine.py").read_text(encoding="utf-8").count("\n")
    assert lines < 400, f"arc_engine/engine.py has {lines} lines: move what is not the commit point out"


def test_the_package_imports_no_torch_and_its_attach_stays_the_function_after_its_module_is_imported() -> None:
    """``import arc_engine`` imports no torch (``arc-engine hosts`` runs on every node before it joins), and the
    submodule ``arc_engine.attach``, imported first, does not hide the function ``arc_engine.attach``."""
    code = ("import sys, arc_engine; assert 'torch' not in sys.modules, 'torch imported'; "
            "from arc_engine.attach import Arc; assert callable(arc_engine.attach) and "
            "arc_engine.attach.__name__ == 'attach' and arc_engine.attach is sys.modules['arc_engine.attach'].attach; "
            "from arc_engine import attach; assert attach is arc_engine.attach; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.stdout.strip() == "ok", result.stderr[-3000:]

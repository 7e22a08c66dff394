"""Suite-wide test wiring: one thread per process, one torch extension cache per environment, and which tests carry
the ``slow`` marker.

Tests run with ``OMP_NUM_THREADS=1`` unless it is set: on a busy 2-core machine, OpenMP's worker threads spin while
they wait for a core, and an in-process 1,000-step test took 142 s with torch's default 2 threads against 10 s with
one. Spawned ranks already run with one thread each (``tests/dist_harness.py``).

``pytest -m "not slow"`` runs every test that stays inside the pytest process and finishes in seconds. A test
is slow when

* it starts processes: it reaches, through its own code or helpers defined in ``tests/``, one of the names in
  :data:`PROCESS_STARTERS` (``run_ranks`` from ``tests/dist_harness.py``, ``subprocess``, ``mp.spawn``, ...).
  This is read from the source, so a new multi-process test is slow without being listed anywhere;
* or it is listed in :data:`SLOW_IN_PROCESS`: single-process tests that train long enough to matter.
"""

from __future__ import annotations

import ast
import os
import sys
from functools import cache
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent

# A function that names any of these starts other processes (gloo ranks, torchrun, launchers, the CLI, the demo).
PROCESS_STARTERS = frozenset({"run_ranks", "run_script", "subprocess", "Popen", "spawn", "start_processes", "Process"})

# Single-process tests that take more than about 10 s on a 2-core machine, as "file::test name" relative to tests/.
# None today: the longest, test_sdc.py::test_no_false_flag_in_a_clean_1000_step_run, takes 3-5 s.
SLOW_IN_PROCESS: frozenset[str] = frozenset()


@cache
def _module_functions(path: Path) -> tuple[dict[str, set[str]], dict[str, tuple[Path, str]]]:
    """Per function defined in ``path`` (at any depth): the names, attributes and parameter (fixture) names it
    references. Also the names imported from other modules of ``tests/`` (``from tests.training import x``),
    mapped to their definition."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    references: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names = references.setdefault(node.name, set())
            for inner in ast.walk(node):
                if isinstance(inner, ast.Name):
                    names.add(inner.id)
                elif isinstance(inner, ast.Attribute):
                    names.add(inner.attr)
                elif isinstance(inner, ast.arg):  # a fixture the test requests by parameter name
                    names.add(inner.arg)
    imported: dict[str, tuple[Path, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."):
            source = TESTS_DIR / (node.module.removeprefix("tests.").replace(".", "/") + ".py")
            if source.is_file():
                for alias in node.names:
                    imported[alias.asname or alias.name] = (source, alias.name)
    return references, imported


def starts_processes(path: Path, function: str, _seen: frozenset[tuple[Path, str]] = frozenset()) -> bool:
    """Whether ``function`` of the test module ``path`` reaches a process starter through code in ``tests/``."""
    if (path, function) in _seen:
        return False
    seen = _seen | {(path, function)}
    references, imported = _module_functions(path)
    names = references.get(function, set())
    if names & PROCESS_STARTERS:
        return True
    for name in names:
        if name in references and name != function and starts_processes(path, name, seen):
            return True
        if name in imported and starts_processes(*imported[name], seen):
            return True
    return False


def is_slow(item: pytest.Item) -> bool:
    path = Path(str(item.path))
    name = getattr(item, "originalname", item.name)
    if f"{path.name}::{name}" in SLOW_IN_PROCESS:
        return True
    return path.suffix == ".py" and starts_processes(path, name)


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when torch is imported, i.e. at collection
    # DeepSpeed JIT-builds its CPU communication op into torch's extension cache, keyed by Python and torch versions
    # only: two environments of the same versions (two clones, a worktree) rebuild it in turns (90-140 s each, under
    # a file lock the other's tests wait on). One cache per environment, where scripts/setup.sh builds it.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    threads = os.environ["OMP_NUM_THREADS"]
    if "torch" in sys.modules and threads.isdigit():  # imported earlier (by a plugin): set it directly
        sys.modules["torch"].set_num_threads(int(threads))
    for entry in sorted(SLOW_IN_PROCESS):
        file_name, _, function = entry.partition("::")
        path = TESTS_DIR / file_name
        if not path.is_file() or function not in _module_functions(path)[0]:
            raise pytest.UsageError(f"tests/conftest.py: SLOW_IN_PROCESS names {entry}, which does not exist")
    for name in LONGEST_FIRST:
        if not (TESTS_DIR / name).is_file():
            raise pytest.UsageError(f"tests/conftest.py: LONGEST_FIRST names {name}, which does not exist")


# Under pytest-xdist (``--dist loadfile``, scripts/test.sh) a test file is one unit of work, and the workers take the
# units in the order collected. These files hold the longest tests (each 60-130 s on 2 cores, measured with
# ``--durations``), so they start first; then the other files that start processes; the in-process files last, so
# that their quick tests fill the workers' final minutes instead of one long test running alone at the end.
LONGEST_FIRST = ("test_megatron_qk_separability_dist.py", "test_demo_megatron.py", "test_campaign.py",
                 "test_hf_trainer_dist.py", "test_lightning_dist.py", "test_megatron_lm_launcher.py")


def _parallel() -> bool:
    """Whether this is a pytest-xdist worker (``-n N``, N > 0): the workers collect, the controller schedules."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


@pytest.hookimpl(tryfirst=True)  # the order set before any other plugin reads the items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = pytest.mark.slow
    for item in items:
        if is_slow(item):
            item.add_marker(slow)
    if not _parallel():
        return
    starts = {Path(str(item.path)).name for item in items if item.get_closest_marker("slow") is not None}

    def order(item: pytest.Item) -> int:
        name = Path(str(item.path)).name
        if name in LONGEST_FIRST:
            return LONGEST_FIRST.index(name)
        return len(LONGEST_FIRST) + (name not in starts)

    items.sort(key=order)

"""``integrations/`` is one package per framework, and the paths the docs and examples import are there."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

INTEGRATIONS = Path(__file__).resolve().parents[1] / "integrations"
PACKAGES = {"pytorch", "deepspeed", "megatron", "hf", "lightning"}

#: (module, name) that README.md, docs/, examples/, launch/ and scripts/ import, at the paths they use
DOCUMENTED = [("hf", "ArcCallback"), ("lightning", "ArcCallback"), ("deepspeed", "attach_deepspeed"),
              ("megatron", "attach_megatron"), ("pytorch.fsdp", "attach_fsdp"), ("pytorch.ddp", "TorchAdapter")]


def test_the_folder_holds_one_package_per_framework_and_no_flat_module() -> None:
    assert sorted(p.name for p in INTEGRATIONS.glob("*.py")) == ["__init__.py"]
    assert {p.parent.name for p in INTEGRATIONS.glob("*/__init__.py")} == PACKAGES


def test_no_path_of_the_flat_layout_or_a_library_named_subpackage_imports() -> None:
    """The 0.1.0 flat paths are gone with their import hook, and no subpackage shadows a library's name."""
    for old in ("ddp", "fsdp", "torch_amp", "deepspeed_internals", "megatron_state", "torch"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"arc_engine.integrations.{old}")


@pytest.mark.parametrize(("module", "name"), DOCUMENTED, ids=[f"{m}.{n}" for m, n in DOCUMENTED])
def test_the_documented_paths_import(module: str, name: str) -> None:
    if module in ("hf", "lightning"):
        pytest.importorskip({"hf": "transformers", "lightning": "lightning"}[module])
    imported = importlib.import_module(f"arc_engine.integrations.{module}")
    assert getattr(imported, name).__module__ == imported.__name__

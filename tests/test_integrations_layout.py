"""``integrations/`` is one package per framework, and every import path of the flat layout before it still works:
an old path is the very module (and its names the very objects) of its new home."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import arc_engine.integrations
from arc_engine.integrations import MOVED

INTEGRATIONS = Path(__file__).resolve().parents[1] / "integrations"
PACKAGES = {"torch", "deepspeed", "megatron", "hf", "lightning"}

#: (module, name) that README.md, docs/, examples/, launch/ and scripts/ import, at the paths they use
DOCUMENTED = [("hf", "ArcCallback"), ("lightning", "ArcCallback"), ("deepspeed", "attach_deepspeed"),
              ("megatron", "attach_megatron"), ("torch.fsdp", "attach_fsdp"), ("torch.ddp", "TorchAdapter")]


def test_the_folder_holds_one_package_per_framework_and_no_flat_module() -> None:
    assert sorted(p.name for p in INTEGRATIONS.glob("*.py")) == ["__init__.py"]
    assert {p.parent.name for p in INTEGRATIONS.glob("*/__init__.py")} == PACKAGES
    assert not [old for old in MOVED if (INTEGRATIONS / f"{old}.py").exists()]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_flat_path_is_the_module_at_its_new_home(old: str) -> None:
    new_home = importlib.import_module(f"arc_engine.integrations.{MOVED[old]}")
    assert (INTEGRATIONS / (MOVED[old].replace(".", "/") + ".py")).is_file()
    assert importlib.import_module(f"arc_engine.integrations.{old}") is new_home
    assert sys.modules[f"arc_engine.integrations.{old}"] is new_home
    assert getattr(arc_engine.integrations, old) is new_home  # ``from arc_engine.integrations import ddp``
    assert new_home.__name__ == new_home.__spec__.name == f"arc_engine.integrations.{MOVED[old]}"


def test_the_old_flat_paths_give_the_same_objects() -> None:
    from arc_engine.integrations.ddp import TorchAdapter
    from arc_engine.integrations.deepspeed.internals import check_capabilities as new_check_capabilities
    from arc_engine.integrations.deepspeed_internals import check_capabilities
    from arc_engine.integrations.fsdp import attach_fsdp
    from arc_engine.integrations.megatron.state import MegatronTrainState as NewMegatronTrainState
    from arc_engine.integrations.megatron_state import MegatronTrainState
    from arc_engine.integrations.torch.amp import ScalerWatch as NewScalerWatch
    from arc_engine.integrations.torch.ddp import TorchAdapter as NewTorchAdapter
    from arc_engine.integrations.torch.fsdp import attach_fsdp as new_attach_fsdp
    from arc_engine.integrations.torch_amp import ScalerWatch

    assert TorchAdapter is NewTorchAdapter and attach_fsdp is new_attach_fsdp and ScalerWatch is NewScalerWatch
    assert check_capabilities is new_check_capabilities and MegatronTrainState is NewMegatronTrainState


def test_a_name_outside_the_table_is_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("arc_engine.integrations.deepspeed_adapter")


@pytest.mark.parametrize(("module", "name"), DOCUMENTED, ids=[f"{m}.{n}" for m, n in DOCUMENTED])
def test_the_documented_paths_import(module: str, name: str) -> None:
    if module in ("hf", "lightning"):
        pytest.importorskip({"hf": "transformers", "lightning": "lightning"}[module])
    imported = importlib.import_module(f"arc_engine.integrations.{module}")
    assert getattr(imported, name).__module__ == imported.__name__

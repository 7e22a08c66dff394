"""The Megatron integration's structure (no processes): every read of megatron-core internals and every wrapped
method lives in ``integrations/megatron/internals.py``, checked by what it reads (a release outside the tested range
warns; a missing internal turns off the one feature that reads it); the wrappers run and come off as documented;
the Megatron-LM launcher's flags parse through a Megatron-style parser."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from arc_engine.integrations.megatron import internals as mi
from arc_engine.monitors.consistency import ConsistencyFamily
from arc_engine.monitors.family import section_of
from arc_engine.monitors.loss_spike import LossSpikeFamily
from arc_engine.monitors.qk_spectra import QKSpectraFamily
from arc_engine.monitors.r_metric import RMetricFamily
from arc_engine.monitors.router_health import RouterFamily
from arc_engine.monitors.sdc import SDCFamily

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE_INTERNALS = [ROOT / "integrations" / "megatron" / name
                     for name in ("__init__.py", "state.py", "checkpoint.py", "recompute.py")]
LAUNCHER = ROOT / "launch" / "megatron" / "pretrain_gpt_arc.py"


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


@pytest.mark.parametrize("path", OUTSIDE_INTERNALS, ids=lambda p: p.name)
def test_megatron_objects_are_read_and_written_only_through_the_internals_module(path: Path) -> None:
    tree = ast.parse(path.read_text())
    private_reads = [ast.unparse(node) for node in ast.walk(tree)
                     if isinstance(node, ast.Attribute) and node.attr.startswith("_")
                     and not node.attr.startswith("__") and _root_name(node) != "self"
                     and not (isinstance(node.value, ast.Name) and node.value.id == "mi")]
    writes = [ast.unparse(target) for node in ast.walk(tree) if isinstance(node, ast.Assign | ast.AugAssign)
              for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
              if isinstance(target, ast.Attribute) and _root_name(target) != "self"]
    calls = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")]
    assert private_reads == [] and writes == [] and calls == [], (private_reads, writes, calls)


def test_the_launcher_replaces_only_the_four_documented_megatron_lm_functions() -> None:
    """``pretrain_gpt_arc.py`` wraps ``setup_model_and_optimizer``, ``evaluate``, ``save_checkpoint`` and
    ``dummy_train_step`` of Megatron-LM's training module (its docstring and docs/megatron.md say why) and assigns
    nothing else of Megatron's; ``gpt_steps.py`` only marks its own dataset provider as ``pretrain_gpt.py`` does."""
    def writes(path: Path) -> list[str]:
        tree = ast.parse(path.read_text())
        found = [ast.unparse(target) for node in ast.walk(tree) if isinstance(node, ast.Assign | ast.AugAssign)
                 for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 if isinstance(target, ast.Attribute) and _root_name(target) != "self"]
        found += [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")]
        return found

    assert sorted(writes(LAUNCHER)) == ["steps.datasets_provider.is_distributed", "training.dummy_train_step",
                                        "training.evaluate", "training.save_checkpoint",
                                        "training.setup_model_and_optimizer"]
    assert writes(LAUNCHER.parent / "gpt_steps.py") == ["train_valid_test_datasets_provider.is_distributed"]


def test_the_version_check_warns_outside_the_tested_range_and_never_raises() -> None:
    for tested in ("0.16.1", "0.16.1+local", "0.17.0", "0.18.2", "0.19.0", "0.19.2+92e005a"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # inside the range: no warning
            assert mi.check_version(tested) is None, tested
    for untested in ("0.16.0", "0.15.3", "0.20.0", "0.20.0rc1", "1.0.0", "unknown"):
        with pytest.warns(mi.UntestedMegatronVersion, match=r"outside the range .* \(0\.16\.1 \.\. 0\.19\.x\)"):
            message = mi.check_version(untested)
        assert message is not None and untested in message


def test_the_installed_megatron_core_is_in_the_tested_range_and_lacks_nothing() -> None:
    pytest.importorskip("megatron.core")
    assert mi.in_tested_range(mi.installed_version()), mi.installed_version()
    assert mi.missing_needs(mi.CORE_NEEDS) == []
    assert {f.name: mi.missing_needs(f.needs) for f in mi.FEATURES} == {f.name: [] for f in mi.FEATURES}
    assert mi.dist_checkpoint_layout() is not None


# ------------------------------------------------ capability checks on stand-ins for the chunks and the optimizer

class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params_list, self.grad_data, self.gradient_scaling_factor = params, torch.zeros(4), 1.0


class _BucketGroup:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.buckets, self.is_first_batch, self.grad_reduce_handle = [_Bucket(params)], False, None
        self.is_last_microbatch = True
        self.ddp_config = types.SimpleNamespace(use_distributed_optimizer=False, average_in_collective=False)
        self.data_parallel_group = None

    def start_grad_sync(self) -> None:
        pass


class _Chunk(torch.nn.Module):
    """What megatron DDP holds that the integration reads (no transformer layers: a bare linear model)."""

    def __init__(self) -> None:
        super().__init__()
        from megatron.core.transformer.transformer_config import TransformerConfig

        self.linear = torch.nn.Linear(2, 2)
        for param in self.linear.parameters():
            param.main_grad = torch.zeros_like(param)
        self.bucket_groups = [_BucketGroup(list(self.linear.parameters()))]
        self.expert_parallel_bucket_groups: list = []
        self.ddp_config = types.SimpleNamespace(use_distributed_optimizer=False)
        self.config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)


class _FP32Optimizer:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.optimizer = torch.optim.SGD(params, lr=0.1)

    def prepare_grads(self) -> bool:
        return False

    def step(self) -> tuple:
        return True, None, None


def _capabilities(chunk: _Chunk | None = None, optimizer: Any = None) -> mi.Capabilities:
    chunk = chunk if chunk is not None else _Chunk()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the installed release is in the range: no warning
        return mi.check_capabilities([chunk], optimizer or _FP32Optimizer(list(chunk.parameters())))


def test_every_feature_is_on_when_the_release_holds_what_it_reads() -> None:
    pytest.importorskip("megatron.core")
    found = _capabilities()
    assert found.off == {} and found.in_tested_range and found.report() is None


def test_a_module_missing_one_function_turns_off_exactly_the_feature_that_reads_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("megatron.core")
    name = "megatron.core.distributed.finalize_model_grads"
    real = importlib.import_module(name)
    fake = types.ModuleType(name)
    for attribute in ("_allreduce_non_tensor_model_parallel_grads", "_allreduce_position_embedding_grads"):
        setattr(fake, attribute, getattr(real, attribute))  # _allreduce_word_embedding_grads left out
    monkeypatch.setitem(sys.modules, name, fake)
    found = _capabilities()
    assert list(found.off) == ["sdc_recompute"], found.off
    assert "_allreduce_word_embedding_grads" in found.off["sdc_recompute"][0]
    message, values = found.report()  # type: ignore[misc]
    assert "sdc_recompute off" in message and values["features_off"] == found.off


def test_a_changed_signature_turns_off_the_feature_that_calls_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe.router import TopKRouter

    monkeypatch.setattr(TopKRouter, "routing", lambda self, scores, padding_mask=None: None)
    found = _capabilities()
    assert list(found.off) == ["router_observation"], found.off
    assert found.off["router_observation"][0].endswith("TopKRouter.routing(logits) (found (scores))")


def test_a_checkpoint_layout_this_module_does_not_know_turns_off_megatron_format_checkpoints(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("megatron.core")
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import common

    for module, attribute in ((serialization, "_legacy_common_state_exists"), (common, "TorchCommonSaveStrategy"),
                              (common, "save_common")):
        if hasattr(module, attribute):
            monkeypatch.delattr(module, attribute)
    assert mi.dist_checkpoint_layout() is None
    assert list(_capabilities().off) == ["megatron_checkpoint"]


def test_bucket_groups_without_their_bucket_list_turn_off_the_local_statistics_only() -> None:
    pytest.importorskip("megatron.core")
    chunk = _Chunk()
    del chunk.bucket_groups[0].buckets
    found = _capabilities(chunk)
    assert list(found.off) == ["bucket_statistics"] and found.off["bucket_statistics"] == ["bucket group.buckets"]


def test_an_optimizer_without_the_veto_is_refused_naming_what_is_missing() -> None:
    pytest.importorskip("megatron.core")
    chunk = _Chunk()

    class NoVeto:
        def __init__(self) -> None:
            self.optimizer = torch.optim.SGD(chunk.parameters(), lr=0.1)

        def step(self) -> tuple:
            return True, None, None

    with pytest.raises(mi.MissingMegatronInternals, match=r"missing optimizer\.prepare_grads"):
        _capabilities(chunk, NoVeto())


def test_an_untested_release_warns_and_turns_nothing_off_by_itself() -> None:
    pytest.importorskip("megatron.core")
    chunk = _Chunk()
    with pytest.warns(mi.UntestedMegatronVersion):
        found = mi.check_capabilities([chunk], _FP32Optimizer(list(chunk.parameters())), installed="0.21.0")
    assert found.off == {} and not found.in_tested_range
    message, values = found.report()  # type: ignore[misc]
    assert "outside the tested range 0.16.1 .. 0.19.x" in message and values["in_tested_range"] is False


def test_a_feature_that_is_off_turns_its_detectors_off_in_a_copy_of_the_config() -> None:
    from arc_engine.config import ArcConfig
    from arc_engine.integrations.megatron import CONFIG_OFF, MegatronAdapter

    adapter = MegatronAdapter.__new__(MegatronAdapter)  # only the capabilities: no megatron objects needed
    described = {f.name: (f.description, f.without) for f in mi.FEATURES}
    adapter.capabilities = mi.Capabilities(mi.TESTED_MEGATRON_CORE_RANGE, "0.21.0", described,
                                           {"bucket_statistics": ["bucket group.buckets"],
                                            "attention_spectra": ["config.kv_channels"]})
    config = ArcConfig()
    effective = adapter.effective_config(config)
    assert effective is not config
    assert section_of(config, SDCFamily()).enabled and section_of(config, QKSpectraFamily()).enabled
    assert adapter.capabilities.config_off == [*CONFIG_OFF["bucket_statistics"], *CONFIG_OFF["attention_spectra"]]
    assert not (section_of(effective, SDCFamily()).enabled or section_of(effective, ConsistencyFamily()).enabled
                or section_of(effective, RMetricFamily()).enabled or section_of(effective, QKSpectraFamily()).enabled)
    assert section_of(effective, RouterFamily()).enabled  # needs no internals
    assert section_of(effective, LossSpikeFamily()).enabled


class _FakeBucketGroup:
    def __init__(self) -> None:
        self.is_first_batch, self.grad_reduce_handle, self.buckets, self.calls = False, None, [], 0

    def start_grad_sync(self, force_all_reduce: bool = False) -> str:
        self.calls += 1
        return "reduced"


def test_the_start_grad_sync_wrapper_sees_each_reduction_once_and_comes_off() -> None:
    group = _FakeBucketGroup()
    seen: list[int] = []
    remove = mi.wrap_start_grad_sync(mi.BucketGroupRef(7, group, False), lambda ref: seen.append(ref.index))
    assert group.start_grad_sync() == "reduced" and seen == [7] and group.calls == 1
    group.is_first_batch, group.grad_reduce_handle = True, object()  # Megatron's own early return: no statistics
    group.start_grad_sync()
    assert seen == [7]
    remove()
    assert "start_grad_sync" not in vars(group)  # the class method again
    group.start_grad_sync()
    assert seen == [7]


def test_the_veto_wrapper_returns_the_decision_through_prepare_grads() -> None:
    class Optimizer:
        def prepare_grads(self) -> bool:
            return False

        def step(self) -> tuple:
            return (not self.prepare_grads(), 1.0, None)

    optimizer = Optimizer()
    decided: list[bool] = []
    remove_veto = mi.found_inf_skips(optimizer)(lambda found_inf: decided.append(found_inf) or True)
    closed: list[tuple] = []
    remove_step = mi.after_step(optimizer, closed.append)
    assert optimizer.step() == (False, 1.0, None)  # skipped through Megatron's own path
    assert decided == [False] and closed == [(False, 1.0, None)]
    remove_veto()
    remove_step()
    assert optimizer.step() == (True, 1.0, None) and closed == [(False, 1.0, None)]


def _load_launcher():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_arc", LAUNCHER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arc_flags_parse_through_a_megatron_style_parser(tmp_path: Path) -> None:
    launcher = _load_launcher()
    config = tmp_path / "arc.yaml"
    config.write_text("stats:\n  interval: 5\n")

    def megatron_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        group = parser.add_argument_group("modelopt")
        group.add_argument("--export-te-mcore-model", action="store_true")
        return parser

    # Megatron-LM's parse_args: its own arguments, then extra_args_provider(parser), then parse_args() (no
    # ignore_unknown_args), with allow_abbrev=False
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--num-layers", type=int)
    parser = launcher.arc_args_provider(megatron_provider)(parser)
    args = parser.parse_args(["--tensor-model-parallel-size", "2", "--num-layers", "4", "--arc-config",
                              str(config), "--arc.detectors.loss_spike.factor=8", "--export-te-mcore-model"])
    import arc_engine

    arc_config = arc_engine.config_from_args(args, exit_on_error=False)
    assert args.tensor_model_parallel_size == 2 and args.export_te_mcore_model
    assert arc_config.stats.interval == 5 and section_of(arc_config, LossSpikeFamily()).factor == 8.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--arc.detectors.loss_spike.factr=8"])  # a misspelt key: argparse refuses it


def test_the_reference_script_takes_megatron_flags_and_arc_flags() -> None:
    from tests.scripts_loader import load_script

    pytest.importorskip("megatron.core")
    script = load_script("train_megatron_gpt")
    args = script.build_parser().parse_args(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                             "2", "--expert-model-parallel-size", "2", "--num-experts", "4",
                                             "--use-distributed-optimizer", "--bf16", "--arc.stats.interval=3"])
    import arc_engine

    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size,
            args.num_experts, args.use_distributed_optimizer, args.bf16) == (2, 2, 2, 4, True, True)
    assert arc_engine.config_from_args(args, exit_on_error=False).stats.interval == 3


def test_recovery_is_refused_with_overlap_param_gather_and_allowed_without() -> None:
    """A snapshot at a step's start reads the bf16 parameters; with ``overlap_param_gather`` their all-gather from
    the previous update may still be in flight then."""
    from types import SimpleNamespace

    from arc_engine.config import load_config
    from arc_engine.integrations.megatron import MegatronAdapter
    from arc_engine.integrations.megatron.internals import overlaps_param_gather

    overlapping = [SimpleNamespace(ddp_config=SimpleNamespace(overlap_param_gather=True))]
    assert overlaps_param_gather(overlapping) and not overlaps_param_gather([SimpleNamespace()])
    adapter = object.__new__(MegatronAdapter)
    adapter.chunks = overlapping
    adapter.capabilities = SimpleNamespace(off={})
    config = load_config(None, ["recovery.enabled=true"])
    with pytest.raises(ValueError, match=r"recovery\.enabled with overlap_param_gather"):
        adapter.check_config(config)

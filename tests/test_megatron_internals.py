"""The Megatron integration's structure (no processes): every read of megatron-core internals and every wrapped
method lives in ``integrations/megatron_internals.py`` behind a version check; the wrappers run and come off as
documented; the Megatron-LM launcher's flags parse through a Megatron-style parser."""

from __future__ import annotations

import argparse
import ast
import importlib.util
from pathlib import Path

import pytest

from arc_engine.integrations import megatron_internals as mi

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE_INTERNALS = [ROOT / "integrations" / name for name in ("megatron.py", "megatron_state.py",
                                                               "megatron_checkpoint.py", "megatron_recompute.py")]
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


def test_the_version_check_refuses_an_untested_megatron_core() -> None:
    mi.check_version("0.16.1")
    mi.check_version("0.16.1+local")
    with pytest.raises(mi.UntestedMegatronVersion, match=r"tested with 0\.16\.1; found 0\.17\.0"):
        mi.check_version("0.17.0")


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
    assert arc_config.stats.interval == 5 and arc_config.detectors.loss_spike.factor == 8.0
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

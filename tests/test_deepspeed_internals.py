"""DeepSpeed without monkeypatching: the tested range and the capability checks (a missing attribute turns off its
feature alone; a release outside the range warns), the structure (every read of ZeRO internals in
``integrations/deepspeed/internals.py``, no assignment to a DeepSpeed object anywhere in ``integrations/``), and the
local (pre-reduction) gradient statistics read from DeepSpeed's reduction buckets on real gloo ranks, with every
attribute write on DeepSpeed's objects recorded while arc_engine runs."""

from __future__ import annotations

import ast
import logging
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from arc_engine.demo.gpt import param_groups
from arc_engine.stats import names
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config, tiny_model_and_data

INTEGRATIONS = Path(__file__).resolve().parents[1] / "integrations"
INTERNALS = INTEGRATIONS / "deepspeed" / "internals.py"

#: Names that hold DeepSpeed objects in the integration sources (the ZeRO optimizer, the engine, the loss scaler).
DEEPSPEED_NAMES = re.compile(r"(self\.)?_?(zero|zero_optimizer|ds_engine|scaler|loss_scaler|bucket)")

#: The only functions that assign to a DeepSpeed object: rollback writes public attributes back, and a step
#: arc_engine skipped is booked as skipped (the ZeRO optimizer's ``overflow`` flag, which DeepSpeed resets each step).
ALLOWED_WRITERS = {"restore_engine_counters", "restore_loss_scaler", "mark_step_not_applied", "after_engine_step",
                   "restore_engine_step"}
#: What attach and close write on a DeepSpeed object in a run without a fault: the engine instance's ``step`` wrapper
#: (set at attach, removed at close), nothing else.
ATTACH_WRITES = [("DeepSpeedEngine", "step", "internals.py")] * 2

#: DeepSpeed's documented surface that integration code may use directly, outside deepspeed/internals.py: of the
#: engine (``deepspeed.initialize``'s first result) and of the ZeRO optimizer (its ``engine.optimizer``).
ENGINE_NAMES = re.compile(r"(self\.)?_?ds_engine")
PUBLIC_ENGINE_ATTRIBUTES = {"module", "optimizer", "lr_scheduler", "global_steps", "skipped_steps",
                            "zero_optimization_stage", "fp16_enabled", "gradient_accumulation_steps",
                            "get_global_grad_norm", "was_step_applied"}
PUBLIC_ZERO_ATTRIBUTES = {"loss_scale", "param_groups", "register_grad_acc_post_hook"}


def _sources() -> list[Path]:
    """The DeepSpeed integration's modules (the Megatron integration has its own rules: test_megatron_internals)."""
    return sorted(p for p in INTEGRATIONS.rglob("*.py") if p.parent.name != "megatron")


def _functions_by_node(tree: ast.AST) -> dict[ast.AST, str]:
    """Each node -> the name of the innermost function defining it."""
    owner: dict[ast.AST, str] = {}
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
        for node in ast.walk(function):
            owner[node] = function.name  # walked outer first, so inner functions overwrite
    return owner


def _assignment_targets(node: ast.AST) -> Iterator[ast.expr]:
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    while targets:
        target = targets.pop()
        if isinstance(target, ast.Tuple | ast.List):
            targets.extend(target.elts)
        else:
            yield target


def deepspeed_writes(path: Path) -> list[str]:
    """Assignments (``x.attr = ...``, ``del x.attr``, ``setattr``/``delattr``, ``__dict__``/``vars()`` writes) on
    a name holding a DeepSpeed object, outside :data:`ALLOWED_WRITERS` in deepspeed/internals.py."""
    tree = ast.parse(path.read_text())
    owner = _functions_by_node(tree)
    found = []
    for node in ast.walk(tree):
        allowed = path == INTERNALS and owner.get(node) in ALLOWED_WRITERS
        for target in _assignment_targets(node):
            base = target.value if isinstance(target, ast.Attribute | ast.Subscript) else None
            text = ast.unparse(base) if base is not None else ""
            if (isinstance(target, ast.Attribute) and DEEPSPEED_NAMES.fullmatch(text)) or "__dict__" in text \
                    or text.startswith("vars("):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(target)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute) and not allowed:
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if name in ("setattr", "delattr", "__setattr__", "__delattr__"):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def private_reads(path: Path) -> list[str]:
    """Attributes of a DeepSpeed object read outside deepspeed/internals.py that are not public (see
    :data:`PUBLIC_ENGINE_ATTRIBUTES`): ``x.attr`` and ``getattr(x, "attr", ...)`` / ``hasattr``."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and DEEPSPEED_NAMES.fullmatch(ast.unparse(node.value)):
            owner, attribute = ast.unparse(node.value), node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                and DEEPSPEED_NAMES.fullmatch(ast.unparse(node.args[0])) and isinstance(node.args[1], ast.Constant):
            owner, attribute = ast.unparse(node.args[0]), str(node.args[1].value)
        else:
            continue
        public = PUBLIC_ENGINE_ATTRIBUTES if ENGINE_NAMES.fullmatch(owner) else PUBLIC_ZERO_ATTRIBUTES
        if attribute not in public:
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


# ------------------------------------------------------------------ single process


def test_check_version_warns_outside_the_tested_range_and_never_raises() -> None:
    import warnings

    from arc_engine.integrations.deepspeed.internals import (
        TESTED_DEEPSPEED_RANGE,
        UntestedDeepSpeedVersion,
        check_version,
    )

    assert (TESTED_DEEPSPEED_RANGE.floor, TESTED_DEEPSPEED_RANGE.ceiling) == ("0.18.0", "0.20.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inside the range: no warning at all
        for tested in ("0.18.0", "0.18.3", "0.19.8", "0.19.8+a1b2c3d", "0.19.80"):
            assert check_version(tested) is None, tested
    for untested in ("0.17.6", "0.20.0", "1.0.0", "0.16", "source-build"):
        with pytest.warns(UntestedDeepSpeedVersion) as caught:
            message = check_version(untested)
        assert message is not None and str(caught[0].message) == message
        assert f"deepspeed {untested} is outside" in message and "(0.18.0 .. 0.19.x)" in message


def test_installed_deepspeed_is_in_the_tested_range() -> None:
    pytest.importorskip("deepspeed")
    from arc_engine.integrations.deepspeed.internals import check_version

    assert check_version() is None  # the environment's own release: the integration's tests below ran against it


def fake_zero(stage: int, *, without: str = "") -> SimpleNamespace:
    """A stand-in for DeepSpeed's ZeRO-1/2 or ZeRO-3 optimizer holding everything the integration reads (one
    parameter group of one 4-element parameter), less the dotted attribute path ``without``."""
    param = torch.nn.Parameter(torch.zeros(4))
    parts: dict = {"optimizer": torch.optim.SGD([param], lr=0.1), "dp_process_group": None, "loss_scale": 1.0,
                   "clip_grad": 0.0, "_global_grad_norm": 0.0, "averaged_gradients": {},
                   "loss_scaler": SimpleNamespace(cur_scale=1.0)}
    if stage == 3:
        param.partition_numel = lambda: 4
        parts.update(fp32_partitioned_groups_flat=[torch.zeros(4)], fp16_groups=[[param]], sub_group_to_group_id={0: 0},
                     groups_padding=[[0]], fp16_partitioned_groups_flat=[torch.zeros(4)],
                     parameter_offload=SimpleNamespace(partition_all_parameters=lambda: None),
                     persistent_parameters=[], invalidate_secondary_tensor=lambda: None)
    else:
        bucket = SimpleNamespace(elements=0, params=[], buffer=[torch.zeros(8)], index=0)
        parts.update(single_partition_of_fp32_groups=[torch.zeros(4)], groups_padding=[0], partition_size=[4],
                     real_dp_process_group=[None], bit16_groups=[[param]], bit16_groups_flat=[torch.zeros(4)],
                     register_grad_acc_post_hook=lambda hook: None, ipg_buckets={torch.float32: bucket},
                     reduce_bucket_size=8, get_param_comm_dtype=lambda p: torch.float32,
                     extra_large_param_to_reduce={}, get_gradient_for_reduction=lambda p: p.grad,
                     contiguous_gradients=True, partition_gradients=True, overlap_comm=False,
                     is_gradient_accumulation_boundary=lambda: True, reduce_ipg_grads=lambda comm_dtype=None: None,
                     update_lp_params=lambda: None, parallel_partitioned_bit16_groups=[[torch.zeros(4)]])
    head, _, tail = without.partition(".")
    if tail:
        parts[head] = SimpleNamespace()  # the outer object is there, the attribute read through it is not
    elif head:
        del parts[head]
    return SimpleNamespace(**parts)


def _feature_needs() -> list[tuple[int, str, str]]:
    from arc_engine.integrations.deepspeed.internals import FEATURES

    return [(stage, feature.name, need) for feature in FEATURES for family, needs in feature.needs.items()
            for stage in ((3,) if family == "zero3" else (1, 2)) for need in needs]


def _core_needs() -> list[tuple[int, str]]:
    from arc_engine.integrations.deepspeed.internals import CORE_NEEDS

    return [(stage, need) for family, needs in CORE_NEEDS.items() for stage in ((3,) if family == "zero3" else (2,))
            for need in needs]


def test_a_complete_zero_optimizer_has_every_feature() -> None:
    from arc_engine.integrations.deepspeed.internals import check_capabilities

    for stage in (1, 2, 3):
        capabilities = check_capabilities(fake_zero(stage), stage, installed="0.19.8")
        assert capabilities.off == {} and capabilities.report() is None


@pytest.mark.parametrize(("stage", "feature", "need"), _feature_needs())
def test_a_missing_attribute_turns_off_exactly_its_feature(stage: int, feature: str, need: str) -> None:
    from arc_engine.integrations.deepspeed.internals import check_capabilities

    capabilities = check_capabilities(fake_zero(stage, without=need), stage, installed="0.19.8")
    assert capabilities.off == {feature: [need]}
    message, values = capabilities.report()
    assert f"{feature} off" in message and need in message and values["features_off"] == {feature: [need]}
    assert values["in_tested_range"] is True


@pytest.mark.parametrize(("stage", "need"), _core_needs())
def test_a_missing_core_attribute_refuses_attach_naming_it(stage: int, need: str) -> None:
    from arc_engine.integrations.deepspeed.internals import MissingDeepSpeedInternals, check_capabilities

    with pytest.raises(MissingDeepSpeedInternals, match=rf"missing {need}\b"):
        check_capabilities(fake_zero(stage, without=need), stage, installed="0.19.8")


def test_a_core_attribute_laid_out_differently_refuses_attach() -> None:
    from arc_engine.integrations.deepspeed.internals import MissingDeepSpeedInternals, check_capabilities

    zero = fake_zero(2)
    zero.single_partition_of_fp32_groups = []  # a release keeping its partitions elsewhere
    with pytest.raises(MissingDeepSpeedInternals, match="single_partition_of_fp32_groups holds 0 entries for 1"):
        check_capabilities(zero, 2, installed="0.19.8")
    zero = fake_zero(2)
    zero.ipg_buckets = {torch.float32: SimpleNamespace(elements=0)}  # buckets of another shape: buckets off
    assert check_capabilities(zero, 2, installed="0.19.8").off == {
        "bucket_local_statistics": ["a reduction bucket has no params"]}


def test_a_release_outside_the_range_warns_and_keeps_what_it_has() -> None:
    from arc_engine.integrations.deepspeed.internals import UntestedDeepSpeedVersion, check_capabilities

    with pytest.warns(UntestedDeepSpeedVersion, match=r"deepspeed 0\.17\.6 is outside"):
        capabilities = check_capabilities(fake_zero(2, without="register_grad_acc_post_hook"), 2, installed="0.17.6")
    assert capabilities.off == {"bucket_local_statistics": ["register_grad_acc_post_hook"]}
    message, values = capabilities.report()
    assert message.startswith("deepspeed 0.17.6, outside the tested range 0.18.0 .. 0.19.x: bucket_local_statistics")
    assert values["in_tested_range"] is False and values["deepspeed"] == "0.17.6"
    with pytest.warns(UntestedDeepSpeedVersion):
        capabilities = check_capabilities(fake_zero(3), 3, installed="0.20.1")
    assert capabilities.off == {} and "every feature's internals are present" in capabilities.report()[0]


def test_the_adapter_turns_off_only_the_missing_feature_and_recovery_without_rollback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deepspeed = pytest.importorskip("deepspeed")
    from arc_engine.integrations.deepspeed import ZeroAdapter
    from arc_engine.integrations.deepspeed.internals import UntestedDeepSpeedVersion

    monkeypatch.setattr(deepspeed, "__version__", "0.17.6")  # a test shim: the environment's release is in range
    zero = fake_zero(2, without="update_lp_params")
    ds_engine = SimpleNamespace(optimizer=zero, module=torch.nn.Linear(2, 2), zero_optimization_stage=lambda: 2)
    with pytest.warns(UntestedDeepSpeedVersion):
        adapter = ZeroAdapter(ds_engine)
    assert adapter.capabilities.off == {"rollback": ["update_lp_params"]}
    plain = make_config(tmp_path)
    assert adapter.effective_config(plain) is plain  # recovery off: nothing to turn off
    asked = make_config(tmp_path, "recovery.enabled=true")
    effective = adapter.effective_config(asked)
    assert asked.recovery.enabled and not effective.recovery.enabled  # a copy: the caller's config is untouched
    assert effective.detectors == asked.detectors
    message, values = adapter.capabilities.report()
    assert values["config_off"] == ["recovery.enabled"] and "rollback off" in message
    adapter.check_config(effective)


def test_no_integration_assigns_to_a_deepspeed_object() -> None:
    writes = [write for path in _sources() for write in deepspeed_writes(path)]
    assert writes == [], "assignments to DeepSpeed's objects outside the rollback writers:\n" + "\n".join(writes)


def test_the_structural_checks_catch_a_monkeypatch_and_a_private_read(tmp_path: Path) -> None:
    patched = tmp_path / "patched.py"
    patched.write_text("def attach(zero, ds_engine):\n"
                       "    zero.average_tensor = lambda t, d: None\n"
                       "    setattr(ds_engine, 'global_steps', 0)\n"
                       "    return zero.ipg_buckets, getattr(zero, 'averaged_gradients', None), zero.loss_scale\n")
    assert len(deepspeed_writes(patched)) == 2
    assert {read.split(": ")[1] for read in private_reads(patched)} == {
        "zero.average_tensor", "zero.ipg_buckets", "getattr(zero, 'averaged_gradients', None)"}


def test_deepspeed_internals_are_read_in_one_module() -> None:
    reads = [read for path in _sources() if path != INTERNALS and path.parent.name == "deepspeed"
             for read in private_reads(path)]
    assert reads == [], "DeepSpeed internals read outside deepspeed/internals.py:\n" + "\n".join(reads)


# ------------------------------------------------------------------ real ranks

@contextmanager
def writes_from(directory: Path, classes: list[type]) -> Iterator[list[tuple[str, str, str]]]:
    """Record (class, attribute, file) of every attribute set or deleted on an instance of ``classes`` by code in
    ``directory`` (a test shim: wraps the classes' ``__setattr__`` / ``__delattr__`` for the block's duration)."""
    records: list[tuple[str, str, str]] = []
    saved = [(cls, cls.__dict__.get("__setattr__"), cls.__dict__.get("__delattr__")) for cls in classes]

    def wrap(cls: type, method: str) -> None:
        original = getattr(cls, method)

        def tracking(self, name, *value):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(str(directory)):
                records.append((type(self).__name__, name, Path(caller).name))
            return original(self, name, *value)

        setattr(cls, method, tracking)

    for cls in classes:
        wrap(cls, "__setattr__")
        wrap(cls, "__delattr__")
    try:
        yield records
    finally:
        for cls, set_method, del_method in saved:
            for method, original in (("__setattr__", set_method), ("__delattr__", del_method)):
                if original is None:
                    delattr(cls, method)
                else:
                    setattr(cls, method, original)


class WarningsKept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _local_rank(rank: int, world: int, stage: int, overlap_comm: bool, run_dir: Path,
                plain_backward: bool = False) -> dict:
    """Two steps of two micro-batches on the tiny GPT under ZeRO ``stage``; ``plain_backward``: ``loss.backward()``
    instead of ``engine.backward(loss)`` (DeepSpeed's torch-style backward)."""
    os.environ["LOCAL_RANK"] = str(rank)
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero import stage_1_and_2

    from arc_engine.integrations.deepspeed import attach_deepspeed

    model, data = tiny_model_and_data()
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    # buckets of 2000 elements: several per backward, filled and reduced from the gradient hooks, and gradients
    # larger than a bucket (reduced on their own)
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "overlap_comm": overlap_comm},
              "steps_per_print": 10_000}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    classes = [DeepSpeedEngine, stage_1_and_2.DeepSpeedZeroOptimizer, LossScaler, DynamicLossScaler]
    classes += [stage_1_and_2.IPGBucket] if hasattr(stage_1_and_2, "IPGBucket") else []  # 0.17.6 has it, 0.17.0 not
    local_sq_rg, sources = [], []
    warnings = WarningsKept()
    logging.getLogger("arc_engine").addHandler(warnings)
    with writes_from(INTEGRATIONS, classes) as writes:
        arc = attach_deepspeed(engine, make_config(run_dir, "detectors.sdc.enabled=true",
                                                   "detectors.sdc.sketch_size=256"))
        for step in range(2):
            for micro in range(2):
                inputs, targets = data.batch(2 * step + micro, rank, BATCH)
                loss = engine(inputs, targets)
                arc.record_loss(loss)
                if plain_backward:
                    loss.backward()
                else:
                    engine.backward(loss)
                engine.step()
            local_sq_rg.append(arc.engine.last_stats.per_rank(names.GRAD_SQ_LOCAL))
            sources.append(arc.adapter.local_grads.source)
        sketch_rk = arc.engine.last_stats.per_rank(names.GRAD_SKETCH_LOCAL)
        arc.close()
    logging.getLogger("arc_engine").removeHandler(warnings)
    return {"local_sq_rg": local_sq_rg, "sketch_rk": sketch_rk, "sources": sources, "writes": writes,
            "warnings": [w for w in warnings.messages if "did not read" in w],
            "buckets": arc.adapter.capabilities.has("bucket_local_statistics")}


def reference_local_sq(world: int, steps: int, accumulated: bool) -> list[list[list[float]]]:
    """Per step, per rank, per group: the squared norm of the rank's own gradient of each micro-batch (loss / 2),
    summed over its 2 micro-batches, or (``accumulated``) of their sum. DeepSpeed's weights change between steps,
    so only step 0 is computed (the parameters are the initial ones)."""
    assert steps == 1
    model, data = tiny_model_and_data()
    groups = param_groups(model, 0.1)
    out = []
    for rank in range(world):
        totals = [0.0] * len(groups)
        model.zero_grad()
        for micro in range(2):
            if not accumulated:
                model.zero_grad()
            (model(*data.batch(micro, rank, BATCH)) / 2).backward()
            if not accumulated:
                for g, group in enumerate(groups):
                    totals[g] += sum(float(p.grad.double().square().sum()) for p in group["params"])
        if accumulated:
            totals = [sum(float(p.grad.double().square().sum()) for p in group["params"]) for group in groups]
        out.append(totals)
    return [out]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "overlap_comm", "source", "accumulated"), [
    (2, False, "buckets", False),  # every micro-batch's gradient, from the buckets
    (1, True, "buckets", True),  # the accumulated gradient, from the buckets at the accumulation boundary
    (1, False, "accumulated", True),  # the accumulated gradient, before the epilogue reduces it
])
def test_local_gradients_read_before_zero_reduces_them_without_writing_to_deepspeed(
        tmp_path: Path, stage: int, overlap_comm: bool, source: str, accumulated: bool) -> None:
    pytest.importorskip("deepspeed")
    import numpy as np

    results = run_ranks(_local_rank, 2, stage, overlap_comm, tmp_path, timeout_s=280)
    for result in results:
        if not result["buckets"]:  # a release without what the buckets are read with: the tensor hooks' statistics
            source, accumulated = "tensor hooks", False
        expected = reference_local_sq(2, 1, accumulated)[0]
        assert result["writes"] == ATTACH_WRITES, result["writes"]
        assert result["sources"] == [source, source] and result["warnings"] == []  # no fallback to tensor hooks
        np.testing.assert_allclose(result["local_sq_rg"][0], expected, rtol=1e-5)
        assert np.isfinite(result["local_sq_rg"][1]).all() and (result["local_sq_rg"][1] > 0).all()
        # both ranks read the same bucket layout: their sketches point the same way, but differ (own gradients)
        sketch_rk = result["sketch_rk"]
        cosine = sketch_rk[0] @ sketch_rk[1] / np.linalg.norm(sketch_rk[0]) / np.linalg.norm(sketch_rk[1])
        assert 0.0 < cosine < 1.0 - 1e-6


@pytest.mark.timeout(300)
def test_a_plain_loss_backward_falls_back_to_tensor_hooks_with_a_warning(tmp_path: Path) -> None:
    """``loss.backward()`` outside ``engine.backward``: DeepSpeed's epilogue reduces the last bucket before its
    post-backward callbacks run, so arc_engine misses it on the first monitored step, says so, and reads every
    gradient through tensor hooks from then on."""
    pytest.importorskip("deepspeed")
    import numpy as np
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not hasattr(DeepSpeedZeroOptimizer, "register_grad_acc_post_hook"):
        pytest.skip("this DeepSpeed (before 0.18.3) has no torch-style loss.backward() under ZeRO-1/2")
    for result in run_ranks(_local_rank, 2, 2, False, tmp_path, True, timeout_s=280):
        assert result["writes"] == ATTACH_WRITES
        assert result["sources"] == ["tensor hooks", "tensor hooks"]
        # a release without the buckets' internals reads tensor hooks from the start: nothing to fall back from
        assert len(result["warnings"]) == (1 if result["buckets"] else 0)
        assert all("(buckets)" in warning for warning in result["warnings"])
        assert np.isfinite(result["local_sq_rg"][1]).all() and (result["local_sq_rg"][1] > 0).all()


def _outside_range_rank(rank: int, world: int, run_dir: Path) -> dict:
    """ZeRO-2 on a DeepSpeed that calls itself 0.17.6 and has no ``register_grad_acc_post_hook`` (as before 0.18.3),
    rank 1's gradient NaN at step 2."""
    import warnings

    os.environ["LOCAL_RANK"] = str(rank)
    import deepspeed

    from arc_engine.integrations.deepspeed import attach_deepspeed
    from arc_engine.integrations.deepspeed.internals import UntestedDeepSpeedVersion

    deepspeed.__version__ = "0.17.6"  # a test shim: an older release, as the version check sees it
    model, data = tiny_model_and_data()
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": 2}, "steps_per_print": 10_000}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def absent(self):
        raise AttributeError("register_grad_acc_post_hook")

    zero = engine.optimizer  # a test shim: the same optimizer, without the callback 0.18.0 .. 0.18.2 lack
    zero.__class__ = type("WithoutPostBackwardHook", (type(zero),), {"register_grad_acc_post_hook": property(absent)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arc = attach_deepspeed(engine, make_config(
            run_dir, "faults.injections=[{kind: nan_grad, rank: 1, step: 2, param: blocks.0.ln1.weight}]"))
    local_sq_rg = []
    for step in range(4):
        inputs, targets = data.batch(step, rank, BATCH)
        loss = engine(inputs, targets)
        arc.record_loss(loss)
        engine.backward(loss)
        engine.step()
        local_sq_rg.append(arc.engine.last_stats.per_rank(names.GRAD_SQ_LOCAL))
    summary = arc.summary()
    source = arc.adapter.local_grads.source
    arc.close()
    return {"warnings": [str(w.message) for w in caught if issubclass(w.category, UntestedDeepSpeedVersion)],
            "source": source, "local_sq_rg": local_sq_rg[0], "summary": summary}


@pytest.mark.timeout(300)
def test_a_release_outside_the_range_trains_with_only_the_missing_feature_off(tmp_path: Path) -> None:
    """Outside the tested range, without the internals of one feature: a warning, one event naming that feature,
    and the rest works -- local statistics from tensor hooks (against the single-process reference), rank 1's NaN
    skipped on both ranks and named, training going on."""
    pytest.importorskip("deepspeed")
    import numpy as np

    from arc_engine.sinks import read_jsonl
    from tests.test_deepspeed_dist import deepspeed_skips_nonfinite_fp32_steps

    results = run_ranks(_outside_range_rank, 2, tmp_path, timeout_s=280)
    model, data = tiny_model_and_data()
    expected = []  # per rank, per group: the squared norm of the rank's own gradient at step 0
    for rank in range(2):
        model.zero_grad()
        model(*data.batch(0, rank, BATCH)).backward()
        expected.append([sum(float(p.grad.double().square().sum()) for p in group["params"])
                         for group in param_groups(model, 0.1)])
    for result in results:
        assert len(result["warnings"]) == 1 and "deepspeed 0.17.6 is outside" in result["warnings"][0]
        assert result["source"] == "tensor hooks"
        np.testing.assert_allclose(result["local_sq_rg"], expected, rtol=1e-5)
        summary = result["summary"]  # the NaN step: DeepSpeed's skip (0.19.8) or arc_engine's (before)
        assert summary["steps"] == 4 and summary["steps_not_applied"] >= 1
        assert summary["skipped_by_framework"] == int(deepspeed_skips_nonfinite_fp32_steps())
    events = read_jsonl(tmp_path / "test" / "events.jsonl")
    compatibility = [e for e in events if e["kind"] == "lifecycle" and e["detector"] == "compatibility"]
    assert len(compatibility) == 1
    off = compatibility[0]["values"]["features_off"]  # (before 0.17.6 the buckets themselves are laid out otherwise)
    assert list(off) == ["bucket_local_statistics"] and "register_grad_acc_post_hook" in off["bucket_local_statistics"]
    assert compatibility[0]["values"]["in_tested_range"] is False
    assert "deepspeed 0.17.6, outside the tested range 0.18.0 .. 0.19.x" in compatibility[0]["message"]
    nan_event = next(e for e in events if e["kind"] == "detection" and e["detector"] == "non_finite")
    assert nan_event["step"] == 2 and nan_event["ranks"] == [1]


def test_deepspeed_moe_expert_parameters_are_told_apart_for_the_quarantine() -> None:
    """DeepSpeed-MoE marks an expert's parameters ``allreduce = False`` (averaged over their expert-data-parallel
    group): the bad-data quarantine and the replicas' fingerprint leave them out (before: every bad-data alarm under
    ``ep_size > 1`` read "replicas diverged", the experts differing by design)."""
    from arc_engine.integrations.deepspeed.internals import expert_params

    dense, expert = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    expert.allreduce = False
    assert expert_params([dense, expert]) == [expert]

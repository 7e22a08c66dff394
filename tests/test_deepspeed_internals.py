"""DeepSpeed without monkeypatching: the version check, the structure (every read of ZeRO internals in
``integrations/deepspeed_internals.py``, no assignment to a DeepSpeed object anywhere in ``integrations/``), and the
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

import pytest
import torch

from arc_engine.demo.gpt import param_groups
from arc_engine.stats import names
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config, tiny_model_and_data

INTEGRATIONS = Path(__file__).resolve().parents[1] / "integrations"
INTERNALS = "deepspeed_internals.py"

#: Names that hold DeepSpeed objects in the integration sources (the ZeRO optimizer, the engine, the loss scaler).
DEEPSPEED_NAMES = re.compile(r"(self\.)?_?(zero|zero_optimizer|ds_engine|scaler|loss_scaler|bucket)")

#: The only functions that assign to a DeepSpeed object: rollback writes public attributes back.
ALLOWED_WRITERS = {"restore_engine_counters", "restore_loss_scaler"}

#: DeepSpeed's documented surface that integration code may use directly, outside deepspeed_internals.py: of the
#: engine (``deepspeed.initialize``'s first result) and of the ZeRO optimizer (its ``engine.optimizer``).
ENGINE_NAMES = re.compile(r"(self\.)?_?ds_engine")
PUBLIC_ENGINE_ATTRIBUTES = {"module", "optimizer", "lr_scheduler", "global_steps", "skipped_steps",
                            "zero_optimization_stage", "fp16_enabled", "gradient_accumulation_steps",
                            "get_global_grad_norm", "was_step_applied"}
PUBLIC_ZERO_ATTRIBUTES = {"loss_scale", "param_groups", "register_grad_acc_post_hook"}


def _sources() -> list[Path]:
    """The DeepSpeed integration's modules (the Megatron integration has its own rules: test_megatron_internals)."""
    return sorted(p for p in INTEGRATIONS.glob("*.py") if not p.name.startswith("megatron"))


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
    a name holding a DeepSpeed object, outside :data:`ALLOWED_WRITERS` in deepspeed_internals.py."""
    tree = ast.parse(path.read_text())
    owner = _functions_by_node(tree)
    found = []
    for node in ast.walk(tree):
        allowed = path.name == INTERNALS and owner.get(node) in ALLOWED_WRITERS
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
    """Attributes of a DeepSpeed object read outside deepspeed_internals.py that are not public (see
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


def test_check_version_refuses_an_untested_release_with_what_to_do() -> None:
    from arc_engine.integrations.deepspeed_internals import (
        TESTED_DEEPSPEED_VERSIONS,
        UntestedDeepSpeedVersion,
        check_version,
    )

    assert TESTED_DEEPSPEED_VERSIONS == ("0.19.8",)
    check_version("0.19.8")
    check_version("0.19.8+a1b2c3d")  # a source build of the tested release
    for untested in ("0.19.7", "0.20.0", "0.19.80"):
        with pytest.raises(UntestedDeepSpeedVersion) as raised:
            check_version(untested)
        message = str(raised.value)
        assert f"deepspeed {untested}" in message and "tested with deepspeed 0.19.8" in message
        assert "pip install 'deepspeed==0.19.8'" in message


def test_installed_deepspeed_is_a_tested_release() -> None:
    pytest.importorskip("deepspeed")
    from arc_engine.integrations.deepspeed_internals import check_version

    check_version()  # the environment's own version passes: the integration's tests below ran against it


def test_attach_refuses_an_untested_deepspeed_before_touching_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    deepspeed = pytest.importorskip("deepspeed")
    from arc_engine.integrations.deepspeed import attach_deepspeed
    from arc_engine.integrations.deepspeed_internals import UntestedDeepSpeedVersion

    monkeypatch.setattr(deepspeed, "__version__", "0.18.0")  # a test shim: the environment has 0.19.8
    with pytest.raises(UntestedDeepSpeedVersion, match=r"this environment has deepspeed 0\.18\.0"):
        attach_deepspeed(object())


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
    reads = [read for path in _sources() if path.name != INTERNALS and path.name.startswith("deepspeed")
             for read in private_reads(path)]
    assert reads == [], "DeepSpeed internals read outside deepspeed_internals.py:\n" + "\n".join(reads)


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
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer, IPGBucket

    from arc_engine.integrations.deepspeed import attach_deepspeed

    model, data = tiny_model_and_data()
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    # buckets of 2000 elements: several per backward, filled and reduced from the gradient hooks, and gradients
    # larger than a bucket (reduced on their own)
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "overlap_comm": overlap_comm},
              "steps_per_print": 10_000}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    classes = [DeepSpeedEngine, DeepSpeedZeroOptimizer, IPGBucket, LossScaler, DynamicLossScaler]
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
            "warnings": [w for w in warnings.messages if "did not read" in w]}


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
    expected = reference_local_sq(2, 1, accumulated)[0]
    for result in results:
        assert result["writes"] == [], result["writes"]
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

    for result in run_ranks(_local_rank, 2, 2, False, tmp_path, True, timeout_s=280):
        assert result["writes"] == []
        assert result["sources"] == ["tensor hooks", "tensor hooks"]
        assert len(result["warnings"]) == 1 and "(buckets)" in result["warnings"][0]
        assert np.isfinite(result["local_sq_rg"][1]).all() and (result["local_sq_rg"][1] > 0).all()

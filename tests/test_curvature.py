"""Curvature diagnostics (ARC paper §3.2): the Hutchinson trace, power iteration and SAM sharpness against closed
forms on quadratic and least-squares models, the training state left untouched, and on 2 gloo ranks under DDP the
ranks' mean, agreed, with training continuing bitwise as without the measurement."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine.diagnostics.curvature import CurvatureGraph, hutchinson_trace, measure, top_eigenvalue
from arc_engine.sinks import read_jsonl
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data

pytestmark = pytest.mark.timeout(300)


def test_a_diagonal_quadratic_gives_the_exact_trace_top_eigenvalue_and_sharpness() -> None:
    """L = ½ θᵀAθ, A = diag(1, 2, 3, 10) at θ = 1: tr = 16 whatever the probes (vᵀAv = tr A for ±1 entries),
    λ_max = 10, and SAM: ρ‖g‖ + ½ρ² ĝᵀAĝ with g = Aθ."""
    a = torch.diag(torch.tensor([1.0, 2.0, 3.0, 10.0], dtype=torch.float64))
    theta = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    result = measure(lambda: 0.5 * theta @ a @ theta, [theta], probes=1, iterations=60, rho=0.1, seed=3)
    g = a @ torch.ones(4, dtype=torch.float64)
    unit = g / g.norm()
    assert result["hessian_trace"] == pytest.approx(16.0, rel=1e-12)
    assert result["lambda_max"] == pytest.approx(10.0, rel=1e-9)
    assert result["sam_sharpness"] == pytest.approx(float(0.1 * g.norm() + 0.005 * unit @ a @ unit), rel=1e-9)
    assert result["loss"] == pytest.approx(8.0)


def test_least_squares_curvature_is_the_gram_matrix() -> None:
    """MSE of a bias-free linear layer: H = 2 XᵀX / n. The power iteration's value is its largest eigenvalue; the
    Hutchinson mean over 4,000 probes is within 3% of its trace (seeded: deterministic)."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 6, dtype=torch.float64), torch.randn(64, 1, dtype=torch.float64)
    layer = torch.nn.Linear(6, 1, bias=False).double()
    hessian = 2 * x.T @ x / 64

    def loss() -> torch.Tensor:
        return ((layer(x) - y) ** 2).mean()

    graph = CurvatureGraph(loss, list(layer.parameters()))
    generator = torch.Generator().manual_seed(0)
    assert top_eigenvalue(graph, 200, generator) == pytest.approx(float(torch.linalg.eigvalsh(hessian)[-1]), rel=1e-6)
    assert hutchinson_trace(graph, 4000, generator) == pytest.approx(float(hessian.trace()), rel=0.03)
    (product,) = graph.hvp([torch.ones(1, 6, dtype=torch.float64)])
    torch.testing.assert_close(product.reshape(-1), hessian @ torch.ones(6, dtype=torch.float64))


def test_a_measurement_leaves_parameters_gradients_and_the_rng_as_they_were() -> None:
    model, data = tiny_model_and_data(seed=4)
    model.blocks[0].attn.proj.register_forward_hook(lambda m, a, out: torch.nn.functional.dropout(out, 0.1))
    inputs, targets = data.batch(0, 0, BATCH)
    model(inputs, targets).backward()
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.random.get_rng_state()
    result = measure(lambda: model(inputs, targets), list(model.parameters()), probes=2, iterations=3, rho=0.05,
                     seed=0)
    assert all(math.isfinite(v) for v in result.values()) and result["sam_sharpness"] != 0.0
    assert all(torch.equal(a, b.detach()) for a, b in zip(params, model.parameters(), strict=True))
    assert all(torch.equal(a, b.grad) for a, b in zip(grads, model.parameters(), strict=True))
    assert torch.equal(rng, torch.random.get_rng_state())


def test_sharded_parameters_are_refused_with_a_clear_error(tmp_path: Path) -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    arc = arc_engine.attach(model, optimizer, make_config(tmp_path))
    next(model.parameters()).ds_id = 0  # what DeepSpeed ZeRO-3 puts on its partitioned parameters
    with pytest.raises(ValueError, match="sharded parameters; curvature diagnostics need each rank's whole model"):
        arc.measure_curvature(lambda: model(*data.batch(0, 0, BATCH)))
    arc.close()


# ------------------------------------------------------------------ 2 real ranks under DDP


def _train(rank: int, world: int, run_dir: Path, measure_at: int) -> dict[str, Any]:
    model, data = tiny_model_and_data(seed=5)
    optimizer = make_optimizer(model)
    ddp = DistributedDataParallel(model)
    arc = arc_engine.attach(ddp, optimizer, make_config(run_dir, "diagnostics.curvature.every=3",
                                                        "diagnostics.curvature.probes=4"))
    held = data.batch(1000, rank, BATCH)  # this rank's held micro-batch
    results, local, due = [], [], []
    for step in range(6):
        due.append(arc.curvature_due())
        if step == measure_at:
            plain = {k: v for k, v in measure(lambda: model(*held), list(model.parameters()), probes=4,
                                             iterations=10, rho=0.05, seed=arc.engine.progress.step).items()}
            local.append(plain)
            results.append(arc.measure_curvature(lambda: ddp(*held)))
        loss = ddp(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    arc.close()
    events = [e for e in read_jsonl(run_dir / "test" / "events.jsonl") if e.get("detector") == "curvature"]
    return {"results": results, "local": local, "due": due, "events": len(events),
            "params": torch.cat([p.detach().flatten() for p in model.parameters()])}


def test_ddp_ranks_agree_on_the_mean_and_training_continues_bitwise(tmp_path: Path) -> None:
    """Each rank measures on its own held micro-batch; every rank returns the mean of the ranks' values (each
    computed here again without arc_engine); the step counter, data and parameters after the run are bitwise those
    of a run without the measurement; ``curvature_due`` follows ``every: 3``."""
    measured = run_ranks(_train, 2, tmp_path / "measured", 2)
    plain = run_ranks(_train, 2, tmp_path / "plain", -1)
    assert measured[0]["results"] == measured[1]["results"]
    (agreed,) = measured[0]["results"]
    for key in ("hessian_trace", "lambda_max", "sam_sharpness", "loss"):
        expected = np.mean([r["local"][0][key] for r in measured])
        assert agreed[key] == pytest.approx(expected, rel=1e-6), key
    assert agreed["lambda_max"] > 0
    for ours, theirs in zip(measured, plain, strict=True):
        assert torch.equal(ours["params"], theirs["params"])
    assert measured[0]["due"] == [True, False, False, True, False, False]
    assert measured[0]["events"] == 1 and plain[0]["events"] == 0  # one event in the run's log


def _zero2(rank: int, world: int, run_dir: Path, measure_at: int) -> dict[str, Any]:
    """DeepSpeed ZeRO-2: each rank holds the whole (replicated) module; the measurement goes through the engine's
    forward and never reaches DeepSpeed's gradient hooks (Hessian-vector products do not accumulate into .grad)."""
    from arc_engine.integrations.deepspeed import attach_deepspeed
    from tests.test_deepspeed_dist import ds_engine

    engine, data = ds_engine(rank, world, 2)
    arc = attach_deepspeed(engine, make_config(run_dir, "diagnostics.curvature.probes=4"))
    held = data.batch(1000, rank, BATCH)
    results, local = [], []
    for step in range(4):
        if step == measure_at:
            local.append(measure(lambda: engine.module(*held), list(engine.module.parameters()), probes=4,
                                 iterations=10, rho=0.05, seed=arc.engine.progress.step))
            results.append(arc.measure_curvature(lambda: engine(*held)))  # the engine, as one trains
        loss = engine(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        engine.backward(loss)
        engine.step()
    arc.close()
    return {"results": results, "local": local,
            "params": torch.cat([p.detach().flatten() for p in engine.module.parameters()])}


def test_deepspeed_zero2_measures_the_mean_and_training_continues_bitwise(tmp_path: Path) -> None:
    """ZeRO-2 on 2 ranks, measured at step 2: every rank returns the mean of the ranks' own values (each computed
    again without arc_engine), and the parameters after the run are bitwise those of a run without the
    measurement (DeepSpeed's partitioned gradients untouched)."""
    measured = run_ranks(_zero2, 2, tmp_path / "measured", 2)
    plain = run_ranks(_zero2, 2, tmp_path / "plain", -1)
    assert measured[0]["results"] == measured[1]["results"]
    (agreed,) = measured[0]["results"]
    for key in ("hessian_trace", "lambda_max", "sam_sharpness", "loss"):
        assert agreed[key] == pytest.approx(np.mean([r["local"][0][key] for r in measured]), rel=1e-6), key
    assert agreed["lambda_max"] > 0
    for ours, theirs in zip(measured, plain, strict=True):
        assert torch.equal(ours["params"], theirs["params"])

"""megatron-core fp16 with Megatron's dynamic loss scaling, on real gloo ranks (the reference script's GPT, DP=2,
the DistributedOptimizer): Megatron's own overflow skips are the scaler's (never escalated while it searches its
scale), every step it applies is applied bitwise as without arc_engine, and statistics are judged unscaled.

CPU fp16 arithmetic is slow but real; the CUDA shims (``arc_engine.testing.megatron_cpu``) are installed inside the
spawned ranks only."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.dist_harness import run_ranks
from tests.scripts_loader import load_script

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.timeout(400)

FLAGS = ["--cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--use-distributed-optimizer", "--fp16", "--initial-loss-scale", str(2.0**24)]
STEPS = 16


def _config(path: Path, run_id: str, **extra: Any) -> str:
    config = {"run": {"run_id": run_id, "run_dir": str(path.parent / "runs")}, "stats": {"interval": 1},
              "sinks": {"console": {"enabled": False}}, **extra}
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _train(flags: list[str], steps: int) -> dict[str, Any]:
    script = load_script("train_megatron_gpt")
    args = script.build_parser().parse_args(flags)
    script.initialize(args)
    state = script.build_model_and_optimizer(args)
    decisions: list[tuple] = []
    norms: dict[int, tuple[float | None, float]] = {}
    arc = state.arc
    if arc is not None:  # every decision the policy commits (found_inf steps included)
        commit = arc.engine.policy.commit

        def record(decision: Any) -> None:
            decisions.append((decision.step, decision.action.name, decision.overflow,
                              sorted({(f.detector, f.severity.name) for f in decision.findings})))
            commit(decision)

        arc.engine.policy.commit = record
    updates = []
    for step in range(steps):
        position = arc.progress.data_position if arc is not None else step
        _, ok, grad_norm = script.train_step(state, args, position)
        updates.append(ok)
        if arc is not None and ok:
            agreed = math.sqrt(float(arc.engine.last_stats.total("grad_sq").sum()))
            local = float(arc.engine.last_stats.per_rank("grad_sq_local").sum())
            norms[step] = (grad_norm, agreed, local)
    params = torch.cat([p.detach().float().flatten() for chunk in state.model for p in chunk.module.parameters()])
    summary = arc.summary() if arc is not None else {}
    if arc is not None:
        arc.close()
    return {"params": params, "updates": updates, "decisions": decisions, "norms": norms, "summary": summary}


def _rank(rank: int, world: int, config: str, nan_config: str) -> dict[str, Any]:
    return {"plain": _train([*FLAGS, "--no-arc"], STEPS), "arc": _train([*FLAGS, "--arc-config", config], STEPS),
            "nan": _train([*FLAGS, "--arc-config", nan_config], STEPS)}


def test_megatron_fp16_overflow_skips_are_the_scalers_and_clean_training_is_bitwise(tmp_path: Path) -> None:
    config = _config(tmp_path / "ok.yaml", "ok", policy={"max_consecutive_skips": 2})
    nan_step = 12
    nan = _config(tmp_path / "nan.yaml", "nan", faults={"injections": [
        {"kind": "nan_loss", "rank": 1, "step": nan_step}]})
    results = run_ranks(_rank, 2, config, nan, timeout_s=380)
    for rank, result in enumerate(results):
        plain, watched = result["plain"], result["arc"]
        skipped = [step for step, ok in enumerate(plain["updates"]) if not ok]
        # Megatron's scaler searches down from 2^24 (hysteresis 2): more skips in a row than max_consecutive_skips
        assert len(skipped) > 2 and skipped == list(range(len(skipped))), (rank, skipped)
        assert watched["updates"] == plain["updates"], rank
        assert torch.equal(watched["params"], plain["params"]), rank
        overflow = [step for step, _, is_overflow, _ in watched["decisions"] if is_overflow]
        assert overflow == skipped, rank
        for step, action, is_overflow, findings in watched["decisions"]:
            if is_overflow:
                assert action == "SKIP" and ("megatron_overflow", "WARNING") in findings, (step, findings)
                assert all(severity == "WARNING" for _, severity in findings), findings
            else:
                assert action == "NONE", (step, findings)
        assert watched["summary"]["skipped_by_policy"] == 0
        assert watched["summary"]["skipped_by_framework"] == len(skipped)
        for step, (megatron_norm, agreed, local_sq) in watched["norms"].items():
            # the agreed norm is Megatron's unscaled pre-clip norm; the local squares are unscaled too (a scaled
            # gradient's would be ~2^30 times larger)
            assert agreed == pytest.approx(megatron_norm, rel=1e-4), (rank, step)
            assert local_sq < 1e4 * megatron_norm**2 + 1.0, (rank, step, local_sq)
        # a NaN loss on rank 1 after the search: not the scaler's routine; skipped on both ranks, training goes on
        faulted = result["nan"]
        assert not faulted["updates"][nan_step] and all(faulted["updates"][nan_step + 1:]), rank
        step, action, is_overflow, findings = next(d for d in faulted["decisions"] if d[0] == nan_step)
        assert (action, is_overflow) == ("SKIP", False) and ("non_finite", "ERROR") in findings
        assert faulted["decisions"] == results[0]["nan"]["decisions"], "ranks disagree"
        assert torch.isfinite(faulted["params"]).all()

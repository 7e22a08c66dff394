"""SDC recomputation under megatron-core (0.16.1, 0.19.2) on real gloo ranks (TP=2 x DP=2, bf16,
DistributedOptimizer): the recompute unit is the suspect data-parallel replica's model-parallel group (its TP peer
recomputes with it, the other replica waits), the correction goes through Megatron's own reduction groups, and a
fault that reproduces only on the suspect's device is classified by the other replica recomputing the same
micro-batches.

Layout: ranks 0,1 are data-parallel replica 0 (TP ranks 0,1), ranks 2,3 replica 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.test_megatron_dist import SMALL, _arc_yaml, _build, _params

pytest.importorskip("megatron.core")

FLAGS = [*SMALL, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"]
FLIP_RANK, FLIP_STEP, STEPS = 1, 8, 11
FLIP = {"kind": "bitflip", "rank": FLIP_RANK, "step": FLIP_STEP, "pattern": "decoder.layers.0.mlp.linear_fc1",
        "where": "weight_grad", "bit": 14, "count": 4}


def _recompute_yaml(path: Path, run_id: str, injections: list[dict], on_faulty_device: str = "exclude") -> str:
    return _arc_yaml(path, run_id, injections=injections,
                     sdc={"enabled": True, "warmup_steps": 4, "update_sample": 1.0,
                          "recompute": {"enabled": True, "on_faulty_device": on_faulty_device}})


def _train(state: Any, script: Any, args: Any) -> tuple[list, dict[int, torch.Tensor]]:
    verdicts, snapshots = [], {}
    while state.arc.progress.step < STEPS:
        step = state.arc.progress.step
        _, applied, _ = script.train_step(state, args, state.arc.progress.data_position)
        decision = state.arc.engine.last_decision
        verdicts.append((step, applied, [(f.detector, f.action.name.lower(), list(f.ranks),
                                          f.values.get("classification")) for f in decision.findings]))
        snapshots[step] = _params(state).clone()
    return verdicts, snapshots


def _runs(rank: int, world: int, clean: str, transient: str, persistent: str) -> dict[str, Any]:
    script, args, state = _build([*FLAGS, "--no-arc"])
    for step in range(STEPS):
        script.train_step(state, args, step)
    reference = _params(state)

    out: dict[str, Any] = {"reference": reference}
    for name, config in (("clean", clean), ("transient", transient), ("persistent", persistent)):
        script, args, state = _build([*FLAGS, "--arc-config", config])
        verdicts, snapshots = _train(state, script, args)
        out[name] = {"verdicts": verdicts, "snapshots": snapshots, "final": _params(state),
                     "calls": state.arc.engine.sdc_recompute.calls, "fired": len(state.arc.faults.bitflips_fired()),
                     "summary": state.arc.summary()}
        state.arc.close()
    return out


@pytest.mark.timeout(600)
def test_megatron_sdc_recompute_runs_on_the_suspect_replica_and_corrects_transient_and_device_faults(
        tmp_path: Path) -> None:
    clean = _recompute_yaml(tmp_path / "clean.yaml", "clean", [])
    transient = _recompute_yaml(tmp_path / "transient.yaml", "transient", [FLIP])
    persistent = _recompute_yaml(tmp_path / "persistent.yaml", "persistent", [{**FLIP, "persistent": True}])
    results = run_ranks(_runs, 4, clean, transient, persistent, timeout_s=580)

    for rank, result in enumerate(results):
        # no fault: with the recomputation armed, training is bitwise the run without arc_engine; nothing recomputed
        assert torch.equal(result["clean"]["final"], result["reference"]), rank
        assert result["clean"]["calls"] == 0 and result["clean"]["summary"]["skipped_by_policy"] == 0, rank

        # a transient flip in rank 1's weight-gradient GEMM: rank 1's bucket is withheld, replica 0 (ranks 0 and 1,
        # TP peers) recomputes, replica 1 waits; the step is applied and equals the fault-free step
        run = result["transient"]
        assert run["calls"] == (1 if rank in (0, 1) else 0), (rank, run["calls"])
        faulty = [v for v in run["verdicts"] if v[2]]
        assert faulty == [(FLIP_STEP, True, [("sdc_recompute", "warn", [FLIP_RANK], "transient")])], faulty
        assert all(applied for _, applied, _ in run["verdicts"]), rank
        torch.testing.assert_close(run["snapshots"][FLIP_STEP], result["clean"]["snapshots"][FLIP_STEP],
                                   rtol=0, atol=0)
        torch.testing.assert_close(run["final"], result["clean"]["final"], rtol=0, atol=0)

        # a persistent fault on rank 1's device: the recomputation reproduces it there; replica 1 recomputes
        # replica 0's micro-batches (rank 3 is rank 1's counterpart) and does not: a faulty device, excluded
        # (rank 3's recomputed share replaces rank 1's) on each step from then on
        run = result["persistent"]
        faulty_steps = list(range(FLIP_STEP, STEPS))
        assert run["calls"] == len(faulty_steps), (rank, run["calls"])
        for step, applied, findings in run["verdicts"]:
            expected = [("sdc_recompute", "warn", [FLIP_RANK], "device")] if step in faulty_steps else []
            assert (applied, findings) == (True, expected), (rank, step, findings)
        torch.testing.assert_close(run["final"], result["clean"]["final"], rtol=0, atol=0)
    assert [r["transient"]["fired"] > 0 for r in results] == [rank == FLIP_RANK for rank in range(4)]
    quarantine = json.loads((tmp_path / "runs" / "persistent" / "quarantine.json").read_text())["quarantined"]
    assert [(e["rank"], e["step"]) for e in quarantine] == [(FLIP_RANK, FLIP_STEP)]


# ------------------------------------------------------------------ PP=2 (tied embeddings) and EP=2 (MoE)

def _transient_run(rank: int, world: int, flags: list[str], clean: str, transient: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, config in (("clean", clean), ("transient", transient)):
        script, args, state = _build([*flags, "--arc-config", config])
        verdicts, snapshots = _train(state, script, args)
        out[name] = {"verdicts": verdicts, "snapshots": snapshots, "final": _params(state),
                     "calls": state.arc.engine.sdc_recompute.calls, "fired": len(state.arc.faults.bitflips_fired())}
        state.arc.close()
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["pp2_dp2_tied_embeddings", "ep2_moe"])
def test_megatron_sdc_recompute_units_span_pipeline_stages_and_expert_parallel_peers(tmp_path: Path,
                                                                                     layout: str) -> None:
    """PP=2 x DP=2 (ranks 0,1 stage 0; ranks 2,3 stage 1): a flip in rank 2's output-layer weight gradient (the
    word embedding tied across the stages): replica 0's two stages (ranks 0 and 2) recompute together through the
    1F1B schedule and the correction reaches the first stage's embedding through Megatron's embedding all-reduce.
    EP=2 MoE on 2 ranks: the token dispatch crosses both replicas, so the unit is the whole job (no peer to
    compare with); the expert bucket's correction uses the expert reduction's own scale."""
    if layout == "pp2_dp2_tied_embeddings":
        world, flip_rank, units = 4, 2, [0, 2]
        flags = [*SMALL, "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"]
        pattern = "output_layer"
    else:
        world, flip_rank, units = 2, 1, [0, 1]
        flags = [*SMALL, "--expert-model-parallel-size", "2", "--num-experts", "4", "--use-distributed-optimizer",
                 "--bf16"]
        pattern = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1"
    flip = {**FLIP, "rank": flip_rank, "pattern": pattern}
    clean = _recompute_yaml(tmp_path / "clean.yaml", "clean", [])
    transient = _recompute_yaml(tmp_path / "transient.yaml", "transient", [flip])
    results = run_ranks(_transient_run, world, flags, clean, transient, timeout_s=580)
    assert [r["transient"]["fired"] > 0 for r in results] == [rank == flip_rank for rank in range(world)]
    for rank, result in enumerate(results):
        run = result["transient"]
        assert result["clean"]["calls"] == 0 and not any(v[2] for v in result["clean"]["verdicts"]), rank
        assert run["calls"] == (1 if rank in units else 0), (rank, run["calls"])
        faulty = [v for v in run["verdicts"] if v[2]]
        assert faulty == [(FLIP_STEP, True, [("sdc_recompute", "warn", [flip_rank], "transient")])], faulty
        assert not torch.equal(run["snapshots"][FLIP_STEP], run["snapshots"][FLIP_STEP - 1])  # applied
        if layout == "ep2_moe":  # one rank per expert reduction: the same sums, bitwise
            torch.testing.assert_close(run["final"], result["clean"]["final"], rtol=0, atol=0)
        else:  # the embedding's two stage sums are added in another order: fp32 rounding, seen through bf16
            torch.testing.assert_close(run["snapshots"][FLIP_STEP], result["clean"]["snapshots"][FLIP_STEP],
                                       rtol=1e-2, atol=1e-4)

"""Separability of the mechanism faults on real megatron-core (CPU, gloo; world 2 = EP 2 x DP 2 for the dense part,
4 experts, top-2): one spawn trains the same model, data and seed four times for 16 steps -- healthy, then with
``attention_lowbit``, ``router_collapse`` and ``dead_expert`` persistent from step 10 on every rank -- with every
step monitored and both mechanism families measuring every 2 steps.

What is asserted is what held on every seed tried (1234, 7, 42, 2024):

* the router monitor alarms on the router faults from their first step, in every MoE layer, and names the dead
  expert and its EP rank; it stays quiet on the healthy run and under the attention fault;
* paired with the healthy run (same data, same initialisation), the attention fault lowers the Δ₂ spectral entropy
  that the QK monitor reads, in every head of the last layer, over the first two faulted measurements, and the
  router fault does not (there it moves the last layer's mean by less than 0.1 nats, either way).

Not asserted here: that the QK *monitor* alarms under the attention fault and stays quiet under the router fault.
On this 16-step 2-layer toy model the healthy per-head Δ₂ entropy moves 20-35 % away from its own trend between
measurements and a collapsed router perturbs the attention updates about as much as the attention fault does;
tests/test_megatron_qk_separability_dist.py asserts the alarms on a 4-layer model trained 160 steps.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.dist_harness import run_ranks
from tests.scripts_loader import load_script
from tests.test_megatron_dist import _arc_yaml

pytest.importorskip("megatron.core")

MODEL = ["--cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0.1"]
STEPS = 16
FAULT_STEP = 10
DEAD_EXPERT = 3
RUNS: dict[str, list[dict[str, Any]]] = {
    "healthy": [],
    "attention_lowbit": [{"kind": "attention_lowbit", "rank": -1, "step": FAULT_STEP, "persistent": True,
                          "bits": 7}],
    "router_collapse": [{"kind": "router_collapse", "rank": -1, "step": FAULT_STEP, "persistent": True,
                         "scale": 2.0, "expert": 0}],
    "dead_expert": [{"kind": "dead_expert", "rank": -1, "step": FAULT_STEP, "persistent": True,
                     "expert": DEAD_EXPERT}],
}


#: the router's alarm thresholds, pinned (the assertions depend on them)
ROUTER = {"every": 2, "warmup_measurements": 3, "window": 50, "factor": 6.0, "min_relative_change": 0.15}


def _train(rank: int, world: int, configs: dict[str, str]) -> dict[str, Any]:
    from arc_engine.monitors.router import router_partials_size, unpack_router_sums

    script = load_script("train_megatron_gpt")
    size = router_partials_size(4)
    out = {}
    for name, config in configs.items():
        args = script.build_parser().parse_args([*MODEL, "--arc-config", config])
        script.initialize(args)
        state = script.build_model_and_optimizer(args)
        engine = state.arc.engine
        delta2_entropy, router_entropy, losses = {}, {}, []
        for _ in range(STEPS):
            loss, _ok, _norm = script.train_step(state, args, state.arc.progress.data_position)
            losses.append(loss)
            step, stats = engine.progress.step - 1, engine.last_stats
            if np.asarray(stats.total("qk_measured")).any():
                delta2_entropy[step] = np.asarray(stats.total("qk_delta2_entropy"), dtype=np.float64).reshape(2, 4)
            sums = np.asarray(stats.total("router_sums"), dtype=np.float64)
            if sums.any():
                router_entropy[step] = [unpack_router_sums(sums[i * size:(i + 1) * size], 4)["entropy_mean"]
                                        for i in range(2)]
        summary, fired = state.arc.summary(), sorted(set(state.arc.faults.fired))
        state.arc.close()  # flushes the events file (written by rank 0)
        torch.distributed.barrier()  # rank 0 has closed (flushed) before any rank reads its file
        events = [e for e in _events(engine.run_dir) if e["kind"] == "detection"]
        out[name] = {"delta2_entropy": delta2_entropy, "router_entropy": router_entropy, "losses": losses,
                     "detections": summary["detections"], "fired": fired,
                     "events": [{k: e[k] for k in ("detector", "step", "message", "values")} for e in events]}
    return out


def _events(run_dir: Path | str) -> list[dict[str, Any]]:
    import json

    path = Path(run_dir) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("separability")
    configs = {name: _arc_yaml(folder / f"{name}.yaml", name, injections=injections, router=ROUTER)
               for name, injections in RUNS.items()}
    results = run_ranks(_train, 2, configs, timeout_s=240)  # and up to 30 s to reap: inside the test's 300 s
    for name in RUNS:  # every rank took the same decisions
        assert results[0][name]["detections"] == results[1][name]["detections"], name
    return results[0]


def _router_alarms(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in run["events"] if e["detector"] == "router"]


@pytest.mark.timeout(300)
def test_the_faults_fire_from_their_step_and_training_stays_finite(runs: dict[str, Any]) -> None:
    for name, run in runs.items():
        assert all(math.isfinite(loss) for loss in run["losses"]), name
        if name != "healthy":
            assert run["fired"] == [(step, name) for step in range(FAULT_STEP, STEPS)], name
    # the same model and data until the faults start
    for name, run in runs.items():
        assert run["losses"][:FAULT_STEP] == runs["healthy"]["losses"][:FAULT_STEP], name


@pytest.mark.timeout(300)
def test_router_monitor_alarms_on_router_faults_and_stays_quiet_on_attention_lowbit(runs: dict[str, Any]) -> None:
    assert _router_alarms(runs["healthy"]) == []
    assert _router_alarms(runs["attention_lowbit"]) == []
    for name in ("router_collapse", "dead_expert"):
        collapse = [e for e in _router_alarms(runs[name]) if e["message"].startswith("router collapse")]
        # from the first faulted measurement on, in both MoE layers, on the routing entropy
        assert {(e["step"], e["values"]["layer"]) for e in collapse} >= {(FAULT_STEP, 0), (FAULT_STEP, 1)}, name
        # on the routing entropy: the job's mean, and (every rank's tokens collapse) the lowest rank's
        assert all({p["statistic"] for p in e["values"]["problems"]} == {"entropy_mean", "rank_min_entropy"}
                   for e in collapse), (name, collapse)
        for step, entropies in runs[name]["router_entropy"].items():
            healthy = runs["healthy"]["router_entropy"][step]
            if step >= FAULT_STEP:
                assert all(f < 0.9 * h for f, h in zip(entropies, healthy, strict=True)), (name, step)
    dead = [e for e in _router_alarms(runs["dead_expert"]) if e["message"].startswith("dead expert")]
    assert {(e["step"], e["values"]["layer"]) for e in dead} == {(s, layer) for s in range(FAULT_STEP, STEPS, 2)
                                                                  for layer in (0, 1)}
    assert all(e["values"]["dead_expert_ids"] == [DEAD_EXPERT] and e["values"]["ep_ranks"] == [1] for e in dead)


@pytest.mark.timeout(300)
def test_attention_lowbit_lowers_the_delta2_entropy_the_qk_monitor_reads_and_router_collapse_does_not(
        runs: dict[str, Any]) -> None:
    healthy = runs["healthy"]["delta2_entropy"]
    assert sorted(healthy) == list(range(2, STEPS, 2))
    drops = {}
    for name in ("attention_lowbit", "router_collapse"):
        faulted = runs[name]["delta2_entropy"]
        assert sorted(faulted) == sorted(healthy), name
        for step in healthy:
            if step <= FAULT_STEP:  # W_10 - W_8 is the last clean increment
                assert np.array_equal(faulted[step], healthy[step]), (name, step)
        # [layers, heads]: how far below the healthy run the first two faulted increments fall
        drops[name] = np.mean([healthy[s] - faulted[s] for s in (FAULT_STEP + 2, FAULT_STEP + 4)], axis=0)
    attention, router = drops["attention_lowbit"][1], drops["router_collapse"][1]
    assert (attention > 0).all() and attention.mean() > 0.1, drops
    assert abs(router.mean()) < 0.1 and router.mean() < attention.mean(), drops

"""megatron-core (0.16.1 and 0.19.2) on real gloo ranks: the reference script's model (GPTModel, megatron DDP, the
DistributedOptimizer, ChainedOptimizer members) with arc_engine attached, faults injected at (rank, step).

The CUDA shims (``arc_engine.testing.megatron_cpu``) are installed inside the spawned ranks only. One spawn costs
about 20-40 s on 2 cores (mostly imports), so each spawn checks several things.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from tests.dist_harness import run_ranks
from tests.scripts_loader import load_script

pytest.importorskip("megatron.core")

SMALL = ["--cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]


def _arc_yaml(path: Path, run_id: str, *, injections: list[dict] | None = None, **detectors: Any) -> str:
    """A config file for one run: every step monitored, quiet console, optional faults and detector settings."""
    config = {"run": {"run_id": run_id, "run_dir": str(path.parent / "runs")}, "stats": {"interval": 1},
              "sinks": {"console": {"enabled": False}},
              "detectors": {"qk_spectra": {"every": 2, "warmup_measurements": 3},
                            "router": {"every": 2, "warmup_measurements": 3}, **detectors},
              "faults": {"injections": injections or []}}
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _build(flags: list[str]) -> tuple[Any, Any, Any]:
    script = load_script("train_megatron_gpt")
    args = script.build_parser().parse_args(flags)
    script.initialize(args)
    return script, args, script.build_model_and_optimizer(args)


def _params(state: Any) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for chunk in state.model for p in chunk.module.parameters()])


def _adam_steps(state: Any) -> list[int]:
    steps = []
    for member in state.optimizer.chained_optimizers:
        for s in member.optimizer.state.values():
            if "step" in s:
                steps.append(int(s["step"]))
    return steps


# ------------------------------------------------------------------ TP=2 x DP=2, bf16, DistributedOptimizer

def _tp_dp_bf16(rank: int, world: int, config_ok: str, config_nan: str) -> dict[str, Any]:
    flags = [*SMALL, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"]
    from tests.training import count_c10d_ops

    script, args, state = _build([*flags, "--no-arc"])
    plain_ops = []
    for step in range(5):
        plain_ops.append(count_c10d_ops(lambda step=step: script.train_step(state, args, step)))
    reference = _params(state)

    script, args, state = _build([*flags, "--arc-config", config_ok])
    grad_norms, arc_ops = [], []
    for _ in range(5):
        results: list[Any] = []
        arc_ops.append(count_c10d_ops(lambda results=results: results.append(
            script.train_step(state, args, state.arc.progress.data_position))))
        _, _ok, grad_norm = results[0]
        agreed = math.sqrt(float(state.arc.engine.last_stats.total("grad_sq").sum()))
        grad_norms.append((grad_norm, agreed))
    with_arc = _params(state)
    state.arc.close()

    script, args, state = _build([*flags, "--arc-config", config_nan])
    updates = []
    for _ in range(5):
        _, ok, _ = script.train_step(state, args, state.arc.progress.data_position)
        updates.append(ok)
    summary = state.arc.summary()
    decision = state.arc.engine.last_decision
    state.arc.close()
    return {"identical": torch.equal(reference, with_arc), "grad_norms": grad_norms, "updates": updates,
            "extra_ops": [a - p for a, p in zip(arc_ops, plain_ops, strict=True)],
            "finite": bool(torch.isfinite(_params(state)).all()), "adam_steps": sorted(set(_adam_steps(state))),
            "skipped": summary["skipped_by_policy"], "detections": summary["detections"],
            "last_action": decision.action.name if decision else None}


@pytest.mark.timeout(400)
def test_tp2_dp2_bf16_nan_is_skipped_on_all_ranks_and_clean_training_is_bitwise_unchanged(tmp_path: Path) -> None:
    ok = _arc_yaml(tmp_path / "ok.yaml", "ok")
    nan = _arc_yaml(tmp_path / "nan.yaml", "nan", injections=[{"kind": "nan_loss", "rank": 3, "step": 2}])
    results = run_ranks(_tp_dp_bf16, 4, ok, nan, timeout_s=380)
    for rank, result in enumerate(results):
        # no fault: the parameters are bitwise those of the run without arc_engine
        assert result["identical"], rank
        # one collective per monitored step (steps 0, 2, 4 also measure the QK spectra: locally)
        assert result["extra_ops"] == [1] * 5, (rank, result["extra_ops"])
        # the agreed reduced-gradient norm is Megatron's own pre-clip grad norm (TP duplicates counted once)
        for megatron_norm, agreed in result["grad_norms"]:
            assert agreed == pytest.approx(megatron_norm, rel=1e-5), (rank, megatron_norm, agreed)
        # a NaN loss on rank 3 under bf16 (stock megatron-core would apply it): skipped by all four ranks
        assert result["updates"] == [True, True, False, True, True], rank
        assert result["finite"], rank
        assert result["adam_steps"] == [4], rank  # the skipped step left Adam's step count alone
        assert result["skipped"] == 1 and result["detections"] == {"non_finite": 1}, rank


# ------------------------------------------------------------------ DP=2, DistributedOptimizer, overlapped gathers

def _overlapped(rank: int, world: int, config_ok: str, config_nan: str) -> dict[str, Any]:
    flags = [*SMALL, "--use-distributed-optimizer", "--bf16", "--overlap-grad-reduce", "--overlap-param-gather"]
    script, args, state = _build([*flags, "--no-arc"])
    for step in range(5):
        script.train_step(state, args, step)
    reference = _params(state)
    script, args, state = _build([*flags, "--arc-config", config_ok])
    for _ in range(5):
        script.train_step(state, args, state.arc.progress.data_position)
    with_arc = _params(state)
    overlapping = state.model[0].ddp_config.overlap_param_gather
    state.arc.close()
    script, args, state = _build([*flags, "--arc-config", config_nan])
    updates = [script.train_step(state, args, state.arc.progress.data_position)[1] for _ in range(5)]
    summary = state.arc.summary()
    state.arc.close()
    return {"identical": torch.equal(reference, with_arc), "overlapping": overlapping, "updates": updates,
            "finite": bool(torch.isfinite(_params(state)).all()), "skipped": summary["skipped_by_policy"]}


@pytest.mark.timeout(400)
def test_overlapped_param_gather_is_bitwise_unchanged_and_a_nan_is_skipped_on_every_rank(tmp_path: Path) -> None:
    """DP=2, bf16, the DistributedOptimizer with overlapped gradient reduction and parameter all-gather (the
    gathers run in the next forward's pre-hooks): no fault, the parameters are bitwise those of the run without
    arc_engine; a NaN loss on rank 1 at step 2 is skipped by both ranks (the skipped update gathers nothing new)."""
    ok = _arc_yaml(tmp_path / "ok.yaml", "ok")
    nan = _arc_yaml(tmp_path / "nan.yaml", "nan", injections=[{"kind": "nan_loss", "rank": 1, "step": 2}])
    for result in run_ranks(_overlapped, 2, ok, nan, timeout_s=380):
        assert result["overlapping"] and result["identical"], result
        assert result["updates"] == [True, True, False, True, True] and result["finite"], result
        assert result["skipped"] == 1, result


# ------------------------------------------------------------------ a release past the tested range

def _untested_release(rank: int, world: int, config: str) -> dict[str, Any]:
    """Attach to a megatron-core that says it is 0.21.0 and whose ``TopKRouter.routing`` takes other arguments (a
    dense model never calls it), then train 4 steps with a NaN loss on rank 1 at step 2."""
    import warnings

    import megatron.core
    from megatron.core.transformer.moe.router import TopKRouter

    from arc_engine.integrations.megatron import internals as mi

    megatron.core.__version__ = "0.21.0"
    TopKRouter.routing = lambda self, scores, padding_mask=None: None  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        script, args, state = _build([*SMALL, "--use-distributed-optimizer", "--arc-config", config])
    applied = []
    while state.arc.progress.step < 4:
        _, ok, _ = script.train_step(state, args, state.arc.progress.data_position)
        applied.append(ok)
    run_dir = state.arc.engine.run_dir
    state.arc.close()
    events = [json.loads(line) for line in (run_dir / f"events.jsonl.rank{rank}").read_text().splitlines()]
    return {"warnings": [str(w.message) for w in caught if issubclass(w.category, mi.UntestedMegatronVersion)],
            "applied": applied, "events": events}


@pytest.mark.timeout(300)
def test_a_release_past_the_tested_range_warns_turns_off_one_feature_and_still_skips_a_nan(tmp_path: Path) -> None:
    """DP=2: the attach warns (not refuses), one ``compatibility`` event on each rank names the release and the one
    feature whose internals changed (the router observation, so ``detectors.router`` is off), and the monitoring
    that needs no such internals still skips a NaN loss on every rank."""
    config = tmp_path / "untested.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"run_id": "untested", "run_dir": str(tmp_path / "runs")}, "stats": {"interval": 1},
        "sinks": {"console": {"enabled": False}, "all_ranks": True},
        "faults": {"injections": [{"kind": "nan_loss", "rank": 1, "step": 2}]}}))
    results = run_ranks(_untested_release, 2, str(config), timeout_s=280)
    for rank, result in enumerate(results):
        assert len(result["warnings"]) == 1 and "megatron-core 0.21.0 is outside" in result["warnings"][0], rank
        compatibility = [e for e in result["events"] if e["detector"] == "compatibility"]
        assert len(compatibility) == 1, (rank, compatibility)
        values = compatibility[0]["values"]
        assert (values["megatron_core"], values["in_tested_range"]) == ("0.21.0", False), values
        assert list(values["features_off"]) == ["router_observation"], values
        assert values["config_off"] == ["detectors.router.enabled"], values
        assert "outside the tested range 0.16.1 .. 0.19.x" in compatibility[0]["message"]
        assert result["applied"] == [True, True, False, True], rank
        skips = [e for e in result["events"] if e["detector"] == "non_finite" and e["action"] == "skip"]
        assert [(e["step"], e["ranks"]) for e in skips] == [(2, [1])], rank


# ------------------------------------------------------------------ SDC: a bit flip in one rank's GEMM

FLIP_RANK, FLIP_STEP = 1, 8


def _sdc_flip(rank: int, world: int, config: str) -> dict[str, Any]:
    flags = [*SMALL, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"]
    script, args, state = _build([*flags, "--arc-config", config])
    verdicts = []
    while state.arc.progress.step < 10:
        step = state.arc.progress.step
        _, applied, _ = script.train_step(state, args, state.arc.progress.data_position)
        decision = state.arc.engine.last_decision
        verdicts.append((step, applied, decision.action.name,
                         {f.detector: list(f.ranks) for f in decision.findings}))
    fired = state.arc.faults.bitflips_fired()
    state.arc.close()
    return {"verdicts": verdicts, "fired": fired,
            "finite": all(bool(torch.isfinite(p).all()) for chunk in state.model for p in chunk.parameters())}


@pytest.mark.timeout(300)
def test_an_sdc_bit_flip_in_a_megatron_gemm_is_caught_named_and_skipped_on_every_rank(tmp_path: Path) -> None:
    """The bitflip fault on megatron-core's ColumnParallelLinear (the weight-gradient GEMM of one TP rank, the top
    exponent bit of 4 bf16 elements, x 2^128): the rank's local gradient norm overflows, the SDC rule flags the step
    (the non-finite detector is off here, which otherwise takes the non-finite case), names the rank from the
    per-rank local statistics, and all four ranks skip it."""
    config = _arc_yaml(tmp_path / "sdc.yaml", "sdc", injections=[
        {"kind": "bitflip", "rank": FLIP_RANK, "step": FLIP_STEP, "pattern": "decoder.layers.0.mlp.linear_fc1",
         "where": "weight_grad", "bit": 14, "count": 4}],
        sdc={"enabled": True, "warmup_steps": 4, "update_sample": 1.0}, non_finite={"enabled": False})
    results = run_ranks(_sdc_flip, 4, config, timeout_s=280)
    verdicts = results[0]["verdicts"]
    assert all(result["verdicts"] == verdicts for result in results)  # one verdict per step, job-wide
    assert [r["fired"] != [] for r in results] == [rank == FLIP_RANK for rank in range(4)]
    assert results[FLIP_RANK]["fired"][0]["dtype"] == "bfloat16"
    skipped = [(step, findings) for step, applied, _, findings in verdicts if not applied]
    assert [step for step, _ in skipped] == [FLIP_STEP], verdicts
    findings = skipped[0][1]
    assert findings.get("sdc") == [FLIP_RANK], findings
    assert all(result["finite"] for result in results)


# ------------------------------------------------------------------ EP=2 MoE: router statistics over all tokens

def _ep2_router(rank: int, world: int, config: str) -> dict[str, Any]:
    from arc_engine.integrations.megatron import internals as mi
    from arc_engine.monitors.router import pack_router_partials, router_partials_size, unpack_router_sums

    flags = [*SMALL, "--expert-model-parallel-size", "2", "--num-experts", "4", "--use-distributed-optimizer",
             "--arc-config", config]
    script, args, state = _build(flags)
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for layer in mi.transformer_layers(state.model):
        index = mi.layer_index(layer)
        mi.observe_routing(mi.router_of(layer), lambda logits, rmap, index=index: seen.setdefault(index, []).append(
            (logits.detach().clone(), rmap.detach().clone())))
    for _ in range(5):
        seen.clear()
        weights = {mi.layer_index(layer): mi.router_of(layer).weight.detach().clone()
                   for layer in mi.transformer_layers(state.model)}  # as the producer reads them: before the update
        script.train_step(state, args, state.arc.progress.data_position)
    # step 4 was measured: compare with one computation over the union of every rank's tokens
    agreed = state.arc.engine.last_stats.total("router_sums")
    size = router_partials_size(4)
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, {k: v for k, v in seen.items()})
    out = {}
    for layer in mi.transformer_layers(state.model):
        index = mi.layer_index(layer)
        logits = torch.cat([lg for per_rank in gathered for lg, _ in per_rank[index]])
        rmap = torch.cat([rm for per_rank in gathered for _, rm in per_rank[index]])
        union = unpack_router_sums(pack_router_partials(logits, rmap, weights[index]), 4)
        out[index] = (unpack_router_sums(agreed[index * size:(index + 1) * size], 4), union)
    detections = state.arc.summary()["detections"]
    state.arc.close()
    return {"layers": out, "detections": detections, "members": len(state.optimizer.chained_optimizers)}


@pytest.mark.timeout(400)
def test_ep2_router_statistics_equal_one_computation_over_the_union_of_tokens(tmp_path: Path) -> None:
    config = _arc_yaml(tmp_path / "ep.yaml", "ep")
    results = run_ranks(_ep2_router, 4, config, timeout_s=380)
    for rank, result in enumerate(results):
        assert result["members"] == 2  # dense + expert DistributedOptimizer
        assert sorted(result["layers"]) == [0, 1]
        for layer, (agreed, union) in result["layers"].items():
            assert agreed["tokens"] == union["tokens"] == 4 * 2 * 32, (rank, layer)  # 4 DP ranks x mbs 2 x seq
            assert agreed["tokens_per_expert"] == union["tokens_per_expert"], (rank, layer)
            for key in ("similarity", "conditioning_ratio", "entropy_mean", "entropy_p1", "entropy_p5", "max_vio"):
                assert agreed[key] == pytest.approx(union[key], rel=1e-9, abs=1e-12), (rank, layer, key)
        assert result["detections"] == {}, rank
    assert results[0]["layers"][0][0]["similarity"] == results[3]["layers"][0][0]["similarity"]


COLLAPSED_RANK, COLLAPSE_AT = 2, 12


def _ep2_rank_collapse(rank: int, world: int, config: str) -> dict[str, Any]:
    from megatron.core import parallel_state

    flags = [*SMALL, "--expert-model-parallel-size", "2", "--num-experts", "4", "--use-distributed-optimizer",
             "--arc-config", config]
    script, args, state = _build(flags)
    verdicts = []
    while state.arc.progress.step < COLLAPSE_AT + 4:
        step = state.arc.progress.step
        script.train_step(state, args, state.arc.progress.data_position)
        verdicts.append((step, [(f.detector, list(f.ranks), f.values.get("ep_group"),
                                 [p["statistic"] for p in f.values.get("problems", [])])
                                for f in state.arc.engine.last_decision.findings]))
    group = dist_ranks(parallel_state.get_expert_model_parallel_group())
    state.arc.close()
    return {"verdicts": verdicts, "ep_group": group}


def dist_ranks(group: Any) -> list[int]:
    return list(torch.distributed.get_process_group_ranks(group))


@pytest.mark.timeout(400)
def test_ep2_dp2_a_collapse_of_one_ranks_tokens_is_named_with_its_expert_parallel_group(tmp_path: Path) -> None:
    """EP=2 x DP=2 (4 ranks): from step 12 rank 2's routers add 2 to expert 0's logit (``router_collapse`` on that
    rank only, a quarter of the job's tokens). The job's mean routing entropy moves less than the alarm's relative
    floor; the lowest rank's does not: the router alarm names rank 2 and its expert-parallel group, on every rank
    alike, at the first measurement after the fault; no collapse before."""
    config = _arc_yaml(tmp_path / "collapse.yaml", "collapse", injections=[
        {"kind": "router_collapse", "rank": COLLAPSED_RANK, "step": COLLAPSE_AT, "persistent": True, "scale": 2.0}])
    results = run_ranks(_ep2_rank_collapse, 4, config, timeout_s=380)
    verdicts = results[0]["verdicts"]
    assert all(result["verdicts"] == verdicts for result in results)
    collapses = [(step, found) for step, findings in verdicts for found in findings
                 if found[0] == "router" and found[3]]  # (a dead-expert finding has no problems)
    assert collapses and collapses[0][0] == COLLAPSE_AT, verdicts
    for _, (_, ranks, group, problems) in collapses:
        assert ranks == [COLLAPSED_RANK] and group == results[COLLAPSED_RANK]["ep_group"], collapses
        assert problems == ["rank_min_entropy"], collapses  # the job's mean moved too little to say it


# ------------------------------------------------------------------ TP=2 per-shard spectra, GQA

def _tp2_spectra(rank: int, world: int, config: str, groups: int) -> dict[str, Any]:
    from megatron.core import parallel_state

    from arc_engine.integrations.megatron import internals as mi
    from arc_engine.monitors.spectra import layer_spectra, split_qkv_rows

    flags = [*SMALL, "--tensor-model-parallel-size", "2", "--num-query-groups", str(groups), "--arc-config", config]
    script, args, state = _build(flags)
    layers = mi.transformer_layers(state.model)
    tp_group = parallel_state.get_tensor_model_parallel_group()

    def full_weights() -> list[torch.Tensor]:
        out = []
        for layer in layers:
            local = layer.self_attention.linear_qkv.weight.detach().float()
            parts = [torch.empty_like(local) for _ in range(2)]
            torch.distributed.all_gather(parts, local, group=tp_group)
            out.append(torch.cat(parts))  # TP splits the interleaved rows into contiguous blocks
        return out

    weights = {}
    for step in range(5):
        weights[step] = full_weights()  # what the producer reads at step `step` (before its update)
        script.train_step(state, args, state.arc.progress.data_position)
    agreed = state.arc.engine.last_stats.total("qk_delta2_entropy").reshape(2, 4)
    # the TP=1 computation on the same model: the whole linear_qkv of each layer, `groups` query groups
    expected = torch.tensor([[head["delta2"]["entropy"] for head in layer_spectra(weights[4][i], weights[2][i],
                                                                                  groups, 4 // groups, 16)]
                             for i in range(2)], dtype=torch.float64)
    measured = state.arc.engine.last_stats.total("qk_measured")
    bound = state.arc.engine.last_stats.total("qk_logit_bound").reshape(2, 4)
    expected_bound = []
    for full in weights[4]:  # the dense d x d product of each head, the reference for the d_k x d_k cores
        q, k = split_qkv_rows(full.double(), groups, 4 // groups, 16)
        expected_bound.append([float(torch.linalg.svdvals(q[h] @ k[h // (4 // groups)].T)[0]) / 4.0
                               for h in range(4)])
    state.arc.close()
    return {"agreed": torch.as_tensor(agreed), "expected": expected, "measured": torch.as_tensor(measured),
            "bound": torch.as_tensor(bound), "expected_bound": torch.tensor(expected_bound, dtype=torch.float64)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("groups", [2, 1], ids=["gqa_2_groups", "mqa_1_group_gathered_over_tp"])
def test_tp2_per_shard_qk_spectra_equal_the_whole_model_per_head_computation(tmp_path: Path, groups: int) -> None:
    config = _arc_yaml(tmp_path / "tp.yaml", "tp")
    results = run_ranks(_tp2_spectra, 2, config, groups, timeout_s=280)
    for result in results:
        assert result["measured"].tolist() == [4.0, 4.0]  # every head of both layers, written once
        assert torch.allclose(result["agreed"], result["expected"], rtol=1e-6, atol=1e-9), \
            (result["agreed"], result["expected"])
        assert (result["agreed"] > 0).all()
        # each head's logit bound σ_max(W_q W_kᵀ)/√d_k, written by the rank holding it, equals the dense product's
        assert torch.allclose(result["bound"], result["expected_bound"], rtol=1e-6), \
            (result["bound"], result["expected_bound"])


GROWN_LAYER, GROWN_AT = 1, 20


def _logit_growth(rank: int, world: int, config: str) -> dict[str, Any]:
    flags = [*SMALL, "--tensor-model-parallel-size", "2", "--arc-config", config]
    script, args, state = _build(flags)
    verdicts = []
    while state.arc.progress.step < GROWN_AT + 4:
        step = state.arc.progress.step
        _, applied, _ = script.train_step(state, args, state.arc.progress.data_position)
        findings = state.arc.engine.last_decision.findings
        verdicts.append((step, applied, {f.detector: f.values.get("heads") for f in findings}))
    state.arc.close()
    return {"verdicts": verdicts}


@pytest.mark.timeout(300)
def test_tp2_attention_logit_growth_names_the_layer_and_every_head_of_both_tp_ranks(tmp_path: Path) -> None:
    """Layer 1's fused QKV weight x 2 at step 20 on every rank (a weight fault: its QK products x 4): the next
    measurement's bound is 4x each head's trend, and the ``qk_logit`` alarm names layer 1's four heads (two per TP
    rank), on both ranks alike, with a warning only; nothing before (10 healthy measurements, the warm-up)."""
    config = _arc_yaml(tmp_path / "grow.yaml", "grow", injections=[
        {"kind": "weight_corruption", "rank": -1, "step": GROWN_AT,
         "pattern": f"*decoder.layers.{GROWN_LAYER}.self_attention.linear_qkv.weight", "scale": 2.0}])
    results = run_ranks(_logit_growth, 2, config, timeout_s=280)
    assert results[0]["verdicts"] == results[1]["verdicts"]
    alarms = [(step, found["qk_logit"]) for step, _, found in results[0]["verdicts"] if "qk_logit" in found]
    assert [step for step, _ in alarms] == [GROWN_AT], alarms
    heads = alarms[0][1]
    assert sorted((h["layer"], h["head"], h["tp_rank"]) for h in heads) == [
        (GROWN_LAYER, 0, 0), (GROWN_LAYER, 1, 0), (GROWN_LAYER, 2, 1), (GROWN_LAYER, 3, 1)]
    assert all(3.0 < h["growth"] < 5.0 for h in heads), heads
    assert all(applied for _, applied, _ in results[0]["verdicts"])  # a warning, not a skip


# ------------------------------------------------------------------ TP=2 x DP=2: consistency per shard

SCALED_RANK, SCALE_FROM = 3, 10


def _tp2_consistency(rank: int, world: int, config: str) -> dict[str, Any]:
    from megatron.core import parallel_state

    from arc_engine.monitors.consistency import POSITION

    flags = [*SMALL, "--tensor-model-parallel-size", "2", "--arc-config", config]
    script, args, state = _build(flags)
    if rank == SCALED_RANK:  # "an NCCL bug": this rank's gradient enters the reduction 5x too large
        for chunk in state.model:
            for param in chunk.module.parameters():
                param.register_hook(lambda grad: grad * 5.0 if state.arc.progress.step >= SCALE_FROM else grad)
    monitor = next(m for m in state.arc.engine.gathering.assembly.monitors if m.name == "consistency")
    rows, findings = [], {}
    while state.arc.progress.step < 14:
        step = state.arc.progress.step
        script.train_step(state, args, state.arc.progress.data_position)
        stats = state.arc.engine.last_stats
        norms = [float(v) for v in torch.tensor(stats.per_rank("grad_sq_local")).sum(dim=1).sqrt()]
        rows.append({"metrics": dict(monitor.metrics()), "norms": norms,
                     "positions": [int(p) for p in stats.per_rank(POSITION)[:, 0]]})
        decision = state.arc.engine.last_decision
        found = [f for f in decision.findings if f.detector == "consistency"]
        if found:
            findings[step] = list(found[0].ranks)
    state.arc.close()
    return {"rows": rows, "findings": findings, "position": monitor.position, "positions": monitor.positions,
            "tp_rank": parallel_state.get_tensor_model_parallel_rank()}


@pytest.mark.timeout(400)
def test_tp2_dp2_consistency_compares_the_replicas_of_each_shard(tmp_path: Path) -> None:
    """Under TP=2 x DP=2 the consistency family compares each tensor-parallel shard over its data-parallel
    replicas: the agreed per-shard CV (the alarm watches the largest) equals the one computed from every rank's
    fetched local norm, grouped by shard, and C_dir is measured per shard. Rank 3's gradient scaled 5x from step 10:
    one finding at step 12 (3 steps past the limit) naming rank 3, on every rank."""
    config = _arc_yaml(tmp_path / "cons.yaml", "cons", consistency={
        "warmup_steps": 5, "window": 10, "direction_every": 1, "detail_every": 1, "sketch_size": 256})
    results = run_ranks(_tp2_consistency, 4, config, timeout_s=380)
    assert [(r["positions"], r["position"]) for r in results] == [(2, r["tp_rank"]) for r in results]
    for result in results:
        assert result["findings"] == {12: [SCALED_RANK]}, result["findings"]
        assert json.dumps(result["rows"]) == json.dumps(results[0]["rows"])  # every rank agrees on every value
    for step, row in enumerate(results[0]["rows"][1:], start=1):
        norms, positions = torch.tensor(row["norms"], dtype=torch.float64), torch.tensor(row["positions"])
        cvs = [float(norms[positions == p].std(unbiased=False) / norms[positions == p].mean()) for p in (0, 1)]
        assert row["metrics"]["grad_norm_cv"] == pytest.approx(max(cvs), rel=1e-6, abs=1e-9), step
        assert row["metrics"]["grad_norm_cv_mean"] == pytest.approx(sum(cvs) / 2, rel=1e-6, abs=1e-9), step
        assert -1.0 <= row["metrics"]["direction"] <= row["metrics"]["direction_mean"] <= 1.0, step
    before, after = results[0]["rows"][SCALE_FROM - 1]["metrics"], results[0]["rows"][SCALE_FROM]["metrics"]
    assert after["grad_norm_cv"] > 2 * before["grad_norm_cv"]


# ------------------------------------------------------------------ TP=2 x DP=2, straggler attribution

def _straggler(rank: int, world: int, config: str, layout: list[str], steps: int) -> dict[str, Any]:
    from megatron.core import parallel_state

    script, args, state = _build([*SMALL, *layout, "--arc-config", config])
    findings: dict[int, dict[str, Any]] = {}
    while state.arc.progress.step < steps:
        step = state.arc.progress.step
        script.train_step(state, args, state.arc.progress.data_position)
        decision = state.arc.engine.last_decision
        for finding in decision.findings:
            if finding.detector == "straggler" and decision.step == step:
                findings[step] = {"ranks": list(finding.ranks), "message": finding.message,
                                  "kinds": {str(k): v for k, v in finding.values["kinds"].items()}}
    probe = state.arc.engine.gathering.probe
    timed = [type(m).__name__ for m in probe.modules] if probe is not None else []
    state.arc.close()
    return {"findings": findings, "timed": timed, "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "stage": parallel_state.get_pipeline_model_parallel_rank(),
            "replica": parallel_state.get_data_parallel_rank()}


SLOW_MODULE = "decoder.layers.0.self_attention.linear_qkv"  # the first attention layer of the rank's stage
#: the injected delay, and the smallest a report names (``min_delay_s``, 0.12 s): far above what 4 ranks on 2 loaded
#: cores vary by (with 0.15 s and 0.05 s, a CI run once named a replica slowed by the machine, before the fault)
STALL_S = 0.3


def _straggler_config(tmp_path: Path, injections: list[dict]) -> str:
    return _arc_yaml(tmp_path / "straggler.yaml", "straggler", straggler={
        "every": 5, "warmup_reports": 1, "persist_reports": 1, "min_delay_s": 0.12, "compute_every": 1,
        "individual_threshold": 0.0},
        injections=[{"kind": "stall", "seconds": STALL_S, "pattern": SLOW_MODULE, **i} for i in injections])


@pytest.mark.timeout(500)
def test_tp2_dp2_straggler_tells_a_slow_tensor_parallel_peer_from_a_slow_replica(tmp_path: Path) -> None:
    """TP=2 x DP=2 (replica 0: ranks 0, 1; replica 1: ranks 2, 3). From step 10 rank 2's first QKV projection takes
    0.3 s longer; rank 3, its tensor-parallel peer, waits for it in the next all-reduce, so both forward sections
    are long, but only rank 2's compute is: at the report of step 15 rank 2 alone is named, a slow model-parallel
    peer. From step 20 rank 3's projection is slow too: at step 25 the whole replica 1 is slow and rank 3 is named.
    Every rank says the same; replica 0 is never named."""
    config = _straggler_config(tmp_path, [{"rank": 2, "step": 10, "steps": 20}, {"rank": 3, "step": 20, "steps": 10}])
    results = run_ranks(_straggler, 4, config, ["--tensor-model-parallel-size", "2"], 31, timeout_s=480)
    assert [(r["replica"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for result in results:
        assert "RowParallelLinear" not in result["timed"] and "VocabParallelEmbedding" not in result["timed"]
        assert "ColumnParallelLinear" in result["timed"]
        assert {step: f["ranks"] for step, f in result["findings"].items()} == {15: [2], 25: [3]}, result["findings"]
        peer, replica = result["findings"][15], result["findings"][25]
        assert peer["kinds"] == {"2": "model-parallel peer"}, peer
        assert "slow model-parallel peer in replica 1: rank 2 (tensor-parallel rank 0" in peer["message"]
        assert "its peers 3 only wait for it" in peer["message"]
        assert replica["kinds"] == {"2": "replica", "3": "replica"}, replica
        assert "slow replica 1 (every rank computes slowly)" in replica["message"]
        assert result["findings"] == results[0]["findings"]


@pytest.mark.timeout(400)
def test_pp2_dp2_straggler_names_a_slow_pipeline_stage_and_not_the_stage_that_waits(tmp_path: Path) -> None:
    """PP=2 x DP=2 (stage 0: ranks 0, 1; stage 1: ranks 2, 3; replica 1: ranks 1, 3). Rank 1's first attention
    layer takes 0.3 s longer from step 10. Stage 0 records no loss (no forward section); its compute is scored
    against the other stage-0 rank: at the report of step 15 rank 1 is named as a slow model-parallel peer of replica
    1, and rank 3, the stage after it, is not (its forward section starts after it received the activations: not a
    candidate, it is counted as the waiting peer)."""
    config = _straggler_config(tmp_path, [{"rank": 1, "step": 10, "steps": 10}])
    results = run_ranks(_straggler, 4, config, ["--pipeline-model-parallel-size", "2"], 16, timeout_s=380)
    assert [(r["replica"], r["stage"]) for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for result in results:
        assert {step: f["ranks"] for step, f in result["findings"].items()} == {15: [1]}, result["findings"]
        (finding,) = result["findings"].values()
        assert finding["kinds"] == {"1": "model-parallel peer"}, finding
        assert "replica 1: rank 1 (tensor-parallel rank 0, pipeline stage 0" in finding["message"]
        assert "its other rank only waits for it" in finding["message"]


# ------------------------------------------------------------------ weight health over TP shards and PP stages

def _weight_health(rank: int, world: int, config: str, layout: list[str]) -> dict[str, Any]:
    """Three steps with weight health every step: the agreed sums per tracked matrix (by name), and this rank's
    reference for the matrices it holds: Σw² before the update and Σg, Σg² of the reduced gradient (main_grad),
    summed over the tensor-parallel shards of a split matrix."""
    from megatron.core import parallel_state

    from arc_engine.monitors.weight_health import GRAD, RANK, WEIGHT

    script, args, state = _build([*SMALL, *layout, "--clip-grad", "0", "--arc-config", config])
    tp_group = parallel_state.get_tensor_model_parallel_group()
    monitor = next(m for m in state.arc.engine.gathering.assembly.monitors if m.name == "weight_health")
    held = [(name, param) for name, param, _ in state.arc.adapter.parts.matrices if param is not None]
    steps = []
    for _ in range(3):
        weights = {name: param.detach().double().square().sum() for name, param in held}
        script.train_step(state, args, state.arc.progress.data_position)
        reference = {}
        for name, param in held:
            grad = param.main_grad.double()
            values = torch.stack([weights[name], torch.tensor(float(param.numel()), dtype=torch.float64),
                                  grad.sum(), grad.square().sum()])
            if getattr(param, "tensor_model_parallel", False):
                torch.distributed.all_reduce(values, group=tp_group)
            reference[name] = values.tolist()
        stats = state.arc.engine.last_stats
        steps.append({"weight": stats.total(WEIGHT).reshape(-1, 3).tolist(),
                      "grad": stats.total(GRAD).reshape(-1, 3).tolist(),
                      "ranked": float(stats.total(RANK).reshape(-1, 2)[:, 1].sum()), "reference": reference})
    labels = monitor.producer.labels
    state.arc.close()
    return {"labels": labels, "steps": steps}


def _check_weight_health(results: list[dict[str, Any]]) -> None:
    labels = results[0]["labels"]
    assert all(r["labels"] == labels for r in results)  # one list of matrices, by name, on every rank
    for step in range(3):
        rows = results[0]["steps"][step]
        assert all(r["steps"][step]["weight"] == rows["weight"] for r in results)  # agreed
        merged: dict[str, list[float]] = {}
        for result in results:
            for name, values in result["steps"][step]["reference"].items():
                assert merged.setdefault(name, values) == pytest.approx(values, rel=1e-9), name  # replicas agree
        assert sorted(merged) == sorted(labels)  # every matrix is held somewhere
        for slot, name in enumerate(labels):
            sq, count, gsum, gsq = merged[name]
            weight, grad = rows["weight"][slot], rows["grad"][slot]
            assert weight[0] == pytest.approx(sq, rel=1e-6) and weight[1] == count, (step, name)
            assert grad[1] == pytest.approx(gsq, rel=1e-5) and grad[2] == count, (step, name)
            assert abs(grad[0] - gsum) <= 1e-5 * math.sqrt(gsq * count), (step, name)  # against Σ|g| scale


@pytest.mark.timeout(500)
def test_weight_health_sums_over_tensor_parallel_shards_and_optimizer_shards(tmp_path: Path) -> None:
    """TP=2 x DP=2, fp32, no clipping: every rank agrees on one list of the model's matrices; the agreed Σw², Σg,
    Σg² and element counts of each equal the sums over its tensor-parallel shards, each element once over the
    data-parallel replicas (the owner's master), the gradient the reduced one; with the DistributedOptimizer (each
    replica holds a shard of every master) the same sums come from the shards. No matrix is whole on a rank, so
    none is rank-measured."""
    config = _arc_yaml(tmp_path / "weights.yaml", "weights", weight_health={"enabled": True, "every": 1})
    plain = run_ranks(_weight_health, 4, config, ["--tensor-model-parallel-size", "2"], timeout_s=240)
    _check_weight_health(plain)
    assert len(plain[0]["labels"]) == 1 + 2 * 4  # the (tied) embedding, 4 matrices per layer
    assert all(step["ranked"] == 0 for step in plain[0]["steps"])  # every matrix split over the TP ranks
    sharded = run_ranks(_weight_health, 4, config, ["--tensor-model-parallel-size", "2",
                                                    "--use-distributed-optimizer"], timeout_s=240)
    assert sharded[0]["labels"] == plain[0]["labels"]
    for result in sharded:  # (main_grad is reduced on each replica's own shard only: compared with the plain run)
        for ours, theirs in zip(result["steps"], plain[0]["steps"], strict=True):
            np.testing.assert_allclose(ours["weight"], theirs["weight"], rtol=1e-6)
            grads, expected = np.array(ours["grad"]), np.array(theirs["grad"])
            np.testing.assert_allclose(grads[:, 1:], expected[:, 1:], rtol=1e-5)
            assert (np.abs(grads[:, 0] - expected[:, 0]) <= 1e-5 * np.sqrt(expected[:, 1] * expected[:, 2])).all()


@pytest.mark.timeout(300)
def test_weight_health_names_the_matrices_of_every_pipeline_stage(tmp_path: Path) -> None:
    """PP=2 x DP=2: stage 0 holds layer 0 and the embeddings, stage 1 layer 1 and the output layer; the list of
    matrices is the union, named by global layer index, and each slot's sums are its stage's. Without tensor
    parallelism every matrix is whole: the first replica of its stage measures the effective ranks (2 per
    measurement)."""
    config = _arc_yaml(tmp_path / "weights.yaml", "weights", weight_health={"enabled": True, "every": 1})
    results = run_ranks(_weight_health, 4, config, ["--pipeline-model-parallel-size", "2"], timeout_s=280)
    _check_weight_health(results)
    labels = results[0]["labels"]
    assert any(name.startswith("layers.0.") for name in labels) and any(name.startswith("layers.1.")
                                                                         for name in labels)
    assert all(step["ranked"] == 2 for step in results[0]["steps"])


# ------------------------------------------------------------------ Fisher and dynamics over TP and optimizer shards

def _fisher(rank: int, world: int, config: str, layout: list[str]) -> dict[str, Any]:
    """Three steps with the Fisher updated and agreed every step: the agreed sums, and the model's element count
    (a tensor-parallel shard counted for all its peers, a duplicate once)."""
    from megatron.core import parallel_state

    from arc_engine.monitors.fisher import FISHER

    script, args, state = _build([*SMALL, *layout, "--clip-grad", "0", "--arc-config", config])
    tp = parallel_state.get_tensor_model_parallel_world_size()
    elements = sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
                   for chunk in state.model for p in chunk.module.parameters())
    sums = []
    for _ in range(4):
        script.train_step(state, args, state.arc.progress.data_position)
        sums.append(state.arc.engine.last_stats.total(FISHER).tolist())
    state.arc.close()
    return {"sums": sums, "elements": elements}


@pytest.mark.timeout(500)
def test_the_fisher_sums_count_every_element_once_over_tensor_and_optimizer_shards(tmp_path: Path) -> None:
    """TP=2 x DP=2, fp32: the agreed element count of the Fisher sums is the model's (each TP shard once, each
    layer norm once although every TP rank holds it, each replica's copy once), with and without the
    DistributedOptimizer; both runs agree on ΣF and ΣF ln F (the same reduced gradients), every rank the same."""
    config = _arc_yaml(tmp_path / "fisher.yaml", "fisher", fisher={"enabled": True, "every": 1})
    plain = run_ranks(_fisher, 4, config, ["--tensor-model-parallel-size", "2"], timeout_s=240)
    sharded = run_ranks(_fisher, 4, config, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
                        timeout_s=240)
    for run in (plain, sharded):
        assert all(r["sums"] == run[0]["sums"] for r in run)
        for step in run[0]["sums"][1:]:  # (the first agreement comes before any F)
            assert step[2] == run[0]["elements"] and step[5] == 4
    for ours, theirs in zip(sharded[0]["sums"][1:], plain[0]["sums"][1:], strict=True):
        assert ours[0] == pytest.approx(theirs[0], rel=1e-5) and ours[1] == pytest.approx(theirs[1], rel=1e-5)


def _dynamics(rank: int, world: int, config: str, layout: list[str]) -> dict[str, Any]:
    """Four steps with the velocity every step: the agreed velocities and the full model's own (each rank sums its
    parameters' squared displacements, a tensor-parallel shard's over its peers)."""
    from megatron.core import parallel_state

    script, args, state = _build([*SMALL, *layout, "--clip-grad", "0", "--arc-config", config])
    tp_group = parallel_state.get_tensor_model_parallel_group()
    params = [p for chunk in state.model for p in chunk.module.parameters()]
    monitor = next(m for m in state.arc.engine.gathering.assembly.monitors if m.name == "dynamics")
    agreed, exact, before = [], [], None
    for step in range(5):
        now = [p.detach().double().clone() for p in params]
        if before is not None:
            total = torch.zeros((), dtype=torch.float64)
            for param, a, b in zip(params, now, before, strict=True):
                moved = (a - b).square().sum()
                if getattr(param, "tensor_model_parallel", False):
                    torch.distributed.all_reduce(moved, group=tp_group)
                total += moved
            exact.append(float(total.sqrt()))
        before = now
        script.train_step(state, args, state.arc.progress.data_position)
        if step:
            agreed.append(monitor.metrics()["velocity"])
    state.arc.close()
    return {"agreed": agreed, "exact": exact}


@pytest.mark.timeout(300)
def test_the_dynamics_velocity_is_the_full_models_over_tensor_and_optimizer_shards(tmp_path: Path) -> None:
    """TP=2 x DP=2 with the DistributedOptimizer: the agreed velocity (each rank's master shard) equals
    ‖θ_t − θ_{t−1}‖ of the whole model, on every rank."""
    config = _arc_yaml(tmp_path / "dynamics.yaml", "dynamics", dynamics={"enabled": True, "every": 1})
    results = run_ranks(_dynamics, 4, config, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
                        timeout_s=240)
    for result in results:
        assert result["agreed"] == results[0]["agreed"] and len(result["agreed"]) == 4
        np.testing.assert_allclose(result["agreed"], result["exact"], rtol=1e-5)


def _curvature(rank: int, world: int, config: str, measure_at: int) -> dict[str, Any]:
    """Data parallelism only (each rank holds the whole model): four steps, a curvature measurement on this rank's
    held micro-batch before step ``measure_at`` through the model as it trains (megatron DDP, Float16Module)."""
    script, args, state = _build([*SMALL, "--arc-config", config])
    inputs, targets = state.data.batch(10_000, state.data_parallel_rank, args.micro_batch_size)
    positions = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
    (model,) = state.model
    results = []
    for step in range(4):
        if step == measure_at:
            results.append(state.arc.measure_curvature(
                lambda: model(inputs, positions, None, labels=targets).float().mean()))
        script.train_step(state, args, state.arc.progress.data_position)
    params = _params(state)
    state.arc.close()
    return {"results": results, "params": params}


@pytest.mark.timeout(300)
def test_curvature_under_megatron_data_parallelism_leaves_training_bitwise(tmp_path: Path) -> None:
    """DP=2: both ranks return the same mean curvature (a positive λ_max) and the parameters after the run are
    bitwise those of a run without the measurement (megatron's gradient buffers untouched)."""
    config = _arc_yaml(tmp_path / "curvature.yaml", "curvature")
    measured = run_ranks(_curvature, 2, config, 2, timeout_s=240)
    plain = run_ranks(_curvature, 2, config, -1, timeout_s=240)
    assert measured[0]["results"] == measured[1]["results"] and len(measured[0]["results"]) == 1
    assert measured[0]["results"][0]["lambda_max"] > 0
    for ours, theirs in zip(measured, plain, strict=True):
        assert torch.equal(ours["params"], theirs["params"])

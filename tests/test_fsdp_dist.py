"""FSDP2 (``fully_shard``) integration on real gloo ranks: statistics against an unsharded reference, bitwise
non-interference, agreed skips that name the rank that produced the NaN, one collective per monitored step."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.fsdp import fully_shard

import arc_engine
from arc_engine.config import ArcConfig
from arc_engine.integrations.pytorch.fsdp import FSDPAdapter, attach_fsdp
from arc_engine.sinks import read_jsonl
from arc_engine.stats import names
from arc_engine.stats.optim_stats import AdamHyper, update_sq_sums
from tests.dist_harness import run_ranks
from tests.training import (
    BATCH,
    EXACT_UPDATE_RMS,
    count_c10d_ops,
    make_config,
    make_optimizer,
    optimizer_steps,
    tiny_model_and_data,
)

pytestmark = pytest.mark.timeout(300)

MAX_NORM = 0.05  # small enough that clipping is active on every step of the tiny GPT
STAT_NAMES = (names.GRAD_SQ, names.WEIGHT_SQ, names.UPDATE_SQ, names.UPDATE_COUNT)


def sharded_gpt(seed: int = 0) -> tuple[torch.nn.Module, Any, torch.optim.Optimizer]:
    """The tiny demo GPT with ``fully_shard`` on each block, then the root (vocab 29: uneven dim-0 shards)."""
    model, data = tiny_model_and_data(seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, data, make_optimizer(model)


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's parameter shards and AdamW state (moments and step count), cloned."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = param.detach().to_local().clone()
        for key, value in optimizer.state.get(param, {}).items():
            out[f"{name}/{key}"] = (value.to_local() if hasattr(value, "to_local") else value).clone()
    return out


def poison_output_grad(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
    """Forward hook: the gradient flowing back into ``output`` becomes NaN (a faulty kernel on one rank)."""
    output.register_hook(lambda grad: grad * float("nan"))


def train_fsdp(rank: int, steps: int, config: ArcConfig | None, *, clip: bool = False, micro_batches: int = 1,
               no_sync: bool = False, corrupt_backward_at: tuple[int, int] | None = None,
               pre_reduce_stats: bool = True) -> dict[str, Any]:
    """Train the sharded GPT for ``steps`` steps; with ``config`` arc_engine is attached. Returns per-step
    local states, decisions and gathered statistics. ``micro_batches``: gradient accumulation with a
    reduce-scatter per micro-batch (FSDP2's default), or only on the last one (``no_sync``).
    ``corrupt_backward_at=(rank, step)``: the gradient flowing into the final layer norm becomes NaN on that
    rank (the loss stays finite)."""
    model, data, optimizer = sharded_gpt()
    arc = attach_fsdp(model, optimizer, config, pre_reduce_stats=pre_reduce_stats) if config is not None else None
    states, decisions, stats = [], [], []
    for step in range(steps):
        handle = None
        if corrupt_backward_at == (rank, step):
            handle = model.ln_f.register_forward_hook(poison_output_grad)
        for micro in range(micro_batches):
            model.set_requires_gradient_sync(not no_sync or micro == micro_batches - 1)
            loss = model(*data.batch(step * micro_batches + micro, rank, BATCH))
            if arc is not None:
                loss = arc.faults.on_loss(loss)
                arc.record_loss(loss)
            (loss / micro_batches).backward()
        if handle is not None:
            handle.remove()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        states.append(local_state(model, optimizer))
        if arc is not None and arc.engine.last_decision is not None:
            decision, gathered = arc.engine.last_decision, arc.engine.last_stats
            decisions.append((decision.step, decision.action.name,
                              [(f.detector, list(f.ranks), f.message) for f in decision.findings]))
            stats.append({"local_sq_rg": gathered.per_rank(names.GRAD_SQ_LOCAL),
                          **{name: gathered.total(name) for name in STAT_NAMES}})
    if arc is not None:
        arc.close()
    return {"states": states, "decisions": decisions, "stats": stats}


# --------------------------------------------------------------------- statistics vs. an unsharded reference

def _train_with_clip(rank: int, world: int, steps: int, config: ArcConfig, micro_batches: int,
                     no_sync: bool) -> dict[str, Any]:
    return train_fsdp(rank, steps, config, clip=True, micro_batches=micro_batches, no_sync=no_sync)


def _sq_by_group(grads_g: list[list[torch.Tensor]]) -> list[float]:
    return [sum(float(t.double().square().sum()) for t in grads) for grads in grads_g]


def _add(a_g: list[list[torch.Tensor]] | None, b_g: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    return b_g if a_g is None else [[x + y for x, y in zip(a, b, strict=True)] for a, b in zip(a_g, b_g, strict=True)]


def reference_stats(world: int, steps: int, micro_batches: int, no_sync: bool) -> list[dict[str, Any]]:
    """The same model, data and seed in one process without FSDP: the gradient is the mean of the ranks'
    accumulated gradients; per step, the pre-clip norms, weight norms, the Adam update about to be applied,
    and each rank's local squared norms of what it handed to each reduce-scatter."""
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    groups = optimizer.param_groups
    out = []
    for step in range(steps):
        local_sq_rg, total_g = np.zeros((world, len(groups))), None
        for rank in range(world):
            rank_g = None
            for micro in range(micro_batches):
                optimizer.zero_grad()
                (model(*data.batch(step * micro_batches + micro, rank, BATCH)) / micro_batches).backward()
                micro_g = [[p.grad.clone() for p in g["params"]] for g in groups]
                local_sq_rg[rank] += 0.0 if no_sync else _sq_by_group(micro_g)
                rank_g = _add(rank_g, micro_g)
            local_sq_rg[rank] += _sq_by_group(rank_g) if no_sync else 0.0
            total_g = _add(total_g, rank_g)
        for group, grads in zip(groups, total_g, strict=True):
            for param, grad in zip(group["params"], grads, strict=True):
                param.grad = grad / world
        expected: dict[str, Any] = {"local_sq_rg": local_sq_rg}
        expected[names.GRAD_SQ] = _sq_by_group([[p.grad for p in g["params"]] for g in groups])
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        expected[names.WEIGHT_SQ] = _sq_by_group([[p.detach() for p in g["params"]] for g in groups])
        rms = []
        for group in groups:
            state = [optimizer.state.get(p, {}) for p in group["params"]]
            update_sq = update_sq_sums(group["params"], [p.grad for p in group["params"]],
                                       [s.get("exp_avg") for s in state], [s.get("exp_avg_sq") for s in state],
                                       int(state[0]["step"]) if state[0] else 0, AdamHyper.from_group(group, True))
            rms.append(math.sqrt(float(update_sq.sum()) / sum(p.numel() for p in group["params"])))
        expected["update_rms"] = rms
        optimizer.step()
        out.append(expected)
    return out


@pytest.mark.parametrize(("micro_batches", "no_sync"), [(1, False), (2, False), (2, True)])
def test_statistics_match_unsharded_reference(tmp_path: Path, micro_batches: int, no_sync: bool) -> None:
    """Pre-clip reduced and per-rank pre-reduction gradient norms, weight norms and Adam update RMS per group,
    with gradient accumulation reduced per micro-batch or once (``set_requires_gradient_sync(False)``)."""
    world, steps = 2, 4
    config = make_config(tmp_path, "stats.optimizer_stats_every=1", EXACT_UPDATE_RMS)
    results = run_ranks(_train_with_clip, world, steps, config, micro_batches, no_sync)
    reference = reference_stats(world, steps, micro_batches, no_sync)
    num_params = sum(p.numel() for p in tiny_model_and_data()[0].parameters())
    assert all(math.sqrt(sum(ref[names.GRAD_SQ])) > 2 * MAX_NORM for ref in reference), "clipping must be active"
    for result in results:
        np.testing.assert_array_equal(result["stats"][-1][names.GRAD_SQ], results[0]["stats"][-1][names.GRAD_SQ])
        for step in (0, steps - 1):
            got, ref = result["stats"][step], reference[step]
            np.testing.assert_allclose(got[names.GRAD_SQ], ref[names.GRAD_SQ], rtol=1e-5)  # pre-clip
            np.testing.assert_allclose(got["local_sq_rg"], ref["local_sq_rg"], rtol=1e-5)  # per rank, pre-reduction
            np.testing.assert_allclose(got[names.WEIGHT_SQ], ref[names.WEIGHT_SQ], rtol=1e-5)
            np.testing.assert_allclose(np.sqrt(got[names.UPDATE_SQ] / got[names.UPDATE_COUNT]), ref["update_rms"],
                                       rtol=1e-4)
            assert got[names.UPDATE_COUNT].sum() == num_params


# --------------------------------------------------------------------- non-interference

def _with_and_without(rank: int, world: int, steps: int, config: ArcConfig) -> list[str]:
    plain = train_fsdp(rank, steps, None)["states"][-1]
    monitored = train_fsdp(rank, steps, config)["states"][-1]
    assert plain.keys() == monitored.keys() and len(plain) > 16
    return [name for name in plain if not torch.equal(plain[name], monitored[name])]


def test_parameters_and_adam_state_bitwise_identical_with_and_without_arc(tmp_path: Path) -> None:
    config = make_config(tmp_path, "stats.optimizer_stats_every=1", EXACT_UPDATE_RMS)
    assert run_ranks(_with_and_without, 2, 4, config) == [[], []]


# --------------------------------------------------------------------- agreed skips

def _train_rank(rank: int, world: int, steps: int, config: ArcConfig,
                corrupt_backward_at: tuple[int, int] | None = None, pre_reduce_stats: bool = True) -> dict[str, Any]:
    return train_fsdp(rank, steps, config, corrupt_backward_at=corrupt_backward_at, pre_reduce_stats=pre_reduce_stats)


def assert_skipped_only(results: list[dict[str, Any]], skip_step: int) -> list[tuple[str, list[int], str]]:
    """Every rank took the same decisions, SKIP only at ``skip_step``; that step changed neither parameters nor
    Adam state; training went on and stayed finite. Returns the skip step's findings."""
    decisions = results[0]["decisions"]
    assert all(r["decisions"] == decisions for r in results), "ranks disagree"
    actions = {step: action for step, action, _ in decisions}
    assert actions.pop(skip_step) == "SKIP" and set(actions.values()) == {"NONE"}
    for result in results:
        before, skipped, after = (result["states"][s] for s in (skip_step - 1, skip_step, skip_step + 1))
        assert all(torch.equal(before[k], skipped[k]) for k in before), "the skipped step changed a shard/state"
        assert not torch.equal(after["ln_f.weight"], skipped["ln_f.weight"]), "training did not continue"
        assert all(torch.isfinite(t).all() for t in result["states"][-1].values())
    return decisions[skip_step][2]


def test_nan_loss_on_one_rank_every_rank_skips(tmp_path: Path) -> None:
    config = make_config(tmp_path, "faults.injections=[{kind: nan_loss, rank: 1, step: 3}]")
    findings = assert_skipped_only(run_ranks(_train_rank, 2, 6, config), 3)
    assert [(detector, ranks) for detector, ranks, _ in findings] == [("non_finite", [1])]
    assert "rank 1 loss+grad (first group 0: decay)" in findings[0][2]
    events = [e for e in read_jsonl(tmp_path / "test" / "events.jsonl") if e["detector"] == "non_finite"]
    assert [(e["step"], e["ranks"]) for e in events] == [(3, [1])]


@pytest.mark.parametrize(("pre_reduce", "named"), [(True, [1]), (False, [0, 1])])
def test_nan_gradient_on_one_rank_names_the_producing_rank(tmp_path: Path, pre_reduce: bool,
                                                          named: list[int]) -> None:
    """A NaN produced in one rank's backward (finite loss) reaches every shard through the reduce-scatter:
    only the pre-reduction statistics (the default) can name the rank that produced it."""
    config = make_config(tmp_path)
    results = run_ranks(_train_rank, 2, 4, config, (1, 2), pre_reduce)
    findings = assert_skipped_only(results, 2)
    assert [(detector, ranks) for detector, ranks, _ in findings] == [("non_finite", named)]
    assert "loss" not in findings[0][2]


# --------------------------------------------------------------------- collectives per step

def _count_collectives(rank: int, world: int, configs: list[tuple[ArcConfig, int]]) -> list[dict[str, int]]:
    out = []
    for config, steps in configs:
        counts = {}
        for label, cfg in (("plain", None), ("arc", config)):
            model, data, optimizer = sharded_gpt()
            arc = arc_engine.attach(model, optimizer, cfg) if cfg is not None else None  # dispatches to FSDP2

            counts[label] = count_c10d_ops(functools.partial(optimizer_steps, model, optimizer, data, arc, rank, steps))
            if arc is not None:
                counts["pipeline"] = arc.engine.gathering.pipeline.collectives
                arc.close()
        out.append(counts)
    return out


def test_one_collective_per_monitored_step(tmp_path: Path) -> None:
    cases = [(1, 3, 3), (3, 4, 2)]  # (interval, steps, monitored steps)
    configs = [(make_config(tmp_path, f"stats.interval={interval}"), steps) for interval, steps, _ in cases]
    for per_case in run_ranks(_count_collectives, 2, configs):
        for (_, _, monitored), counts in zip(cases, per_case, strict=True):
            assert counts["plain"] > 0 and counts["arc"] - counts["plain"] == monitored, counts
            assert counts["pipeline"] == monitored


# --------------------------------------------------------------------- refused set-ups (single process)

def test_gradient_faults_and_unsharded_models_are_refused(tmp_path: Path) -> None:
    model, _ = tiny_model_and_data()
    optimizer = make_optimizer(model)
    with pytest.raises(ValueError, match="nan_grad"):
        FSDPAdapter.check_config(make_config(tmp_path, "faults.injections=[{kind: nan_grad, rank: 0, step: 1}]"))
    with pytest.raises(ValueError, match="must be a DTensor sharded by fully_shard"):
        attach_fsdp(model, optimizer, make_config(tmp_path))


# --------------------------------------------------------------------- one attach path: faults and watchdog

def _stalled(rank: int, world: int, run_dir: Path) -> dict[str, Any]:
    config = make_config(run_dir, "faults.injections=[{kind: stall, rank: 1, step: 8, seconds: 6}]",
                         "watchdog.warmup_steps=3", "watchdog.safety_factor=3", "watchdog.min_timeout_s=1.5",
                         "watchdog.max_timeout_s=3", "watchdog.action=alert")
    model, data, optimizer = sharded_gpt()
    arc = attach_fsdp(model, optimizer, config)
    for step in range(12):
        loss = model(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    fired = list(arc.faults.fired)
    arc.close()
    return {"fired": fired}


def test_a_stall_fault_under_fsdp2_fires_the_watchdog(tmp_path: Path) -> None:
    """The stall fault reaches FSDP2 through the one attach path (it used to be silently ignored there): rank 1
    sleeps 6 s at step 8 and the watchdog of both ranks dumps its stacks. The timeout is clamped to [1.5 s, 3 s],
    so the assertions hold whatever the machine's load makes of the step times."""
    results = run_ranks(_stalled, 2, tmp_path, timeout_s=240)
    assert results[1]["fired"] == [(8, "stall")] and results[0]["fired"] == []
    stacks = sorted(p.name for p in (tmp_path / "test" / "stacks").iterdir())
    assert stacks == ["rank0-iter8.txt", "rank1-iter8.txt"], stacks
    events = read_jsonl(tmp_path / "test" / "events.jsonl")
    assert [e["severity"] for e in events if e["detector"] == "hang"] == ["critical", "info"]


def _hooks_never_run(rank: int, world: int, steps: int, config: ArcConfig, hookless_config: ArcConfig
                     ) -> dict[str, Any]:
    """As compiled autograd runs: no Python tensor hook of arc_engine's fires (their bodies are no-ops here)."""
    from arc_engine.integrations.pytorch import fsdp

    plain = train_fsdp(rank, steps, config)
    fsdp.FSDPGradStats.on_reduced_grad = lambda self, param: None
    fsdp.FSDPGradStats.on_local_grad = lambda self, i, param: None
    hookless = train_fsdp(rank, steps, hookless_config)
    return {"plain": plain["stats"], "hookless": hookless["stats"], "decisions": hookless["decisions"]}


def test_gradients_whose_hooks_never_ran_are_read_at_the_optimizer_step_with_an_event(tmp_path: Path) -> None:
    config, hookless = make_config(tmp_path, "stats.interval=1"), make_config(tmp_path / "hookless", "stats.interval=1")
    for result in run_ranks(_hooks_never_run, 2, 3, config, hookless):
        for plain, hookless in zip(result["plain"], result["hookless"], strict=True):
            np.testing.assert_allclose(hookless[names.GRAD_SQ], plain[names.GRAD_SQ], rtol=1e-6)
            # the local statistics fall back to the reduced shards' norms: every rank's is its shard's
            assert np.all(hookless["local_sq_rg"] > 0) and not np.allclose(hookless["local_sq_rg"],
                                                                           plain["local_sq_rg"])
        assert [action for _, action, _ in result["decisions"]] == ["NONE"] * 3
    assert not [e for e in read_jsonl(tmp_path / "test" / "events.jsonl") if e.get("action") == "hooks_missed"]
    missed = [e for e in read_jsonl(tmp_path / "hookless" / "test" / "events.jsonl")
              if e.get("action") == "hooks_missed"]
    assert missed and missed[0]["severity"] == "warning" and "compiled autograd" in missed[0]["message"], missed


# --------------------------------------------------------------------- bad data: skipped, no quarantine

def test_a_bad_shard_under_fsdp2_is_skipped_naming_its_rank_without_a_quarantine(tmp_path: Path) -> None:
    """Rank 1's tokens all random on steps 60-63: each of those steps is a data finding naming rank 1 and is skipped
    on both ranks (FSDP2's sharded parameters run no tensor hooks before the reduce-scatter, so no quarantine drops
    only rank 1's share); every other step is applied."""
    config = make_config(tmp_path, "faults.injections=[{kind: data_corruption, rank: 1, step: 60, steps: 4, "
                                   "rate: 1.0, seed: 3}]")
    results = run_ranks(_train_rank, 2, 66, config)
    decisions = results[0]["decisions"]
    assert all(r["decisions"] == decisions for r in results)
    data = {step: action for step, action, findings in decisions for detector, ranks, _ in findings
            if detector == "data" and ranks == [1]}
    assert data == dict.fromkeys(range(60, 64), "SKIP"), data
    assert {step for step, action, _ in decisions if action == "SKIP"} == set(range(60, 64))

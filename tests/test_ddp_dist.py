"""DDP + torch.optim integration on real gloo ranks: exact statistics, agreed decisions, bitwise
non-interference, one collective per monitored step."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine.sinks import read_jsonl
from arc_engine.stats import names
from tests.dist_harness import run_ranks
from tests.training import (
    BATCH,
    EXACT_UPDATE_RMS,
    count_c10d_ops,
    make_config,
    make_optimizer,
    optimizer_steps,
    tiny_model_and_data,
    train_ddp,
)

pytestmark = pytest.mark.timeout(300)


# --------------------------------------------------------------------- statistics vs. a reference

def _first_step_stats(rank: int, world: int, run_dir: Path) -> dict:
    model, data = tiny_model_and_data()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets, groups split across them
    optimizer = make_optimizer(model)
    arc = arc_engine.attach(ddp, optimizer, make_config(run_dir, EXACT_UPDATE_RMS))
    inputs, targets = data.batch(0, rank, BATCH)
    loss = ddp(inputs, targets)
    arc.record_loss(loss)
    loss.backward()
    optimizer.step()
    stats = arc.engine.last_stats
    arc.close()
    return {"local_sq_rg": stats.per_rank(names.GRAD_SQ_LOCAL), "global_sq_g": stats.total(names.GRAD_SQ),
            "global_sq_rg": stats.per_rank(names.GRAD_SQ), "update_count_rg": stats.per_rank(names.UPDATE_COUNT),
            "loss_r": stats.per_rank(names.LOSS)[:, 0], "weight_sq_g": stats.total(names.WEIGHT_SQ),
            "update_rms_g": np.sqrt(stats.total(names.UPDATE_SQ) / stats.total(names.UPDATE_COUNT))}


def test_gradient_statistics_match_single_process_reference(tmp_path: Path) -> None:
    world = 2
    results = run_ranks(_first_step_stats, world, tmp_path)
    model, data = tiny_model_and_data()
    groups = make_optimizer(model).param_groups
    per_rank_grads, losses = [], []
    for rank in range(world):
        model.zero_grad()
        loss = model(*data.batch(0, rank, BATCH))
        loss.backward()
        losses.append(float(loss.detach()))
        per_rank_grads.append([[p.grad.clone() for p in g["params"]] for g in groups])
    for result in results:
        np.testing.assert_allclose(result["loss_r"], losses, rtol=1e-6)
        for rank in range(world):
            expected = [sum(float(g.double().square().sum()) for g in grads) for grads in per_rank_grads[rank]]
            np.testing.assert_allclose(result["local_sq_rg"][rank], expected, rtol=1e-5)
        mean_sq = [sum(float(((a + b) / 2).double().square().sum()) for a, b in zip(ga, gb, strict=True))
                   for ga, gb in zip(per_rank_grads[0], per_rank_grads[1], strict=True)]
        np.testing.assert_allclose(result["global_sq_g"], mean_sq, rtol=1e-5)
        np.testing.assert_array_equal(result["local_sq_rg"], results[0]["local_sq_rg"])
        # the replicated statistics are split: each rank computed a part of the reduced norm and of the update
        for slot in ("global_sq_rg", "update_count_rg"):
            per_rank = result[slot].sum(axis=1)
            assert (per_rank > 0).all() and (per_rank < per_rank.sum()).all(), (slot, per_rank)
    # weights before the step, and the update AdamW then applies with the averaged gradient (U = m̂/(√v̂+ε))
    weight_sq = [sum(float(p.detach().double().square().sum()) for p in g["params"]) for g in groups]
    optimizer = make_optimizer(model)
    for gid, group in enumerate(optimizer.param_groups):
        for pid, param in enumerate(group["params"]):
            param.grad = (per_rank_grads[0][gid][pid] + per_rank_grads[1][gid][pid]) / 2
    optimizer.step()
    update_rms = []
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        sq, count = 0.0, 0
        for param in group["params"]:
            state = optimizer.state[param]
            update = (state["exp_avg"] / (1 - beta1)) / ((state["exp_avg_sq"] / (1 - beta2)).sqrt() + group["eps"])
            sq, count = sq + float(update.double().square().sum()), count + param.numel()
        update_rms.append((sq / count) ** 0.5)
    for result in results:
        np.testing.assert_allclose(result["weight_sq_g"], weight_sq, rtol=1e-6)
        np.testing.assert_allclose(result["update_rms_g"], update_rms, rtol=1e-5)


# --------------------------------------------------------------------- agreed decisions

def _train_rank(rank: int, world: int, steps: int, config) -> dict:
    return train_ddp(rank, steps, config)


def test_nan_on_one_rank_every_rank_skips_the_same_step(tmp_path: Path) -> None:
    config = make_config(tmp_path, "faults.injections=[{kind: nan_grad, rank: 1, step: 3, "
                                   "param: blocks.0.ln1.weight}]")
    results = run_ranks(_train_rank, 3, 8, config)
    decisions = results[0]["decisions"]
    assert all(r["decisions"] == decisions for r in results), "ranks disagree"
    by_step = {step: (action, findings) for step, action, findings in decisions}
    assert by_step[3][0] == "SKIP"
    assert by_step[3][1] == [("non_finite", [1])]
    assert all(action == "NONE" for step, (action, _) in by_step.items() if step != 3)
    for result in results:
        snaps = result["snapshots"]
        assert torch.equal(snaps[3], snaps[2]), "the skipped step changed parameters"
        assert not torch.equal(snaps[4], snaps[3])
        assert all(torch.isfinite(p).all() for p in result["params"].values())
        assert result["summary"]["skipped_by_policy"] == 1
    events = read_jsonl(tmp_path / "test" / "events.jsonl")
    nan_events = [e for e in events if e["detector"] == "non_finite"]
    assert len(nan_events) == 1 and nan_events[0]["ranks"] == [1] and nan_events[0]["step"] == 3
    assert nan_events[0]["values"]["first_group_name"] == "no_decay"


def test_persistent_fault_aborts_every_rank_at_the_same_step(tmp_path: Path) -> None:
    config = make_config(tmp_path, "policy.max_consecutive_skips=2",
                         "faults.injections=[{kind: nan_loss, rank: 0, step: 2, steps: 100}]")
    results = run_ranks(_train_rank, 2, 20, config)
    assert [r.get("aborted_at") for r in results] == [4, 4]  # skips at 2 and 3, the third in a row aborts
    assert all(r["exit_code"] == arc_engine.EXIT_ABORT for r in results)
    events = read_jsonl(tmp_path / "test" / "events.jsonl")
    assert any(e["detector"] == "policy" and e["action"] == "abort" for e in events)
    # rank 0's NaN loss beside rank 1's finite one suspects rank 0's batches: bad-data entries in the data ledger
    # (a resumed run skips them again), while the skips counted as ordinary ones (the abort above, at the 3rd)
    ledger = read_jsonl(tmp_path / "test" / "data_ledger.jsonl")
    assert [(e["first"], e["action"], e["bad_data"], e["ranks"]) for e in ledger if e["first"] < 4] == [
        (2, "skip", True, [0]), (3, "skip", True, [0])], ledger
    assert "suspect data: the batch of rank 0" in next(e for e in events if e["detector"] == "non_finite")["message"]


def test_loss_spike_is_skipped_on_every_rank(tmp_path: Path) -> None:
    config = make_config(tmp_path, "detectors.loss_spike.warmup_steps=5",
                         "faults.injections=[{kind: loss_scale, rank: -1, step: 12, scale: 20}]")
    results = run_ranks(_train_rank, 2, 16, config)
    for result in results:
        flagged = [(s, a) for s, a, findings in result["decisions"] if findings]
        assert flagged == [(12, "SKIP")]
        assert torch.equal(result["snapshots"][12], result["snapshots"][11])


# --------------------------------------------------------------------- non-interference

def _with_and_without(rank: int, world: int, steps: int, config) -> bool:
    plain = train_ddp(rank, steps, None)["params"]
    monitored = train_ddp(rank, steps, config)["params"]
    return all(torch.equal(plain[name], monitored[name]) for name in plain)


@pytest.mark.parametrize("world", [2, 3])  # 3: the 1/N scaling must round like DDP's own reducer
def test_parameters_bitwise_identical_with_and_without_arc(tmp_path: Path, world: int) -> None:
    config = make_config(tmp_path, "stats.optimizer_stats_every=1", EXACT_UPDATE_RMS)  # every statistic on every step
    assert run_ranks(_with_and_without, world, 6, config) == [True] * world


# --------------------------------------------------------------------- collectives per step

def _count_collectives(rank: int, world: int, config, steps: int) -> dict:
    counts = {}
    for label, cfg in (("plain", None), ("arc", config)):
        model, data = tiny_model_and_data()
        ddp = DistributedDataParallel(model)
        optimizer = make_optimizer(model)
        arc = arc_engine.attach(ddp, optimizer, cfg) if cfg is not None else None
        counts[label] = count_c10d_ops(functools.partial(optimizer_steps, ddp, optimizer, data, arc, rank, steps))
        if arc is not None:
            counts["pipeline"] = arc.engine.gathering.pipeline.collectives
            counts["host_copies"] = arc.engine.gathering.pipeline.host_copies
            arc.close()
    return counts


@pytest.mark.parametrize(("interval", "steps", "monitored", "extra"),
                         [(1, 4, 4, ""), (3, 7, 3, ""), (1, 4, 4, "detectors.data.sustained_threshold=12")])
def test_one_collective_per_monitored_step(tmp_path: Path, interval: int, steps: int, monitored: int,
                                           extra: str) -> None:
    """Also with the data detector's sustained excess on: its flag rides in the SUM slots."""
    config = make_config(tmp_path, f"stats.interval={interval}", *filter(None, [extra]))
    for counts in run_ranks(_count_collectives, 2, config, steps):
        assert counts["arc"] - counts["plain"] == monitored, counts
        assert counts["pipeline"] == monitored and counts["host_copies"] == monitored


def test_grad_norm_reported_is_pre_clip(tmp_path: Path) -> None:
    results = run_ranks(_train_rank, 2, 3, make_config(tmp_path))
    for result in results:
        assert all(math.isfinite(n) and n > 0 for n in result["grad_norms"])
        assert result["grad_norms"] == results[0]["grad_norms"]


def _clipped_in_place(rank: int, world: int, config) -> dict:
    """DDP with its gradients as views of the buckets (clipping writes the buckets) and many buckets; the loop clips
    to a tiny norm between ``backward()`` and ``step()``."""
    model, data = tiny_model_and_data()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01, gradient_as_bucket_view=True)
    optimizer = make_optimizer(model)
    arc = arc_engine.attach(ddp, optimizer, config)
    pre_clip, clipped, agreed = [], [], []
    for step in range(4):
        inputs, targets = data.batch(step, rank, BATCH)
        loss = ddp(inputs, targets)
        arc.record_loss(loss)
        loss.backward()
        pre_clip.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)))
        clipped.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        agreed.append(math.sqrt(float(arc.engine.last_stats.total(names.GRAD_SQ).sum())))
    buckets = len(str(ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")).split(","))
    arc.close()
    return {"pre_clip": pre_clip, "clipped": clipped, "agreed": agreed, "buckets": buckets}


def test_reduced_norms_are_taken_before_the_loop_clips_the_buckets(tmp_path: Path) -> None:
    """The reduced buckets' norms are taken when the backward ends, so a clip that writes the buckets in place
    (``gradient_as_bucket_view``) before the optimizer step leaves the agreed norm the pre-clip one."""
    for result in run_ranks(_clipped_in_place, 2, make_config(tmp_path, "stats.interval=1")):
        assert result["buckets"] >= 4, result["buckets"]
        for pre, clipped, agreed in zip(result["pre_clip"], result["clipped"], result["agreed"], strict=True):
            assert clipped < 0.01 * pre  # the clip was active
            assert math.isclose(agreed, pre, rel_tol=1e-5), (agreed, pre, clipped)


# --------------------------------------------------------------------- a comm hook of the user's own

def _with_a_users_comm_hook(rank: int, world: int, run_dir: Path) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    calls: list[int] = []

    def counting_fp16_hook(state: object, bucket: torch.distributed.GradBucket) -> torch.futures.Future:
        calls.append(bucket.index())
        return default_hooks.fp16_compress_hook(state, bucket)  # type: ignore[arg-type]

    model, data = tiny_model_and_data()
    reference, _ = tiny_model_and_data()  # the same initial weights
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    plain = DistributedDataParallel(reference, bucket_cap_mb=0.01)
    plain.register_comm_hook(None, default_hooks.fp16_compress_hook)
    optimizer = make_optimizer(model)
    arc = arc_engine.attach(ddp, optimizer, make_config(run_dir), ddp_comm_hook=(counting_fp16_hook, None))
    inputs, targets = data.batch(0, rank, BATCH)
    loss = ddp(inputs, targets)
    arc.record_loss(loss)
    loss.backward()
    plain(inputs, targets).backward()
    same = all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    reduced_sq = sum(float(p.grad.double().square().sum()) for p in model.parameters())
    optimizer.step()
    stats = arc.engine.last_stats
    arc.close()
    refusals = []
    for attach_args in ({"ddp_comm_hook": (counting_fp16_hook, None),
                         "config": make_config(run_dir, "detectors.sdc.enabled=true",
                                               "detectors.sdc.recompute.enabled=true")},
                        {"ddp_comm_hook": counting_fp16_hook, "config": make_config(run_dir)},
                        {"config": make_config(run_dir)}):  # plain already has a hook
        try:
            arc_engine.attach(plain, make_optimizer(reference), **attach_args)
        except ValueError as error:
            refusals.append(str(error))
    return {"same": same, "calls": len(calls), "grad_sq": float(stats.total(names.GRAD_SQ).sum()),
            "reduced_sq": reduced_sq, "refusals": refusals}


def test_a_users_comm_hook_does_the_reduction_bitwise_as_alone_and_unusable_hooks_are_refused(tmp_path: Path) -> None:
    """``attach(..., ddp_comm_hook=(hook, state))``: the user's hook (fp16 compression) reduces every bucket, the
    gradients are bitwise those of DDP with that hook alone, the reduced norm is the one of those gradients; hooks
    that cannot be honoured are refused with a message saying what to do."""
    for result in run_ranks(_with_a_users_comm_hook, 2, tmp_path):
        assert result["same"]  # fp16-rounded: arc_engine's own fp32 mean would not give these gradients
        assert result["calls"] >= 1
        assert result["grad_sq"] == pytest.approx(result["reduced_sq"], rel=1e-5)
        recompute, not_a_pair, already = result["refusals"]
        assert "detectors.sdc.recompute" in recompute
        assert "(hook, state) pair" in not_a_pair
        assert "already has a comm hook" in already

"""DeepSpeed ZeRO-1/2 on real gloo ranks (deepspeed.initialize, CPU accelerator): partition statistics equal an
unsharded reference, decisions are agreed, DeepSpeed's own skipped steps are reported, one collective per step."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from arc_engine.demo.gpt import param_groups
from arc_engine.sinks import read_jsonl
from arc_engine.stats import names
from tests.dist_harness import run_ranks
from tests.training import (
    BATCH,
    EXACT_UPDATE_RMS,
    count_c10d_ops,
    make_config,
    reference_clipped_adamw,
    tiny_model_and_data,
)

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.timeout(300)
CLIP = 0.05  # small enough that clipping is active on every step


def deepspeed_skips_nonfinite_fp32_steps() -> bool:
    """Whether the installed DeepSpeed's ZeRO-1/2 skips a step with a NaN/Inf gradient norm in fp32 itself (0.19.8,
    which checks the norm with ``is_invalid_grad_norm``). Earlier releases (0.18, 0.19.7) check overflow only under
    fp16 (and bf16 when configured) and hand the gradient to the optimizer, where arc_engine's ``non_finite`` rule
    skips the step."""
    from deepspeed.runtime.zero import stage_1_and_2

    return hasattr(stage_1_and_2, "is_invalid_grad_norm")


def zero3_gathers_race_on_gloo() -> bool:
    """Whether the installed DeepSpeed's ZeRO-3 races on gloo: before 0.19.8, ``Init._allgather_params`` waits only
    for the last of its asynchronous all-gathers (on CUDA they complete in order on one stream; gloo's are
    independent, and the CPU accelerator's synchronize does nothing), so a gathered parameter can be used, freed and
    its memory reused while gloo still writes into it. Gradients then pick up garbage at random steps, with or
    without arc_engine (seen on 0.16.9, 0.18.0, 0.18.9, 0.19.0, 0.19.4, 0.19.7; gone with 0.19.8's fix, waiting
    for every handle, applied to 0.18.0). A DeepSpeed defect on CPU ranks; a version gate, as no attribute shows it."""
    import deepspeed

    from arc_engine.compat import release

    return release(str(deepspeed.__version__)) < (0, 19, 8)


def wait_for_zero3_gathers() -> None:
    """A test shim for CPU ranks, called in each rank before a ZeRO-3 engine is built: where
    :func:`zero3_gathers_race_on_gloo`, every asynchronous all-gather of ``deepspeed.comm`` (ZeRO-3's parameter
    gathers) is waited for before it returns, as DeepSpeed 0.19.8 waits for every one; on CPU it costs no overlap.
    Idempotent."""
    if not zero3_gathers_race_on_gloo():
        return
    from deepspeed import comm

    def waiting(original):
        def gather(*args, async_op: bool = False, **kwargs):
            handle = original(*args, async_op=async_op, **kwargs)
            if async_op and handle is not None:
                handle.wait()
            return handle

        gather.waits_for_completion = True
        return gather

    for name in ("all_gather", "all_gather_into_tensor"):
        if not getattr(getattr(comm, name), "waits_for_completion", False):
            setattr(comm, name, waiting(getattr(comm, name)))


def ds_engine(rank: int, world: int, stage: int, clip: float = CLIP, overlap_comm: bool | None = None):
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    import deepspeed

    if stage == 3:
        wait_for_zero3_gathers()
    model, data = tiny_model_and_data()
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    zero = {"stage": stage} if overlap_comm is None else {"stage": stage, "overlap_comm": overlap_comm}
    config = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": zero,
              "gradient_clipping": clip, "steps_per_print": 10_000}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, data


def train(engine, data, arc, rank: int, steps: int, first: int = 0) -> list[dict]:
    out = []
    for step in range(first, first + steps):
        inputs, targets = data.batch(step, rank, BATCH)
        loss = engine(inputs, targets)
        if arc is not None:
            loss = arc.faults.on_loss(loss)
            arc.record_loss(loss)
        engine.backward(loss)
        engine.step()
        record = {"params": torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()]),
                  "applied": engine.was_step_applied(),
                  "arc_applied": None if arc is None else arc.last_step_applied}
        if arc is not None and arc.engine.last_stats is not None and arc.engine.last_decision.step == step:
            stats = arc.engine.last_stats
            record.update(grad_sq=stats.total(names.GRAD_SQ), weight_sq=stats.total(names.WEIGHT_SQ),
                          update_rms=np.sqrt(stats.total(names.UPDATE_SQ) / stats.total(names.UPDATE_COUNT)),
                          ds_norm=float(engine.get_global_grad_norm()), action=arc.engine.last_decision.action.name)
        out.append(record)
    return out


def _stats_rank(rank: int, world: int, stage: int, run_dir: Path) -> list[dict]:
    from arc_engine.integrations.deepspeed import attach_deepspeed

    engine, data = ds_engine(rank, world, stage)
    arc = attach_deepspeed(engine, make_config(run_dir, "stats.optimizer_stats_every=1", EXACT_UPDATE_RMS))
    records = train(engine, data, arc, rank, 1)
    local_sq_rg = arc.engine.last_stats.per_rank(names.GRAD_SQ_LOCAL)
    records += train(engine, data, arc, rank, 2, first=1)
    source = arc.adapter.local_grads.source  # after the steps: a fallback to tensor hooks would show here
    buckets = arc.adapter.capabilities.has("bucket_local_statistics")  # False before DeepSpeed 0.18.3
    arc.close()
    records[0].update(local_sq_rg=local_sq_rg, source=source, buckets=buckets)
    return [{k: v for k, v in r.items() if k != "params"} for r in records]


@pytest.mark.parametrize("stage", [1, 2])
def test_partition_statistics_match_unsharded_reference(tmp_path: Path, stage: int) -> None:
    results = run_ranks(_stats_rank, 2, stage, tmp_path)
    expected, _ = reference_clipped_adamw(2, 3, CLIP)
    for records in results:
        for step, (got, want) in enumerate(zip(records, expected, strict=True)):
            np.testing.assert_allclose(got["grad_sq"], want["grad_sq"], rtol=1e-5, err_msg=f"step {step}")
            np.testing.assert_allclose(got["weight_sq"], want["weight_sq"], rtol=1e-5, err_msg=f"step {step}")
            np.testing.assert_allclose(got["update_rms"], want["update_rms"], rtol=1e-4, err_msg=f"step {step}")
            # our partial sums reproduce DeepSpeed's own pre-clip global norm
            assert float(np.sqrt(np.sum(got["grad_sq"]))) == pytest.approx(got["ds_norm"], rel=1e-5)
            assert np.sqrt(np.sum(got["grad_sq"])) > CLIP  # clipping was active
        assert all(np.array_equal(a["grad_sq"], b["grad_sq"]) for a, b in zip(records, results[0], strict=True))
    # each rank's own gradient before the reduction, read from what DeepSpeed is about to reduce: its buckets
    # (stage 2) or the accumulated gradients before the backward epilogue reduces them (stage 1); on a release
    # without what those are read with, from tensor hooks (one micro-batch per step: the same values)
    model, data = tiny_model_and_data()
    groups = param_groups(model, 0.1)
    local_sq_rg = []
    for rank in range(2):
        model.zero_grad()
        model(*data.batch(0, rank, BATCH)).backward()
        local_sq_rg.append([sum(float(p.grad.double().square().sum()) for p in g["params"]) for g in groups])
    for records in results:
        read = ("buckets" if stage == 2 else "accumulated") if records[0]["buckets"] else "tensor hooks"
        assert records[0]["source"] == read
        np.testing.assert_allclose(records[0]["local_sq_rg"], local_sq_rg, rtol=1e-5)


def master_weights(engine) -> torch.Tensor:
    """This rank's fp32 master partitions (what the optimizer updates) under any ZeRO stage."""
    zero = engine.optimizer
    flats = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
    return torch.cat([f.detach().flatten().clone() for f in flats])


def _bitwise_rank(rank: int, world: int, stage: int, run_dir: Path, overlap_comm: bool | None = None) -> bool:
    import arc_engine

    engine, data = ds_engine(rank, world, stage, overlap_comm=overlap_comm)
    train(engine, data, None, rank, 4)
    plain = master_weights(engine)
    engine, data = ds_engine(rank, world, stage, overlap_comm=overlap_comm)
    arc = arc_engine.attach(engine, None, make_config(run_dir, "stats.optimizer_stats_every=1", EXACT_UPDATE_RMS))
    train(engine, data, arc, rank, 4)
    arc.close()
    return torch.equal(plain, master_weights(engine))


@pytest.mark.parametrize("stage, overlap_comm", [(1, None), (2, None), (2, True), (3, None)],
                         ids=["zero1", "zero2", "zero2-overlap_comm", "zero3"])  # ZeRO-3 overlaps by default
def test_parameters_bitwise_identical_with_and_without_arc(tmp_path: Path, stage: int, overlap_comm: bool | None
                                                           ) -> None:
    assert run_ranks(_bitwise_rank, 2, stage, tmp_path, overlap_comm) == [True, True]


def _faults_rank(rank: int, world: int, run_dir: Path) -> list[dict]:
    from arc_engine.integrations.deepspeed import attach_deepspeed

    engine, data = ds_engine(rank, world, 2)
    config = make_config(run_dir, "detectors.loss_spike.warmup_steps=3",
                         "faults.injections=[{kind: nan_grad, rank: 1, step: 4, param: blocks.0.ln1.weight}, "
                         "{kind: loss_scale, rank: -1, step: 7, scale: 30}]")
    arc = attach_deepspeed(engine, config)
    records = train(engine, data, arc, rank, 10)
    summary = arc.summary()
    arc.close()
    return [{"params": r["params"], "action": r.get("action"), "applied": r["applied"],
             "arc_applied": r["arc_applied"]} for r in records] + [summary]


def test_zero2_nan_and_spike_are_handled_the_same_way_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_faults_rank, 2, tmp_path)
    by_deepspeed = deepspeed_skips_nonfinite_fp32_steps()
    for result in results:
        *records, summary = result
        # step 4: rank 1's NaN gradient makes DeepSpeed skip the step itself (overflow) and arc_engine reports it;
        # where DeepSpeed lets it through (before 0.19.8), arc_engine skips it and DeepSpeed books the step as
        # skipped (was_step_applied() False, no scheduler step): either way nothing is applied
        assert not records[4]["applied"] and torch.equal(records[4]["params"], records[3]["params"])
        # ... and arc_engine has closed that step by the time engine.step() returns
        assert [r["arc_applied"] for r in records[3:6]] == [True, False, True]
        # step 7: a loss spike only arc_engine sees; arc_engine skips it on every rank
        assert records[7]["action"] == "SKIP" and torch.equal(records[7]["params"], records[6]["params"])
        assert not records[7]["applied"] and records[6]["applied"] and records[8]["applied"]
        assert all(torch.isfinite(r["params"]).all() for r in records)
        assert not torch.equal(records[9]["params"], records[7]["params"])  # training went on
        # two steps not applied; the NaN step counts once, as DeepSpeed's where DeepSpeed skipped it itself
        assert summary["steps_not_applied"] == 2 and summary["skipped_by_framework"] == int(by_deepspeed), summary
        assert summary["skipped_by_policy"] == 2 - int(by_deepspeed), summary
        assert [r["action"] for r in records] == [r["action"] for r in results[0][:-1]]
    events = read_jsonl(tmp_path / "test" / "events.jsonl")
    detections = [(e["step"], e["detector"]) for e in events if e["kind"] == "detection"]
    assert detections == [(4, "non_finite"), *([(4, "deepspeed_overflow")] if by_deepspeed else []),
                          (7, "loss_spike")]
    nan_event = next(e for e in events if e["detector"] == "non_finite")
    assert nan_event["ranks"] == [1] and nan_event["values"]["first_group_name"] == "no_decay"


def _explosion_rank(rank: int, world: int, run_dir: Path) -> dict:
    from arc_engine.integrations.deepspeed import attach_deepspeed

    engine, data = ds_engine(rank, world, 2)
    config = make_config(run_dir, "faults.injections=[{kind: grad_scale, rank: 1, step: 30, scale: 100.0}]")
    arc = attach_deepspeed(engine, config)
    records = train(engine, data, arc, rank, 36)
    arc.close()
    events = read_jsonl(run_dir / "test" / "events.jsonl") if rank == 0 else []
    return {"actions": [r.get("action") for r in records], "ds_norms": [r.get("ds_norm") for r in records],
            "unchanged": torch.equal(records[30]["params"], records[29]["params"]),
            "explosions": [(e["step"], e["values"]) for e in events
                           if e["kind"] == "detection" and e["detector"] == "grad_norm"]}


def test_zero2_an_explosion_that_clipping_bounds_is_found_against_the_runs_baseline(tmp_path: Path) -> None:
    """ZeRO-2 with gradient clipping at 1: rank 1's gradient x100 on step 30 (the campaign's gradient_explosion,
    between the rules of thumb's 100 and the fixed 1e4 ceiling). The relative arm finds it on that step only, every
    rank skips it, nothing else is a gradient explosion."""
    results = run_ranks(_explosion_rank, 2, tmp_path)
    assert results[0]["actions"] == results[1]["actions"]
    (step, values), = results[0]["explosions"]
    assert step == 30 and values["relative"] and values["grad_norm"] < 1e4
    assert values["grad_norm"] > 10 * values["baseline"]
    assert results[0]["actions"][30] == "SKIP" and results[0]["unchanged"]


def _collectives_rank(rank: int, world: int, run_dir: Path) -> dict:
    from arc_engine.integrations.deepspeed import attach_deepspeed

    counts = {}
    for label in ("plain", "arc"):
        engine, data = ds_engine(rank, world, 2)
        arc = attach_deepspeed(engine, make_config(run_dir)) if label == "arc" else None
        train(engine, data, arc, rank, 1)  # warm-up outside the profile

        def three_steps(engine=engine, data=data, arc=arc) -> None:
            for step in range(1, 4):
                inputs, targets = data.batch(step, rank, BATCH)
                loss = engine(inputs, targets)
                if arc is not None:
                    arc.record_loss(loss)
                engine.backward(loss)
                engine.step()

        counts[label] = count_c10d_ops(three_steps)
        if arc is not None:
            arc.close()
    return counts


def test_zero2_one_collective_per_monitored_step(tmp_path: Path) -> None:
    for counts in run_ranks(_collectives_rank, 2, tmp_path):
        assert counts["arc"] - counts["plain"] == 3, counts


REPO = Path(__file__).resolve().parents[1]


def test_reference_script_runs_under_the_deepspeed_launcher_with_arc_config(tmp_path: Path) -> None:
    import subprocess
    import sys

    cmd = ["bash", str(REPO / "launch" / "deepspeed.sh"), str(REPO / "scripts" / "train_deepspeed_gpt.py"),
           "--deepspeed_config", str(REPO / "configs" / "ds_zero2.json"), "--arc-config",
           str(REPO / "configs" / "demo.yaml"), "--steps", "90", "--log-every", "45", f"--arc.run.run_dir={tmp_path}"]
    env = dict(os.environ, PYTHON=sys.executable, NUM_GPUS="2", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    by_deepspeed = deepspeed_skips_nonfinite_fp32_steps()  # else arc_engine skips the NaN step (before 0.19.8)
    skip = "deepspeed_overflow -> SKIP" if by_deepspeed else "non_finite -> SKIP"
    assert skip in proc.stdout and "loss_spike -> SKIP" in proc.stdout
    assert f"[train] done: 90 steps, 2 skipped ({int(by_deepspeed)} by DeepSpeed)" in proc.stdout
    events = read_jsonl(tmp_path / "demo" / "events.jsonl")
    # (the straggler family times the ranks: on a loaded machine it may flag one; no assertion on wall-clock values)
    assert [(e["step"], e["detector"], e["ranks"]) for e in events
            if e["kind"] == "detection" and e["detector"] != "straggler"] == [
        (40, "non_finite", [1]), *([(40, "deepspeed_overflow", [])] if by_deepspeed else []),
        (80, "loss_spike", []), (80, "grad_norm", [])]  # the loss x 30 is a gradient x 30: the relative arm

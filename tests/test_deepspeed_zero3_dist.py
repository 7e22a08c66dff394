"""DeepSpeed ZeRO-3 on real gloo ranks (deepspeed.initialize, CPU accelerator): sub-group partition statistics
equal an unsharded reference and DeepSpeed's own norm; a SKIP decided by arc_engine applies nothing on any rank.

Attached through ``arc_engine.attach`` (which dispatches to ``attach_deepspeed`` and :class:`Zero3PartitionStats`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import arc_engine
from arc_engine.config import ArcConfig
from arc_engine.demo.gpt import param_groups
from arc_engine.stats import names
from tests.dist_harness import run_ranks
from tests.training import BATCH, EXACT_UPDATE_RMS, make_config, reference_clipped_adamw, tiny_model_and_data

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.timeout(300)
CLIP = 0.05  # small enough that clipping is active on every step


def ds_engine(rank: int, world: int, sub_group_size: int | None = None) -> tuple[Any, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    import deepspeed

    from tests.test_deepspeed_dist import wait_for_zero3_gathers

    wait_for_zero3_gathers()  # DeepSpeed before 0.19.8 races on gloo otherwise
    model, data = tiny_model_and_data()
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    zero: dict[str, Any] = {"stage": 3}
    if sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    config = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": zero, "gradient_clipping": CLIP,
              "steps_per_print": 1000}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, data


def train(rank: int, world: int, steps: int, config: ArcConfig, sub_group_size: int | None = None) -> dict:
    """Train ``steps`` steps with arc_engine hooked in; per step the decision, gathered statistics and this
    rank's fp32 partitions; at the end the gathered full parameters."""
    engine, data = ds_engine(rank, world, sub_group_size)
    import deepspeed

    arc = arc_engine.attach(engine, None, config)
    out = []
    for step in range(steps):
        inputs, targets = data.batch(step, rank, BATCH)
        loss = arc.faults.on_loss(engine(inputs, targets))
        arc.record_loss(loss)
        engine.backward(loss)
        engine.step()
        decision, stats = arc.engine.last_decision, arc.engine.last_stats
        assert decision is not None and decision.step == step
        partitions = engine.optimizer.fp32_partitioned_groups_flat
        adam_steps = [int(engine.optimizer.optimizer.state[p]["step"]) for p in partitions]
        out.append({"partitions": torch.cat([p.detach().clone() for p in partitions]), "adam_steps": adam_steps,
                    "action": decision.action.name, "grad_sq": stats.total(names.GRAD_SQ),
                    "weight_sq": stats.total(names.WEIGHT_SQ),
                    "update_rms": np.sqrt(stats.total(names.UPDATE_SQ) / stats.total(names.UPDATE_COUNT)),
                    "update_count": stats.total(names.UPDATE_COUNT), "ds_norm": float(engine.get_global_grad_norm()),
                    "num_sub_groups": len(engine.optimizer.fp32_partitioned_groups_flat)})
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        final = torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])
    arc.close()
    padding = any(pad for paddings in engine.optimizer.groups_padding for pad in paddings)
    return {"steps": out, "final": final, "rank": rank, "padding": padding}


def _stats_rank(rank: int, world: int, run_dir: Path, sub_group_size: int | None) -> dict:
    config = make_config(run_dir, "stats.optimizer_stats_every=1", EXACT_UPDATE_RMS)
    return train(rank, world, 3, config, sub_group_size)


@pytest.mark.parametrize(("world", "sub_group_size"), [(2, None), (2, 1000), (3, None)])
def test_partition_statistics_match_unsharded_reference(tmp_path: Path, world: int, sub_group_size: int | None) -> None:
    """Per parameter group, summed over sub-groups and ranks: pre-clip gradient norm, weight norm, Adam update
    RMS at steps 0..2; sub-group 0's final gradient and later sub-groups' raw ones agree. With 3 ranks the last
    rank's partitions hold padding (e.g. 928 = 3 x 310 - 2), which must not count."""
    results = run_ranks(_stats_rank, world, tmp_path, sub_group_size)
    expected, final = reference_clipped_adamw(world, 3, CLIP)
    for result in results:
        records = result["steps"]
        assert result["padding"] == (world == 3 and result["rank"] == world - 1)
        if sub_group_size is not None:
            assert records[0]["num_sub_groups"] > 2  # a group spans several sub-groups
        for step, (got, want) in enumerate(zip(records, expected, strict=True)):
            np.testing.assert_allclose(got["grad_sq"], want["grad_sq"], rtol=1e-5, err_msg=f"step {step}")
            np.testing.assert_allclose(got["weight_sq"], want["weight_sq"], rtol=1e-5, err_msg=f"step {step}")
            np.testing.assert_allclose(got["update_rms"], want["update_rms"], rtol=1e-4, err_msg=f"step {step}")
            np.testing.assert_array_equal(got["update_count"], want["num_params"])
            # our partial sums reproduce DeepSpeed's own pre-clip global norm
            assert float(np.sqrt(np.sum(got["grad_sq"]))) == pytest.approx(got["ds_norm"], rel=1e-5)
            assert np.sqrt(np.sum(got["grad_sq"])) > CLIP  # clipping was active
            assert got["action"] == "NONE"
        torch.testing.assert_close(result["final"], final, rtol=1e-4, atol=1e-6)  # the hooks changed nothing


def _spike_rank(rank: int, world: int, run_dir: Path) -> dict:
    config = make_config(run_dir, "detectors.loss_spike.warmup_steps=3",
                         "faults.injections=[{kind: loss_scale, rank: -1, step: 6, scale: 30}]")
    return train(rank, world, 8, config)


def test_loss_spike_skip_leaves_partitions_unchanged_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_spike_rank, 2, tmp_path)
    for result in results:
        records = result["steps"]
        assert [r["action"] for r in records] == ["NONE"] * 6 + ["SKIP", "NONE"]
        assert torch.equal(records[5]["partitions"], records[6]["partitions"]), "the skipped step applied"
        assert [r["adam_steps"] for r in records] == [[n] * len(records[0]["adam_steps"])
                                                      for n in (1, 2, 3, 4, 5, 6, 6, 7)]
        assert not torch.equal(records[4]["partitions"], records[5]["partitions"])
        assert not torch.equal(records[6]["partitions"], records[7]["partitions"]), "training did not continue"
    torch.testing.assert_close(results[0]["final"], results[1]["final"], rtol=0, atol=0)

"""DeepSpeed ZeRO-3 on real gloo ranks honours the optimizer-statistics settings every other integration honours:
the update RMS on ``detectors.sdc.update_sample`` windows, the weight norms on the ``stats.optimizer_stats_every``
schedule (the SDC rule needs the update RMS on every step, not the weight norms)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from arc_engine.stats import names
from arc_engine.stats.sampling import window_bounds
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.timeout(300)
SAMPLE = 1 / 32
STEPS = 4


def _sampling_rank(rank: int, world: int, run_dir: Path) -> dict:
    """Train a few steps with SDC on and weight norms every 2nd step; per step the gathered optimizer statistics,
    and per parameter group the real (unpadded) partition size of each parameter on this rank."""
    import arc_engine
    from tests.test_deepspeed_zero3_dist import ds_engine

    engine, data = ds_engine(rank, world, sub_group_size=1000)
    config = make_config(run_dir, "detectors.sdc.enabled=true", f"detectors.sdc.update_sample={SAMPLE}",
                         "stats.optimizer_stats_every=2", "detectors.loss_spike.enabled=false")
    arc = arc_engine.attach(engine, None, config)
    steps = []
    for step in range(STEPS):
        loss = engine(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        engine.backward(loss)
        engine.step()
        stats = arc.engine.last_stats
        steps.append({"update_count": stats.total(names.UPDATE_COUNT), "update_sq": stats.total(names.UPDATE_SQ),
                      "weight_sq": stats.total(names.WEIGHT_SQ), "action": arc.engine.last_decision.action.name})
    arc.close()
    zero = engine.optimizer
    sizes: list[list[int]] = [[] for _ in zero.optimizer.param_groups]
    for sub_group, (params, paddings) in enumerate(zip(zero.fp16_groups, zero.groups_padding, strict=True)):
        group_id = int(zero.sub_group_to_group_id[sub_group])
        sizes[group_id] += [param.partition_numel() - pad for param, pad in zip(params, paddings, strict=True)]
    return {"steps": steps, "sizes": sizes, "sub_groups": len(zero.fp16_groups)}


def test_zero3_samples_the_update_and_follows_the_weight_norm_schedule(tmp_path: Path) -> None:
    """Before this was fixed, ZeRO-3 computed the update over every element and the weight norms on every step."""
    results = run_ranks(_sampling_rank, 2, tmp_path)
    num_groups = len(results[0]["sizes"])
    full_g = np.array([sum(sum(r["sizes"][g]) for r in results) for g in range(num_groups)], dtype=float)
    sampled_g = np.array([sum(window_bounds(n, SAMPLE, 0, 0)[1] for r in results for n in r["sizes"][g])
                          for g in range(num_groups)], dtype=float)
    assert results[0]["sub_groups"] > 2  # parameter groups cut into several sub-groups
    assert sampled_g[0] < full_g[0]  # the matrices are sampled (the small vectors of group 1 are taken whole)
    for result in results:
        for step, record in enumerate(result["steps"]):
            np.testing.assert_array_equal(record["update_count"], sampled_g, err_msg=f"step {step}")
            assert np.all(np.isfinite(record["update_sq"])) and np.all(record["update_sq"] > 0)
            assert np.all(record["weight_sq"] > 0) == (step % 2 == 0) and np.any(record["weight_sq"]) == (step % 2 == 0)
            assert record["action"] == "NONE"
        # the same agreed statistics on every rank
        np.testing.assert_array_equal(result["steps"][-1]["update_sq"], results[0]["steps"][-1]["update_sq"])

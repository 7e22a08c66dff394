"""Host work per monitored step constant in the number of tensors, counted as operators on CPU.

:class:`~arc_engine.testing.launches.KernelCounter` counts the operators arc_engine's own code dispatches in a DDP
step (on a GPU, each launches kernels and costs host time). A GPT of 2 and of 8 layers (4 times the tensors, one
DDP bucket each) must cost arc_engine the same operators on every step, with the default configuration and the
update RMS over whole tensors (``update_sample=1``: every weight matrix is then a slice too large to concatenate,
the path whose launches grew with the tensors before). FSDP2 calls arc_engine once per parameter and gradient (its
hooks are per tensor), so there the bound is per tensor: one norm kernel for the local gradient (FSDP frees it after
its reduce-scatter), the reduced shards all at once at the end of the backward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import arc_engine
from arc_engine.config import load_config
from arc_engine.demo.gpt import GPT, GPTConfig, param_groups
from arc_engine.testing.launches import KernelCounter
from tests.dist_harness import run_ranks

WARMUP, STEPS = 3, 12
#: operators a step may differ by between the two sizes (none seen; room for a slot written on one size only)
SLACK = 2


def _count(rank: int, world: int, run_dir: Path, layers: int, sample: float, fsdp: bool = False,
           bucket_mb: float = 100.0) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, num_layers=layers, d_model=128, num_heads=4))
    config = load_config(None, [f"run.run_dir={run_dir / f'{layers}_{sample}_{fsdp}_{bucket_mb}'}",
                                "run.run_id=launches", "sinks.console.enabled=false",
                                f"detectors.sdc.update_sample={sample}"])
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        from arc_engine.integrations.pytorch.fsdp import attach_fsdp

        for block in model.blocks:
            fully_shard(block)
        ddp = fully_shard(model)
        optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4)
        arc = attach_fsdp(ddp, optimizer, config)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4)
        arc = arc_engine.attach(ddp, optimizer, config)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    counter = KernelCounter()

    def step() -> None:
        loss = ddp(tokens, tokens)
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(WARMUP):
        step()
    with counter:
        for index in range(STEPS):
            counter.begin(index)
            step()
    arc.close()
    buckets = len(str(ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")).split(",")) if not fsdp else 0
    return {"tensors": len(list(model.parameters())), "counts": [counter.count(i) for i in range(STEPS)],
            "buckets": buckets,
            "sites": counter.report(list(range(STEPS))).splitlines()}


def test_arc_engine_launches_the_same_operators_for_four_times_the_tensors(tmp_path: Path) -> None:
    small = run_ranks(_count, 1, tmp_path, 2, 1.0)[0]
    large = run_ranks(_count, 1, tmp_path, 8, 1.0)[0]
    assert large["tensors"] >= 3 * small["tensors"]
    assert min(small["counts"]) > 20, small  # the counter sees the statistics' operators at all
    extra = [b - a for a, b in zip(small["counts"], large["counts"], strict=True)]
    assert max(extra) <= SLACK, (extra, sorted(set(large["sites"]) - set(small["sites"]))[:40])


def test_sampled_windows_launch_no_more_than_whole_tensors(tmp_path: Path) -> None:
    """The default sample (one moving window per tensor, concatenated) costs no more operators than whole tensors
    taken by the multi-tensor kernels, on the larger model."""
    whole = run_ranks(_count, 1, tmp_path, 8, 1.0)[0]
    sampled = run_ranks(_count, 1, tmp_path, 8, 1 / 32)[0]
    assert max(sampled["counts"]) <= max(whole["counts"]) + SLACK, (sampled["counts"], whole["counts"])


def test_fsdp2_launches_one_operator_per_tensor(tmp_path: Path) -> None:
    """Per tensor, FSDP2's hooks cost one norm, of the local gradient (a norm per reduced shard, as before the
    end-of-backward callback, or a write per hook would show as a second); on the gradient sketch's steps (the
    consistency family's, periodic) the local gradient's block sums add two more."""
    small = run_ranks(_count, 1, tmp_path, 2, 1 / 32, True)[0]
    large = run_ranks(_count, 1, tmp_path, 8, 1 / 32, True)[0]
    more = large["tensors"] - small["tensors"]
    per_tensor = [(b - a) / more for a, b in zip(small["counts"], large["counts"], strict=True)]
    assert sorted(per_tensor)[len(per_tensor) // 2] <= 1.0 and max(per_tensor) <= 3.0, \
        (per_tensor, sorted(set(large["sites"]) - set(small["sites"]))[:40])


def test_ddp_launches_three_operators_per_bucket(tmp_path: Path) -> None:
    """Per DDP bucket, on the same model: the local gradient's norm (before the in-place reduction), the 1/N
    scaling and the all-reduce. The reduced buckets' norms are one kernel per backward, taken when it ends (a norm
    per bucket in the future's callback, as before, would show as a fourth)."""
    one = run_ranks(_count, 1, tmp_path, 8, 1 / 32, False, 100.0)[0]
    many = run_ranks(_count, 1, tmp_path, 8, 1 / 32, False, 0.05)[0]
    assert one["buckets"] == 1 and many["buckets"] >= 8, (one["buckets"], many["buckets"])
    more = many["buckets"] - one["buckets"]
    per_bucket = [(b - a) / more for a, b in zip(one["counts"], many["counts"], strict=True)]
    assert sorted(per_bucket)[len(per_bucket) // 2] <= 3.0, \
        (per_bucket, sorted(set(many["sites"]) - set(one["sites"]))[:40])

"""DeepSpeed and megatron-core on CUDA (``-m cuda``; skipped without CUDA or without the framework, never required
by CI; run by ``scripts/gpu_check.sh``, which installs both from ``gpu_wheels/``). One GPU, NCCL at world size 1.

Each asserts, on CUDA kernels, what the CPU lanes assert on gloo: the parameters bitwise identical with and without
arc_engine (DeepSpeed ZeRO-2 in bf16 and in fp16 with its dynamic loss scaler, ZeRO-3 in bf16; megatron-core's GPT
in bf16 with the DistributedOptimizer and overlapped gradient reduction and parameter all-gather), the statistics on
the model's CUDA device, and at most one CUDA synchronisation by arc_engine per monitored step and none on the
others (``torch.cuda.set_sync_debug_mode``, attributed to arc_engine's own frames).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config, tiny_model_and_data

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(400),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 6
AGREE = "arc_engine/stats/pipeline.py"


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs {module} (scripts/gpu_wheels.sh ships it to the GPU machine)")


def _sync_problems(run: dict[str, Any]) -> list[str]:
    """The steps where arc_engine synchronised other than once, in the agreement, on a monitored step."""
    problems = []
    for step, sites in run["syncs"].items():
        others = [site for site in sites if not (site.startswith(AGREE) and "(agree)" in site)]
        if others or len(sites) - len(others) > (1 if step in run["monitored"] else 0):
            problems.append(f"step {step}: {sites}")
    return problems


# ------------------------------------------------------------------ DeepSpeed


def _deepspeed(stage: int, precision: str, config: Any, counter: Any = None) -> dict[str, Any]:
    import deepspeed

    from arc_engine.demo.gpt import param_groups
    from arc_engine.integrations.deepspeed import attach_deepspeed

    model, data = tiny_model_and_data()
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    ds_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": stage},
                                 "gradient_clipping": 1.0, "steps_per_print": 10_000}
    if precision == "bf16":
        ds_config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        ds_config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    arc = attach_deepspeed(engine, config) if config is not None else None
    monitored = []
    for step in range(STEPS):
        if counter is not None:
            counter.begin(step)
        inputs, targets = (t.to(engine.device) for t in data.batch(step, 0, BATCH))
        loss = engine(inputs, targets)
        if arc is not None:
            arc.record_loss(loss)
        engine.backward(loss)
        engine.step()
        if arc is not None and arc.engine.last_decision is not None and arc.engine.last_decision.step == step:
            monitored.append(step)
    torch.cuda.synchronize()
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = torch.cat([p.detach().float().flatten().cpu() for p in engine.module.parameters()])
    else:
        params = torch.cat([p.detach().float().flatten().cpu() for p in engine.module.parameters()])
    out = {"params": params, "monitored": monitored}
    if arc is not None:
        out["stats_device"] = str(arc.engine.gathering.pipeline.device)
        arc.close()
    return out


def _deepspeed_rank(rank: int, world: int, run_dir: Path) -> dict[str, Any]:
    from arc_engine.testing.host_syncs import CudaSyncCounter

    os.environ.setdefault("LOCAL_RANK", "0")
    torch.cuda.set_device(0)
    out = {}
    for stage, precision in ((2, "bf16"), (2, "fp16"), (3, "bf16")):
        name = f"zero{stage}_{precision}"
        plain = _deepspeed(stage, precision, None)
        counter = CudaSyncCounter()
        with counter:
            watched = _deepspeed(stage, precision, make_config(run_dir / name, "stats.interval=2"), counter)
        out[name] = {"identical": torch.equal(plain["params"], watched["params"]),
                     "stats_device": watched["stats_device"], "monitored": watched["monitored"],
                     "syncs": {step: counter.by_step.get(step, []) for step in range(STEPS)}}
    return out


def test_deepspeed_zero2_bf16_fp16_and_zero3_bitwise_unchanged_one_sync_per_monitored_step(tmp_path: Path) -> None:
    _needs("deepspeed")
    result = run_ranks(_deepspeed_rank, 1, tmp_path, backend="nccl", timeout_s=360)[0]
    for name, run in result.items():
        assert run["identical"], name
        assert run["stats_device"] == "cuda:0", (name, run["stats_device"])
        assert run["monitored"] == list(range(0, STEPS, 2)), (name, run["monitored"])
        assert not _sync_problems(run), (name, _sync_problems(run))


# ------------------------------------------------------------------ megatron-core


def _megatron_rank(rank: int, world: int, config: str) -> dict[str, Any]:
    from arc_engine.testing.host_syncs import CudaSyncCounter
    from tests.scripts_loader import load_script

    os.environ.setdefault("LOCAL_RANK", "0")
    torch.cuda.set_device(0)
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--use-distributed-optimizer", "--bf16", "--overlap-grad-reduce", "--overlap-param-gather"]
    script = load_script("train_megatron_gpt")

    def build(extra: list[str]) -> tuple[Any, Any]:
        args = script.build_parser().parse_args([*flags, *extra])
        script.initialize(args)
        return args, script.build_model_and_optimizer(args)

    def params(state: Any) -> torch.Tensor:
        torch.cuda.synchronize()
        return torch.cat([p.detach().float().flatten().cpu() for chunk in state.model
                          for p in chunk.module.parameters()])

    args, state = build(["--no-arc"])
    for step in range(STEPS):
        script.train_step(state, args, step)
    reference = params(state)
    args, state = build(["--arc-config", config])
    counter, monitored = CudaSyncCounter(), []
    with counter:
        for step in range(STEPS):
            counter.begin(step)
            script.train_step(state, args, state.arc.progress.data_position)
            decision = state.arc.engine.last_decision
            if decision is not None and decision.step == step:
                monitored.append(step)
    watched = params(state)
    device = state.arc.engine.gathering.pipeline.device
    out = {"identical": torch.equal(reference, watched), "stats_device": str(device),
           "monitored": monitored, "syncs": {step: counter.by_step.get(step, []) for step in range(STEPS)}}
    state.arc.close()
    return out


def test_megatron_gpt_distributed_optimizer_overlapped_bitwise_unchanged_one_sync(tmp_path: Path) -> None:
    _needs("megatron.core")
    config = tmp_path / "arc.yaml"
    config.write_text(f"run: {{run_dir: {tmp_path / 'run'}, run_id: megatron_cuda}}\nstats: {{interval: 2}}\n"
                      "sinks: {console: {enabled: false}}\n")
    result = run_ranks(_megatron_rank, 1, str(config), backend="nccl", timeout_s=360)[0]
    assert result["identical"]
    assert result["stats_device"] == "cuda:0", result["stats_device"]
    assert result["monitored"] == list(range(0, STEPS, 2)), result["monitored"]
    assert not _sync_problems(result), _sync_problems(result)

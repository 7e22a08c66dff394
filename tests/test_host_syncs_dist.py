"""One host synchronisation per monitored step, none on the others: counted on real gloo ranks for DDP, FSDP2,
DeepSpeed ZeRO-1/2/3 and megatron-core (dense with tensor parallelism, MoE with expert parallelism), with the
default configuration and with every family on.

:class:`~arc_engine.testing.host_syncs.HostSyncCounter` records each host read (``item``, ``tolist``, ``bool``,
``.cpu()``, ``nonzero``, a boolean mask...) made by arc_engine's own code. The one expected read is the agreed
statistics' copy to the host (``StatPipeline.agree``). Periodic work is counted apart: at most one read per
family on the steps it is due -- the straggler family's fixed-size follow-up reduction (every
``detectors.straggler.every`` monitored steps; more only when a rank is slow) and the QK spectra's summaries
(every ``detectors.qk_spectra.every`` steps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import arc_engine
from arc_engine.testing.host_syncs import HostSyncCounter
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data

pytestmark = pytest.mark.timeout(420)

STEPS = 8  # no step builds a tensor from host data on the device (see check)
AGREE = "arc_engine/stats/pipeline.py"
#: periodic host reads: a call-site fragment -> (the family's period in steps, here, every step monitored)
PERIODIC = {"(_follow_up)": 4, "arc_engine/monitors/qk_spectra.py": 2}
#: every family that runs on a plain data-parallel model, on; every step monitored
EVERY_FAMILY = ("stats.interval=1", "detectors.weight_health.enabled=true", "detectors.weight_health.every=2",
                "detectors.dynamics.enabled=true", "detectors.dynamics.every=2", "detectors.conformal.enabled=true",
                "detectors.fisher.enabled=true", "detectors.fisher.every=2", "detectors.consistency.direction_every=2",
                "detectors.straggler.every=4")
DEFAULT = ("stats.interval=2",)


def check(counter: HostSyncCounter, monitored: list[int], steps: int) -> list[str]:
    """Every rule the counts break, as lines naming the step and the call sites (empty: all kept)."""
    problems = []
    for step in range(steps):
        sites = counter.by_step.get(step, [])
        agree = [site for site in sites if site.startswith(AGREE) and "(agree)" in site]
        periodic = {fragment: [site for site in sites if fragment in site] for fragment in PERIODIC}
        other = [site for site in sites if site not in agree and not any(f in site for f in PERIODIC)]
        late = [site for fragment, hits in periodic.items() for site in hits
                if len(hits) > 1 or step % PERIODIC[fragment] or step not in monitored]
        expected = 1 if step in monitored else 0
        if len(agree) != expected or other or late:
            problems.append(f"step {step} ({'monitored' if step in monitored else 'not monitored'}): "
                            f"{len(agree)} agreed-statistics copies, other host reads: {other}, periodic reads "
                            f"off their steps or repeated: {late}")
        # not even the first steps' caches (an index made once per bucket: host_to_device, pinned and non-blocking
        # on CUDA); a periodic family's copy goes with its read, on its steps
        copies = [site for site in counter.copies_by_step.get(step, [])
                  if not any(f in site and step % PERIODIC[f] == 0 and step in monitored for f in PERIODIC)]
        if copies:
            problems.append(f"step {step}: tensors built from host data on the device: {copies}")
    return problems


def counted_loop(arc: arc_engine.Arc, steps: int, one_step: Any) -> list[str]:
    """Run ``one_step(step)`` ``steps`` times under a counter; the broken rules (see :func:`check`)."""
    counter, monitored = HostSyncCounter(), []
    with counter:
        for step in range(steps):
            counter.begin(step)
            one_step(step)
            decision = arc.engine.last_decision
            if decision is not None and decision.step == step:
                monitored.append(step)
    assert monitored, "no step was monitored"
    return check(counter, monitored, steps)


def _torch_native(rank: int, world: int, run_dir: Path) -> dict[str, list[str]]:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from arc_engine.integrations.pytorch.fsdp import attach_fsdp

    out = {}
    for name, overrides in (("default", DEFAULT), ("every_family", EVERY_FAMILY)):
        model, data = tiny_model_and_data()
        ddp = DistributedDataParallel(model)
        optimizer = make_optimizer(model)
        arc = arc_engine.attach(ddp, optimizer, make_config(run_dir / f"ddp_{name}", *overrides))
        out[f"ddp/{name}"] = counted_loop(arc, STEPS, _plain_step(ddp, optimizer, data, arc, rank))
        arc.close()

        model, data = tiny_model_and_data()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = make_optimizer(model)
        arc = attach_fsdp(model, optimizer, make_config(run_dir / f"fsdp_{name}", *overrides))
        out[f"fsdp2/{name}"] = counted_loop(arc, STEPS, _plain_step(model, optimizer, data, arc, rank))
        arc.close()
    return out


def _plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: Any, arc: arc_engine.Arc,
                rank: int) -> Any:
    def one_step(step: int) -> None:
        loss = model(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return one_step


def test_ddp_and_fsdp2_read_the_host_once_per_monitored_step(tmp_path: Path) -> None:
    for per_rank in run_ranks(_torch_native, 2, tmp_path):
        assert per_rank == {key: [] for key in per_rank}, per_rank


def _deepspeed(rank: int, world: int, run_dir: Path) -> dict[str, list[str]]:
    from arc_engine.integrations.deepspeed import attach_deepspeed
    from tests.test_deepspeed_dist import ds_engine

    out = {}
    for stage in (1, 2, 3):
        for name, overrides in (("default", DEFAULT), ("every_family", EVERY_FAMILY)):
            engine, data = ds_engine(rank, world, stage)
            arc = attach_deepspeed(engine, make_config(run_dir / f"z{stage}_{name}", *overrides))

            def one_step(step: int, engine: Any = engine, data: Any = data, arc: arc_engine.Arc = arc) -> None:
                loss = engine(*data.batch(step, rank, BATCH))
                arc.record_loss(loss)
                engine.backward(loss)
                engine.step()

            out[f"zero{stage}/{name}"] = counted_loop(arc, STEPS, one_step)
            arc.close()
            engine.destroy()
    return out


def test_deepspeed_zero_1_2_3_read_the_host_once_per_monitored_step(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    for per_rank in run_ranks(_deepspeed, 2, tmp_path, timeout_s=400):
        assert per_rank == {key: [] for key in per_rank}, per_rank


def _megatron(rank: int, world: int, run_dir: Path) -> dict[str, list[str]]:
    import yaml

    from tests.test_megatron_dist import SMALL, _build

    layouts = {"tp2": [*SMALL, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"],
               "moe_ep2": [*SMALL, "--expert-model-parallel-size", "2", "--num-experts", "4",
                           "--use-distributed-optimizer"]}
    families = {"default": {"stats": {"interval": 2}},
                "every_family": {"stats": {"interval": 1},
                                 "detectors": {"qk_spectra": {"every": 2, "warmup_measurements": 3},
                                               "router": {"every": 2, "warmup_measurements": 3},
                                               "weight_health": {"enabled": True, "every": 2},
                                               "straggler": {"every": 4}}}}
    out = {}
    for layout, flags in layouts.items():
        for name, settings in families.items():
            config = run_dir / f"{layout}_{name}.yaml"
            if rank == 0:
                config.write_text(yaml.safe_dump({"run": {"run_id": f"{layout}_{name}", "run_dir": str(run_dir)},
                                                  "sinks": {"console": {"enabled": False}}, **settings}))
            torch.distributed.barrier()
            script, args, state = _build([*flags, "--arc-config", str(config)])

            def one_step(step: int, script: Any = script, args: Any = args, state: Any = state) -> None:
                script.train_step(state, args, state.arc.progress.data_position)

            out[f"{layout}/{name}"] = counted_loop(state.arc, STEPS, one_step)
            state.arc.close()
            from megatron.core import parallel_state
            parallel_state.destroy_model_parallel()
    return out


def test_megatron_dense_and_moe_read_the_host_once_per_monitored_step(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    for per_rank in run_ranks(_megatron, 2, tmp_path, timeout_s=400):
        assert per_rank == {key: [] for key in per_rank}, per_rank


def test_the_counter_sees_arc_engines_reads_and_not_the_loops() -> None:
    """The harness itself: a read in arc_engine's code is counted on its step, with its call site; the loop's own
    reads and arc_engine code that reads nothing are not."""
    from arc_engine.monitors.spectra import spectral_summary, spectral_summary_t

    counter = HostSyncCounter()
    sigma = torch.tensor([3.0, 1.0])
    with counter:
        counter.begin(0)
        float(sigma.sum())                 # the loop's own read
        spectral_summary_t(sigma)          # arc code, device-side only
        counter.begin(1)
        spectral_summary(sigma)            # arc code that reads the host: one .tolist()
    assert counter.count(0) == 0
    assert counter.count(1) == 1 and "arc_engine/monitors/spectra.py" in counter.by_step[1][0], counter.report()


def test_statistics_come_to_the_buffers_device_and_follow_the_models_device() -> None:
    """Values are moved to the buffer's device and dtype on the way in (so ``stats.device: cpu`` takes a CUDA loss;
    the CUDA half is in tests/test_cuda_paths.py), and the device choice honours ``cpu`` and needs NCCL for CUDA."""
    from arc_engine.stats import Reduce, StatBuffer, StatLayout, model_device, stats_device

    layout = StatLayout()
    layout.add("loss", 1, Reduce.SUM)
    layout.add("norms", 2, Reduce.SUM)
    layout.freeze()
    buffer = StatBuffer(layout, torch.device("cpu"))
    buffer.add("loss", torch.tensor(2.5, dtype=torch.bfloat16))
    buffer.index_add("norms", torch.tensor([1, 1]), torch.tensor([1.0, 2.0]))
    assert buffer.values.tolist() == [2.5, 0.0, 3.0]
    assert stats_device(None, "cpu", torch.device("cuda", 3)) == torch.device("cpu")
    assert stats_device(None, "auto", torch.device("cuda", 3)) == torch.device("cpu")  # no NCCL group here
    assert model_device([torch.zeros(1)]) == torch.device("cpu") and model_device([]) is None

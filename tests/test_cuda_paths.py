"""arc_engine's own CUDA paths (``-m cuda``; skipped without CUDA, never required by CI; run by
``scripts/gpu_check.sh``). One GPU: NCCL at world size 1 for DDP and FSDP2, two ranks sharing the GPU over gloo for
the multi-rank paths (NCCL refuses two ranks on one device).

Each asserts what the CPU tests cannot: parameters bitwise identical with and without arc_engine on CUDA kernels;
at most one CUDA synchronisation by arc_engine per monitored step and none on the others, as the device reports them
(``torch.cuda.set_sync_debug_mode``); the statistics on the model's CUDA device under NCCL and a CUDA loss taken by
a CPU (gloo) buffer; a NaN skipped on every rank; a rollback restored from CUDA snapshots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import arc_engine
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(400),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 8
AGREE = "arc_engine/stats/pipeline.py"


def _train(rank: int, wrap: str, config: Any, steps: int, counter: Any = None) -> dict[str, Any]:
    """The tiny GPT on cuda:0 under ``wrap`` (``ddp`` or ``fsdp2``), with arc_engine when ``config`` is given."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from arc_engine.integrations.pytorch.fsdp import attach_fsdp

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    model, data = tiny_model_and_data()
    model = model.to(device)
    if wrap == "ddp":
        model = DistributedDataParallel(model, device_ids=[0])
        optimizer = make_optimizer(model.module)
        arc = arc_engine.attach(model, optimizer, config) if config is not None else None
    else:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = make_optimizer(model)
        arc = attach_fsdp(model, optimizer, config) if config is not None else None
    monitored, actions, grad_errors = [], [], []
    for step in range(steps):
        if counter is not None:
            counter.begin(step)
        inputs, targets = (t.to(device) for t in data.batch(step, rank, BATCH))
        loss = model(inputs, targets)
        if arc is not None:
            loss = arc.faults.on_loss(loss)
            arc.record_loss(loss)
        loss.backward()
        # the reduced gradient's squared norm as the optimizer will see it (FSDP2: its hooks ran on the
        # post-reduce stream; the agreed value must be complete, not a stale or partial read)
        grad_sq = sum(float((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).double().square().sum())
                      for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if arc is not None and arc.engine.last_decision is not None and arc.engine.last_decision.step == step:
            monitored.append(step)
            actions.append(arc.engine.last_decision.action.name)
            agreed = float(arc.engine.last_stats.total("grad_sq").sum())
            grad_errors.append(abs(agreed - grad_sq) / grad_sq if grad_sq else agreed)
    torch.cuda.synchronize()
    params = torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().flatten().cpu()
                        for p in model.parameters()])
    out = {"params": params, "monitored": monitored, "actions": actions, "grad_errors": grad_errors}
    if arc is not None:
        out["stats_device"] = str(arc.engine.gathering.pipeline.device)
        out["rollbacks"] = arc.progress.rolled_back
        arc.close()
    return out


def _nccl_one_rank(rank: int, world: int, run_dir: Path) -> dict[str, Any]:
    from arc_engine.testing.host_syncs import CudaSyncCounter

    out = {}
    for wrap in ("ddp", "fsdp2"):
        plain = _train(rank, wrap, None, STEPS)
        counter = CudaSyncCounter()
        with counter:
            watched = _train(rank, wrap, make_config(run_dir / wrap, "stats.interval=2"), STEPS, counter)
        syncs = {step: counter.by_step.get(step, []) for step in range(STEPS)}
        out[wrap] = {"identical": torch.equal(plain["params"], watched["params"]),
                     "monitored": watched["monitored"], "stats_device": watched["stats_device"], "syncs": syncs,
                     "grad_errors": watched["grad_errors"]}
    return out


def test_nccl_ddp_and_fsdp2_bitwise_unchanged_one_sync_per_monitored_step(tmp_path: Path) -> None:
    result = run_ranks(_nccl_one_rank, 1, tmp_path, backend="nccl", timeout_s=300)[0]
    for wrap, run in result.items():
        assert run["identical"], wrap
        assert run["stats_device"] == "cuda:0", run
        # the agreed reduced-gradient norm is the one the optimizer saw (single precision per parameter)
        assert run["grad_errors"] and max(run["grad_errors"]) < 1e-5, (wrap, run["grad_errors"])
        for step, sites in run["syncs"].items():
            others = [site for site in sites if not (site.startswith(AGREE) and "(agree)" in site)]
            expected = 1 if step in run["monitored"] else 0
            assert len(sites) - len(others) <= expected and not others, (wrap, step, sites)


def _gloo_two_ranks(rank: int, world: int, run_dir: Path) -> dict[str, Any]:
    nan = "faults.injections=[{kind: nan_loss, rank: 1, step: 3}]"
    skipped = _train(rank, "ddp", make_config(run_dir / "skip", "stats.interval=1", nan), 6)
    on_cpu = _train(rank, "ddp", make_config(run_dir / "cpu", "stats.interval=1", "stats.device=cpu"), 3)
    rollback = _train(rank, "ddp", make_config(
        run_dir / "rollback", "stats.interval=1", "recovery.enabled=true", "recovery.checkpoint_freq=2",
        "policy.max_consecutive_skips=1", "policy.on_persistent_failure=rollback",
        "faults.injections=[{kind: nan_loss, rank: 1, step: 5}, {kind: nan_loss, rank: 1, step: 6}]"), 10)
    return {"skip_actions": skipped["actions"], "skip_finite": bool(torch.isfinite(skipped["params"]).all()),
            "cpu_device": on_cpu["stats_device"], "cpu_monitored": on_cpu["monitored"],
            "rollbacks": rollback["rollbacks"],
            "rollback_finite": bool(torch.isfinite(rollback["params"]).all())}


def test_two_ranks_on_one_gpu_over_gloo_skip_roll_back_and_take_cuda_losses(tmp_path: Path) -> None:
    results = run_ranks(_gloo_two_ranks, 2, tmp_path, timeout_s=300)
    assert results[0]["skip_actions"] == results[1]["skip_actions"]
    assert results[0]["skip_actions"][3] == "SKIP" and results[0]["skip_finite"], results[0]
    for result in results:
        assert result["cpu_device"] == "cpu" and result["cpu_monitored"] == [0, 1, 2], result
        assert result["rollbacks"] and result["rollback_finite"], result


# ------------------------------------------------------------------ one process, no process group


def test_snapshot_copies_are_ordered_before_the_update_that_follows_at_once() -> None:
    """A snapshot's device-to-host copies run on a side stream; the optimizer's update is queued right after
    (``Snapshot.fence``: a device-side wait, no host sync). Large tensors make the copies long, so an update that
    did not wait for them would land in the host copies: the copies must equal the state before the update, bit for
    bit, and no CUDA synchronisation is made by the capture."""
    from arc_engine.recovery.snapshot import capture
    from arc_engine.recovery.state import TorchTrainState
    from arc_engine.testing.host_syncs import CudaSyncCounter

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(4))).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = torch.randn(256, 4096, device="cuda")

    def step() -> None:
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # optimizer state exists
    state = TorchTrainState(model, optimizer)
    before = [t.clone() for t in state.live_tensors()]  # on the current stream, ordered before the capture
    counter = CudaSyncCounter()
    with counter:
        counter.begin(0)
        snapshot = capture(1, state)
        snapshot.fence()
        step()  # writes every parameter and moment right away
    assert snapshot.copied, "a CUDA snapshot records its copies' events"
    assert not counter.by_step.get(0), counter.by_step
    snapshot.wait()
    for saved, reference in zip(snapshot.tensors, before, strict=True):
        assert torch.equal(saved, reference.cpu())
    assert not all(torch.equal(live, ref) for live, ref in zip(state.live_tensors(), before, strict=True))


def test_the_section_clock_times_with_cuda_events_read_without_a_sync() -> None:
    """The forward section and the iteration measured by CUDA events, read a step late once complete (NaN
    before): no synchronisation by arc_engine, and the times those of the GPU's work (a second of matrix
    products is not a microsecond)."""
    from arc_engine.stats.timing import SectionClock
    from arc_engine.testing.host_syncs import CudaSyncCounter

    clock = SectionClock(torch.device("cuda", 0))
    a = torch.randn(4096, 4096, device="cuda")
    counter = CudaSyncCounter()
    with counter:
        counter.begin(0)
        for _ in range(2):
            clock.start()
            for _ in range(20):
                a = (a @ a).tanh()
            clock.loss()
            for _ in range(20):
                a = (a @ a).tanh()
        clock.start()
        unread = clock.times()
    assert not counter.by_step.get(0), counter.by_step
    torch.cuda.synchronize()  # the test's own: the events are complete
    forward, iteration = clock.times()
    assert 0.0 < forward < iteration, (forward, iteration)
    assert all(t != t or t > 0 for t in unread)  # NaN (not complete yet) or a real time, never a sync


def test_host_to_device_copies_behind_queued_work_without_a_sync() -> None:
    """The caches' index tensors (``grad_stats.host_to_device``): made while the device is busy, with no
    synchronisation, and right once the queued work is done."""
    from arc_engine.stats.grad_stats import host_to_device
    from arc_engine.testing.host_syncs import CudaSyncCounter

    a = torch.randn(4096, 4096, device="cuda")
    counter = CudaSyncCounter()
    with counter:
        counter.begin(0)
        for _ in range(20):
            a = (a @ a).tanh()
        index = host_to_device([3, 1, 2], torch.long, torch.device("cuda", 0))
        picked = torch.arange(10, device="cuda").index_select(0, index)
    assert not counter.by_step.get(0), counter.by_step
    assert index.dtype == torch.long and index.is_cuda
    assert picked.tolist() == [3, 1, 2]


def test_nvml_polls_this_gpu_and_counts_nothing_on_a_healthy_one() -> None:
    """The R-Metric's hardware events: NVML finds the GPU by its PCI address and a poll of a healthy GPU counts
    no event (skipped without nvidia-ml-py)."""
    pytest.importorskip("pynvml")
    from arc_engine.monitors.hardware_events import HardwareEvents

    events = HardwareEvents(torch.device("cuda", 0), True)
    assert events.active
    assert events.poll() == 0 and events.poll() == 0
    assert events.active  # no NVML error turned it off

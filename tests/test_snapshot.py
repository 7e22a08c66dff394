"""Host-memory snapshots: a restore is bitwise (in place), and training resumed from it retraces the original run;
the recovery state machine's transitions."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from arc_engine.config.schema import RecoveryConfig
from arc_engine.events import Action, Finding, Severity
from arc_engine.policy import EXIT_RECOVERY_EXHAUSTED, Decision
from arc_engine.recovery import RecoveryController, RecoveryState, SnapshotRing, TorchTrainState, capture, restore
from arc_engine.recovery.snapshot import ring_capacity
from arc_engine.recovery.state import TrainState
from tests.training import BATCH, make_optimizer, tiny_model_and_data


def step_once(model, optimizer, data, step: int) -> None:
    """A step that draws from every RNG (dropout-like noise from torch, numpy and Python)."""
    inputs, targets = data.batch(step, 0, BATCH)
    loss = model(inputs, targets) * (1 + 0.01 * torch.rand(()) + 0.01 * np.random.rand() + 0.01 * random.random())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def test_restore_is_bitwise_and_the_continuation_retraces_the_run() -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    state = TorchTrainState(model, optimizer, scheduler)
    for step in range(3):
        step_once(model, optimizer, data, step)
        scheduler.step()
    snapshot = capture(3, state, extra={"data_position": 3})
    lr_at_snapshot = optimizer.param_groups[0]["lr"]
    params_at_snapshot = flat_params(model)
    adam_at_snapshot = {k: {n: t.clone() for n, t in v.items()} for k, v in optimizer.state_dict()["state"].items()}
    live_ptrs = [t.data_ptr() for t in state.live_tensors()]
    for step in range(3, 6):
        step_once(model, optimizer, data, step)
        scheduler.step()
    trajectory = flat_params(model)
    assert not torch.equal(trajectory, params_at_snapshot)
    assert optimizer.param_groups[0]["lr"] != lr_at_snapshot

    extra = restore(snapshot, state)
    assert extra == {"data_position": 3}
    assert [t.data_ptr() for t in state.live_tensors()] == live_ptrs  # in place: every alias sees the old values
    assert torch.equal(flat_params(model), params_at_snapshot)
    assert optimizer.param_groups[0]["lr"] == lr_at_snapshot and scheduler.last_epoch == 3
    for key, adam in optimizer.state_dict()["state"].items():
        assert all(torch.equal(adam[n], adam_at_snapshot[key][n]) for n in adam)
    for step in range(3, 6):  # same data, same RNG draws, same schedule: the same parameters, bit for bit
        step_once(model, optimizer, data, step)
        scheduler.step()
    assert torch.equal(flat_params(model), trajectory)
    # the snapshot survives its own restore and can be used again
    restore(snapshot, state)
    assert torch.equal(flat_params(model), params_at_snapshot)


def test_snapshot_is_independent_of_live_tensors() -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    step_once(model, optimizer, data, 0)
    snapshot = capture(1, TorchTrainState(model, optimizer))
    kept = [t.clone() for t in snapshot.tensors]
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    assert all(torch.equal(a, b) for a, b in zip(snapshot.tensors, kept, strict=True))
    assert snapshot.nbytes >= sum(p.numel() * 4 for p in model.parameters()) * 3  # weights + two Adam moments


def test_restore_refuses_a_state_of_another_structure() -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    snapshot = capture(0, TorchTrainState(model, optimizer))  # before the first step: no Adam state yet
    step_once(model, optimizer, data, 0)
    with pytest.raises(RuntimeError, match="cannot restore the snapshot of step 0"):
        restore(snapshot, TorchTrainState(model, optimizer))


def test_ring_is_bounded_and_keeps_the_newest() -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    state = TorchTrainState(model, optimizer)
    step_once(model, optimizer, data, 0)
    size = capture(0, state).nbytes
    ring = SnapshotRing(ring_capacity(size * 2.5, size))
    for step in range(5):
        assert ring.push(capture(step, state))
    assert ring.steps == [3, 4] and ring.total_bytes <= size * 2.5
    assert ring.latest().step == 4
    assert SnapshotRing(ring_capacity(size - 1, size)).push(capture(9, state)) is False
    with pytest.raises(ValueError):
        SnapshotRing(-1)


def test_captures_reuse_the_host_buffers_of_evicted_snapshots() -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    state = TorchTrainState(model, optimizer)
    step_once(model, optimizer, data, 0)
    ring = SnapshotRing(2)
    buffers_seen = set()
    for step in range(1, 8):
        step_once(model, optimizer, data, step)
        snapshot = capture(step, state, into=ring.spare_buffers())
        assert all(torch.equal(a, b) for a, b in zip(snapshot.tensors, state.live_tensors(), strict=True))
        buffers_seen.add(snapshot.tensors[0].data_ptr())
        assert ring.push(snapshot)
    assert len(buffers_seen) == 3  # two held by the ring, one evicted and reused, round and round
    assert ring.steps == [6, 7]
    # a spare set whose shapes no longer match is not used
    foreign = [torch.zeros(1)]
    assert capture(8, state, into=foreign).tensors[0] is not foreign[0]


def test_a_snapshot_for_the_disk_tier_only_copies_no_tensor_and_cannot_be_restored() -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    state = TorchTrainState(model, optimizer)
    step_once(model, optimizer, data, 0)
    snapshot = capture(1, state, extra={"data_position": 1}, tensors=False)
    assert snapshot.tensors == [] and snapshot.nbytes == 0 and snapshot.extra == {"data_position": 1}
    assert SnapshotRing(0).push(snapshot) is False
    with pytest.raises(RuntimeError, match="holds no tensors"):
        restore(snapshot, state)


# ------------------------------------------------------------------ the ARC state machine (pure)

def rollback(step: int, *, from_policy: bool = False) -> Decision:
    detector = "policy" if from_policy else "loss_spike"
    return Decision(step, Action.ROLLBACK, (Finding(detector, Action.ROLLBACK, Severity.ERROR, "bad"),))


def test_rollbacks_then_escapes_then_a_distinct_abort() -> None:
    controller = RecoveryController(RecoveryConfig(enabled=True, max_consecutive_rollbacks=2, max_escapes=1,
                                                   lr_reduction_factor=0.5))
    outcomes = []
    for step in range(10):
        decision = controller.resolve(rollback(step), has_target=True)
        outcomes.append("abort" if decision.action == Action.ABORT else "escape" if decision.escape else "rollback")
        if decision.action == Action.ABORT:
            assert decision.exit_code == EXIT_RECOVERY_EXHAUSTED
            assert "recovery exhausted" in decision.findings[-1].message
            break
        controller.on_rollback(decision)
    assert outcomes == ["rollback", "rollback", "escape", "rollback", "rollback", "abort"]
    assert controller.state is RecoveryState.RECOVERING


def test_learning_rate_heals_and_returns_to_schedule() -> None:
    controller = RecoveryController(RecoveryConfig(enabled=True, lr_reduction_factor=0.5, lr_recovery_steps=4,
                                                   checkpoint_freq=2))
    assert controller.lr_factor == 1.0
    controller.on_rollback(controller.resolve(rollback(5), has_target=True))
    controller.on_rollback(controller.resolve(rollback(5), has_target=True))
    assert controller.lr_factor == 0.25  # compounding over consecutive rollbacks
    due = [controller.on_healthy_step() for _ in range(4)]
    assert due == [False, True, False, True]  # a snapshot every checkpoint_freq healthy steps
    assert controller.lr_factor == 1.0 and controller.state is RecoveryState.TRAINING
    restored = RecoveryController(controller.config)
    restored.load_state_dict(controller.state_dict())
    assert restored.state_dict() == controller.state_dict()


def test_a_new_verified_state_resets_consecutive_rollbacks() -> None:
    controller = RecoveryController(RecoveryConfig(enabled=True, max_consecutive_rollbacks=1))
    controller.on_rollback(controller.resolve(rollback(1), has_target=True))
    assert controller.resolve(rollback(2), has_target=True).escape
    controller.on_verified()
    assert not controller.resolve(rollback(3), has_target=True).escape


def test_no_target_yet_skips_but_an_escalated_failure_stops() -> None:
    controller = RecoveryController(RecoveryConfig(enabled=True))
    assert controller.resolve(rollback(1), has_target=False).action == Action.SKIP
    assert controller.resolve(rollback(1, from_policy=True), has_target=False).action == Action.ABORT


class _NativeFormatState(TrainState):
    """A train state whose backend brings its own checkpoint format (as megatron-core's does)."""

    def native_disk_format(self) -> object:
        from types import SimpleNamespace

        return SimpleNamespace(name="megatron")


@pytest.mark.parametrize(("wanted", "state", "expected"), [
    ("auto", "native", "megatron"), ("dcp", "native", None), ("megatron", "native", "megatron"),
    ("auto", "plain", None), ("dcp", "plain", None), ("megatron", "plain", ValueError)])
def test_checkpoint_format_selection(wanted: str, state: str, expected: object) -> None:
    from types import SimpleNamespace

    from arc_engine.config.schema import CheckpointConfig
    from arc_engine.recovery.rollback import Recovery

    engine = SimpleNamespace(config=SimpleNamespace(recovery=RecoveryConfig(
        enabled=True, checkpoint=CheckpointConfig(format=wanted))))
    model, _ = tiny_model_and_data()
    train_state = _NativeFormatState() if state == "native" else TorchTrainState(model, make_optimizer(model))
    recovery = Recovery(engine, train_state)  # type: ignore[arg-type]
    if expected is ValueError:
        with pytest.raises(ValueError, match="format: megatron is not available for TorchTrainState"):
            recovery._disk_format()
    else:
        chosen = recovery._disk_format()
        assert (chosen.name if chosen is not None else None) == expected


def test_an_unknown_checkpoint_format_is_a_config_error() -> None:
    from arc_engine.config.errors import ConfigError
    from arc_engine.config.schema import CheckpointConfig

    with pytest.raises(ConfigError, match="format"):
        CheckpointConfig(format="torch_dist")


def test_with_the_memory_tier_off_snapshots_copy_no_tensors_and_disk_saves_still_commit(tmp_path) -> None:
    import arc_engine
    from tests.training import make_config

    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    config = make_config(tmp_path, "recovery.enabled=true", "recovery.checkpoint_freq=2",
                         "recovery.memory_ring_mb=0", "recovery.checkpoint.every_steps=2")
    candidates = []
    with arc_engine.attach(model, optimizer, config) as arc:
        for _ in range(7):
            loss = model(*data.batch(arc.progress.data_position, 0, BATCH))
            arc.record_loss(loss)
            if arc.engine.recovery.candidate is not None:
                candidates.append(arc.engine.recovery.candidate)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert arc.engine.recovery.ring.capacity == 0
        arc.engine.recovery.checkpoints.wait(60)
        committed = [info.step for info in arc.engine.recovery.checkpoints.committed()]
    assert len(candidates) >= 3 and all(not c.has_tensors and c.tensors == [] for c in candidates)
    assert committed[-2:] == [4, 6]


def test_a_disk_save_of_the_verified_state_writes_the_snapshots_copies_and_the_ring_keeps_them_while_it_runs() -> None:
    """``from_snapshot`` swaps every live tensor of the DCP state dict for the snapshot's host copy (a view that is not
    a whole live tensor stays), ``HostStager`` passes such stable tensors through uncopied, and a busy snapshot's
    buffers are never handed to the next capture."""
    from arc_engine.recovery.snapshot import from_snapshot
    from arc_engine.recovery.staging import HostStager

    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    state = TorchTrainState(model, optimizer)
    step_once(model, optimizer, data, 0)
    snapshot = capture(1, state)
    train = state.dcp_state_dict()
    train["extra_view"] = next(iter(model.parameters())).detach()[:1]  # part of a live tensor: no copy of its own
    swapped, used = from_snapshot(train, state.live_tensors(), snapshot.tensors)
    assert len(used) == len(state.live_tensors())
    copies = {id(t) for t in snapshot.tensors}
    leaves = [v for v in swapped["model"].values()] + [
        v for s in swapped["optim"]["state"].values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    assert leaves and all(id(t) in copies for t in leaves)
    assert swapped["extra_view"] is train["extra_view"]
    stager = HostStager()
    staged = stager.stage(swapped, stable=frozenset(id(t) for t in used))
    assert all(staged["model"][k] is swapped["model"][k] for k in swapped["model"])
    assert stager.nbytes == train["extra_view"].numel() * 4 + sum(  # only what is not a snapshot copy is copied
        v.numel() * v.element_size() for s in swapped["optim"]["state"].values() for v in s.values()
        if isinstance(v, torch.Tensor) and id(v) not in copies)
    busy = {id(snapshot)}
    ring = SnapshotRing(1, busy=lambda s: id(s) in busy)
    ring.push(snapshot)
    ring.push(capture(2, state, into=ring.spare_buffers()))  # evicts the busy snapshot
    assert ring.spare_buffers() is None  # its buffers were not kept for reuse
    busy.clear()
    ring.push(capture(3, state, into=ring.spare_buffers()))
    assert ring.spare_buffers() is not None


def test_disk_saves_from_the_memory_tier_stage_nothing_and_load_back_the_verified_state(tmp_path) -> None:
    """With the memory ring on, each disk checkpoint writes the verified snapshot's host copies (no tensor staged
    again on this single rank); resuming from it gives the snapshot's tensors bitwise."""
    import arc_engine
    from tests.training import make_config

    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    config = make_config(tmp_path, "recovery.enabled=true", "recovery.checkpoint_freq=2",
                         "recovery.checkpoint.every_steps=4")
    with arc_engine.attach(model, optimizer, config) as arc:
        recovery = arc.engine.recovery
        staged = []
        for _ in range(9):
            loss = model(*data.batch(arc.progress.data_position, 0, BATCH))
            arc.record_loss(loss)
            loss.backward()
            saves = recovery.disk_saves
            optimizer.step()
            optimizer.zero_grad()
            if recovery.disk_saves > saves:
                staged.append(recovery.checkpoints.last_staged_bytes)
                source = recovery._disk_source()
        recovery.checkpoints.wait(60)
        last = recovery.checkpoints.committed()[-1]
    assert len(staged) >= 2 and all(nbytes == 0 for nbytes in staged)
    assert source is not None and last.step == source.step
    model2, _ = tiny_model_and_data()
    optimizer2 = make_optimizer(model2)
    resume = make_config(tmp_path, "recovery.enabled=true", "recovery.checkpoint.resume=true")
    with arc_engine.attach(model2, optimizer2, resume) as arc2:
        live = TorchTrainState(model2, optimizer2).live_tensors()
        assert arc2.engine.progress.step == source.step
        assert len(live) == len(source.tensors)
        assert all(torch.equal(a, b) for a, b in zip(live, source.tensors, strict=True))


def test_only_the_module_buffers_are_copied_before_the_forward_on_cuda() -> None:
    """The CUDA capture copies what the forward may write (module buffers: running statistics) on the current
    stream and the rest on a side stream: ``forward_written`` names exactly the buffers of ``live_tensors``; a
    state without it gets every tensor copied before the forward. On CPU a snapshot's fence and wait are no-ops."""
    from arc_engine.recovery.snapshot import _forward_written

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    state = TorchTrainState(model, optimizer)
    live = state.live_tensors()
    written = _forward_written(state, len(live))
    buffers = {id(b) for b in model.buffers()}
    assert written == {i for i, t in enumerate(live) if any(t is b or t.data_ptr() == b.data_ptr()
                                                            for b in model.buffers())}
    assert len(written) == len(buffers) == 3  # running mean, running var, batches tracked

    class Bare(TrainState):
        def live_tensors(self):
            return live

    assert _forward_written(Bare(), len(live)) == set(range(len(live)))
    snapshot = capture(1, state)
    assert snapshot.copied is None
    snapshot.fence()
    snapshot.wait()


def test_deepspeed_and_megatron_states_name_their_module_buffers_as_what_the_forward_writes() -> None:
    """A CUDA snapshot copies only these ahead of the forward (the rest on a side stream after the update is
    fenced): without ``forward_written`` every copy would be queued before the forward on the compute stream."""
    from types import SimpleNamespace

    from arc_engine.integrations.deepspeed.state import Zero3TrainState, ZeroTrainState
    from arc_engine.integrations.megatron.state import MegatronTrainState

    module = torch.nn.BatchNorm1d(3)  # parameters: weight, bias; buffers: running mean, running var, batch count
    partitions = [("fp32_0", torch.zeros(6)), ("state_0_exp_avg", torch.zeros(6))]
    for kind, buffers in ((ZeroTrainState, [2, 3, 4]), (Zero3TrainState, [0, 1, 2])):
        state = object.__new__(kind)
        state.ds_engine = SimpleNamespace(module=module)
        state._partition_state = lambda: partitions
        live = state.live_tensors()
        assert state.forward_written() == buffers, kind
        assert [live[i].data_ptr() for i in buffers] == [b.data_ptr() for b in module.buffers()]
    megatron = object.__new__(MegatronTrainState)
    megatron.chunks, megatron.members = [torch.nn.Sequential(module)], []
    assert megatron.forward_written() == [2, 3, 4]


def test_the_rings_default_budget_is_sized_from_the_state_and_a_state_that_does_not_fit_is_an_event(tmp_path) -> None:
    import arc_engine
    from arc_engine.recovery.snapshot import ring_budget_bytes
    from arc_engine.sinks import read_jsonl
    from tests.training import make_config, optimizer_steps

    gib = 2**30
    assert ring_budget_bytes(None, 3 * gib, 0, 8) == 6 * gib  # two snapshots when the host's memory is unknown
    assert ring_budget_bytes(None, 3 * gib, 512 * gib, 8) == 6 * gib  # 16 GB per rank allowed: two fit
    assert ring_budget_bytes(None, 30 * gib, 512 * gib, 8) == 16 * gib  # capped at a quarter of the host's share
    assert ring_budget_bytes(64.0, 3 * gib, 512 * gib, 8) == 64 * 2**20  # a configured budget is the budget
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    auto = make_config(tmp_path, "recovery.enabled=true", "recovery.checkpoint_freq=1")
    with arc_engine.attach(model, optimizer, auto) as arc:
        optimizer_steps(model, optimizer, data, arc, 0, 3)
        assert arc.engine.recovery.ring.capacity == 2  # sized at the first snapshot: room for two
    tight = make_config(tmp_path / "tight", "recovery.enabled=true", "recovery.checkpoint_freq=1",
                        "recovery.memory_ring_mb=0.01")
    with arc_engine.attach(model, optimizer, tight) as arc:
        optimizer_steps(model, optimizer, data, arc, 0, 3)
        assert arc.engine.recovery.ring.capacity == 0
    off = [e for e in read_jsonl(tmp_path / "tight" / "test" / "events.jsonl") if e.get("action") == "memory_ring_off"]
    assert len(off) == 1 and off[0]["severity"] == "warning" and "does not fit" in off[0]["message"], off

"""Bad data, found and localized (``detectors.data``), the policy's own bound for its skips, and the data ledger:
simulated ranks for the rule, 2 real DDP ranks with a corrupted shard for the whole path (detection, the bad rank
named, the run surviving, the ledger, a rerun honouring it, the exports)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from arc_engine.cli import main as cli
from arc_engine.config import load_config
from arc_engine.data_ledger import DataLedger, megatron_iterations, read_ledger, skip_batches
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.bad_data import BadDataFamily, BadDataMonitor
from arc_engine.monitors.family import FamilyContext, StepView, section_of
from arc_engine.policy import DecisionPolicy
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, StatLayout, names
from tests.dist_harness import run_ranks
from tests.training import family_stats_layout, make_config, train_ddp

# ------------------------------------------------------------------ the rule on simulated ranks


def _family(*overrides: str) -> tuple[StatLayout, list[BadDataMonitor]]:
    """The family's layout and one monitor per simulated rank (each with its own rank)."""
    config = load_config(None, list(overrides))
    ctx = FamilyContext(config, section_of(config, BadDataFamily()), ["g0"], Reduce.SUM)
    layout = family_stats_layout(BadDataFamily().statistics(ctx), 1)
    return layout, [BadDataMonitor(section_of(config, BadDataFamily()), rank) for rank in range(4)]


def _rows(layout: StatLayout, monitors: list[BadDataMonitor], losses: list[float], step: int) -> np.ndarray:
    """Each simulated rank's buffer (its loss, its monitor's writes) as one row."""
    rows = []
    for monitor, loss in zip(monitors, losses, strict=True):
        buffer = StatBuffer(layout, torch.device("cpu"))
        buffer.reset()
        buffer.put(names.LOSS, loss)
        buffer.put(names.LOSS_COUNT, 1.0)
        buffer.put(names.LOSS_RANKS, 1.0)
        monitor.write(buffer, StepView(step))
        rows.append(buffer.values.numpy().copy())
    return np.stack(rows)


def _agree(layout: StatLayout, monitors: list[BadDataMonitor], losses: list[float], step: int) -> AgreedStats:
    return AgreedStats.from_rows(layout, _rows(layout, monitors, losses, step))


def test_a_rank_whose_loss_parts_from_its_peers_is_named_on_that_step_under_a_falling_loss() -> None:
    """4 ranks, the loss falling from 5 to 2 (a decaying schedule) with per-rank noise: no alarm in 300 clean
    steps; rank 2's loss 40% above its peers' on one step: a bad_data finding naming rank 2, on that step only, and
    the spread never enters the baseline."""
    layout, monitors = _family()
    rng = np.random.default_rng(0)
    for step in range(300):
        level = 2.0 + 3.0 * math.exp(-step / 60)
        losses = list(level + 0.05 * rng.standard_normal(4))
        if step == 250:
            losses[2] = 1.4 * level
        stats = _agree(layout, monitors, losses, step)
        found = [f for m in monitors for f in m.evaluate(step, stats)]
        for monitor in monitors:
            monitor.commit(step, applied=not found)
        if step != 250:
            assert not found, (step, found[0].message)
            continue
        assert len(found) == 4 and {f.ranks for f in found} == {(2,)}
        (finding, *_) = found
        assert finding.bad_data and finding.action is Action.SKIP and "rank 2's loss" in finding.message
        assert finding.values["rank_loss"] == pytest.approx(losses[2], rel=1e-6)
        assert finding.values["peers_loss"] == pytest.approx(np.mean(losses[:2] + losses[3:]), rel=1e-5)
    assert max(monitors[0].history) < 0.2  # the alarm's spread stayed out


def test_a_spread_without_a_standing_out_rank_is_found_but_names_no_rank() -> None:
    """Two ranks high and two low by the same amount: the spread alarms; no rank is at min_excess above its peers'
    mean once the others are averaged (a balanced split): the finding names none."""
    layout, monitors = _family("detectors.data.min_excess=0.5")
    rng = np.random.default_rng(1)
    for step in range(40):
        stats = _agree(layout, monitors, list(3.0 + 0.02 * rng.standard_normal(4)), step)
        for monitor in monitors:  # every rank's monitor: the shared shift moves alike
            assert monitor.evaluate(step, stats) == []
            monitor.commit(step, True)
    (finding,) = monitors[0].evaluate(40, _agree(layout, monitors, [3.6, 2.4, 3.6, 2.4], 40))
    assert finding.ranks == () and "no single rank" in finding.message


def _gap_run(fault: tuple[int, int, float] | None, *overrides: str, steps: int = 2000,
             seed: int = 3) -> list[tuple[int, Finding]]:
    """2 simulated ranks whose losses differ by the nature of their data (rank 0 0.6 above rank 1, the gap drifting
    slowly, as code against prose) with heavy-tailed batch noise (Student's t, 3 degrees of freedom, scale 0.2), the
    loss falling; ``fault`` = (first step, rank, excess) for 50 steps. Each rank evaluates with its own row. Returns
    rank 0's findings by step (every rank finds the same)."""
    layout, monitors = _family(*overrides)
    monitors = monitors[:2]
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        level = 2.0 + 3.0 * math.exp(-step / 500)
        gap = 0.3 * (1 + 0.3 * math.sin(step / 700))
        noise = rng.standard_t(3, 2) / math.sqrt(3.0)
        losses = [level + gap + 0.2 * noise[0], level - gap + 0.2 * noise[1]]
        if fault is not None and fault[0] <= step < fault[0] + 50:
            losses[fault[1]] += fault[2]
        rows = _rows(layout, monitors, losses, step)
        found = [monitor.evaluate(step, AgreedStats.from_rows(layout, rows, my_row=rank))
                 for rank, monitor in enumerate(monitors)]
        assert [[(f.action, f.ranks) for f in fs] for fs in found[1:]] == [[(f.action, f.ranks) for f in found[0]]]
        for monitor in monitors:
            monitor.commit(step, applied=not found[0])
        out += [(step, f) for f in found[0]]
    return out


def test_a_bad_shard_that_lasts_is_named_where_the_ranks_losses_differ_by_their_data() -> None:
    """Per-rank data of different kinds and heavy-tailed batches (what real text gave: the spread rule's limit grew
    past a corrupted rank's deviation): no finding in 1,500 clean steps; rank 1's loss 0.6 above its own level for
    50 steps from step 1,500 (3 noise scales, no single step out of the ordinary) is named by the sustained excess
    within 12 steps, on every rank alike, and no longer once its loss rejoined. With the sum off (the default) the
    spread rule alone finds nothing."""
    found = _gap_run((1500, 1, 0.6), "detectors.data.sustained_threshold=12")
    steps = [step for step, _ in found]
    assert steps and 1500 < steps[0] <= 1512 and steps[-1] <= 1558, steps
    first = found[0][1]
    assert first.ranks == (1,) and first.bad_data and first.action is Action.SKIP
    assert first.values["sustained"] > 12 and "rank 1's loss has stood above" in first.message
    assert _gap_run((1500, 1, 0.6)) == []  # off by default


def test_the_sustained_excess_is_each_ranks_own_state() -> None:
    """A monitor restored from its own state keeps its sum and level; from another rank's (a checkpoint's shared
    copy) it starts again, and warms up before it reports anything."""
    layout, monitors = _family("detectors.data.sustained_threshold=12")
    for step in range(30):
        rows = _rows(layout, monitors[:2], [3.0 + 0.01 * (step % 3), 2.0], step)
        for rank, monitor in enumerate(monitors[:2]):
            monitor.evaluate(step, AgreedStats.from_rows(layout, rows, my_row=rank))
            monitor.commit(step, True)
    zero, one = monitors[0].sustained, monitors[1].sustained
    assert zero.count == one.count == 30 and zero.level == pytest.approx(0.5, abs=0.01) and zero.warm
    assert one.level == pytest.approx(-0.5, abs=0.01)
    config = section_of(load_config(None, ["detectors.data.sustained_threshold=12"]), BadDataFamily())
    restored, other = BadDataMonitor(config, 1), BadDataMonitor(config, 1)
    restored.load_state_dict(monitors[1].state_dict())
    other.load_state_dict(monitors[0].state_dict())
    assert restored.sustained.state_dict(1) == one.state_dict(1)
    assert other.sustained.count == 0 and not other.sustained.warm and other.sustained.value() == 0.0


# ------------------------------------------------------------------ the policy's bound for data skips


def _data_skip(step: int) -> list[Finding]:
    return [Finding("data", Action.SKIP, Severity.WARNING, "bad data", ranks=(1,), bad_data=True),
            Finding("loss_spike", Action.SKIP, Severity.WARNING, "spike")]


def test_data_skips_count_apart_and_escalate_only_when_the_bad_data_does_not_end() -> None:
    config = load_config(None, ["policy.max_consecutive_skips=2", "policy.max_consecutive_data_skips=6",
                                "policy.on_persistent_failure=abort"])
    policy = DecisionPolicy(config.policy)
    for step in range(6):  # past max_consecutive_skips: still skips, counted as data skips
        decision = policy.decide(step, _data_skip(step))
        assert decision.action is Action.SKIP and decision.data
        policy.commit(decision)
    assert policy.consecutive_skips == 0 and policy.consecutive_data_skips == 6 and policy.skipped_steps == 6
    decision = policy.decide(6, _data_skip(6))
    assert decision.action is Action.ABORT
    assert "7 consecutive steps would be skipped for bad data (rank 1)" in decision.findings[-1].message
    assert "the bad data does not end" in decision.findings[-1].message
    # an applied step ends the run of data skips; a plain skip still has its own bound
    policy.commit(policy.decide(7, []))
    assert policy.consecutive_data_skips == 0
    spike = [Finding("loss_spike", Action.SKIP, Severity.WARNING, "spike")]
    for step in (8, 9):
        policy.commit(policy.decide(step, spike))
    assert policy.decide(10, spike).action is Action.ABORT


# ------------------------------------------------------------------ the ledger


def test_the_ledger_merges_honours_and_exports(tmp_path: Path) -> None:
    ledger = DataLedger()
    ledger.open(tmp_path / "data_ledger.jsonl")
    ledger.record(first=7, step=7, iteration=7, action="skip", bad_data=True, ranks=[1], detectors=["data"],
                  reason="bad data")
    ledger.record(first=8, step=8, iteration=8, action="skip", detectors=["loss_spike"], reason="spike")
    ledger.record(first=3, last=6, step=8, iteration=9, action="not_replayed", reason="rolled back")
    ledger.record(first=9, step=9, iteration=10, action="warn", bad_data=True, ranks=[0], reason="observed")
    assert ledger.bad(7)["ranks"] == [1] and ledger.bad(8) is None and ledger.bad(9) is None  # skips of bad data only
    entries = read_ledger(tmp_path / "data_ledger.jsonl")
    assert [e["first"] for e in entries] == [7, 8, 3, 9]
    other = DataLedger()
    assert other.merge(entries) == 4 and other.merge(entries) == 0  # merging is idempotent
    other.load_state_dict(ledger.state_dict())
    assert len(other.entries) == 4
    assert megatron_iterations(entries) == [8]
    assert skip_batches(entries) == {"skip_batches": [7], "ranks": {"7": [1]}}
    (tmp_path / "bad.jsonl").write_text('{"first": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        read_ledger(tmp_path / "bad.jsonl")


def test_an_unwritable_ledger_keeps_its_entries_in_memory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    ledger = DataLedger()
    ledger.open(blocker / "data_ledger.jsonl")  # a directory that cannot exist
    for step in (1, 2):
        ledger.record(first=step, step=step, iteration=step, action="skip", bad_data=True)
    assert ledger.bad_positions() == [1, 2]
    assert sum("cannot be written" in r.getMessage() for r in caplog.records) == 1


# ------------------------------------------------------------------ the whole path on 2 DDP ranks

FAULT = "faults.injections=[{kind: data_corruption, rank: 1, step: 120, steps: 12, rate: 1.0, seed: 3}]"


def _run(rank: int, world: int, run_dir: Path, fault: bool) -> dict:
    config = make_config(run_dir, *((FAULT,) if fault else ()))
    return train_ddp(rank, 150, config)


def test_a_corrupted_shard_is_quarantined_naming_its_rank_and_a_rerun_honours_the_ledger(tmp_path: Path) -> None:
    """Default settings (recovery off). Clean: no data finding in 150 steps. Rank 1's tokens all random on steps
    120-131: step 120 is skipped with a data finding naming rank 1 and its data position, on both ranks alike; steps
    121-131 are applied without rank 1's share (quarantine: warnings naming rank 1); step 132 lifts it; the replicas
    stay identical; the run goes on to the end; the ledger holds position 120 (skip) and 121-131 (dropped) as bad data
    of rank 1; the exports say so; a rerun in the same run directory without the fault skips those positions (the
    data_ledger finding) and applies every other step."""
    clean = run_ranks(_run, 2, tmp_path / "clean", False)
    assert not [d for d in clean[0]["decisions"] for f in d[2] if f[0] == "data"]
    assert "aborted_at" not in clean[0]
    faulted = run_ranks(_run, 2, tmp_path / "faulted", True)
    assert faulted[0]["decisions"] == faulted[1]["decisions"]
    assert "aborted_at" not in faulted[0], faulted[0]
    blamed = {step: action for step, action, findings in faulted[0]["decisions"]
              for detector, ranks in findings if detector == "data" and ranks == [1]}
    assert blamed == {120: "SKIP", **dict.fromkeys(range(121, 132), "WARN")}, blamed
    assert all(torch.equal(faulted[0]["params"][name], faulted[1]["params"][name]) for name in faulted[0]["params"])
    assert faulted[0]["summary"]["skipped_by_policy"] == 1
    run_dir = tmp_path / "faulted" / "test"
    entries = read_ledger(run_dir / "data_ledger.jsonl")
    assert [e["first"] for e in entries if e["bad_data"]] == list(range(120, 132))
    assert [e["action"] for e in entries if e["bad_data"]] == ["skip"] + ["dropped"] * 11
    assert all(e["ranks"] == [1] and "data position" in e["reason"] for e in entries if e["bad_data"])
    assert megatron_iterations(entries) == list(range(121, 133))
    assert cli(["data-ledger", str(run_dir), "--format", "skip-batches"]) == 0
    assert json.loads((run_dir / "skip_batches.json").read_text())["skip_batches"] == list(range(120, 132))
    rerun = run_ranks(_run, 2, tmp_path / "faulted", False)
    skipped = {step for step, action, findings in rerun[0]["decisions"] if action == "SKIP"}
    assert skipped == set(range(120, 132))
    # (the straggler family times the ranks: a loaded test machine can make it report, on any step)
    assert all(f[0] == "data_ledger" and f[1] == [1] for step, _, findings in rerun[0]["decisions"]
               if step in skipped for f in findings if f[0] != "straggler")


def test_the_data_ledger_command_prints_exports_and_refuses_bad_input(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ledger = DataLedger()
    ledger.open(tmp_path / "data_ledger.jsonl")
    ledger.record(first=4, step=4, iteration=4, action="skip", bad_data=True, ranks=[3], detectors=["data"],
                  reason="bad data on rank 3")
    assert cli(["data-ledger", str(tmp_path)]) == 0
    assert "1 positions skipped for bad data" in capsys.readouterr().out
    assert cli(["data-ledger", str(tmp_path), "--format", "megatron"]) == 0
    assert capsys.readouterr().out.strip() == "--iterations-to-skip 5"
    assert cli(["data-ledger", str(tmp_path / "nowhere")]) == 2
    (tmp_path / "data_ledger.jsonl").write_text("not json\n")
    assert cli(["data-ledger", str(tmp_path)]) == 2
    assert "data_ledger.jsonl:1" in capsys.readouterr().err


# ------------------------------------------------------------------ the quarantine's hooks under DDP


def _quarantined_grads(rank: int, world: int, groups: list[list[int]] | None = None, blamed: int = 1) -> dict:
    """DDP over this rank's group of ``groups`` (None: every rank); ``blamed`` quarantined for one backward."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from arc_engine.monitors.bad_data import Quarantine
    from arc_engine.monitors.family import LocalGrads
    from tests.training import BATCH, tiny_model_and_data

    mine = None
    for members in groups or []:  # every rank creates every group, in the same order
        group = dist.new_group(members)
        if rank in members:
            mine = group
    model, data = tiny_model_and_data(0)
    alone, _ = tiny_model_and_data(0)  # the same weights, no DDP: each rank's own local gradient
    alone(*data.batch(0, rank, BATCH)).backward()
    own = [p.grad.clone() for p in alone.parameters()]
    ddp = DistributedDataParallel(model, process_group=mine)
    quarantine = Quarantine(rank, LocalGrads(tuple(model.parameters()), mine))
    quarantine.start(blamed=blamed, step=0)
    hooked = len(quarantine._handles)
    ddp(*data.batch(0, rank, BATCH)).backward()
    held = [p.grad.clone() for p in model.parameters()]
    quarantine.stop()
    model.zero_grad(set_to_none=True)
    ddp(*data.batch(0, rank, BATCH)).backward()
    released = [p.grad.clone() for p in model.parameters()]
    return {"own": own, "held": held, "released": released, "hooks": len(quarantine._handles), "hooked": hooked}


def _mean(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [sum(parts) / len(parts) for parts in zip(*grads, strict=True)]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b, strict=True))


def test_a_quarantined_ranks_share_is_left_out_of_the_ddp_reduction_exactly() -> None:
    """Rank 1 quarantined at 2 ranks: the reduced gradient on both ranks is rank 0's own local gradient, bitwise
    (rank 1 contributes zeros, rank 0 twice its gradient, DDP averages); stopped, no hook remains and the reduction is
    the mean of both again."""
    results = run_ranks(_quarantined_grads, 2)
    for result in results:
        assert result["hooks"] == 0
        assert all(torch.equal(h, o) for h, o in zip(result["held"], results[0]["own"], strict=True))
        mean = [(a + b) / 2 for a, b in zip(results[0]["own"], results[1]["own"], strict=True)]
        assert all(torch.allclose(r, m, rtol=1e-6, atol=1e-7) for r, m in zip(result["released"], mean, strict=True))
        assert not all(torch.equal(r, h) for r, h in zip(result["released"], result["held"], strict=True))


def test_the_quarantine_scales_by_the_reductions_own_group_at_3_ranks_and_on_ddp_sub_groups() -> None:
    """At 3 ranks the peers of the blamed rank scale by 3/2 (before: by n/(n-1) with n the ranks that recorded a
    loss, which need not be the ranks DDP averages over). With DDP on sub-groups {0, 2} and {1, 3} of 4 ranks (a
    2 x 2 grid) and rank 1 blamed: its group's reduction is rank 3's own gradient, the other group's is untouched
    (before: every rank scaled by 4/3, the other group trained on gradients 4/3 too large)."""
    three = run_ranks(_quarantined_grads, 3)
    peers = _mean([three[0]["own"], three[2]["own"]])
    assert all(_close(result["held"], peers) for result in three)
    four = run_ranks(_quarantined_grads, 4, [[0, 2], [1, 3]])
    assert [result["hooked"] > 0 for result in four] == [False, True, False, True]
    assert _close(four[1]["held"], four[3]["own"]) and _close(four[3]["held"], four[3]["own"])
    untouched = _mean([four[0]["own"], four[2]["own"]])
    assert _close(four[0]["held"], untouched) and _close(four[2]["held"], untouched)


def _zero_quarantined(rank: int, world: int, stage: int, run_dir: Path, blamed: int = 1) -> dict:
    """A DeepSpeed ZeRO-``stage`` engine (SGD, lr 1, no clipping: the update is the reduced gradient) with arc_engine
    attached; ``blamed`` quarantined over the adapter's reduction group for one step. Returns this rank's own local
    gradient (the same weights and batch, no DeepSpeed) and the update."""
    import os

    import deepspeed

    from arc_engine.integrations.deepspeed import attach_deepspeed
    from arc_engine.monitors.bad_data import Quarantine
    from tests.training import BATCH, tiny_model_and_data

    os.environ["LOCAL_RANK"] = str(rank)
    model, data = tiny_model_and_data(0)
    alone, _ = tiny_model_and_data(0)
    alone(*data.batch(0, rank, BATCH)).backward()
    own = [p.grad.clone() for p in alone.parameters()]
    config = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 10_000}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=config)
    arc = attach_deepspeed(engine, make_config(run_dir))
    local = arc.adapter.local_grad_reduction
    quarantine = Quarantine(rank, local)
    before = [p.detach().clone() for p in engine.module.parameters()]
    quarantine.start(blamed=blamed, step=0)
    loss = engine(*data.batch(0, rank, BATCH))
    arc.record_loss(loss)
    engine.backward(loss)
    engine.step()
    quarantine.stop()
    update = [b - p.detach() for b, p in zip(before, engine.module.parameters(), strict=True)]
    applied = arc.last_step_applied
    arc.close()
    return {"own": own, "update": update, "applied": applied, "members": quarantine.reduction_ranks(),
            "covered": len(local.params) == len(own) and not local.left_out}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "world"), [(1, 3), (2, 4)])
def test_under_zero_1_and_2_the_quarantine_leaves_the_blamed_ranks_share_out_of_deepspeeds_reduction(
        tmp_path: Path, stage: int, world: int) -> None:
    """DeepSpeed ZeRO-1 at 3 ranks and ZeRO-2 at 4, rank 1 quarantined for one step: every rank's update (SGD, lr 1,
    so the reduced gradient DeepSpeed applied) is the mean of the other ranks' own gradients -- rank 1 contributes
    zeros and its peers scale by n/(n-1) over DeepSpeed's data-parallel group, which the adapter names."""
    pytest.importorskip("deepspeed")
    results = run_ranks(_zero_quarantined, world, stage, tmp_path)
    peers = _mean([result["own"] for rank, result in enumerate(results) if rank != 1])
    everyone = _mean([result["own"] for result in results])
    for result in results:
        assert result["applied"] and result["covered"] and result["members"] == list(range(world))
        assert _close(result["update"], peers), stage
        assert not _close(result["update"], everyone)  # the blamed rank's share would change it


# ------------------------------------------------------------------ replicas that diverged are not bad data

DIVERGE = "faults.injections=[{kind: optimizer_state, rank: 1, step: 120, scale: 1.0e-8, state_key: exp_avg_sq}]"


def _diverged(rank: int, world: int, run_dir: Path) -> dict:
    from tests.training import train_ddp as train

    result = train(rank, 150, make_config(run_dir, DIVERGE))
    result.pop("snapshots", None)
    return result


def test_replicas_whose_weights_diverged_are_not_taken_for_bad_data(tmp_path: Path) -> None:
    """Rank 1's Adam second moment x 1e-8 before its update at step 120 (only rank 1's replica moves 10^4 x too far):
    from then on the ranks' losses part because their weights differ. The data rule's follow-up compares the
    replicas' weight fingerprints: the finding says the replicas differ, is not bad data (no quarantine, nothing in
    the ledger as bad data), and asks for a rollback, which without recovery stops the run on that step, on both
    ranks alike."""
    results = run_ranks(_diverged, 2, tmp_path)
    assert results[0]["decisions"] == results[1]["decisions"]
    assert results[0]["aborted_at"] == results[1]["aborted_at"] > 120, results[0].get("aborted_at")
    assert not [step for step, action, _ in results[0]["decisions"] if action == "SKIP"]
    entries = [e for e in read_ledger(tmp_path / "test" / "data_ledger.jsonl") if e["action"] == "abort"]
    assert [e["step"] for e in entries] == [results[0]["aborted_at"]] and "data" in entries[0]["detectors"]
    assert not [e for e in read_ledger(tmp_path / "test" / "data_ledger.jsonl") if e["bad_data"]]
    events = [json.loads(line) for line in (tmp_path / "test" / "events.jsonl").read_text().splitlines()]
    messages = [e["message"] for e in events if e.get("detector") == "data"]
    assert messages and all("replicas' weights differ" in m for m in messages), messages[:2]

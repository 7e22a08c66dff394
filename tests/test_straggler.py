"""Straggler scores: the pure scores, the monitor on simulated ranks (each with its own producer, their buffers
reduced as the pipeline would: the fixed-size follow-up reductions included), and 4 real gloo ranks under DDP where
one rank sleeps in its forward pass (it is named, once, by every rank, and counts as a system event of the R-Metric)
while a clean run flags nobody."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine.config import load_config
from arc_engine.events import Action, Severity
from arc_engine.monitors.family import FamilyContext, StepView, section_of
from arc_engine.monitors.straggler import (
    NAMED_SLOTS,
    PEER,
    RANK,
    REPLICA_SLOW,
    SECTION_TIMES,
    STAGE_TIMES,
    StragglerFamily,
    StragglerMonitor,
    StragglerProducer,
    Verdict,
    attribute,
    performance_scores,
    report_due,
)
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, StatLayout
from arc_engine.stats.timing import ComputeProbe, SectionClock, local_compute_modules
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data

pytestmark = pytest.mark.timeout(300)


def test_scores_are_the_fastest_over_each_and_the_best_over_the_current() -> None:
    times = np.array([0.10, 0.20, math.nan, 0.125])
    best = np.array([0.08, math.inf, 0.1, 0.125])
    relative, individual = performance_scores(times, best)
    assert relative[[0, 1, 3]] == pytest.approx([1.0, 0.5, 0.8])
    assert math.isnan(relative[2]) and math.isnan(individual[2])
    assert individual[0] == pytest.approx(0.8) and math.isnan(individual[1]) and individual[3] == pytest.approx(1.0)
    assert [s for s in range(0, 70, 2) if report_due(s, 2, 10)] == [20, 40, 60]  # every 10th monitored step


def test_the_clock_times_the_forward_section_and_the_iteration() -> None:
    clock = SectionClock(torch.device("cpu"))
    assert all(math.isnan(t) for t in clock.times())
    clock.start()
    clock.loss()
    first = clock.times()
    assert first[0] >= 0.0 and math.isnan(first[1])  # no previous start yet
    clock.loss()  # a second micro-batch's loss leaves the forward section as it was
    assert clock.times()[0] == first[0]
    clock.start()
    forward, iteration = clock.times()
    assert math.isnan(forward) and iteration >= first[0]  # this step recorded no loss yet


class Simulated:
    """``ranks`` simulated ranks, each with its own producer; every step each writes its buffer (forward and compute
    times from ``times(step, rank)``, an identity from ``who(rank)``) and the monitor of rank 0 judges the stacked
    buffers, reduced as the pipeline would (the follow-up reductions over every row)."""

    def __init__(self, ranks: int, who: Any = lambda rank: (-1, 0, 0), stages: int = 1, *overrides: str) -> None:
        config = load_config(None, ["detectors.straggler.every=5", "detectors.straggler.warmup_reports=1",
                                    "detectors.straggler.min_delay_s=0.01", "detectors.straggler.persist_reports=1",
                                    *overrides])
        ctx = FamilyContext(config, section_of(config, StragglerFamily()), ["g"], Reduce.SUM)
        self.layout = StatLayout()
        for decl in StragglerFamily().statistics(ctx):
            self.layout.add(decl.name, decl.size * (stages if decl.name == STAGE_TIMES else 1), decl.reduce)
        self.layout.freeze()
        self.monitor = StragglerMonitor(section_of(config, StragglerFamily()), 1)
        self.producers = [StragglerProducer(5, 1, who(rank), rank, stages) for rank in range(ranks)]
        self.buffers = [StatBuffer(self.layout, torch.device("cpu")) for _ in range(ranks)]

    def run(self, steps: int, times: Any) -> dict[int, list[Any]]:
        return self.run_from(1, steps, times)

    def run_from(self, first: int, last: int, times: Any) -> dict[int, list[Any]]:
        findings = {}
        for step in range(first, last + 1):
            for rank, (producer, buffer) in enumerate(zip(self.producers, self.buffers, strict=True)):
                forward, compute = times(step, rank)
                buffer.reset()
                producer.write(buffer, StepView(step, [], (forward, 0.5), 0, compute=(compute,)))
            rows = np.stack([buffer.values.numpy() for buffer in self.buffers])
            stats = AgreedStats.from_rows(self.layout, rows, ranks=tuple(range(len(rows))))
            found = self.monitor.evaluate(step, stats)
            if found:
                findings[step] = found
            self.monitor.commit(step, True)
        return findings


def test_a_slow_rank_is_named_once_after_the_warmup_report_and_survives_a_restore() -> None:
    """Ranks' forward times 0.10 s, rank 2 at 0.30 s from step 6 (its window of steps 6-10): reports at steps 5, 10,
    15, 20; the first is the warm-up; the finding comes at 10 (relative score 1/3 < 0.7) and not again at 15 while
    rank 2 stays slow; rank 2 recovers by 20 and is dropped."""
    sim = Simulated(4)
    base = [0.10, 0.101, 0.10, 0.099]
    findings = sim.run(20, lambda step, rank: (0.30 if rank == 2 and 6 <= step <= 15 else base[rank], math.nan))
    assert list(findings) == [10]
    (finding,) = findings[10]
    assert finding.detector == "straggler" and finding.ranks == (2,) and "rank 2 forward 0.3 s" in finding.message
    assert finding.values["unnamed_slow_ranks"] == 0 and finding.values["kinds"] == {2: RANK}
    monitor = sim.monitor
    assert monitor.metrics()["stragglers"] == 0.0 and monitor.events == 1 and monitor.reports == 4
    assert sim.producers[2].best_forward == pytest.approx(0.10)  # each rank keeps its own best
    restored = StragglerMonitor(monitor.config, 1)
    restored.load_state_dict(monitor.state_dict())
    assert restored.reports == 4 and restored.events == 1 and restored.stragglers == monitor.stragglers


def test_the_individual_score_is_the_ranks_own_best_and_a_restore_keeps_only_its_own() -> None:
    """Rank 1 slows down by 30%, past rank 0, which was always slower (its relative score 0.12/0.13 stays above the
    threshold): only its individual score (its best over its current median) sees it. When every rank slows down at
    once (relative scores stay 1) that is the machine's or the job's, not a rank's: one info event, no straggler. A
    restore from another rank's state (a checkpoint's shared copy) does not take that rank's best."""
    sim = Simulated(2, lambda rank: (-1, 0, 0), 1, "detectors.straggler.individual_threshold=0.8")
    findings = sim.run(15, lambda step, rank: (0.12 if rank == 0 else 0.13 if step > 10 else 0.10, math.nan))
    assert list(findings) == [15] and findings[15][0].ranks == (1,)
    assert findings[15][0].severity == Severity.WARNING
    assert findings[15][0].values["individual_score_min"] == pytest.approx(0.10 / 0.13, rel=1e-6)
    assert findings[15][0].values["relative_score_min"] == pytest.approx(0.12 / 0.13, rel=1e-6)
    caught_up = Simulated(2, lambda rank: (-1, 0, 0), 1, "detectors.straggler.individual_threshold=0.8")
    level = caught_up.run(15, lambda step, rank: (0.13 if step > 10 or rank == 0 else 0.10, math.nan))
    assert level == {}  # as slow as its peer that was always slower: it holds nobody back
    together = Simulated(2, lambda rank: (-1, 0, 0), 1, "detectors.straggler.individual_threshold=0.8")
    found = together.run(25, lambda step, rank: (0.15 if step > 10 else 0.10, math.nan))
    assert list(found) == [15] and [(f.severity, f.ranks) for f in found[15]] == [(Severity.INFO, ())]
    assert "every rank is slower than its own best" in found[15][0].message and found[15][0].values["every_rank_slower"]
    assert together.monitor.stragglers == frozenset() and together.monitor.events == 0
    own, other = StragglerProducer(5, 1, rank=1), StragglerProducer(5, 1, rank=1)
    own.load_state_dict(sim.producers[1].state_dict())
    other.load_state_dict(sim.producers[0].state_dict())
    assert own.best_forward == pytest.approx(0.10) and other.best_forward == math.inf


def test_a_batch_size_ramp_names_no_rank_when_the_ranks_bests_were_taken_at_different_noise_levels() -> None:
    """What 20,000 steps of real text showed: before a ramp rank 0 ran 0.14 s (a noisy rank: the main process's host
    work; relative score 0.71, not slow) and rank 1 0.10 s; after it both run 0.18 s. Rank 1's individual score is
    0.56, rank 0's 0.78 (above the threshold, so the slowdown does not read as every rank's), but rank 1 is as fast as
    rank 0: nobody is named."""
    sim = Simulated(2, lambda rank: (-1, 0, 0), 1)
    findings = sim.run(30, lambda step, rank: (0.18 if step > 10 else 0.14 if rank == 0 else 0.10, math.nan))
    assert findings == {} and sim.monitor.events == 0
    assert sim.producers[1].best_forward == pytest.approx(0.10) and sim.producers[0].best_forward == pytest.approx(0.14)


def test_a_rank_is_named_only_when_slow_in_persist_reports_reports_in_a_row_and_a_restore_keeps_the_count() -> None:
    """persist_reports=2, reports every 5 steps (the first a warm-up): rank 3 slow in the window of step 10 only
    is passing, not named; rank 1 slow in the windows of 20 and 25 is named at 25, once, also by a monitor restored
    from the state of step 20; its streak ends when it recovers."""
    sim = Simulated(4, lambda rank: (-1, 0, 0), 1, "detectors.straggler.persist_reports=2")

    def times(step: int, rank: int) -> tuple[float, float]:
        slow = (rank == 3 and 6 <= step <= 10) or (rank == 1 and 16 <= step <= 25)
        return (0.30 if slow else 0.10), math.nan

    findings = sim.run(20, times)
    assert findings == {} and sim.monitor.streaks == {1: 1} and sim.monitor.metrics()["passing_slow_ranks"] == 1.0
    restored = StragglerMonitor(sim.monitor.config, 1)
    restored.load_state_dict(sim.monitor.state_dict())
    for monitor in (sim.monitor, restored):
        sim.monitor = monitor
        found = sim.run_from(21, 30, times)
        assert list(found) == [25] and [(f.severity, f.ranks) for f in found[25]] == [(Severity.WARNING, (1,))]
        assert "(2 reports in a row of 5 monitored steps)" in found[25][0].message
        assert monitor.stragglers == frozenset() and monitor.streaks == {} and monitor.events == 1
        for producer in sim.producers:  # replay steps 21-30 for the restored monitor
            producer.forward.clear()
            producer.compute.clear()


def test_slowness_that_moves_between_ranks_is_one_info_event_about_the_machine_and_no_straggler() -> None:
    """A contended machine: each report another rank is the slow one (never twice in a row). Once two ranks have been
    slow and recovered, one info event names them; no straggler is named; after CALM_REPORTS calm reports the next
    episode is told again, once."""
    from arc_engine.monitors.straggler import CALM_REPORTS

    sim = Simulated(3, lambda rank: (-1, 0, 0), 1, "detectors.straggler.persist_reports=2")
    turns = {2: 0, 3: 1, 4: 2, 5: 0, 6: 1}  # report index (step // 5) -> the slow rank of its window
    second = 7 + CALM_REPORTS  # the next episode: after CALM_REPORTS calm reports
    turns.update({second: 2, second + 1: 1, second + 2: 0})

    def times(step: int, rank: int) -> tuple[float, float]:
        return (0.30 if turns.get((step + 4) // 5) == rank else 0.10), math.nan

    findings = sim.run(5 * (second + 3), times)
    assert [(step, [(f.severity, f.ranks) for f in found]) for step, found in findings.items()] == [
        (20, [(Severity.INFO, ())]), (5 * (second + 2), [(Severity.INFO, ())])]
    first = findings[20][0]
    assert "ranks 0, 1 were each slow and recovered within 1 report(s), none for 2 in a row" in first.message
    assert first.values["passing_ranks"] == [0, 1] and sim.monitor.events == 0 and not sim.monitor.stragglers
    assert first.action == Action.NONE  # an event about the machine asks for nothing


def test_the_producer_writes_window_medians_on_report_steps_only() -> None:
    sim = Simulated(1)
    producer, buffer = StragglerProducer(5, 1, (3, 1, 0), 7), sim.buffers[0]
    for step in range(1, 6):
        buffer.reset()
        producer.write(buffer, StepView(step, [], (0.01 * step, 0.5), 0))
        producer.write(buffer, StepView(step, [], (9.0, 9.0), 0))  # a recomputed step agrees twice: counted once
        values = buffer.view(SECTION_TIMES).tolist()
        stage = buffer.view(STAGE_TIMES).tolist()
        if step == 5:
            assert np.array_equal(values, [0.03, 0.5, 5.0, math.nan, 0.0, 3.0, 1.0, 0.0, math.inf, math.inf, 7.0],
                                  equal_nan=True), values
            # no compute sample, no earlier best (no individual score): MAX's identity
            assert stage == [-0.03, 0.03, -math.inf, -math.inf, 0.5, -math.inf]
        else:
            assert values == [0.0] * 11 and stage == [-math.inf] * 6
    assert not producer.forward and producer.best_forward == pytest.approx(0.03)  # the next window starts empty
    for step in range(6, 11):  # twice as slow: the individual score against the best of the first window
        buffer.reset()
        producer.write(buffer, StepView(step, [], (0.06, 0.5), 0))
    assert buffer.view(STAGE_TIMES).tolist()[5] == pytest.approx(0.5)


def test_many_slow_ranks_fill_their_slots_and_the_rest_are_counted() -> None:
    """NAMED_SLOTS + 3 ranks of 2 x NAMED_SLOTS + 8 slow: ranks r and r + NAMED_SLOTS share a slot, the slower is named
    and the other counted; the reductions' sizes do not depend on the number of ranks."""
    ranks = 2 * NAMED_SLOTS + 8
    slow = {**{r: 0.30 for r in range(NAMED_SLOTS)}, **{NAMED_SLOTS + r: 0.40 for r in range(3)}}
    sim = Simulated(ranks)
    findings = sim.run(10, lambda step, rank: (slow.get(rank, 0.10) if step > 5 else 0.10, math.nan))
    (finding,) = findings[10]
    expected = {*range(3, NAMED_SLOTS), *range(NAMED_SLOTS, NAMED_SLOTS + 3)}
    assert set(finding.ranks) == expected and finding.values["unnamed_slow_ranks"] == 3
    assert "3 more slow rank(s) not named" in finding.message


def test_scores_compare_the_ranks_of_one_pipeline_stage() -> None:
    """Stage 0 runs 0.10 s and 0.20 s, stage 1 0.40 s and 0.41 s: each is scored against its own stage."""
    relative, _ = performance_scores(np.array([0.10, 0.20, 0.40, 0.41]), np.full(4, math.inf), np.array([0, 0, 1, 1]))
    assert relative == pytest.approx([1.0, 0.5, 1.0, 0.40 / 0.41])


def test_attribution_tells_a_slow_peer_from_a_slow_replica() -> None:
    """Replicas {0, 1} and {2, 3} of 2 ranks each, plus rank 4 alone (no replica known)."""
    replicas = {0: 0, 1: 0, 2: 1, 3: 1, 4: -1}

    def slow(rank: int, computing: bool) -> Verdict:
        return Verdict(rank, replicas[rank], 0, 0, 0.3, 0.2, 0.5, 0.5 if computing else 1.0, math.nan,
                       not computing, computing)

    def ranks(result: list) -> list:
        return [(kind, [v.rank for v in named], waiting, others) for kind, named, waiting, others in result]

    # rank 2 computes slowly; rank 3's forward is as long (it waits in the tensor-parallel all-reduce)
    assert ranks(attribute([slow(2, True), slow(3, False)], {1: (2, 1, 2)})) == [(PEER, [2], [3], 0)]
    # the waiting peer need not be a candidate: it is counted
    assert ranks(attribute([slow(2, True)], {1: (2, 1, 2)})) == [(PEER, [2], [], 1)]
    # both ranks of replica 1 compute slowly: the replica
    assert ranks(attribute([slow(2, True), slow(3, True)], {1: (2, 2, 2)})) == [(REPLICA_SLOW, [2, 3], [], 0)]
    # replica 1's forward is slow, nobody's compute: the replica (the delay is outside compute)
    assert ranks(attribute([slow(2, False), slow(3, False)], {1: (2, 0, 2)})) == [(REPLICA_SLOW, [2, 3], [], 0)]
    # a rank without a replica stands alone, next to a slow peer elsewhere
    assert ranks(attribute([slow(0, False), slow(1, True), slow(4, True)], {0: (2, 1, 2)})) == \
        [(PEER, [1], [0], 0), (RANK, [4], [], 0)]


def test_under_tp2_dp2_a_slow_tensor_parallel_rank_is_named_and_its_waiting_peer_is_not() -> None:
    """Simulated reports of 4 ranks, TP=2 x DP=2 (replica 0: ranks 0, 1; replica 1: ranks 2, 3). From step 10 rank 2
    computes 0.2 s longer and rank 3's forward waits as long; from step 15 rank 3 computes slowly too."""
    sim = Simulated(4, lambda rank: (rank // 2, rank % 2, 0))

    def times(step: int, rank: int) -> tuple[float, float]:
        extra2 = 0.2 if step > 5 else 0.0
        extra3 = 0.2 if step > 10 else 0.0
        wait = max(extra2, extra3) if rank >= 2 else 0.0
        return 0.10 + wait, 0.05 + (extra2 if rank == 2 else extra3 if rank == 3 else 0.0)

    findings = sim.run(20, times)
    monitor = sim.monitor
    assert list(findings) == [10, 15]
    (peer,), (replica,) = findings[10], findings[15]
    assert peer.ranks == (2,) and peer.values["kinds"] == {2: PEER}
    assert "slow model-parallel peer in replica 1: rank 2 (tensor-parallel rank 0" in peer.message
    assert "its peers 3 only wait for it" in peer.message
    assert replica.ranks == (3,) and replica.values["kinds"] == {2: REPLICA_SLOW, 3: REPLICA_SLOW}
    assert "slow replica 1 (every rank computes slowly)" in replica.message
    assert monitor.stragglers == {2, 3}


class FakeClock:
    """Stands in for the ``time`` module of the timing and fault code: only sleeps move it, so the times the probe
    reads are exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    from arc_engine.faults import injector
    from arc_engine.stats import timing

    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    monkeypatch.setattr(injector, "time", clock)
    return clock


def test_the_compute_probe_times_sampled_steps_only_and_not_the_waits_before_a_module(fake_clock: FakeClock) -> None:
    """A model of three Linear layers; a pre-hook registered first on the first layer sleeps 0.2 s (a framework's
    parameter gather waiting on a peer: not compute), a forward hook on the second sleeps 0.05 s (a slow device:
    compute). The probe times every 2nd step, and leaves no hook behind on the others."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[0].register_forward_pre_hook(lambda module, args: fake_clock.sleep(0.2))
    model[2].register_forward_hook(lambda module, args, output: fake_clock.sleep(0.05))
    modules = local_compute_modules([model], 64)
    assert modules == [model[0], model[2], model[3]]  # leaves with parameters (not the ReLU)
    assert local_compute_modules([model], 2) == [model[0], model[2]]
    assert local_compute_modules([model], 64, lambda module: module is model[3]) == [model[0], model[2]]
    probe = ComputeProbe(modules, torch.device("cpu"), every=2)
    samples = {}
    for step in range(4):
        probe.start(step)
        hooked = len(model[3]._forward_hooks)
        model(torch.ones(2, 4))
        model(torch.ones(2, 4))  # a second micro-batch: each module is timed at its first call only
        samples[step] = (probe.take(), hooked)
    probe.close()
    assert [samples[step][1] for step in range(4)] == [1, 0, 1, 0] and not model[3]._forward_hooks
    for step in (0, 2):  # the slow module in, the gather's wait out
        assert samples[step][0] == [pytest.approx(0.05)]
    assert samples[1][0] == samples[3][0] == []


def test_a_stall_with_a_pattern_sleeps_after_the_matching_module_once_per_step(fake_clock: FakeClock) -> None:
    from arc_engine.config.schema import FaultSpec
    from arc_engine.faults import FaultInjector

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    step = [0]
    spec = FaultSpec(kind="stall", rank=0, step=1, steps=1, seconds=0.01, pattern="1")
    injector = FaultInjector([spec], 0, lambda: step[0])
    injector.install(model)
    probe = ComputeProbe([model[1]], torch.device("cpu"), every=1)
    seconds = []
    for step[0] in range(3):
        probe.start(step[0])
        model(torch.ones(1, 4))
        model(torch.ones(1, 4))
        seconds.extend(probe.take())
    assert injector.fired == [(1, "stall")]
    assert seconds == [0.0, pytest.approx(0.01), 0.0]
    with pytest.raises(ValueError, match="matches no module"):
        FaultInjector([FaultSpec(kind="stall", rank=0, step=1, seconds=0.1, pattern="nope*")], 0,
                      lambda: 0).install(model)


# ------------------------------------------------------------------ 4 real ranks under DDP


def _train(rank: int, world: int, run_dir: Path, stall_rank: int) -> dict[str, Any]:
    model, data = tiny_model_and_data(seed=1)
    optimizer = make_optimizer(model)
    ddp = DistributedDataParallel(model)
    faults = f"faults.injections=[{{kind: stall, rank: {stall_rank}, step: 20, steps: 40, seconds: 0.15}}]" \
        if stall_rank >= 0 else "faults.injections=[]"
    config = make_config(run_dir, "detectors.straggler.every=10", "detectors.straggler.min_delay_s=0.06",
                         "detectors.straggler.individual_threshold=0", faults)
    arc = arc_engine.attach(ddp, optimizer, config)
    findings: dict[int, list[int]] = {}
    lambdas = []
    r_metric = next(m for m in arc.engine.gathering.assembly.monitors if m.name == "r_metric")
    for step in range(60):
        loss = ddp(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        decision = arc.engine.last_decision
        for finding in decision.findings if decision.step == step else ():
            if finding.detector in ("straggler", "r_metric"):
                findings.setdefault(step, []).extend([finding.detector, *finding.ranks])
        lambdas.append(r_metric.metrics()["lambda"])
    summary = arc.summary()
    arc.close()
    return {"findings": findings, "lambdas": lambdas, "detail_fetches": arc.engine.gathering.pipeline.detail_fetches,
            "follow_ups": arc.engine.gathering.pipeline.follow_ups,
            "detections": summary["detections"]}


def test_a_rank_sleeping_in_its_forward_is_named_and_counts_towards_lambda(tmp_path: Path) -> None:
    """Rank 2 sleeps 150 ms in each forward from step 20: slow at the report of step 30 and again at 40, it is named
    at 40 (persist_reports = 2) on every rank, once (the report at 50 sees the same straggler); the R-Metric's λ
    counts the event from the next step on. A clean
    run (below) names nobody. Only fixed-size reductions travel, on report steps only."""
    results = run_ranks(_train, 4, tmp_path, 2)
    for result in results:
        assert result["findings"] == {40: ["straggler", 2]}, result["findings"]
        assert result["lambdas"][:41] == [0.0] * 41 and result["lambdas"][41:] == [1.0] * 19
        # no all-gather: one fixed-size follow-up per report (steps 10-50), one more with a slow rank (30, 40, 50)
        assert result["detail_fetches"] == 0 and result["follow_ups"] == 5 + 3


def test_a_clean_run_flags_no_straggler_and_raises_no_r_metric_alert(tmp_path: Path) -> None:
    results = run_ranks(_train, 4, tmp_path, -1)
    for result in results:
        assert result["findings"] == {} and result["detections"] == {}
        assert result["lambdas"] == [0.0] * 60


def test_a_compiled_model_turns_the_compute_probe_off_with_an_event_and_still_trains(tmp_path) -> None:
    """torch.compile ignores module hooks added after compilation, and the probe adds and removes them every few
    steps: on a compiled model it is off, said by a warning event, and the rest of the step's statistics stay."""
    from arc_engine.sinks import read_jsonl
    from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data

    model, data = tiny_model_and_data()
    compiled = torch.compile(model, backend="eager")
    optimizer = make_optimizer(model)
    with arc_engine.attach(compiled, optimizer, make_config(tmp_path, "stats.interval=1")) as arc:
        assert arc.engine.gathering.probe is None
        for step in range(3):
            loss = compiled(*data.batch(step, 0, BATCH))
            arc.record_loss(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert arc.engine.last_decision.step == 2 and arc.engine.last_stats.total("grad_sq").sum() > 0
    off = [e for e in read_jsonl(tmp_path / "test" / "events.jsonl") if e.get("action") == "compute_probe_off"]
    assert len(off) == 1 and off[0]["severity"] == "warning" and "torch.compile" in off[0]["message"], off

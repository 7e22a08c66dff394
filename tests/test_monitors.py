"""Detectors (non-finite, gradient norm, loss spike) and the decision policy, driven by hand-built statistics."""

from __future__ import annotations

import dataclasses
import math
from collections import deque

import numpy as np
import pytest

from arc_engine.config import load_config
from arc_engine.config.schema import PolicyConfig
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.family import FamilyContext, section_of
from arc_engine.monitors.loss_spike import (
    LossSpikeConfig,
    LossSpikeFamily,
    LossSpikeMonitor,
    mean_loss,
    robust_baseline,
    spike_threshold,
)
from arc_engine.monitors.non_finite import NonFiniteConfig, NonFiniteMonitor
from arc_engine.monitors.numerics import GradNormConfig, GradNormMonitor, classify_grad_norm, global_grad_norm
from arc_engine.monitors.worker_spread import LOSS_MOMENTS
from arc_engine.policy.decision import DecisionPolicy
from arc_engine.stats import AgreedStats, Reduce, StatLayout, names

GROUP_NAMES = ["decay", "no_decay"]


def gathered_stats(loss_r, *, loss_count_r=None, grad_sq_g=None, nonfinite_rg=None, ranks=None,
                   grad_reduce=Reduce.REPLICATED) -> AgreedStats:
    """What ``StatsPipeline.agree`` would return, with the slots ``ArcEngine.__init__`` registers.

    ``grad_sq_g`` is the reduced gradient's squared norm per group, written to every rank's row (REPLICATED).
    """
    layout = StatLayout()
    num_groups = len(GROUP_NAMES)
    layout.add(names.LOSS, 1, Reduce.SUM)
    layout.add(names.LOSS_COUNT, 1, Reduce.SUM)
    layout.add(names.LOSS_RANKS, 1, Reduce.SUM)
    layout.add(names.GRAD_SQ_LOCAL, num_groups, Reduce.DETAIL)
    layout.add(names.GRAD_NONFINITE_LOCAL, num_groups, Reduce.SUM)
    layout.add(names.GRAD_SQ, num_groups, grad_reduce)
    layout.freeze()
    num_ranks = len(loss_r)
    matrix_rn = np.zeros((num_ranks, layout.size))

    def fill(name, values):
        matrix_rn[:, layout[name].span] = np.broadcast_to(np.asarray(values, dtype=np.float64),
                                                          (num_ranks, layout[name].size))

    fill(names.LOSS, np.asarray(loss_r)[:, None])
    count_r = np.asarray(loss_count_r if loss_count_r is not None else np.ones(num_ranks))
    fill(names.LOSS_COUNT, count_r[:, None])
    fill(names.LOSS_RANKS, (count_r > 0)[:, None])
    fill(names.GRAD_SQ_LOCAL, 1.0)
    fill(names.GRAD_NONFINITE_LOCAL, nonfinite_rg if nonfinite_rg is not None else 0.0)
    fill(names.GRAD_SQ, grad_sq_g if grad_sq_g is not None else 1.0)
    fill(names.LOSS, np.where(count_r > 0, np.asarray(loss_r, dtype=np.float64), 0.0)[:, None])  # 0: none recorded
    return AgreedStats.from_rows(layout, matrix_rn, tuple(ranks if ranks is not None else range(num_ranks)))


def single_loss(loss: float) -> AgreedStats:
    return gathered_stats([loss])


# ------------------------------------------------------------------ numerics: pure functions


def test_global_grad_norm_and_its_classification_as_ok_explosion_vanishing_nonfinite():
    assert global_grad_norm(np.array([9.0, 16.0])) == pytest.approx(5.0)
    assert math.isnan(global_grad_norm(np.array([1.0, math.nan])))
    assert math.isinf(global_grad_norm(np.array([1.0, math.inf])))
    assert classify_grad_norm(5.0, 1e4, 1e-10) == "ok"
    assert classify_grad_norm(2e4, 1e4, 1e-10) == "explosion"
    assert classify_grad_norm(1e-12, 1e4, 1e-10) == "vanishing"
    assert classify_grad_norm(math.nan, 1e4, 1e-10) == "nonfinite"
    assert classify_grad_norm(math.inf, 1e4, 1e-10) == "nonfinite"


# ------------------------------------------------------------------ numerics: monitors


def test_healthy_step_has_no_finding():
    nonfinite = NonFiniteMonitor(NonFiniteConfig(), GROUP_NAMES)
    grad_norm = GradNormMonitor(GradNormConfig())
    stats = gathered_stats([2.0, 2.1], grad_sq_g=[4.0, 5.0])
    assert nonfinite.evaluate(0, stats) == []
    assert grad_norm.evaluate(0, stats) == []
    assert grad_norm.last_norm == pytest.approx(3.0)
    nonfinite.commit(0, applied=True)
    grad_norm.commit(0, applied=True)
    assert nonfinite.count == 0 and grad_norm.explosions == 0 and grad_norm.vanishings == 0


def test_gradient_explosion_and_vanishing_use_configured_actions():
    config = GradNormConfig(explosion_threshold=100.0, vanishing_threshold=1e-6,
                            explosion_action="abort", vanishing_action="skip")
    monitor = GradNormMonitor(config)
    (explosion,) = monitor.evaluate(0, gathered_stats([2.0], grad_sq_g=[1e4, 1e4]))
    assert explosion.action == Action.ABORT
    assert explosion.values["grad_norm"] == pytest.approx(math.sqrt(2e4))
    assert "gradient explosion" in explosion.message
    monitor.commit(0, applied=False)
    (vanishing,) = monitor.evaluate(1, gathered_stats([2.0], grad_sq_g=[1e-14, 0.0]))
    assert vanishing.action == Action.SKIP
    assert "vanishing gradient" in vanishing.message
    monitor.commit(1, applied=False)
    assert (monitor.explosions, monitor.vanishings) == (1, 1)
    # a non-finite norm is left to the NonFiniteMonitor
    assert monitor.evaluate(2, gathered_stats([2.0], grad_sq_g=[math.nan, 1.0])) == []


def test_sharded_grad_norm_sums_over_ranks():
    monitor = GradNormMonitor(GradNormConfig(explosion_threshold=10.0))
    stats = gathered_stats([1.0, 1.0], grad_sq_g=[40.0, 20.0], grad_reduce=Reduce.SUM)
    (finding,) = monitor.evaluate(0, stats)  # each rank holds 60: sum 120, norm ~10.95 > 10
    assert finding.values["grad_norm"] == pytest.approx(math.sqrt(120.0))


# ------------------------------------------------------------------ loss spike: pure functions


def test_robust_baseline_ignores_outliers():
    median, robust_std = robust_baseline(np.array([1.0, 2.0, 3.0, 4.0, 100.0]))
    assert median == 3.0
    assert robust_std == pytest.approx(1.4826)


def test_spike_threshold_takes_the_stricter_condition():
    assert spike_threshold(10.0, 1.0, 6.0, 0.25) == pytest.approx(16.0)
    assert spike_threshold(10.0, 0.1, 6.0, 0.25) == pytest.approx(12.5)


def test_mean_loss_divides_the_agreed_sum_by_the_ranks_that_recorded_one():
    assert mean_loss(4.0, 2.0) == pytest.approx(2.0)
    assert math.isnan(mean_loss(0.0, 0.0))
    stats = gathered_stats([1.0, 99.0, 3.0], loss_count_r=[1, 0, 2])  # the middle rank recorded no loss
    assert mean_loss(float(stats.total(names.LOSS)[0]), float(stats.total(names.LOSS_RANKS)[0])) == pytest.approx(2.0)


# ------------------------------------------------------------------ loss spike: monitor


def feed(monitor: LossSpikeMonitor, losses, start: int = 0) -> list[bool]:
    """Evaluate and commit each loss; a flagged step is not applied. Returns whether each step was flagged."""
    flagged = []
    for offset, loss in enumerate(losses):
        findings = monitor.evaluate(start + offset, single_loss(loss))
        monitor.commit(start + offset, applied=not findings)
        flagged.append(bool(findings))
    return flagged


def steady_losses(count: int, seed: int = 0) -> list[float]:
    return list(3.0 * np.random.default_rng(seed).lognormal(0.0, 0.02, count))


def test_no_flag_during_warmup():
    config = LossSpikeConfig(warmup_steps=10, window=50)
    monitor = LossSpikeMonitor(config)
    assert feed(monitor, [3.0, 3.0, 3.0, 30.0, 3.0]) == [False] * 5
    assert feed(monitor, steady_losses(5)) == [False] * 5  # now 10 accepted losses: the baseline is trusted
    (finding,) = monitor.evaluate(10, single_loss(30.0))
    assert finding.action == Action.SKIP


def test_flags_3x_spike_after_warmup_and_keeps_it_out_of_history():
    monitor = LossSpikeMonitor(LossSpikeConfig(action="warn"))
    assert not any(feed(monitor, steady_losses(30)))
    history = list(monitor.history)
    (finding,) = monitor.evaluate(30, single_loss(9.0))
    assert finding.action == Action.WARN
    assert finding.values["loss"] == 9.0
    assert finding.values["ratio_to_median"] == pytest.approx(3.0, rel=0.05)
    assert "loss spike" in finding.message
    monitor.commit(30, applied=True)  # even an applied (warn) spike must not enter the baseline
    assert list(monitor.history) == history
    assert monitor.spikes == 1
    assert feed(monitor, [3.0], start=31) == [False]
    assert list(monitor.history) == [*history, 3.0][-monitor.config.window:]


def test_loss_spike_state_round_trip_gives_identical_decisions():
    config = LossSpikeConfig(warmup_steps=5, window=20)
    original = LossSpikeMonitor(config)
    feed(original, [*steady_losses(25), 12.0, *steady_losses(3, seed=1)])
    restored = LossSpikeMonitor(config)
    restored.load_state_dict(original.state_dict())
    assert list(restored.history) == list(original.history) and restored.spikes == original.spikes == 1
    upcoming = [3.0, 7.0, 3.1, 2.9, 9.0, 3.05, 4.5]
    expected = feed(original, upcoming, start=29)
    assert feed(restored, upcoming, start=29) == expected
    assert feed(LossSpikeMonitor(config), upcoming) != expected  # a cold monitor would decide differently
    assert original.state_dict() == restored.state_dict()


def spread_stats(losses) -> AgreedStats:
    """One step of ranks' losses with the shared worker moments the data family writes (shift 0)."""
    layout = StatLayout()
    for name, size in ((names.LOSS, 1), (names.LOSS_COUNT, 1), (names.LOSS_RANKS, 1), (LOSS_MOMENTS, 5)):
        layout.add(name, size, Reduce.SUM)
    layout.freeze()
    rows = np.zeros((len(losses), layout.size))
    for rank, loss in enumerate(losses):
        rows[rank, layout[names.LOSS].span] = loss
        rows[rank, layout[names.LOSS_COUNT].span] = 1.0
        rows[rank, layout[names.LOSS_RANKS].span] = 1.0
        rows[rank, layout[LOSS_MOMENTS].span] = [loss, loss ** 2, 0.0, loss ** 3, loss ** 4]
    return AgreedStats.from_rows(layout, rows, tuple(range(len(losses))))


def two_kinds(count: int, seed: int = 0) -> list[tuple[float, float]]:
    """Two ranks reading different kinds of text: their own levels, and noise of their own."""
    rng = np.random.default_rng(seed)
    return [(2.3 + 0.08 * rng.standard_normal(), 2.8 + 0.08 * rng.standard_normal()) for _ in range(count)]


def feed_ranks(monitor: LossSpikeMonitor, steps, start: int = 0) -> list[list[Finding]]:
    found = []
    for offset, losses in enumerate(steps):
        findings = monitor.evaluate(start + offset, spread_stats(losses))
        monitor.commit(start + offset, applied=not any(f.action >= Action.SKIP for f in findings))
        found.append(findings)
    return found


def test_one_ranks_outlier_batch_is_left_to_the_data_detector_and_a_job_wide_spike_is_not() -> None:
    monitor = LossSpikeMonitor(LossSpikeConfig(), read_spread=True)
    assert not any(feed_ranks(monitor, two_kinds(60)))
    history, spreads = list(monitor.history), list(monitor.spreads)
    assert len(spreads) == 60
    (outlier,) = monitor.evaluate(60, spread_stats([5.0, 2.8]))  # rank 0's batch: twice its level, rank 1 as usual
    assert (outlier.action, outlier.severity) == (Action.NONE, Severity.INFO)
    assert "left to the data detector" in outlier.message
    assert outlier.values["loss"] > outlier.values["threshold"]  # over the threshold, as the mean alone reads it
    monitor.commit(60, applied=True)
    assert (monitor.one_rank, monitor.spikes) == (1, 0)
    assert list(monitor.history) == history and list(monitor.spreads) == spreads  # kept out of both baselines
    (spike,) = monitor.evaluate(61, spread_stats([2.3 * 1.6, 2.8 * 1.6]))  # every rank's loss up: the training's
    assert (spike.action, spike.severity) == (Action.SKIP, Severity.WARNING)
    monitor.commit(61, applied=False)
    restored = LossSpikeMonitor(LossSpikeConfig(), read_spread=True)
    restored.load_state_dict(monitor.state_dict())
    assert list(restored.spreads) == spreads and restored.one_rank == 1
    upcoming = [(5.0, 2.8), (3.6, 4.4), *two_kinds(3, seed=1)]
    assert [[f.action for f in fs] for fs in feed_ranks(restored, upcoming, 62)] == \
        [[f.action for f in fs] for fs in feed_ranks(monitor, upcoming, 62)]


def test_without_the_spread_one_ranks_outlier_is_a_spike() -> None:
    """The data detector off (the spread not read), or one rank: the mean's rule alone, as before."""
    for monitor, outlier in ((LossSpikeMonitor(LossSpikeConfig(), read_spread=False), [5.0, 2.8]),
                             (LossSpikeMonitor(LossSpikeConfig(one_rank_to_data=False), read_spread=True),
                              [5.0, 2.8])):
        feed_ranks(monitor, two_kinds(60))
        (spike,) = monitor.evaluate(60, spread_stats(outlier))
        assert spike.action == Action.SKIP
    alone = LossSpikeMonitor(LossSpikeConfig(), read_spread=True)
    feed_ranks(alone, [(2.3 + 0.02 * i % 0.1,) for i in range(60)])
    (spike,) = alone.evaluate(60, spread_stats([5.0]))
    assert spike.action == Action.SKIP


def test_the_family_reads_the_spread_only_with_the_data_detector_on() -> None:
    def family_reads(*overrides: str) -> tuple[bool, int, list[str]]:
        config = load_config(None, list(overrides))
        ctx = FamilyContext(config, section_of(config, LossSpikeFamily()), GROUP_NAMES, Reduce.REPLICATED)
        (monitor,) = LossSpikeFamily().monitors(ctx)
        return monitor.read_spread, monitor.spread_warmup, [decl.name for decl in LossSpikeFamily().statistics(ctx)]

    assert family_reads() == (True, 20, [LOSS_MOMENTS])
    assert family_reads("detectors.data.warmup_steps=40", "detectors.data.window=100") == (True, 40, [LOSS_MOMENTS])
    assert family_reads("detectors.data.enabled=false")[::2] == (False, [])
    assert family_reads("detectors.loss_spike.one_rank_to_data=false")[::2] == (False, [])


def test_an_outlier_before_the_data_detectors_warmup_is_a_spike() -> None:
    """The data detector cannot judge before its own warm-up: until then the mean's rule decides alone."""
    monitor = LossSpikeMonitor(LossSpikeConfig(warmup_steps=5), read_spread=True, data_warmup=30)
    feed_ranks(monitor, two_kinds(25))
    (spike,) = monitor.evaluate(25, spread_stats([5.0, 2.8]))
    assert spike.action == Action.SKIP
    monitor.commit(25, applied=False)
    feed_ranks(monitor, two_kinds(5, seed=2), 26)  # 30 accepted steps now
    (outlier,) = monitor.evaluate(31, spread_stats([5.0, 2.8]))
    assert outlier.action == Action.NONE


# ------------------------------------------------------------------ decision policy


def finding(action: Action) -> Finding:
    return Finding("test", action, Severity.ERROR, f"requested {action.name}")


def run_policy(policy: DecisionPolicy, actions: list[Action]) -> list[Action]:
    decided = []
    for step, action in enumerate(actions):
        decision = policy.decide(step, [finding(action)] if action else [])
        policy.commit(decision)
        decided.append(decision.action)
    return decided


def test_policy_escalates_persistent_skips_to_abort():
    policy = DecisionPolicy(PolicyConfig(max_consecutive_skips=2, on_persistent_failure="abort"))
    assert run_policy(policy, [Action.SKIP, Action.SKIP]) == [Action.SKIP, Action.SKIP]
    decision = policy.decide(2, [finding(Action.SKIP)])
    assert decision.action == Action.ABORT and not decision.applies_update
    assert decision.findings[-1].detector == "policy"
    assert "3 consecutive steps" in decision.findings[-1].message
    assert policy.skipped_steps == 2


def test_policy_resets_after_a_healthy_step():
    policy = DecisionPolicy(PolicyConfig(max_consecutive_skips=2))
    actions = [Action.SKIP, Action.SKIP, Action.NONE, Action.SKIP, Action.SKIP, Action.WARN, Action.SKIP]
    assert run_policy(policy, actions) == actions
    assert policy.skipped_steps == 5 and policy.consecutive_skips == 1


def test_one_ranks_non_finite_gradients_behind_a_loss_scaler_escalate_like_any_persistent_fault():
    """Overflow skips (a dynamic loss scaler's) that blame the same rank, not every rank, count as a persistent fault
    past max_consecutive_skips, naming the rank; overflows on every rank (a scale too high) stay the scaler's routine,
    and another rank's overflow starts the count again."""
    def overflow_on(*ranks: int) -> list[Finding]:
        return [Finding("non_finite", Action.SKIP, Severity.ERROR, "non-finite", ranks=ranks),
                Finding("grad_scaler_overflow", Action.SKIP, Severity.WARNING, "the scaler skipped", by_framework=True)]

    def run(policy: DecisionPolicy, blamed: list[tuple[int, ...]]) -> list[Action]:
        decided = []
        for step, ranks in enumerate(blamed):
            decision = policy.decide(step, overflow_on(*ranks), overflow=True)
            policy.commit(decision)
            decided.append(decision.action)
        return decided

    config = PolicyConfig(max_consecutive_skips=2, max_consecutive_overflow_skips=32, on_persistent_failure="abort")
    everywhere = run(DecisionPolicy(config, num_ranks=4), [(0, 1, 2, 3)] * 10)
    assert everywhere == [Action.SKIP] * 10  # a scale search: routine
    alternating = run(DecisionPolicy(config, num_ranks=4), [(1,), (2,)] * 5)
    assert alternating == [Action.SKIP] * 10  # no rank's fault persists
    policy = DecisionPolicy(config, num_ranks=4)
    assert run(policy, [(1,), (1,), (1,)]) == [Action.SKIP, Action.SKIP, Action.ABORT]
    escalation = policy.decide(3, overflow_on(1), overflow=True)  # (the policy's state after the abort was reset)
    assert escalation.action == Action.SKIP
    single = DecisionPolicy(config, num_ranks=1)  # one rank: every overflow is every rank's
    assert run(single, [(0,)] * 5) == [Action.SKIP] * 5
    blamed = DecisionPolicy(config, num_ranks=2)
    run(blamed, [(1,), (1,)])
    stop = blamed.decide(2, overflow_on(1), overflow=True)
    note = stop.findings[-1]
    assert stop.action == Action.ABORT and note.ranks == (1,) and "rank 1 only" in note.message, note
    restored = DecisionPolicy(config, num_ranks=2)
    restored.load_state_dict(blamed.state_dict())
    assert restored.decide(2, overflow_on(1), overflow=True).action == Action.ABORT


def test_zero_skips_allowed_aborts_on_first_skip():
    assert run_policy(DecisionPolicy(PolicyConfig(max_consecutive_skips=0)), [Action.SKIP]) == [Action.ABORT]


def test_rollback_without_recovery_escalates_to_abort():
    decision = DecisionPolicy(PolicyConfig()).decide(0, [finding(Action.ROLLBACK)])
    assert decision.action == Action.ABORT
    assert "recovery is not enabled" in decision.findings[-1].message
    with_recovery = DecisionPolicy(PolicyConfig(), can_rollback=True)
    assert with_recovery.decide(0, [finding(Action.ROLLBACK)]).action == Action.ROLLBACK


def test_persistent_skips_escalate_to_rollback_by_default():
    policy = DecisionPolicy(PolicyConfig(max_consecutive_skips=1), can_rollback=True)
    assert run_policy(policy, [Action.SKIP]) == [Action.SKIP]
    decision = policy.decide(1, [finding(Action.SKIP)])
    assert decision.action == Action.ROLLBACK and decision.findings[-1].detector == "policy"
    policy.commit(decision)
    assert policy.consecutive_skips == 0  # the rollback changed the state: a new run of skips starts


def test_strongest_action_wins():
    decision = DecisionPolicy(PolicyConfig()).decide(0, [finding(Action.WARN), finding(Action.SKIP)])
    assert decision.action == Action.SKIP and len(decision.findings) == 2


# ------------------------------------------------------------------ why a robust baseline: vs Megatron / Lightning


def noisy_loss_trace(seed: int = 0, num_steps: int = 2000, sigma: float = 0.08):
    """A decreasing pretraining-like loss with multiplicative noise and 10 spikes (2x..5x) at known steps.

    Measured over seeds 0..99 at sigma=0.08: ours never false-alarms and catches all 10 spikes in 94 seeds; in
    the other 6 it misses only the 2x spike at step 100, where the steep early descent inflates the window's MAD.
    """
    rng = np.random.default_rng(seed)
    steps = np.arange(num_steps)
    loss = (2.0 + 3.0 * np.exp(-steps / 300.0)) * rng.lognormal(0.0, sigma, num_steps)
    spike_steps = np.linspace(100, num_steps - 100, 10).astype(int)
    loss[spike_steps] *= np.linspace(2.0, 5.0, 10)
    return loss, set(spike_steps.tolist())


def megatron_spikes(losses, num_samples: int = 100, threshold: float = 10.0) -> set[int]:
    """Megatron-LM ``RerunStateMachine.is_unexpectedly_large`` (loss, threshold=10): the max |loss| of the
    first ``num_samples`` steps is the reference; afterwards a loss >= threshold x that max is spiky."""
    reference, flagged = 0.0, set()
    for step, loss in enumerate(losses):
        if step < num_samples:
            reference = max(reference, abs(loss))
        elif abs(loss) >= threshold * reference:
            flagged.add(step)
    return flagged


def lightning_spikes(losses, window: int = 10, warmup: int = 1, atol: float | None = None,
                     rtol: float | None = 2.0) -> set[int]:
    """Lightning's ``SpikeDetection`` (lightning/fabric/utilities/spike.py; defaults window=10, warmup=1,
    atol=None, rtol=2.0, mode="min"): after ``warmup`` batches, a loss that is not below the last accepted loss
    and differs from the running mean of the last ``window`` accepted losses by >= atol and >= rtol x mean is
    a spike. Lightning then stops training; here the spike is just kept out of the running statistics."""
    recent, last, flagged = deque(maxlen=window), 0.0, set()
    for step, loss in enumerate(losses):
        mean = float(np.mean(recent)) if recent else 0.0
        deviation = abs(loss - mean)
        is_spike = (step >= warmup and loss > last  # not an improvement (mode="min")
                    and (atol is None or deviation >= abs(atol))
                    and (rtol is None or deviation >= abs(rtol * mean)))
        if is_spike:
            flagged.add(step)
        else:
            recent.append(loss)
            last = loss
    return flagged


def our_spikes(losses, config: LossSpikeConfig | None = None) -> set[int]:
    monitor = LossSpikeMonitor(config or LossSpikeConfig())
    return {step for step, flagged in enumerate(feed(monitor, losses)) if flagged}


def score(flagged: set[int], spikes: set[int]) -> tuple[int, int]:
    """``(detections, false_alarms)``."""
    return len(flagged & spikes), len(flagged - spikes)


def test_robust_baseline_beats_megatron_and_lightning_rules():
    losses, spikes = noisy_loss_trace()
    ours = score(our_spikes(losses), spikes)
    megatron = score(megatron_spikes(losses), spikes)
    lightning_default = score(lightning_spikes(losses), spikes)
    # Lightning with a tolerance as tight as our min_relative_increase (0.25)
    lightning_tight = score(lightning_spikes(losses, rtol=0.25), spikes)
    print(f"\n{len(spikes)} spikes in {len(losses)} steps: (detections, false alarms) "
          f"ours={ours} megatron={megatron} lightning(rtol=2.0)={lightning_default} "
          f"lightning(rtol=0.25)={lightning_tight}")
    assert ours == (len(spikes), 0)
    assert ours[0] > megatron[0]
    # Lightning's default tolerance (loss >= 3x the mean) is quiet but misses the 2x..3x spikes ...
    assert ours[0] > lightning_default[0] and ours[1] <= lightning_default[1]
    # ... and a tolerance tight enough to catch them fires on the noise.
    assert ours[1] < lightning_tight[1]


def test_robust_baseline_adapts_to_noisier_losses():
    """A fixed relative tolerance that is quiet at one noise level alarms when the batch gets smaller."""
    quiet_losses, spikes = noisy_loss_trace(sigma=0.08)
    # rtol=0.5 is a well-tuned Lightning rule at sigma=0.08: every spike, no false alarm (like ours)
    assert score(lightning_spikes(quiet_losses, rtol=0.5), spikes) == (len(spikes), 0)
    noisy_losses, spikes = noisy_loss_trace(sigma=0.15)
    ours = score(our_spikes(noisy_losses), spikes)
    lightning = score(lightning_spikes(noisy_losses, rtol=0.5), spikes)
    print(f"\nsigma=0.15: (detections, false alarms) ours={ours} lightning(rtol=0.5)={lightning}")
    assert ours[1] == 0 < lightning[1]
    # the price of adapting: a 2x spike inside the noisier, steep early phase may pass unflagged
    assert ours[0] >= len(spikes) - 1


def test_a_relative_gradient_explosion_below_the_fixed_ceiling_is_found_against_the_runs_own_log_norms() -> None:
    """A pre-clip norm decaying from 50 to 1 with 30% log-normal noise: no alarm in 400 steps; 100x the trend on one
    step (far below the 1e4 ceiling): an explosion with the explosion action, reported against the baseline; that norm
    never enters the baseline; the baseline survives a state round trip; ``relative: false`` leaves it to the
    ceiling."""
    def stats_of(norm: float) -> AgreedStats:
        layout = StatLayout()
        layout.add(names.GRAD_SQ, 1, Reduce.SUM)
        return AgreedStats.from_rows(layout, np.array([[norm * norm]]))

    config = GradNormConfig()
    monitor, off = GradNormMonitor(config), GradNormMonitor(dataclasses.replace(config, relative=False))
    rng = np.random.default_rng(4)
    for step in range(400):
        norm = (1.0 + 49.0 * math.exp(-step / 80)) * math.exp(0.3 * rng.standard_normal())
        if step == 350:
            norm *= 100.0
        found, found_off = monitor.evaluate(step, stats_of(norm)), off.evaluate(step, stats_of(norm))
        monitor.commit(step, applied=not found)
        off.commit(step, applied=True)
        assert found_off == []
        if step != 350:
            assert found == [], (step, found)
            continue
        (finding,) = found
        assert finding.action is Action.SKIP and finding.values["relative"] and "baseline" in finding.message
        assert finding.values["grad_norm"] / finding.values["baseline"] > 50
    assert max(monitor.history) < math.log(100.0)
    restored = GradNormMonitor(config)
    restored.load_state_dict(monitor.state_dict())
    assert list(restored.history) == list(monitor.history) and restored.explosions == 1


def test_the_level_shift_arm_sees_a_sustained_rise_under_a_decaying_loss_and_not_a_lone_spike() -> None:
    """A loss decaying from 6 to 2 with 2% noise: 1,000 steps, no finding of either arm. Then one step 3x (a spike:
    the spike arm, not the level arm), and from step 1,100 a sustained +15% (no step of it a spike): one level-shift
    finding within 5 steps, with the level action, and none again while the shift lasts."""
    from arc_engine.monitors.loss_spike import cusum_step, difference_noise

    assert cusum_step(3.0, 100.0, 1.0, 5.0) == 7.0 and cusum_step(1.0, -4.0, 1.0, 5.0) == 0.0
    trend = [10.0 - 0.1 * i for i in range(50)]  # a pure trend: no step-to-step noise at all
    assert difference_noise(trend) == pytest.approx(0.0, abs=1e-12) and math.isnan(difference_noise([1.0, 2.0]))
    layout = StatLayout()
    layout.add(names.LOSS, 1, Reduce.SUM)
    layout.add(names.LOSS_RANKS, 1, Reduce.SUM)
    monitor = LossSpikeMonitor(LossSpikeConfig())
    rng = np.random.default_rng(5)
    level_steps, spike_steps = [], []
    for step in range(1200):
        loss = (2.0 + 4.0 * math.exp(-step / 300)) * (1 + 0.02 * rng.standard_normal())
        loss *= 3.0 if step == 1050 else 1.15 if step >= 1100 else 1.0
        found = monitor.evaluate(step, AgreedStats.from_rows(layout, np.array([[loss, 1.0]])))
        spike = [f for f in found if "spike" in f.message]
        level = [f for f in found if f.values.get("level_shift")]
        monitor.commit(step, applied=not spike)
        spike_steps += [step] * len(spike)
        level_steps += [step] * len(level)
        assert all(f.action is Action.WARN for f in level)
    assert spike_steps == [1050]
    assert len(level_steps) == 1 and 1100 <= level_steps[0] < 1105, level_steps
    assert monitor.metrics()["level_shifts"] == 1.0

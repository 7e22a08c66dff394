"""The R-Metric: the three-stage normalization against hand-computed values, the score as written and normalized,
the monitor on simulated ranks (a stationary run stays quiet in the default reading and alerts in the paper's;
a loss drift and a worker-variance rise alert once, after most of ``persist`` steps), the validation-loss source, agreed
system events, and the state across a restore. The 4-rank runs are in tests/test_straggler.py."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from arc_engine.config import load_config
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.family import FamilyContext, ModelParts, StepView, section_of
from arc_engine.monitors.hardware_events import HardwareEvents, pci_bus_id
from arc_engine.monitors.r_metric import (
    DEVICE_EVENTS,
    EVENTS,
    VALIDATION,
    Normalizer,
    RMetricFamily,
    RMetricMonitor,
    percentile_rank,
)
from arc_engine.monitors.worker_spread import GRAD_NORM_MOMENTS
from arc_engine.policy import Decision
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, StatLayout, names
from tests.scripts_loader import load_script


def test_percentile_rank_counts_ties_half() -> None:
    assert percentile_rank(np.array([1.0, 2.0, 3.0]), 2.5) == pytest.approx(2 / 3)
    assert percentile_rank(np.array([1.0, 2.0, 3.0]), 2.0) == pytest.approx(0.5)
    assert percentile_rank(np.zeros(7), 0.0) == 0.5  # nothing happening is neutral
    assert percentile_rank(np.zeros(4), 1.0) == 1.0
    assert percentile_rank(np.array([]), 3.0) == 0.5


def test_the_normalization_matches_hand_computed_values() -> None:
    """Window 3, EMA 0.3, gain 4 on the stream 1, 2, 3, 2.5, 0:
    p = 0.5 (empty), 1, 1, 2/3 (among 1, 2, 3), 0 (among 2, 3, 2.5);
    s = 0.5, 0.65, 0.755, 0.7285, 0.50995; norm = 1 / (1 + exp(-4 (s - 0.5)))."""
    normalizer = Normalizer(3, 0.3, 4.0)
    expected_s = [0.5, 0.65, 0.755, 0.3 * 2 / 3 + 0.7 * 0.755, 0.7 * (0.3 * 2 / 3 + 0.7 * 0.755)]
    for value, s in zip([1.0, 2.0, 3.0, 2.5, 0.0], expected_s, strict=True):
        peeked = normalizer.peek(value)
        normalizer.push(value)
        assert normalizer.smoothed == pytest.approx(s) and peeked[0] == pytest.approx(s)
        assert normalizer.norm == pytest.approx(1.0 / (1.0 + math.exp(-4.0 * (s - 0.5))))
    assert list(normalizer.history) == [3.0, 2.5, 0.0]
    assert normalizer.norm == pytest.approx(0.509949, abs=1e-6)  # 1 / (1 + exp(-4 x 0.00995))


# ------------------------------------------------------------------ the monitor on simulated ranks

def _setup(*overrides: str) -> tuple[StatLayout, RMetricMonitor]:
    # alone here: no consistency family writes the shared worker moments, so the R-Metric writes them itself
    config = load_config(None, ["detectors.r_metric.nvml=false", "detectors.consistency.enabled=false", *overrides])
    ctx = FamilyContext(config, section_of(config, RMetricFamily()), ["g"], Reduce.SUM)
    family = RMetricFamily()
    layout = StatLayout()
    for name, size, reduce in names.adapter_statistics(1, Reduce.SUM):
        layout.add(name, size, reduce)
    for decl in family.statistics(ctx):
        layout.add(decl.name, decl.size, decl.reduce)
    layout.freeze()
    (monitor,) = family.monitors(ctx)
    return layout, monitor


def _step(layout: StatLayout, monitor: RMetricMonitor, step: int, losses: list[float], norms: list[float],
          events: int = 0) -> list[Finding]:
    rows = []
    for rank, (loss, norm) in enumerate(zip(losses, norms, strict=True)):
        buffer = StatBuffer(layout, torch.device("cpu"))
        buffer.put(names.LOSS, loss)
        buffer.put(names.LOSS_COUNT, 1.0)
        buffer.put(names.LOSS_RANKS, 1.0)
        buffer.put(names.GRAD_SQ_LOCAL, norm * norm)
        monitor.write(buffer, StepView(step, [], local_events=events))
        if rank:  # one monitor stands for every rank here: the events are rank 0's own
            buffer.view(EVENTS).zero_()
        rows.append(buffer.values.numpy().copy())
    findings = monitor.evaluate(step, AgreedStats.from_rows(layout, np.stack(rows)))
    monitor.commit(step, True)
    return findings


def _run(layout: StatLayout, monitor: RMetricMonitor, steps: int, drift_from: int = -1, spread_from: int = -1,
         seed: int = 0) -> dict[int, list[Finding]]:
    """Four ranks, noisy stationary losses and norms; from ``drift_from`` the loss rises 0.05 per step, from
    ``spread_from`` the ranks' norms part further every step."""
    rng = np.random.default_rng(seed)
    alerts = {}
    for step in range(steps):
        base = 3.0 + 0.05 * max(step - drift_from, 0) * (drift_from >= 0)
        spread = 0.1 * (1 + 0.2 * max(step - spread_from, 0) * (spread_from >= 0))
        losses = list(base + 0.05 * rng.normal(size=4))
        norms = list(np.abs(1.0 + spread * rng.normal(size=4)))
        found = _step(layout, monitor, step, losses, norms)
        if found:
            alerts[step] = found
    return alerts


def test_a_stationary_run_alerts_as_written_but_not_in_the_normalized_reading() -> None:
    layout, monitor = _setup()
    assert _run(layout, monitor, 600) == {}
    values = monitor.metrics()
    assert values["score"] == pytest.approx(values["score_paper"] / 1.25)
    layout, paper = _setup("detectors.r_metric.score=paper")
    assert len(_run(layout, paper, 600)) >= 3  # R ~ 0.62 on a stationary run: above 0.57 most of the time


def test_a_loss_drift_alerts_once_after_most_of_persist_steps_and_names_the_drift() -> None:
    layout, monitor = _setup()
    alerts = _run(layout, monitor, 200, drift_from=120)
    assert len(alerts) == 1
    (step, (finding,)), = alerts.items()
    assert 120 + 20 <= step <= 120 + 60, step  # most of the last 40 steps above the threshold: the drift's
    assert finding.detector == "r_metric" and finding.action is Action.WARN
    assert "largest term: training-loss drift ΔL" in finding.message
    assert finding.values["norm_drift"] > 0.8 and finding.values["score"] > 0.57


def test_a_rising_worker_variance_alerts() -> None:
    layout, monitor = _setup("detectors.r_metric.drift_weight=0.1")
    alerts = _run(layout, monitor, 200, spread_from=120)
    assert len(alerts) == 1 and "worker gradient-norm variance σ²" in next(iter(alerts.values()))[0].message


def test_validation_losses_replace_the_training_loss_proxy() -> None:
    """Ranks 0 and 1 record validation losses 2.0 and 4.0 before step 5: the term restarts on their mean (3.0) and
    from then on only moves on steps with a validation loss."""
    layout, monitor = _setup()
    _run(layout, monitor, 5)
    assert monitor.source == "train_loss" and len(monitor.losses) == 5
    rows = []
    for rank in range(2):
        buffer = StatBuffer(layout, torch.device("cpu"))
        monitor._validation = [2.0 + 2.0 * rank]  # what record_validation_loss leaves on each rank
        monitor.write(buffer, StepView(5, []))
        rows.append(buffer.values.numpy().copy())
    assert rows[1][layout[VALIDATION].span].tolist() == [4.0, 1.0]
    monitor.evaluate(5, AgreedStats.from_rows(layout, np.stack(rows)))
    monitor.commit(5, True)
    assert monitor.source == "validation" and list(monitor.losses) == [3.0]
    drift_history = list(monitor.normalizers["drift"].history)
    _run(layout, monitor, 3, seed=1)  # no validation loss: the drift term holds
    assert list(monitor.normalizers["drift"].history) == drift_history and list(monitor.losses) == [3.0]


def test_agreed_events_and_local_events_make_lambda() -> None:
    layout, monitor = _setup("detectors.r_metric.event_window=3")
    straggler = Finding("straggler", Action.WARN, Severity.WARNING, "two ranks", ranks=(1, 3))
    overflow = Finding("deepspeed_overflow", Action.SKIP, Severity.WARNING, "overflow")
    other = Finding("loss_spike", Action.SKIP, Severity.WARNING, "spike")
    machine = Finding("straggler", Action.NONE, Severity.INFO, "a contended machine")  # names no rank: not counted
    _step(layout, monitor, 0, [3.0] * 4, [1.0] * 4)
    monitor.observe(Decision(0, Action.WARN, (straggler, machine, overflow, other)))
    _step(layout, monitor, 1, [3.0] * 4, [1.0] * 4, events=2)  # rank 0: two hang reports so far
    assert monitor.metrics()["lambda"] == 5.0  # 2 stragglers + 1 overflow + 2 local
    _step(layout, monitor, 2, [3.0] * 4, [1.0] * 4, events=2)  # no new local event
    assert monitor.metrics()["lambda"] == 5.0
    for step in (3, 4):
        _step(layout, monitor, step, [3.0] * 4, [1.0] * 4, events=2)
    assert monitor.metrics()["lambda"] == 0.0  # out of the 3-step window


def test_the_state_survives_a_restore_and_the_variance_is_off_under_model_parallelism() -> None:
    layout, monitor = _setup()
    _run(layout, monitor, 50)
    state: dict[str, Any] = monitor.state_dict()
    _, restored = _setup()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    config = load_config(None, ["detectors.r_metric.nvml=false"])
    sharded = FamilyContext(config, section_of(config, RMetricFamily()), ["g"], Reduce.SUM,
                            ModelParts(model_parallel_size=2))
    family = RMetricFamily()
    assert GRAD_NORM_MOMENTS not in {d.name for d in family.statistics(sharded)}
    (monitor,) = family.monitors(sharded)
    assert not monitor.variance and EVENTS in monitor.required_stats()


def test_hardware_events_stay_off_without_a_gpu_and_address_nvml_by_pci() -> None:
    """On CPU nothing is polled (0 events, no NVML import); a CUDA device is found in NVML by its PCI address, which
    CUDA_VISIBLE_DEVICES does not renumber."""
    events = HardwareEvents(torch.device("cpu"), True)
    assert not events.active and events.poll() == 0
    properties = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    assert pci_bus_id(properties) == "00000000:3B:00.0"
    assert pci_bus_id(SimpleNamespace(pci_bus_id=59)) is None  # torch without the full address: by index instead



def test_a_healthy_runs_growing_worker_spread_is_neutral_relative_to_its_recent_level() -> None:
    """The ranks' spread grows by orders of magnitude as the loss falls (the bench's healthy runs); a percentile
    against the raw history reads that as a warning (as on clean campaign runs), σ² relative to its recent level does
    not."""
    healthy = load_script("bench_r_metric").healthy
    warned = {}
    for relative in (True, False):
        loaded = load_config(None, ["detectors.r_metric.nvml=false",
                                    f"detectors.r_metric.variance_relative={str(relative).lower()}"])
        config = section_of(loaded, RMetricFamily())
        warned[relative] = 0
        for seed in range(8):
            monitor = RMetricMonitor(config, variance=True)
            alerts = 0
            for step, raw in enumerate(healthy(np.random.default_rng(seed), 360, 0.0)):
                alerts += len(monitor.judge(raw))
                monitor.commit(step, True)
            warned[relative] += alerts > 0
    assert warned[True] == 0 and warned[False] >= 4, warned


def test_the_relative_level_survives_a_restart_and_a_sustained_spread_jump_still_alerts() -> None:
    config = section_of(load_config(None, ["detectors.r_metric.nvml=false"]), RMetricFamily())
    rng = np.random.default_rng(3)
    monitor, alerts = RMetricMonitor(config, variance=True), []
    for step in range(400):  # the ranks' spread jumps 30x at step 200 and stays there
        raw = {"events": 0.0, "variance": float(0.01 * (30.0 if step >= 200 else 1.0) * np.exp(0.3 * rng.normal())),
               "loss": 3.0 + 0.05 * float(rng.normal()), "source": 0.0}
        if monitor.judge(raw):
            alerts.append(step)
        monitor.commit(step, True)
        if step == 150:
            state = monitor.state_dict()
            monitor = RMetricMonitor(config, variance=True)
            monitor.load_state_dict(state)
            assert list(monitor.log_variances) == state["log_variances"] and len(state["log_variances"]) == 100
    assert len(alerts) == 1 and 200 < alerts[0] <= 250, alerts


def test_the_devices_that_reported_events_are_named_from_their_rows_only_on_a_step_with_events() -> None:
    """Each rank writes its device's new events (NVML's, or the ``hardware_events`` fault's) into one SUM slot;
    only when the agreed sum is not 0 are the rows read, naming the devices in a finding with no action whose
    evidence the device ledger records, once per episode. The events count in λ as well."""
    layout, monitor = _setup()
    peers = [_setup()[1] for _ in range(3)]  # the other ranks' producers (the same layout)

    def step(number: int, device_events: list[int]) -> list[Finding]:
        rows = []
        for writer, events in zip([monitor, *peers], device_events, strict=True):
            buffer = StatBuffer(layout, torch.device("cpu"))
            buffer.put(names.LOSS, 3.0)
            buffer.put(names.LOSS_COUNT, 1.0)
            buffer.put(names.LOSS_RANKS, 1.0)
            buffer.put(names.GRAD_SQ_LOCAL, 1.0)
            writer.write(buffer, StepView(number, [], local_events=events, device_events=events))
            rows.append(buffer.values.numpy().copy())
        findings = monitor.evaluate(number, AgreedStats.from_rows(layout, np.stack(rows), ranks=(4, 5, 6, 7)))
        monitor.commit(number, True)
        return findings

    assert not [f for f in step(0, [0, 0, 0, 0]) if f.detector == "hardware_events"]
    (named,) = [f for f in step(1, [0, 0, 3, 0]) if f.detector == "hardware_events"]  # running counts
    assert (named.ranks, named.action, named.hardware) == ((6,), Action.NONE, "hardware_event"), named
    assert named.values == {"events_per_rank": {"6": 3}} and "rank 6: 3" in named.message
    assert monitor.metrics()["lambda"] == 3.0
    assert DEVICE_EVENTS in layout
    # the same device again within event_window monitored steps: counted in λ, not named again; another device is
    later = [f for f in step(2, [0, 0, 5, 1]) if f.detector == "hardware_events"]
    assert [f.ranks for f in later] == [(7,)] and monitor.metrics()["lambda"] == 6.0, later  # 3 + 2 + 1

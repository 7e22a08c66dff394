"""``policy.mode: observe``: arc_engine detects, reports and alerts exactly as it would act, and carries nothing
out: no skip, rollback, recomputation, escalation or abort; the hang watchdog only alerts; a framework's own skip is
still reported as the framework's."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from arc_engine.config import ConfigError, load_config
from arc_engine.config.schema import PolicyConfig
from arc_engine.events import Action, Finding, Severity
from arc_engine.policy.decision import DecisionPolicy
from arc_engine.sinks import read_jsonl
from tests.dist_harness import run_ranks
from tests.training import make_config, train_ddp

ROOT = Path(__file__).resolve().parent.parent
SPIKE_STEP, NAN_STEP, STEPS = 5, 8, 11


def test_observe_refuses_the_settings_that_only_act() -> None:
    for override, key in [("recovery.enabled=true", "recovery.enabled"),
                          ("detectors.sdc.recompute.enabled=true", "detectors.sdc.recompute.enabled")]:
        with pytest.raises(ConfigError) as refused:
            load_config(None, ["policy.mode=observe", override])
        assert refused.value.key == key and "observe" in str(refused.value)
    assert load_config(ROOT / "configs" / "monitoring_only.yaml").policy.mode == "observe"


def test_observe_never_escalates_and_keeps_the_frameworks_own_skips() -> None:
    policy = DecisionPolicy(PolicyConfig(mode="observe", max_consecutive_skips=0, max_consecutive_overflow_skips=0,
                                         on_persistent_failure="abort"))
    nan = Finding("non_finite", Action.SKIP, Severity.ERROR, "NaN", (1,))
    abort = Finding("grad_norm", Action.ABORT, Severity.CRITICAL, "explosion")
    scaler = Finding("grad_scaler_overflow", Action.SKIP, Severity.WARNING, "overflow", by_framework=True)
    for step in range(5):
        for findings, overflow, happened, observed in [([nan], False, Action.NONE, Action.SKIP),
                                                        ([abort], False, Action.NONE, Action.ABORT),
                                                        ([scaler], True, Action.SKIP, Action.SKIP),
                                                        ([nan, scaler], False, Action.SKIP, Action.SKIP)]:
            decision = policy.decide(step, findings, overflow=overflow)
            assert (decision.action, decision.observed) == (happened, observed), (step, findings)
            assert not any(f.detector == "policy" for f in decision.findings)
            policy.commit(decision)


def _rank(rank: int, world: int, observing, acting) -> dict:
    return {"observe": train_ddp(rank, STEPS, observing), "act": train_ddp(rank, STEPS, acting)}


def test_observe_applies_every_step_and_reports_what_act_would_have_done(tmp_path: Path) -> None:
    """2 DDP ranks, a 30x loss spike at step 5 and a NaN gradient on rank 1 at step 8, with a policy that aborts at
    the first skip: acting, the job stops at step 5; observing, every step is applied (the spike moves the weights,
    the NaN reaches them), both ranks report the same findings with action ``none``, and the action events say
    what acting would have done."""
    faults = (f"faults.injections=[{{kind: loss_scale, rank: -1, step: {SPIKE_STEP}, scale: 30.0}}, "
              f"{{kind: nan_grad, rank: 1, step: {NAN_STEP}}}]")
    common = ("stats.interval=1", "detectors.loss_spike.warmup_steps=3", "policy.max_consecutive_skips=0",
              "policy.on_persistent_failure=abort", "watchdog.enabled=false", faults)
    observing = make_config(tmp_path / "observe", "policy.mode=observe", *common)
    acting = make_config(tmp_path / "act", *common)
    results = run_ranks(_rank, 2, observing, acting, timeout_s=240)
    for rank, result in enumerate(results):
        assert result["act"]["aborted_at"] == SPIKE_STEP, rank
        observed = result["observe"]
        snapshots = observed["snapshots"]
        assert len(snapshots) == STEPS
        assert all(not torch.equal(a, b) for a, b in itertools.pairwise(snapshots[:NAN_STEP + 1])), rank
        assert torch.isfinite(snapshots[NAN_STEP - 1]).all() and not torch.isfinite(snapshots[NAN_STEP]).all()
        assert {action for _, action, _ in observed["decisions"]} == {"NONE"}, observed["decisions"]
        assert observed["decisions"] == results[0]["observe"]["decisions"], "ranks disagree"
        flagged = {step: {d for d, _ in findings} for step, _, findings in observed["decisions"] if findings}
        assert "loss_spike" in flagged[SPIKE_STEP] and "non_finite" in flagged[NAN_STEP], flagged
    events = read_jsonl(tmp_path / "observe" / "test" / "events.jsonl")
    would = {e["step"]: e["values"]["would_have"] for e in events if e["kind"] == "action"}
    # the step's own verdict (observing keeps no run of skips, so nothing escalates to the abort acting took)
    assert would[SPIKE_STEP] == "skip" and would[NAN_STEP] == "skip", would
    assert set(would) == {SPIKE_STEP, *range(NAN_STEP, STEPS)}, would  # the NaN stays in the weights
    assert all(e["action"] == "none" for e in events if e["kind"] in ("detection", "action")), events
    assert not any(e["kind"] == "action" and e["action"] in ("skip", "abort", "rollback") for e in events)

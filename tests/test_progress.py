"""The one progress object (``arc.progress``): each step that did not reach the parameters counted once, by cause;
the same names in the summary, the metrics and the checkpoints; no counter forwarded or aliased elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from arc_engine.events import Action, Finding, Severity
from arc_engine.policy import Decision
from arc_engine.policy.decision import not_applied_cause
from arc_engine.progress import FRAMEWORK, POLICY, ROLLBACK, Progress

SPIKE = Finding("loss_spike", Action.SKIP, Severity.WARNING, "spike")
DEEPSPEED = Finding("deepspeed_overflow", Action.SKIP, Severity.WARNING, "overflow", by_framework=True)


@pytest.mark.parametrize(("decision", "framework_skipped", "cause"), [
    (None, False, None),
    (Decision(3, Action.NONE), False, None),
    (Decision(3, Action.WARN, (SPIKE,)), False, None),
    (Decision(3, Action.NONE), True, FRAMEWORK),            # the framework skipped after a decision to apply
    (Decision(3, Action.SKIP, (SPIKE,)), False, POLICY),
    (Decision(3, Action.SKIP, (SPIKE,), data=True), False, POLICY),
    (Decision(3, Action.SKIP, (SPIKE,), overflow=True), False, FRAMEWORK),   # a loss scaler's routine overflow
    (Decision(3, Action.SKIP, (SPIKE, DEEPSPEED)), False, FRAMEWORK),        # two causes: counted once
    (Decision(3, Action.SKIP, (SPIKE,)), True, POLICY),
    (Decision(3, Action.ROLLBACK, (SPIKE,)), False, ROLLBACK),
    (Decision(3, Action.ROLLBACK, (SPIKE,), escape=True), True, ROLLBACK),
])
def test_each_step_not_applied_has_one_cause(decision: Decision | None, framework_skipped: bool,
                                             cause: str | None) -> None:
    assert not_applied_cause(decision, framework_skipped) == cause


def test_the_counts_by_cause_add_up_and_survive_a_rollback_and_a_restart() -> None:
    progress = Progress()
    for cause in (None, POLICY, None, FRAMEWORK, ROLLBACK, None, POLICY):
        progress.close_step(cause)
    assert (progress.step, progress.iteration, progress.data_position, progress.applied_steps) == (7, 7, 7, 3)
    assert (progress.skipped_by_policy, progress.rolled_back, progress.skipped_by_framework) == (2, 1, 1)
    assert progress.steps_not_applied == 4 and not progress.last_applied
    progress.rewind(4, 6, applied_steps=2)  # a rollback: the state's counters go back, the causes do not
    assert (progress.step, progress.data_position, progress.applied_steps, progress.iteration) == (4, 6, 2, 7)
    assert progress.steps_not_applied == 4
    restarted = Progress()
    restarted.load_counters(progress.counters())
    assert restarted.counts() | {"steps": 0, "applied_steps": 0} == progress.counts() | {"steps": 0,
                                                                                       "applied_steps": 0}
    legacy = Progress()  # a checkpoint of an earlier release: its not-applied steps unsplit
    legacy.load_counters({"iteration": 9, "monitored_steps": 9, "unapplied_steps": 3, "framework_skipped_steps": 1})
    assert (legacy.skipped_by_policy, legacy.rolled_back, legacy.skipped_by_framework) == (2, 0, 1)
    assert set(progress.metrics()) == {f"arc/{name}" for name in ("iteration", "applied_steps", "steps_not_applied",
                                                                  "skipped_by_policy", "rolled_back",
                                                                  "skipped_by_framework")}


def test_the_summary_counts_are_the_progress_counts_and_arc_forwards_none(tmp_path: Path) -> None:
    """A run with a NaN skipped by the policy: the summary carries the progress counts under their names, and the
    Arc handle has ``progress`` and no counter of its own."""
    import arc_engine
    from arc_engine.wiring import Arc
    from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data

    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    arc = arc_engine.attach(model, optimizer, make_config(
        tmp_path, "stats.interval=1", "faults.injections=[{kind: nan_loss, rank: 0, step: 2}]"))
    for _ in range(5):
        loss = arc.faults.on_loss(model(*data.batch(arc.progress.data_position, 0, BATCH)))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    summary = arc.summary()
    arc.close()
    assert {key: summary[key] for key in arc.progress.counts()} == arc.progress.counts()
    assert (summary["steps"], summary["applied_steps"], summary["skipped_by_policy"],
            summary["steps_not_applied"]) == (5, 4, 1, 1)
    assert not any(name in vars(Arc) for name in ("step", "applied_steps", "skipped_steps", "data_position",
                                                  "rollbacks")) and "progress" in vars(Arc)

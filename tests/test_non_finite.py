"""``detectors.non_finite`` (``arc_engine/monitors/non_finite.py``): the family's own test, next to its one module.

Its config parses under ``detectors.non_finite`` through the same seam as a plugin family's, its monitor names the
rank and parameter group of a NaN/Inf, and a finite local gradient that turns non-finite in the reduction is caught.
"""

from __future__ import annotations

import math

import numpy as np

from arc_engine.config import load_config
from arc_engine.config.docs import field_docs
from arc_engine.events import Action, Severity
from arc_engine.monitors.family import section_of
from arc_engine.monitors.non_finite import NonFiniteConfig, NonFiniteFamily, NonFiniteMonitor, nonfinite_ranks
from arc_engine.monitors.registry import builtin_families, section_class
from tests.test_monitors import GROUP_NAMES, gathered_stats


def test_the_family_brings_its_config_through_the_plugin_seam() -> None:
    assert any(isinstance(family, NonFiniteFamily) for family in builtin_families())
    assert section_class("non_finite") is NonFiniteConfig
    assert set(field_docs(NonFiniteConfig)) == {"enabled", "action"}  # every key documented where it is declared
    assert section_of(load_config(None), NonFiniteFamily()) == NonFiniteConfig()
    config = load_config(None, ["detectors.non_finite.action=warn"])
    assert section_of(config, NonFiniteFamily()).action == "warn"


def test_nonfinite_ranks_reports_loss_grad_and_first_group():
    loss_r = np.array([1.0, math.nan, 2.0, math.inf])
    count_r = np.array([1, 1, 1, 1])
    nonfinite_rg = np.array([[0, 0], [0, 0], [0, 3], [1, 2]])
    assert nonfinite_ranks(loss_r, count_r, nonfinite_rg) == [(1, "loss", None), (2, "grad", 1),
                                                               (3, "loss+grad", 0)]
    # a rank that recorded no loss this step is not blamed for its (unset) loss value
    assert nonfinite_ranks(np.array([math.nan]), np.array([0]), np.zeros((1, 2))) == []


def test_nan_loss_on_one_rank_names_that_rank():
    monitor = NonFiniteMonitor(NonFiniteConfig(action="skip"), GROUP_NAMES)
    (finding,) = monitor.evaluate(3, gathered_stats([2.0, math.nan, 2.1]))
    assert finding.ranks == (1,)
    assert finding.action == Action.SKIP
    assert finding.severity == Severity.ERROR
    assert "rank 1 loss" in finding.message
    assert "rank 0" not in finding.message and "rank 2" not in finding.message
    monitor.commit(3, applied=False)
    assert monitor.count == 1


def test_nan_gradient_names_rank_and_group():
    monitor = NonFiniteMonitor(NonFiniteConfig(action="abort"), GROUP_NAMES)
    nonfinite_rg = np.zeros((3, 2))
    nonfinite_rg[2, 1] = 1
    (finding,) = monitor.evaluate(0, gathered_stats([2.0, 2.0, 2.0], nonfinite_rg=nonfinite_rg))
    assert finding.ranks == (2,)
    assert finding.action == Action.ABORT
    assert "rank 2 grad" in finding.message
    assert "group 1" in finding.message and "no_decay" in finding.message
    assert finding.values["first_group_name"] == "no_decay"
    assert finding.values["nonfinite_params_per_rank"] == [0.0, 0.0, 1.0]


def test_rows_map_to_global_ranks():
    monitor = NonFiniteMonitor(NonFiniteConfig(), GROUP_NAMES)
    (finding,) = monitor.evaluate(0, gathered_stats([1.0, math.inf], ranks=(4, 6)))
    assert finding.ranks == (6,)
    assert "rank 6 loss" in finding.message


def test_inf_counts_as_nonfinite():
    monitor = NonFiniteMonitor(NonFiniteConfig(action="warn"), GROUP_NAMES)
    (finding,) = monitor.evaluate(0, gathered_stats([math.inf, 1.0]))
    assert finding.ranks == (0,) and finding.action == Action.WARN
    (finding,) = monitor.evaluate(1, gathered_stats([-math.inf, 1.0]))
    assert finding.ranks == (0,)


def test_a_nan_loss_on_some_ranks_blames_their_batches_in_the_data_ledger_and_the_skip_stays_an_ordinary_one(
        tmp_path) -> None:
    """Rank 1's loss NaN, ranks 0 and 2 finite on the same weights: the finding suspects rank 1's batch
    (data_suspect), so the data ledger records the position as suspect bad data (skipped again once suspected
    twice);
    the policy counts the skip as an ordinary one (max_consecutive_skips bounds a faulty device's NaNs, not the data
    bound). A NaN loss on every rank (the model's, not a batch's) and a NaN gradient at a finite loss suspect no
    batch."""
    from arc_engine.config.schema import PolicyConfig
    from arc_engine.data_ledger import DataLedger, read_ledger
    from arc_engine.policy import DecisionPolicy

    monitor = NonFiniteMonitor(NonFiniteConfig(), GROUP_NAMES)
    (finding,) = monitor.evaluate(7, gathered_stats([2.0, math.nan, 2.1]))
    assert finding.action == Action.SKIP and finding.data_suspect and not finding.bad_data
    assert finding.values["suspect_data_ranks"] == [1]
    assert "suspect data: the batch of rank 1 gave a non-finite loss where the other ranks" in finding.message
    policy = DecisionPolicy(PolicyConfig(max_consecutive_skips=1), can_rollback=True)
    decision = policy.decide(7, [finding])
    assert decision.action == Action.SKIP and not decision.data
    policy.commit(decision)
    assert policy.consecutive_skips == 1 and policy.consecutive_data_skips == 0
    assert policy.decide(8, [finding]).action == Action.ROLLBACK  # the ordinary bound escalates
    ledger = DataLedger()
    ledger.open(tmp_path / "data_ledger.jsonl")
    (positioned,) = ledger.with_position([finding], 41)
    assert positioned.values["data_position"] == 41 and positioned.message.endswith("(data position 41)")
    ledger.record_decision(decision, position=41, iteration=7)
    (entry,) = read_ledger(tmp_path / "data_ledger.jsonl")
    assert entry["bad_data"] and entry["suspect"] and entry["ranks"] == [1] and entry["action"] == "skip"
    assert entry["first"] == 41
    # a replay or a resume meets the position again: trained on (a device's transient NaN leaves a good batch);
    # suspected a second time, the batch is known bad and skipped from then on
    assert ledger.with_position([], 41) == [] and ledger.bad_positions() == []
    ledger.record_decision(decision, position=41, iteration=12)
    again = ledger.with_position([], 41)
    assert [f.detector for f in again] == ["data_ledger"] and again[0].action == Action.SKIP
    assert ledger.bad_positions() == [41]
    (everywhere,) = monitor.evaluate(9, gathered_stats([math.nan, math.nan, math.nan]))
    nonfinite_rg = np.zeros((3, 2))
    nonfinite_rg[1, 0] = 1
    (grad_only,) = monitor.evaluate(10, gathered_stats([2.0, 2.0, 2.0], nonfinite_rg=nonfinite_rg))
    assert not everywhere.data_suspect and not grad_only.data_suspect

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


def test_nonfinite_reduced_gradient_with_finite_local_gradients_is_caught():
    # e.g. corruption inside the all-reduce: every rank's own gradient was finite
    monitor = NonFiniteMonitor(NonFiniteConfig(action="skip"), GROUP_NAMES)
    stats = gathered_stats([2.0, 2.0], grad_sq_g=[1.0, float("nan")])
    (finding,) = monitor.evaluate(3, stats)
    assert finding.action == Action.SKIP and finding.ranks == (0, 1)
    assert finding.values["first_group_name"] == "no_decay" and finding.values["reduced"] is True
    assert monitor.evaluate(4, gathered_stats([2.0, 2.0])) == []

"""The paper's separability, alarms included, on real megatron-core (CPU, gloo; 2 ranks = EP 2 x DP 2 for the
dense part, 4 experts): ``scripts/separability_megatron.py`` at its defaults but the length -- a 4-layer x 128 MoE
GPT with 8 heads trained three times for 128 steps (the script's default is 160) with the same seed and data
(healthy, ``attention_lowbit`` and ``router_collapse`` persistent from step 96 on every rank), both mechanism
families measuring every 4 steps, the QK alarm at its configured defaults.

Asserted: the QK monitor alarms under the attention fault only (after the fault starts, never before) and the router
monitor under the router fault only, on every rank alike. Seed 1234; docs/megatron.md gives the other seeds run
with the script and what the alarm did on each.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist_harness import run_ranks
from tests.scripts_loader import load_script

pytest.importorskip("megatron.core")

FAULT_STEP = 96
#: the script runs 160 steps; seed 1234's QK alarm comes at step 112 (docs/megatron.md), so 128 hold every assertion
#: at four fifths of the cost
STEPS = 128


def _train(rank: int, world: int) -> dict[str, Any]:
    script = load_script("separability_megatron")
    args = script.build_parser().parse_args(["--seed", "1234", "--steps", str(STEPS)])
    assert args.fault_step == FAULT_STEP
    return {name: alarms for name, (alarms, _entropy) in script.run_all(args).items()}


@pytest.fixture(scope="module")
def alarms() -> dict[str, dict[str, list[int]]]:
    results = run_ranks(_train, 2, timeout_s=900, collective_timeout_s=120)
    assert results[0] == results[1]  # every rank took the same decisions
    return results[0]


@pytest.mark.timeout(960)
def test_the_qk_monitor_alarms_on_the_attention_fault_only(alarms: dict[str, dict[str, list[int]]]) -> None:
    assert alarms["healthy"]["qk_spectra"] == []
    assert alarms["router_collapse"]["qk_spectra"] == []
    attention = alarms["attention_lowbit"]["qk_spectra"]
    assert attention and min(attention) >= FAULT_STEP, attention


@pytest.mark.timeout(960)
def test_the_router_monitor_alarms_on_the_router_fault_only(alarms: dict[str, dict[str, list[int]]]) -> None:
    assert alarms["healthy"]["router"] == []
    assert alarms["attention_lowbit"]["router"] == []
    assert min(alarms["router_collapse"]["router"]) == FAULT_STEP

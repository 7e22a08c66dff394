"""The named fault library (arc_engine/faults/library.py): every fault builds specs that a config accepts and that
install on the model they target; severity, rank and the model parts a fault needs."""

from __future__ import annotations

import dataclasses
import math

import pytest

from arc_engine.config import load_config
from arc_engine.demo.gpt import GPT, GPTConfig
from arc_engine.faults import FaultInjector
from arc_engine.faults.library import (
    ARC_SCENARIOS,
    DEMO_TARGETS,
    LIBRARY,
    MEGATRON_MOE_TARGETS,
    R_METRIC_FAULTS,
    SDC_FAULTS,
    fault_specs,
)


def test_the_library_holds_the_papers_faults() -> None:
    assert len(R_METRIC_FAULTS) == 17  # the R-Metric paper's Appendix F
    assert set(R_METRIC_FAULTS) | set(ARC_SCENARIOS) | set(SDC_FAULTS) == set(LIBRARY)
    assert {"nan_bomb", "inf_nuke", "loss_supernova", "catastrophic_lr", "weight_sabotage", "optimizer_sabotage",
            "silent_weight_corruption"} <= set(ARC_SCENARIOS)
    assert all(LIBRARY[name].source for name in LIBRARY)


@pytest.mark.parametrize("name", [name for name in LIBRARY if not LIBRARY[name].needs])
def test_every_fault_loads_as_a_config_and_installs_on_the_demo_gpt(name: str) -> None:
    specs = fault_specs(name, 12, rank=1, seed=3, targets=DEMO_TARGETS)
    assert specs and all(spec.step == 12 for spec in specs)
    assert all(spec.rank in (1, -1) for spec in specs)
    config = load_config(base={"faults": {"injections": [dataclasses.asdict(spec) for spec in specs]}})
    assert config.faults.injections == specs  # what the campaign writes into a run's config round-trips
    model = GPT(GPTConfig(vocab_size=40, seq_len=16, num_layers=2, d_model=32, num_heads=4))
    injector = FaultInjector(specs, 1, lambda: 0)
    injector.install(model)  # every pattern matches something in the demo GPT
    injector.remove()


def test_severity_scales_the_magnitude_and_is_checked() -> None:
    assert fault_specs("catastrophic_lr", 5)[0].scale == 1e5  # the ARC paper's 100,000x
    assert fault_specs("lr_spike", 5)[0].scale == 50.0  # its NanoGPT row
    assert fault_specs("gradient_apocalypse", 5, severity=2.0)[0].steps == 6
    assert fault_specs("loss_supernova", 5, severity=0.5)[0].scale == 5e5
    assert fault_specs("optimizer_sabotage", 5, severity=10.0)[0].scale == pytest.approx(1e-9)
    for severity in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="severity"):
            fault_specs("nan_bomb", 1, severity=severity)
    with pytest.raises(ValueError, match="unknown fault 'tsunami'"):
        fault_specs("tsunami", 1)


def test_moe_faults_need_a_model_with_experts() -> None:
    with pytest.raises(ValueError, match="mixture-of-experts"):
        fault_specs("router_imbalance", 3, targets=DEMO_TARGETS)
    (spec,) = fault_specs("router_imbalance", 3, targets=MEGATRON_MOE_TARGETS)
    assert (spec.kind, spec.pattern, spec.persistent) == ("router_collapse", "*router", True)
    (spec,) = fault_specs("expert_failure", 3, targets=MEGATRON_MOE_TARGETS)
    assert (spec.kind, spec.scale) == ("weight_corruption", 0.0)


def test_the_manual_lists_every_fault() -> None:
    from pathlib import Path

    manual = (Path(__file__).resolve().parents[1] / "docs" / "campaign.md").read_text()
    missing = [name for name in LIBRARY if f"| `{name}` |" not in manual]
    assert not missing, f"docs/campaign.md lacks a row for {missing}"

"""A monitor family defined outside the package, on the plugin seam: its own config section read from YAML, its own
statistic (combined by MAX across ranks) written by its own producer, its own monitor -- run on 2 real ranks
without a line of arc_engine/ knowing it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
import yaml
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine.config import ConfigError, load_config
from arc_engine.config.docs import render_sections
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext, Producer, StatDecl, StepView
from arc_engine.monitors.registry import register_family, unregister_family
from arc_engine.stats import AgreedStats, Reduce, StatBuffer
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_optimizer, tiny_model_and_data

pytestmark = pytest.mark.timeout(240)

CORRUPT_STEP = 6  # rank 1's replica gets one absurd weight after this step's update


@dataclass(kw_only=True)
class WeightGuardConfig:
    """The largest weight on any rank against a threshold."""

    enabled: bool = True
    """Watch the weights."""
    threshold: float = 1.0e3
    """The largest absolute weight that passes.
    Allowed: > 0"""
    action: Literal["warn", "skip", "rollback", "abort"] = "warn"
    """What a weight above the threshold gets."""

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ConfigError("threshold", self.threshold, "must be > 0")


class WeightGuardMonitor(Monitor):
    """Flags a step when the largest |weight| held by any rank exceeds the threshold."""

    name = "weight_guard"

    def __init__(self, config: WeightGuardConfig) -> None:
        self.config = config
        self.flags = 0
        self.last = float("nan")
        self._flagged = False

    def required_stats(self) -> tuple[str, ...]:
        return ("weight_abs_max",)

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        self.last = float(stats.total("weight_abs_max")[0])
        self._flagged = self.last > self.config.threshold
        if not self._flagged:
            return []
        return [Finding(self.name, Action.parse(self.config.action), Severity.ERROR,
                        f"a weight of magnitude {self.last:.3g} > {self.config.threshold:.3g}", (),
                        {"weight_abs_max": self.last})]

    def commit(self, step: int, applied: bool) -> None:
        self.flags += int(self._flagged)

    def metrics(self) -> dict[str, float]:
        return {"weight_abs_max": self.last}

    def state_dict(self) -> dict[str, Any]:
        return {"flags": self.flags}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.flags = int(state["flags"])


def write_weight_abs_max(buffer: StatBuffer, view: StepView) -> None:
    largest = torch.stack([p.detach().abs().max() for p in view.params]).max()
    buffer.put("weight_abs_max", largest)


class WeightGuardFamily(FamilyBase):
    name = "weight_guard"
    config_class = WeightGuardConfig

    def __init__(self, every: int = 1) -> None:
        self.every = every

    def statistics(self, ctx: FamilyContext) -> list[StatDecl]:
        due = None if self.every == 1 else (lambda step: step % self.every == 0)
        return [StatDecl("weight_abs_max", 1, Reduce.MAX, due=due)]

    def producers(self, ctx: FamilyContext) -> list[Producer]:
        return [Producer("before_agreement", write_weight_abs_max)]

    def monitors(self, ctx: FamilyContext) -> list[WeightGuardMonitor]:
        return [WeightGuardMonitor(ctx.section)]


def write_yaml(path: Path, section: dict[str, Any]) -> Path:
    config = {"run": {"run_id": "plugin", "run_dir": str(path.parent)}, "sinks": {"console": {"enabled": False}},
              "detectors": {"loss_spike": {"enabled": False}, "weight_guard": section}}
    path.write_text(yaml.safe_dump(config))
    return path


def _train(rank: int, world: int, config_path: Path, every: int = 1) -> dict[str, Any]:
    register_family(WeightGuardFamily(every))
    model, data = tiny_model_and_data()
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    config = load_config(config_path)
    arc = arc_engine.attach(ddp, optimizer, config)
    actions, lasts = [], []
    for step in range(CORRUPT_STEP + 3):
        loss = ddp(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        decision = arc.engine.last_decision
        actions.append((decision.action.name, tuple(f.detector for f in decision.findings)))
        lasts.append(next(m for m in arc.engine.gathering.assembly.monitors if m.name == "weight_guard").last)
        if step == CORRUPT_STEP and rank == 1:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = 500.0  # this replica alone is corrupted
    guard = next(m for m in arc.engine.gathering.assembly.monitors if m.name == "weight_guard")
    out = {"actions": actions, "threshold": config.detectors.plugins["weight_guard"].threshold,
           "collectives": arc.engine.gathering.pipeline.collectives, "steps": len(actions), "flags": guard.flags,
           "state": arc.engine.gathering.assembly.state_dict()["weight_guard"], "lasts": lasts}
    arc.close()
    return out


def test_a_family_defined_in_a_test_file_runs_on_two_ranks(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "arc.yaml", {"threshold": 100.0, "action": "skip"})
    results = run_ranks(_train, 2, path)
    for result in results:
        assert result["threshold"] == 100.0  # read from the YAML, not the default
        flagged = [step for step, (_, detectors) in enumerate(result["actions"]) if "weight_guard" in detectors]
        assert flagged == [CORRUPT_STEP + 1, CORRUPT_STEP + 2]  # the MAX carries rank 1's weight to rank 0
        assert all(result["actions"][step][0] == "SKIP" for step in flagged)
        assert result["actions"] == results[0]["actions"]
        assert result["collectives"] == 2 * result["steps"]  # its MAX slot adds the MAX all-reduce
        assert result["flags"] == 2 and result["state"] == {"flags": 2}


def test_a_max_statistic_due_every_other_step_adds_its_collective_on_those_steps_only(tmp_path: Path) -> None:
    """``StatDecl(due=...)``: the MAX all-reduce runs on the due steps only (the other steps keep one collective)
    and the slot reads NaN between them, so a periodic fixed-size statistic costs nothing on the others."""
    path = write_yaml(tmp_path / "arc.yaml", {"threshold": 100.0, "action": "skip"})
    results = run_ranks(_train, 2, path, 2)
    for result in results:
        due = [step for step in range(result["steps"]) if step % 2 == 0]  # 0, 2, 4, 6, 8
        assert result["collectives"] == result["steps"] + len(due)
        assert [step for step, last in enumerate(result["lasts"]) if last == last] == due  # NaN elsewhere
        flagged = [step for step, (_, detectors) in enumerate(result["actions"]) if "weight_guard" in detectors]
        assert flagged == [CORRUPT_STEP + 2]  # the first due step after rank 1's corruption, seen by every rank


def test_a_plugin_section_is_validated_like_a_built_in(tmp_path: Path) -> None:
    register_family(WeightGuardFamily())
    try:
        with pytest.raises(ConfigError, match="threshold"):
            load_config(write_yaml(tmp_path / "bad.yaml", {"threshold": -1.0}))
        with pytest.raises(ConfigError, match="unknown key"):
            load_config(write_yaml(tmp_path / "typo.yaml", {"treshold": 5.0}))
        overridden = load_config(None, ["detectors.weight_guard.threshold=7"])
        assert overridden.detectors.plugins["weight_guard"].threshold == 7.0
    finally:
        unregister_family("weight_guard")
    with pytest.raises(ConfigError, match="not a built-in section nor a registered monitor family"):
        load_config(write_yaml(tmp_path / "unregistered.yaml", {"threshold": 5.0}))


def test_a_plugin_config_documents_its_keys_as_the_built_in_sections_do() -> None:
    page = render_sections(WeightGuardConfig, "detectors.weight_guard")
    assert page.splitlines()[:3] == ["## `detectors.weight_guard`", "", "The largest weight on any rank against a "
                                     "threshold."]
    assert ("| `detectors.weight_guard.threshold` | float | `1000.0` | > 0 | The largest absolute weight that "
            "passes. |") in page.splitlines()
    assert "| `detectors.weight_guard.action` | choice | `warn` | `warn`, `skip`, `rollback`, `abort` |" in page

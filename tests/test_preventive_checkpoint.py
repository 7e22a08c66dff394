"""The ``checkpoint`` action: a monitor that sees trouble coming asks for a preventive checkpoint. The step applies;
recovery snapshots the next step (verified by that step's decision) and saves it to disk outside the schedule, on
every rank; without recovery it is a warning that applies the step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine.config import load_config
from arc_engine.events import Action, Finding, Severity
from arc_engine.monitors.base import Monitor
from arc_engine.monitors.family import FamilyBase, FamilyContext
from arc_engine.monitors.registry import register_family, unregister_family
from arc_engine.policy import DecisionPolicy
from arc_engine.sinks import read_jsonl
from arc_engine.stats import AgreedStats
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data

pytestmark = pytest.mark.timeout(240)
ADVISED_AT = 6


@dataclass(kw_only=True)
class ForesightConfig:
    enabled: bool = True
    action: Literal["warn", "checkpoint", "skip", "rollback", "abort"] = "checkpoint"


class ForesightMonitor(Monitor):
    """Asks for a preventive checkpoint at one step (a stand-in for conformal's or dynamics' warning ahead)."""

    name = "foresight"

    def __init__(self, config: ForesightConfig) -> None:
        self.config = config

    def required_stats(self) -> tuple[str, ...]:
        return ()

    def evaluate(self, step: int, stats: AgreedStats) -> list[Finding]:
        if step != ADVISED_AT:
            return []
        return [Finding(self.name, Action.parse(self.config.action), Severity.WARNING, "trouble ahead")]

    def commit(self, step: int, applied: bool) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class ForesightFamily(FamilyBase):
    name = "foresight"
    config_class = ForesightConfig

    def monitors(self, ctx: FamilyContext) -> list[Any]:
        return [ForesightMonitor(ctx.section)]


def test_a_checkpoint_decision_applies_the_step() -> None:
    policy = DecisionPolicy(load_config(None, []).policy, can_rollback=False)
    decision = policy.decide(3, [Finding("foresight", Action.CHECKPOINT, Severity.WARNING, "ahead"),
                                 Finding("loss_spike", Action.WARN, Severity.WARNING, "up")])
    assert decision.action == Action.CHECKPOINT and decision.applies_update
    skip = policy.decide(3, [Finding("foresight", Action.CHECKPOINT, Severity.WARNING, "ahead"),
                             Finding("loss_spike", Action.SKIP, Severity.WARNING, "up")])
    assert skip.action == Action.SKIP and not skip.applies_update  # a stronger action wins


def _train(rank: int, world: int, run_dir: Path, recovery: bool) -> dict[str, Any]:
    register_family(ForesightFamily())
    try:
        model, data = tiny_model_and_data(seed=6)
        optimizer = make_optimizer(model)
        ddp = DistributedDataParallel(model)
        overrides = ["recovery.enabled=true", "recovery.checkpoint_freq=100", "recovery.checkpoint.every_steps=1000",
                     f"recovery.checkpoint.dir={run_dir / 'ckpt'}"] if recovery else []
        arc = arc_engine.attach(ddp, optimizer, make_config(run_dir, *overrides))
        applied = []
        for step in range(10):
            loss = ddp(*data.batch(step, rank, BATCH))
            arc.record_loss(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            applied.append(arc.last_step_applied)
        rec = arc.engine.recovery
        result = {"applied": applied, "ring": list(rec.ring.steps) if rec is not None else [],
                  "disk_saves": rec.disk_saves if rec is not None else 0,
                  "params": torch.cat([p.detach().flatten() for p in model.parameters()])}
        arc.close()
    finally:
        unregister_family("foresight")
    events = read_jsonl(run_dir / "test" / "events.jsonl")
    result["actions"] = [(e["step"], e["detector"], e["action"]) for e in events
                         if e["kind"] in ("action", "detection") and e["detector"] in ("recovery", "foresight")]
    return result


def test_recovery_takes_a_preventive_snapshot_and_saves_it_to_disk(tmp_path: Path) -> None:
    """2 ranks under DDP; snapshots every 100 healthy steps and disk saves every 1,000 would take none in 10 steps.
    The foresight monitor asks at step 6: every step applies, the step-7 snapshot is verified and saved to disk
    (one save), on every rank. Without recovery the same run only warns, with the same parameters."""
    results = run_ranks(_train, 2, tmp_path / "recovery", True)
    plain = run_ranks(_train, 2, tmp_path / "plain", False)
    for result, other in zip(results, plain, strict=True):
        assert result["applied"] == [True] * 10 and other["applied"] == [True] * 10
        assert result["ring"] == [ADVISED_AT + 1] and result["disk_saves"] == 1, result
        assert other["ring"] == [] and other["disk_saves"] == 0
        assert torch.equal(result["params"], other["params"])
    assert (ADVISED_AT, "foresight", "checkpoint") in results[0]["actions"]
    assert (ADVISED_AT, "recovery", "checkpoint") in results[0]["actions"]
    assert (ADVISED_AT, "foresight", "checkpoint") in plain[0]["actions"]

"""Job-wide agreement on a 2 x 2 grid: 4 gloo ranks, 2 data-parallel groups x 2 model-parallel peers.

The model's linear layers are split across the 2 model-parallel peers (a column-parallel layer, then a row-parallel
one whose partial outputs are summed over the model-parallel group), and DDP averages gradients within each
data-parallel group -- the layout Megatron uses. A NaN gradient on one rank of one data-parallel group, an exponent
bit flip in one rank's weight gradient and a loss spike on one rank must each make all 4 ranks take the same action
at the same step, with no hang, and leave the data-parallel replicas bitwise equal. The control run agrees per
data-parallel group only (``group=`` the DDP group): model-parallel peers then part ways at the NaN.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from tests.dist_harness import run_ranks

pytestmark = pytest.mark.timeout(300)

MP = 2  # model-parallel peers per data-parallel group; rank = dp_rank * MP + mp_rank
STEPS = 26
NAN_STEP, FLIP_STEP, SPIKE_STEP = 8, 13, 19
NAN_RANK, FLIP_RANK, SPIKE_RANK = 1, 2, 3


class _ReduceFromPeers(torch.autograd.Function):
    """Sum the partial outputs of the row-parallel layer over the model-parallel group; identity backward."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class SplitMLP(torch.nn.Module):
    """y = W2 gelu(W1 x + b1): W1/b1 split by rows (column-parallel), W2 by columns (row-parallel)."""

    def __init__(self, mp_group: dist.ProcessGroup, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        torch.manual_seed(100 + dist.get_rank(mp_group))  # each peer its own shard, the same across replicas
        self.fc1 = torch.nn.Linear(width, hidden // MP)
        self.fc2 = torch.nn.Linear(hidden // MP, width, bias=False)
        self.mp_group = mp_group

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.fc1(inputs))
        output = _ReduceFromPeers.apply(self.fc2(hidden), self.mp_group)
        return torch.nn.functional.mse_loss(output, targets)


def grid_groups(rank: int, world: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (data-parallel, model-parallel) groups; every rank creates every group, in the same order."""
    dp_groups = [dist.new_group([mp + dp * MP for dp in range(world // MP)]) for mp in range(MP)]
    mp_groups = [dist.new_group([mp + dp * MP for mp in range(MP)]) for dp in range(world // MP)]
    return dp_groups[rank % MP], mp_groups[rank // MP]


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch for model-parallel peers, another one per data-parallel rank."""
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    inputs = torch.randn(8, 16, generator=gen)
    return inputs, torch.tanh(inputs.flip(1))


def write_config(run_dir: Path) -> Path:
    faults = [{"kind": "nan_grad", "rank": NAN_RANK, "step": NAN_STEP, "param": "fc2.weight"},
              {"kind": "bitflip", "rank": FLIP_RANK, "step": FLIP_STEP, "pattern": "fc1", "where": "weight_grad",
               "bit": 30, "count": 4},
              {"kind": "loss_scale", "rank": SPIKE_RANK, "step": SPIKE_STEP, "scale": 50.0}]
    config = {"run": {"run_id": "grid", "run_dir": str(run_dir)}, "sinks": {"console": {"enabled": False}},
              "detectors": {"loss_spike": {"warmup_steps": 5},
                            "sdc": {"enabled": True, "warmup_steps": 5, "update_sample": 1.0}},
              "faults": {"injections": faults}}
    path = run_dir / "arc.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _train(rank: int, world: int, config_path: Path, per_dp_group: bool) -> dict[str, Any]:
    dp_group, mp_group = grid_groups(rank, world)
    model = SplitMLP(mp_group)
    ddp = DistributedDataParallel(model, process_group=dp_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    arc = arc_engine.attach(ddp, optimizer, config_path, group=dp_group if per_dp_group else None)
    actions: list[tuple[str, tuple[str, ...]]] = []
    named: dict[int, dict[str, tuple[int, ...]]] = {}
    for step in range(STEPS):
        loss = ddp(*batch(step, rank // MP))
        loss = arc.faults.on_loss(loss)
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        decision = arc.engine.last_decision
        detectors = tuple(sorted({f.detector for f in decision.findings}))
        actions.append((decision.action.name, detectors))
        if decision.findings:
            named[step] = {f.detector: f.ranks for f in decision.findings}
    summary = arc.summary()
    arc.close()
    return {"actions": actions, "named": named, "params": [p.detach().clone() for p in model.parameters()],
            "collectives": summary["collectives"], "detail_fetches": summary["detail_fetches"],
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def test_every_rank_of_a_2x2_grid_takes_the_same_action_at_every_step(tmp_path: Path) -> None:
    results = run_ranks(_train, 4, write_config(tmp_path), False, timeout_s=240)
    actions = results[0]["actions"]
    assert all(result["actions"] == actions for result in results)  # one verdict per step, job-wide
    skipped = {step for step, (action, _) in enumerate(actions) if action == "SKIP"}
    assert skipped == {NAN_STEP, FLIP_STEP, SPIKE_STEP}, actions
    # the flip overflows: the non-finite detector names its rank; the SDC rule leaves that case to it (one finding)
    assert actions[NAN_STEP][1] == ("non_finite",) and actions[FLIP_STEP][1] == ("non_finite",)
    assert actions[SPIKE_STEP][1] == ("loss_spike",)
    named = results[0]["named"]
    assert named[NAN_STEP]["non_finite"] == (NAN_RANK,)    # the rank is named from the per-rank detail
    assert named[FLIP_STEP]["non_finite"] == (FLIP_RANK,)
    for rank, result in enumerate(results):
        assert result["finite"]
        # one all-reduce per monitored step, findings or not; the straggler report's step (the 20th monitored
        # step) adds its MAX block
        assert result["collectives"] == STEPS + 1
        assert result["detail_fetches"] >= 2   # the NaN and the flip fetched who held them; healthy steps did not
        replica = results[(rank + MP) % 4]      # the other data-parallel group's copy of this shard
        assert all(torch.equal(a, b) for a, b in zip(result["params"], replica["params"], strict=True))


def test_agreeing_per_data_parallel_group_lets_model_parallel_peers_part_ways(tmp_path: Path) -> None:
    """The control: the old scope (one decision per DP group) skips the NaN step only in the group that saw it."""
    results = run_ranks(_train, 4, write_config(tmp_path), True, timeout_s=240)
    at_nan = [result["actions"][NAN_STEP][0] for result in results]
    assert at_nan[NAN_RANK] == "SKIP" and at_nan[NAN_RANK - 1] == "NONE"  # model-parallel peers disagree


def _own_group(rank: int, world: int, run_dir: Path) -> dict[str, Any]:
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in the same order
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"run": {"run_id": "solo", "run_dir": str(run_dir / f"job{rank}")},
              "sinks": {"console": {"enabled": False}}}
    path = run_dir / f"arc{rank}.yaml"
    path.write_text(yaml.safe_dump(config))
    arc = arc_engine.attach(model, optimizer, path, group=groups[rank])
    loss = model(torch.ones(3, 4)).square().mean()
    arc.record_loss(loss)
    loss.backward()
    optimizer.step()
    arc.close()
    return {"leader": arc.engine.gathering.pipeline.leader}


def test_the_first_rank_of_a_decision_group_writes_its_sinks_without_global_rank_0(tmp_path: Path) -> None:
    """Two decision groups of one rank each: rank 1 leads its own and writes its event log (global rank 0 is in
    the other group)."""
    results = run_ranks(_own_group, 2, tmp_path)
    assert [r["leader"] for r in results] == [0, 1]
    for rank in range(2):
        events = (tmp_path / f"job{rank}" / "solo" / "events.jsonl").read_text()
        assert '"lifecycle"' in events and '"summary"' in events

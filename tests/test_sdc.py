"""The SDC detector (update-RMS jumps, SDC paper §VI): the pure rule, the monitor's baselines, and real runs with
exponent-bit flips injected into a backward GEMM (single process and 2 gloo ranks under DDP)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine.faults.bitflip import BitFlipInjector, BitFlipSpec
from arc_engine.monitors.family import section_of
from arc_engine.monitors.sdc import (
    SDCConfig,
    SDCFamily,
    SDCMonitor,
    is_sdc,
    sdc_threshold,
    suspect_ranks,
    update_rms_max,
)
from arc_engine.sinks import read_jsonl
from arc_engine.stats import AgreedStats, Reduce, StatLayout, names
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data

pytestmark = pytest.mark.timeout(300)


def test_rule_flags_jumps_above_mu_over_alpha_sqrt_delta_g_and_non_finite_norms() -> None:
    assert sdc_threshold(0.01, 0.05, 0.0) == math.inf  # ΔG = 0 never flags
    assert sdc_threshold(0.01, 0.05, 4.0) == pytest.approx(0.01 / (0.05 * 2.0))
    assert not is_sdc(1.0, 0.99, 5.0, 5.0, mu=0.001, alpha=0.05)  # a jump with no gradient-norm jump
    assert is_sdc(1.5, 1.0, 9.0, 5.0, mu=0.01, alpha=0.05)  # 0.5 > 0.01 / (0.05 * 2) = 0.1
    assert not is_sdc(1.05, 1.0, 9.0, 5.0, mu=0.01, alpha=0.05)  # 0.05 <= 0.1
    assert is_sdc(1.0, 1.0, math.inf, 5.0, mu=0.01, alpha=0.05)  # infinite pre-clip norm
    assert is_sdc(1.0, 1.0, math.nan, 5.0, mu=0.01, alpha=0.05)
    assert update_rms_max(np.array([4.0, 90.0, 0.0]), np.array([1.0, 10.0, 0.0])) == 3.0


def test_the_rank_whose_local_gradient_jumped_is_named() -> None:
    previous = np.array([1.0, 1.1, 0.9, 1.0])
    assert suspect_ranks(np.array([1.1, 1.0, 45.0, 1.05]), previous, 4.0) == [2]
    assert suspect_ranks(np.array([1.0, 40.0]), np.array([1.0, 1.0]), 4.0) == [1]  # 2 ranks: the peer is the reference
    assert suspect_ranks(np.array([1.0, np.inf, 1.0]), np.ones(3), 4.0) == [1]
    assert suspect_ranks(np.array([2.0, 2.1, 1.9, 2.0]), np.ones(4), 4.0) == []  # a global change: no single rank


def gathered(r: float, g: float, local: tuple[float, ...] = (1.0,)) -> AgreedStats:
    layout = StatLayout()
    for name in (names.UPDATE_SQ, names.UPDATE_COUNT, names.GRAD_SQ):
        layout.add(name, 1, Reduce.SUM)
    layout.add(names.GRAD_SQ_LOCAL, 1, Reduce.DETAIL)
    layout.freeze()
    rows = [[r * r * 10.0, 10.0, g * g, local[0] ** 2]] + [[0.0, 0.0, 0.0, v * v] for v in local[1:]]
    return AgreedStats.from_rows(layout, np.array(rows))


def test_monitor_learns_mu_in_warmup_and_skipped_steps_do_not_move_the_baseline() -> None:
    monitor = SDCMonitor(SDCConfig(enabled=True, warmup_steps=3, alpha=0.05))
    for step, r in enumerate([1.0, 1.01, 0.99, 1.0]):  # jumps 0.01, 0.02, 0.01: mu = 0.04 / 3
        assert monitor.evaluate(step, gathered(r, 5.0)) == []
        monitor.commit(step, True)
    assert monitor.warmed_up and monitor.mu == pytest.approx(0.04 / 3)
    findings = monitor.evaluate(4, gathered(1.5, 9.0))  # threshold mu / (0.05 * 2) = 0.133 < 0.5
    assert [f.detector for f in findings] == ["sdc"] and findings[0].values["delta_r"] == pytest.approx(0.5)
    assert findings[0].ranks == ()  # one rank only: nobody to compare with
    monitor.commit(4, False)
    assert monitor.r_prev == 1.0 and monitor.g_prev == 5.0  # the skipped update never happened
    assert monitor.evaluate(5, gathered(1.0, 5.0)) == []
    restored = SDCMonitor(monitor.config)
    restored.load_state_dict(monitor.state_dict())
    assert restored.state_dict() == monitor.state_dict()


def test_a_non_finite_norm_is_left_to_the_non_finite_detector_when_it_is_on() -> None:
    """With the non-finite detector on (the default set), a NaN/Inf gradient norm is its finding, reported once
    with the rank it came from; the SDC rule flags it itself when that detector is off, or when the recomputation is
    on. Either way the baselines do not move."""
    from arc_engine.config import load_config
    from arc_engine.monitors.family import FamilyContext
    from arc_engine.monitors.sdc import SDCFamily

    for non_finite_on, recompute_on in ((True, False), (False, False), (True, True)):
        config = load_config(None, [f"detectors.non_finite.enabled={str(non_finite_on).lower()}",
                                    f"detectors.sdc.recompute.enabled={str(recompute_on).lower()}"])
        ctx = FamilyContext(config, section_of(config, SDCFamily()), ["g"], Reduce.SUM)
        (monitor,) = SDCFamily().monitors(ctx)
        monitor.evaluate(0, gathered(1.0, 5.0))
        monitor.commit(0, True)
        findings = monitor.evaluate(1, gathered(1.0, math.inf))
        # with the recomputation on, the rule keeps it: its finding makes every rank recompute the step
        assert [f.detector for f in findings] == ([] if non_finite_on and not recompute_on else ["sdc"])
        monitor.commit(1, False)
        assert monitor.r_prev == 1.0 and monitor.g_prev == 5.0


# ------------------------------------------------------------------ real runs with bit flips

def sdc_config(run_dir: Path, *overrides: str) -> Any:
    return make_config(run_dir, "detectors.sdc.enabled=true", "detectors.sdc.warmup_steps=30",
                       "detectors.loss_spike.enabled=false", "detectors.grad_norm.enabled=false",
                       "detectors.non_finite.enabled=false", *overrides)


def train_with_flips(model: torch.nn.Module, arc: Any, data: Any, rank: int, steps: int) -> dict[str, Any]:
    optimizer = arc.optimizer
    decisions, params_before = {}, {}
    for step in range(steps):
        params_before[step] = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        loss = model(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        decision = arc.engine.last_decision
        decisions[step] = {f.detector: f.ranks for f in decision.findings} if decision.step == step else {}
    flagged = [step for step, found in decisions.items() if "sdc" in found]
    suspects = {step: list(found["sdc"]) for step, found in decisions.items() if "sdc" in found}
    unchanged = {step: torch.equal(params_before[step], params_before[step + 1]) for step in flagged
                 if step + 1 < steps}
    return {"flagged": flagged, "suspects": suspects, "unchanged_after_flag": unchanged, "summary": arc.summary()}


def _run(rank: int, world: int, run_dir: Path, steps: int, flip_at: list[int], flip_rank: int,
         bit: int = 30, count: int = 4, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    wrapped = DistributedDataParallel(model) if world > 1 else model
    arc = arc_engine.attach(wrapped, optimizer, sdc_config(run_dir, *overrides))
    arc.optimizer = optimizer
    spec = BitFlipSpec(pattern="blocks.0.mlp.0", where="backward", rank=flip_rank, steps=flip_at, count=count, bit=bit,
                       max_per_step=1)
    injector = BitFlipInjector(spec, rank=rank, current_step=lambda: arc.engine.progress.iteration)
    injector.install(model)
    out = train_with_flips(wrapped, arc, data, rank, steps)
    out["fired"] = [f["step"] for f in injector.fired]
    arc.close()
    return out


@pytest.mark.parametrize(("bit", "count"), [(30, 4), (26, 256)], ids=["exponent-msb", "exponent-bit-3"])
def test_bit_flip_in_backward_is_flagged_before_the_update_is_applied(tmp_path: Path, bit: int, count: int) -> None:
    """fp32 bit 30 (the exponent's top bit) makes the gradient norm infinite; bit 26 scales 256 values of the
    backward GEMM output by 2^8, a finite jump caught by the ΔR / √ΔG rule."""
    result = _run(0, 1, tmp_path, 80, [50], 0, bit, count)
    assert result["fired"] == [50]
    assert result["flagged"] == [50]
    assert result["unchanged_after_flag"] == {50: True}  # the corrupted update was never applied


def test_a_sampled_update_rms_still_flags_the_flip(tmp_path: Path) -> None:
    """update_sample = 1/32 (the default): R_t over one 1/32 window per tensor, moving every step; the corruption
    spreads through the backward pass, so the windows see it, and the window motion raises no flag on a clean run."""
    result = _run(0, 1, tmp_path, 80, [50], 0, 26, 256, ("detectors.sdc.update_sample=0.03125",))
    assert result["fired"] == [50] and result["flagged"] == [50]
    clean = _run(0, 1, tmp_path / "clean", 300, [], 0, overrides=("detectors.sdc.update_sample=0.03125",))
    assert clean["flagged"] == []


def test_sample_windows_are_views_placed_by_position_and_phase() -> None:
    from arc_engine.stats.sampling import sample_window

    tensor = torch.arange(4000.0)
    window = sample_window(tensor, 0.25, 3, phase=5)
    assert window.numel() == 1000 and window.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    assert torch.equal(window, sample_window(tensor.clone(), 0.25, 3, phase=5))  # same place for the same index, phase
    assert not torch.equal(window, sample_window(tensor, 0.25, 3, phase=6))  # the next phase moves it
    assert sample_window(tensor, 1.0, 3) is tensor


def test_no_false_flag_in_a_clean_1000_step_run(tmp_path: Path) -> None:
    result = _run(0, 1, tmp_path, 1000, [], 0)
    assert result["flagged"] == []
    assert result["summary"]["monitored_steps"] == 1000


def _default_run(rank: int, world: int, run_dir: Path, steps: int) -> dict[str, Any]:
    model, data = tiny_model_and_data(seed=1)
    optimizer = make_optimizer(model)
    wrapped = DistributedDataParallel(model) if world > 1 else model
    arc = arc_engine.attach(wrapped, optimizer, make_config(run_dir))  # the production defaults
    arc.optimizer = optimizer
    assert section_of(arc.engine.config, SDCFamily()).enabled
    out = train_with_flips(wrapped, arc, data, rank, steps)
    out["warmed_up"] = next(m for m in arc.engine.gathering.assembly.monitors if m.name == "sdc").warmed_up
    arc.close()
    return out


def test_the_default_set_raises_nothing_on_a_clean_ddp_run_past_the_sdc_warm_up(tmp_path: Path) -> None:
    """SDC detection on by default: 2 DDP ranks, 400 clean steps (the rule arms after 100), every default detector
    on: no finding of any kind, every step applied. (Except the straggler family's: it times the ranks, and on the
    test machine the other worker's ranks share the cores, which it may report as a contended machine.)"""
    results = run_ranks(_default_run, 2, tmp_path, 400)
    for result in results:
        assert result["warmed_up"] and result["flagged"] == []
        summary = result["summary"]
        assert summary["monitored_steps"] == 400 and summary["skipped_by_policy"] == 0
        assert {k: v for k, v in summary["detections"].items() if k != "straggler"} == {}
    events = [e for e in read_jsonl(tmp_path / "test" / "events.jsonl")
              if e["kind"] == "detection" and e["detector"] != "straggler"]
    assert events == []


@pytest.mark.parametrize(("world", "bad_rank"), [(2, 1), (4, 2)])
def test_bit_flip_on_one_ddp_rank_is_flagged_on_every_rank_and_the_rank_named(tmp_path: Path, world: int,
                                                                              bad_rank: int) -> None:
    results = run_ranks(_run, world, tmp_path, 60, [40], bad_rank, 26, 256)
    assert [r["fired"] for r in results] == [[40] if rank == bad_rank else [] for rank in range(world)]
    assert [r["flagged"] for r in results] == [[40]] * world
    assert all(r["suspects"] == {40: [bad_rank]} for r in results)  # named from its pre-reduction gradient
    assert all(r["unchanged_after_flag"] == {40: True} for r in results)
    events = [e for e in read_jsonl(tmp_path / "test" / "events.jsonl") if e["detector"] == "sdc"]
    assert f"suspected on rank {bad_rank} (" in events[0]["message"]
    assert events[0]["values"]["suspects"][str(bad_rank)].endswith(":cpu")  # host:device


def _run_zero2(rank: int, world: int, run_dir: Path, steps: int, flip_at: int) -> dict[str, Any]:
    from arc_engine.integrations.deepspeed import attach_deepspeed
    from tests.test_deepspeed_dist import ds_engine

    # No clipping: clipping to a small norm damps the update-RMS jump (see the README's SDC notes).
    engine, data = ds_engine(rank, world, 2, clip=0.0)
    arc = attach_deepspeed(engine, sdc_config(run_dir))
    # A finite corruption (2^8 x 256 values): an infinite one DeepSpeed would skip by itself (overflow check).
    spec = BitFlipSpec(pattern="blocks.0.mlp.0", where="backward", rank=1, steps=[flip_at], count=256, bit=26,
                       max_per_step=1)
    injector = BitFlipInjector(spec, rank=rank, current_step=lambda: arc.engine.progress.iteration)
    injector.install(engine.module)
    flagged, unchanged, suspects = [], None, []
    for step in range(steps):
        before = torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])
        loss = engine(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        engine.backward(loss)
        engine.step()
        decision = arc.engine.last_decision
        sdc = [f for f in decision.findings if f.detector == "sdc"] if decision.step == step else []
        if sdc:
            flagged.append(step)
            suspects = list(sdc[0].ranks)
            unchanged = torch.equal(before, torch.cat([p.detach().flatten() for p in engine.module.parameters()]))
    arc.close()
    return {"flagged": flagged, "unchanged": unchanged, "suspects": suspects,
            "fired": [f["step"] for f in injector.fired]}


def test_bit_flip_on_one_rank_under_deepspeed_zero2_is_flagged_on_every_rank(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    results = run_ranks(_run_zero2, 2, tmp_path, 45, 40)
    assert [r["fired"] for r in results] == [[], [40]]
    assert [r["flagged"] for r in results] == [[40], [40]]
    assert [r["suspects"] for r in results] == [[1], [1]]
    assert all(r["unchanged"] for r in results)  # DeepSpeed applied nothing on any rank


# ------------------------------------------------------------------ a corruption only a moving window can see

TAIL_FRACTION = 0.02  # the corrupted part: the last 2% of one rank's flat ZeRO-2 partition
TAIL_FIRST, TAIL_STEPS = 40, 32  # corrupted steps: [40, 72), i.e. ⌈1/update_sample⌉ of them
TAIL_DRIFT = 0.5  # added to each corrupted element, times (k + 1) on the k-th corrupted step


def tail_corruption_hook(zero: Any, rank: int, bad_rank: int, fired: list[int]) -> Any:
    """A step pre-hook for DeepSpeed's inner optimizer that corrupts the last :data:`TAIL_FRACTION` of ``bad_rank``'s
    group-0 fp32 partition gradient (what Adam is about to apply) on steps ``TAIL_FIRST`` to ``TAIL_FIRST +
    TAIL_STEPS - 1``: a drifting fault (a degrading device) that adds ``TAIL_DRIFT`` x (k+1) to every element on the
    k-th corrupted step, so the gradient norm rises on each of them. Registered before arc_engine's hooks, so
    arc_engine's statistics see the corrupted gradient, as they would see a faulty device's."""
    calls = [0]

    def hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        partition = zero.single_partition_of_fp32_groups[0]
        if optimizer.param_groups[0]["params"][0] is not partition:
            return  # not group 0's inner step
        step, calls[0] = calls[0], calls[0] + 1
        k = step - TAIL_FIRST
        if rank != bad_rank or not 0 <= k < TAIL_STEPS:
            return
        real = partition.numel() - int(zero.groups_padding[0])
        tail = math.ceil(TAIL_FRACTION * real)
        partition.grad.view(-1)[real - tail:real].add_(TAIL_DRIFT * (k + 1))
        fired.append(step)

    return hook


def _run_zero2_tail(rank: int, world: int, run_dir: Path) -> dict[str, Any]:
    from arc_engine.integrations.deepspeed import attach_deepspeed
    from tests.test_deepspeed_dist import ds_engine

    engine, data = ds_engine(rank, world, 2, clip=0.0)
    fired: list[int] = []
    zero = engine.optimizer
    zero.optimizer.register_step_pre_hook(tail_corruption_hook(zero, rank, 1, fired))  # before arc_engine's hooks
    arc = attach_deepspeed(engine, sdc_config(run_dir))
    flagged = []
    for step in range(TAIL_FIRST + TAIL_STEPS):
        loss = engine(*data.batch(step, rank, BATCH))
        arc.record_loss(loss)
        engine.backward(loss)
        engine.step()
        decision = arc.engine.last_decision
        if decision.step == step and any(f.detector == "sdc" for f in decision.findings):
            flagged.append(step)
    real = zero.single_partition_of_fp32_groups[0].numel() - int(zero.groups_padding[0])
    arc.close()
    return {"flagged": flagged, "fired": fired, "real": real}


def test_a_corruption_in_the_tail_of_a_zero2_partition_is_flagged_within_32_steps(tmp_path: Path) -> None:
    """Under ZeRO-2 a parameter group is one flat partition per rank. A 1/32 window that stayed at offset 0 would never
    see the last 2% of rank 1's partition; the moving window reaches it within ⌈1/update_sample⌉ = 32 steps, and the
    rule flags the step it does (the gradient norm rises on every corrupted step, the update RMS jumps only when the
    window is on the corrupted region)."""
    pytest.importorskip("deepspeed")
    from arc_engine.stats.sampling import sample_phase, window_bounds

    results = run_ranks(_run_zero2_tail, 2, tmp_path)
    assert results[0]["fired"] == [] and results[1]["fired"] == list(range(TAIL_FIRST, TAIL_FIRST + TAIL_STEPS))
    flagged = results[0]["flagged"]
    assert flagged and results[1]["flagged"] == flagged  # the same decision on every rank
    assert TAIL_FIRST <= flagged[0] < TAIL_FIRST + TAIL_STEPS  # no false flag before the corruption, then caught
    # caught through the window: on the first flagged step, rank 1's window lies over the corrupted tail
    real = results[1]["real"]
    start, length = window_bounds(real, 1 / 32, 0, sample_phase(flagged[0], 1))
    assert start + length > real - math.ceil(TAIL_FRACTION * real)

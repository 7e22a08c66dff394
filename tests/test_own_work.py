"""``stats.own_work``: arc_engine's own work per step, piece by piece (:mod:`arc_engine.own_work`).

CPU-time figures are asserted only where the test controls them (a piece that busy-waits until its thread's CPU
clock advanced by a set amount; a piece that sleeps, which costs its thread no CPU time); wall-clock figures only
as present."""

from __future__ import annotations

import time
from pathlib import Path

import torch

import arc_engine
from arc_engine.engine import ArcEngine
from arc_engine.own_work import OwnWork
from arc_engine.sinks import read_jsonl
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data, train_ddp

BUSY_MS = 20


def _busy(ms: float) -> None:
    """Use ``ms`` of this thread's CPU time."""
    end = time.thread_time_ns() + int(ms * 1e6)
    while time.thread_time_ns() < end:
        pass


def test_off_adds_nothing_to_the_hot_path() -> None:
    work = OwnWork(False)

    def hook() -> int:
        return 1

    assert work.wrap("hook", hook) is hook
    assert work.section("a") is work.section("b")  # one shared no-op context
    work.end_step()
    assert work.report().pieces == {} and work.report().host_ms == 0.0


def test_nested_pieces_are_listed_but_counted_once_and_blocked_time_is_not_work() -> None:
    work = OwnWork(True)

    outer_calls = []

    def outer() -> None:
        outer_calls.append(1)
        with work.section("inner"):
            _busy(BUSY_MS)
        _busy(BUSY_MS / 2)

    timed_outer = work.wrap("outer", outer)
    timed_sleep = work.wrap("sleeps", lambda: time.sleep(0.05))
    work.end_step()
    work.reset()  # warm-up forgotten: the totals cover what follows
    for _ in range(2):
        timed_outer()
        timed_sleep()
        work.end_step()
    report = work.report()
    assert report.steps == 2 and len(outer_calls) == 2
    outer_ms, inner_ms = report.pieces["outer"]["host_ms"], report.pieces["inner"]["host_ms"]
    assert report.pieces["outer"]["depth"] == 0 and report.pieces["inner"]["depth"] == 1
    assert report.pieces["outer"]["calls"] == 1.0 and report.pieces["inner"]["calls"] == 1.0
    assert inner_ms >= BUSY_MS and outer_ms >= inner_ms + BUSY_MS / 2
    assert report.pieces["sleeps"]["host_ms"] < BUSY_MS / 2  # 50 ms asleep: little CPU time
    # own work: the outermost calls only (the inner piece is inside "outer")
    outermost = outer_ms + report.pieces["sleeps"]["host_ms"]
    assert abs(report.host_ms - outermost) < 1e-9
    assert report.step_ms > 0 and report.fraction > 0
    assert report.lines()[0].startswith("arc_engine work: ")
    assert any(line.startswith("    inner: ") for line in report.lines())


def _train(arc: arc_engine.Arc, model, optimizer, data, steps: int) -> None:
    for _ in range(steps):
        loss = model(*data.batch(arc.progress.step, 0, BATCH))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_an_attached_run_reports_its_pieces_and_off_leaves_the_methods_unwrapped(tmp_path: Path) -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    arc = arc_engine.attach(model, optimizer, make_config(tmp_path / "on", "stats.own_work=true",
                                                          "recovery.enabled=true", "recovery.checkpoint_freq=2",
                                                          "recovery.checkpoint.every_steps=0"))
    _train(arc, model, optimizer, data, 6)
    summary = arc.summary()
    arc.close()
    own = summary["own_work"]
    pieces = own["pieces"]
    for name in ("on_step_start", "record_loss", "optimizer.pre_step", "optimizer.post_step", "decide", "agree",
                 "recovery.snapshot"):
        assert name in pieces, sorted(pieces)
    assert pieces["record_loss"]["calls"] == 1.0 and pieces["decide"]["depth"] == 1  # inside the pre-step hook
    assert pieces["optimizer_stats"]["calls"] > 0  # periodic (every 10th step), amortized over the 6
    assert own["host_ms"] > 0 and own["fraction"] > 0
    assert own["host_ms"] >= pieces["optimizer.pre_step"]["host_ms"]
    reported = [e for e in read_jsonl(tmp_path / "on" / "test" / "events.jsonl") if e["detector"] == "own_work"]
    assert len(reported) == 1 and reported[0]["message"].startswith("rank 0: arc_engine work: ")
    assert "% of the step" in reported[0]["message"] and "decide" in reported[0]["values"]["pieces"]

    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    with arc_engine.attach(model, optimizer, make_config(tmp_path / "off")) as arc:
        assert arc.engine.record_loss.__func__ is ArcEngine.record_loss
        assert arc.engine.decide.__func__ is ArcEngine.decide
        _train(arc, model, optimizer, data, 2)
        assert "own_work" not in arc.summary()


def _ddp_own_work(rank: int, world: int, run_dir: Path) -> dict:
    out = train_ddp(rank, 4, make_config(run_dir, "stats.own_work=true"))
    return out["summary"]["own_work"]


def test_ddp_hooks_are_timed_on_every_rank(tmp_path: Path) -> None:
    for own in run_ranks(_ddp_own_work, 2, tmp_path):
        pieces = own["pieces"]
        assert pieces["ddp.comm_hook"]["calls"] >= 1 and pieces["ddp.reduced_stats"]["calls"] >= 1
        assert pieces["ddp.comm_hook"]["depth"] == 0 and own["host_ms"] > 0
        assert torch.isfinite(torch.tensor(own["fraction"]))


def _fsdp_own_work(rank: int, world: int, run_dir: Path) -> dict:
    from tests.test_fsdp_dist import sharded_gpt

    model, data, optimizer = sharded_gpt()
    arc = arc_engine.attach(model, optimizer, make_config(run_dir, "stats.own_work=true"))
    _train(arc, model, optimizer, data, 3)
    own = arc.summary()["own_work"]
    arc.close()
    return own


def test_fsdp2_gradient_hooks_are_timed_on_every_rank(tmp_path: Path) -> None:
    """Both of FSDP2's gradient hooks: each rank's unsharded gradient (before the reduce-scatter) and its reduced
    shard; each fires once per parameter and step."""
    for own in run_ranks(_fsdp_own_work, 2, tmp_path):
        pieces = own["pieces"]
        assert pieces["fsdp.local_grad"]["calls"] >= 1 and pieces["fsdp.reduced_grad"]["calls"] >= 1
        assert pieces["fsdp.local_grad"]["calls"] == pieces["fsdp.reduced_grad"]["calls"]
        assert pieces["fsdp.local_grad"]["depth"] == 0 and own["host_ms"] > 0

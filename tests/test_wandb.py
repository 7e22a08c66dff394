"""W&B alerts and metrics from one rank, read back from the real offline run's ``.wandb`` transaction log, and the
hang watchdog (issue 6)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from arc_engine.config import load_config
from arc_engine.events import Event, Severity
from arc_engine.policy.decision import EXIT_HANG
from arc_engine.sinks.alerts import AlertLimiter, alert_level, alert_title, redact, summary_title
from arc_engine.sinks.base import Sink
from arc_engine.watchdog import (
    AGREEING,
    LOSS_RECORDED,
    STEP_STARTED,
    HangWatchdog,
    ProgressBoard,
    hang_timeout,
    stuck_ranks,
)
from tests.dist_harness import run_ranks
from tests.training import make_config, train_ddp
from tests.wandb_records import alerts, history, read_records, run_ids, transaction_logs

pytest.importorskip("wandb")

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 hex characters, shaped like a W&B API key


def _event(detector: str = "sdc", ranks: tuple[int, ...] = (5,), severity: Severity = Severity.ERROR,
           step: int = 7) -> Event:
    return Event("run-x", step, "detection", detector, severity, "skip", f"{detector} tripped", ranks,
                 {"r_jump": 0.5, "threshold": float("inf")}, iteration=step)


# ---------------------------------------------------------------- pure parts


def test_alert_titles_say_what_and_where_under_64_characters() -> None:
    locations = {5: "node-3:gpu1", 1: "a-very-long-hostname-of-a-cluster-node-in-some-datacenter:cuda:7"}
    assert alert_title(_event(), locations) == "SDC suspected on rank 5 (node-3:gpu1)"
    assert alert_title(_event("non_finite", (1, 3)), locations) == "NaN/Inf values on ranks 1, 3"
    assert alert_title(_event("loss_spike", ()), locations) == "Loss spike"
    rollback = Event("run-x", 9, "action", "recovery", Severity.ERROR, "rollback", "rollback: ...", ())
    assert alert_title(rollback, locations) == "Rolled back"
    long_title = alert_title(_event("non_finite", (1,)), locations)
    assert len(long_title) < 64 and long_title.startswith("NaN/Inf values on rank 1 (")
    assert alert_title(_event("non_finite", tuple(range(64))), locations) == "NaN/Inf values on 64 ranks"
    summary = summary_title(long_title, 41, 600)
    assert len(summary) < 64 and summary.endswith(": 41 more in the last 10 min")
    assert [alert_level(s) for s in Severity] == ["INFO", "INFO", "WARN", "ERROR", "ERROR"]


def test_limiter_sends_the_first_counts_repeats_and_summarizes_when_the_window_ends() -> None:
    limiter = AlertLimiter(window_s=600, locations={3: "h:cpu"}, run_dir="/runs/x")
    first = limiter.offer(_event("non_finite", (3,)), now=0.0)
    assert first is not None and first.title == "NaN/Inf values on rank 3 (h:cpu)" and first.level == "ERROR"
    assert "step 7 (iteration 7)" in first.text and "/runs/x" in first.text and '"threshold": "inf"' in first.text
    assert all(limiter.offer(_event("non_finite", (3,), step=8 + i), now=1.0 + i) is None for i in range(41))
    assert limiter.offer(_event("non_finite", (2,)), now=50.0) is not None  # another rank: another key
    assert limiter.due(now=100.0) == []  # window still open
    (summary,) = limiter.due(now=600.5)
    assert summary.title == "NaN/Inf values on rank 3 (h:cpu): 41 more in the last 10 min"
    assert "step 48" in summary.text  # the latest repeat
    assert limiter.due(now=2000.0) == []  # nothing pending any more
    again = limiter.offer(_event("non_finite", (3,)), now=2000.0)
    assert again is not None and (limiter.sent, limiter.suppressed) == (4, 41)


def test_redact_removes_the_api_key_and_long_tokens() -> None:
    text = f"init failed: bad key {FAKE_KEY} for https://api.example/?k=local-{FAKE_KEY}"
    cleaned = redact(text, (FAKE_KEY,))
    assert FAKE_KEY not in cleaned and "***" in cleaned
    assert "abcdef0123456789abcdef" not in redact("token abcdef0123456789abcdef0123456789abcdef", ())


def test_hang_timeout_is_initial_during_warmup_then_factor_times_longest_step_clamped() -> None:
    config = load_config(None, ["watchdog.warmup_steps=3", "watchdog.safety_factor=4", "watchdog.min_timeout_s=10",
                                "watchdog.max_timeout_s=100", "watchdog.initial_timeout_s=900"]).watchdog
    assert hang_timeout(config, 2, 50.0) == 900  # still warming up
    assert hang_timeout(config, 3, 1.0) == 10  # 4 s, clamped up
    assert hang_timeout(config, 3, 5.0) == 20
    assert hang_timeout(config, 3, 60.0) == 100  # 240 s, clamped down


class ManualClock:
    """A clock that moves only when the test says so. It counts its reads, so a test can wait until the watchdog
    thread has looked at the time (and acted on it) without asserting anything about real time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.reads += 1
            return self.now

    def wait_for_watchdog_polls(self, polls: int = 2) -> None:
        """Return once the watchdog thread has read the clock ``polls`` more times. Its loop reads the clock once per
        poll and acts on that reading before the next one, so two reads mean one whole poll saw the current time."""
        target = self.reads + polls
        deadline = time.monotonic() + 60  # a bound on a stuck thread only; nothing is asserted about the wait
        while self.reads < target:
            assert time.monotonic() < deadline, "the watchdog thread stopped polling"
            time.sleep(0.01)


def test_watchdog_timeout_counts_steps_after_warmup_only() -> None:
    config = load_config(None, ["watchdog.warmup_steps=2", "watchdog.safety_factor=4", "watchdog.min_timeout_s=10",
                                "watchdog.max_timeout_s=100", "watchdog.initial_timeout_s=900"]).watchdog
    clock = ManualClock()
    watchdog = HangWatchdog(config, 0, Path("unused"), lambda *r: None, lambda: 0, clock=clock)  # never started
    for now, timeout_s in [(100.0, 900.0),  # a 100 s first step (compilation) is in the warm-up: not counted
                           (101.0, 900.0),  # warm-up complete, no step measured yet
                           (104.0, 12.0),  # a 3 s step: 4 x 3 s
                           (105.0, 12.0),  # a shorter step does not lower it
                           (130.0, 100.0)]:  # a 25 s step: 4 x 25 s clamped to max_timeout_s
        clock.now = now
        watchdog.heartbeat()
        assert watchdog.timeout_s == timeout_s, (now, watchdog.timeout_s)


def test_watchdog_fires_once_per_stall_with_a_stack_dump_rearms_and_ignores_paused_phases(tmp_path: Path) -> None:
    config = load_config(None, ["watchdog.warmup_steps=2", "watchdog.safety_factor=2", "watchdog.min_timeout_s=0.5",
                                "watchdog.initial_timeout_s=30", "watchdog.action=alert"]).watchdog
    clock = ManualClock()
    reports: list[tuple[str, str, dict]] = []
    watchdog = HangWatchdog(config, 0, tmp_path, lambda *r: reports.append(r), lambda: 42, clock=clock,
                            exit=lambda code: pytest.fail(f"exited with {code} under action: alert")).start()
    try:
        for step in range(1, 5):  # four 1 s steps; the last two are past the warm-up
            clock.now = float(step)
            watchdog.heartbeat()
        assert watchdog.timeout_s == 2.0  # 2 x the longest step after warm-up
        clock.now = 5.5  # 1.5 s without a step: not yet a hang
        clock.wait_for_watchdog_polls()
        assert reports == []
        clock.now = 6.5  # 2.5 s: a hang
        clock.wait_for_watchdog_polls()
        assert [r[0] for r in reports] == ["hang"]
        dump = tmp_path / "stacks" / "rank0-iter42.txt"
        assert reports[0][2] == {"stalled_s": 2.5, "timeout_s": 2.0, "completed_steps": 4, "stack_dump": str(dump),
                                 "stuck_ranks": [], "progress": {}, "abort": False, "exit_code": None}
        text = dump.read_text()
        assert "wait_for_watchdog_polls" in text and "arc-hang-watchdog" in text  # every thread, this one included
        clock.now = 20.0  # the same stall goes on: no second report
        clock.wait_for_watchdog_polls()
        assert [r[0] for r in reports] == ["hang"]
        watchdog.heartbeat()
        assert [r[0] for r in reports] == ["hang", "resumed"] and reports[1][2] == {"stalled_s": 16.0}
        assert watchdog.timeout_s == 2.0  # the step that ended the stall does not set the timeout
        with watchdog.paused():
            clock.now = 100.0  # a known long phase: no report
            clock.wait_for_watchdog_polls()
        clock.now = 101.0  # the pause re-armed from its end: 1 s since
        clock.wait_for_watchdog_polls()
        assert len(reports) == 2
    finally:
        watchdog.stop()


class DictStore:
    """The two calls of a c10d store the progress board makes."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key].encode()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]


def test_stuck_ranks_are_the_ones_behind() -> None:
    assert stuck_ranks({0: 19, 1: 17, 2: 19}, 3) == [1]  # rank 1 never reached step 5's agreement
    assert stuck_ranks({0: 9, 2: 9}, 3) == [1]  # rank 1 never published (dead from the start)
    assert stuck_ranks({0: 9, 1: 9}, 2) == []  # level: nobody is ahead
    assert stuck_ranks({}, 2) == []


def test_watchdog_abort_names_the_rank_behind_and_exits_after_abort_after_timeouts(tmp_path: Path) -> None:
    config = load_config(None, ["watchdog.warmup_steps=1", "watchdog.safety_factor=2", "watchdog.min_timeout_s=1",
                                "watchdog.initial_timeout_s=30", "watchdog.action=abort",
                                "watchdog.abort_after=2"]).watchdog
    clock, store = ManualClock(), DictStore()
    board = ProgressBoard(store, "run", 2)
    board.publish(1, 4 * 3 + 1)  # rank 1: 3 steps done, its 4th forward began and never recorded a loss
    reports: list[tuple[str, str, dict]] = []
    exits: list[int] = []
    flushed: list[bool] = []
    watchdog = HangWatchdog(config, 0, tmp_path, lambda *r: reports.append(r), lambda: 4, clock=clock, board=board,
                            world_size=2, on_abort=lambda: flushed.append(True), exit=exits.append).start()
    try:
        for step in range(1, 4):
            clock.now = float(step)
            watchdog.heartbeat()
        for phase in (STEP_STARTED, LOSS_RECORDED, AGREEING):  # rank 0 waits for rank 1 in step 4's agreement
            watchdog.reached(phase)
        assert watchdog.timeout_s == 2.0
        clock.now = 5.5  # first timeout: the alert names rank 1, no exit yet
        clock.wait_for_watchdog_polls()
        assert [r[0] for r in reports] == ["hang"] and exits == []
        assert reports[0][2]["stuck_ranks"] == [1] and reports[0][2]["progress"] == {"0": 15, "1": 13}
        assert "stopped: rank(s) [1]" in reports[0][1]
        clock.now = 7.5  # second timeout in a row: abort
        clock.wait_for_watchdog_polls(1)
        deadline = time.monotonic() + 60  # a bound on a stuck thread only
        while not exits:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert exits == [EXIT_HANG] and flushed == [True]
        assert reports[-1][2]["abort"] is True and reports[-1][2]["exit_code"] == EXIT_HANG
        assert f"aborting with exit code {EXIT_HANG}" in reports[-1][1]
    finally:
        watchdog.stop()


# ---------------------------------------------------------------- real runs, real wandb (offline)


def _wandb_overrides(run_dir: Path, *extra: str) -> list[str]:
    return ["sinks.wandb.enabled=true", "sinks.wandb.mode=offline", f"sinks.wandb.dir={run_dir}",
            "sinks.metrics_interval=5", *extra]


def _train(rank: int, world: int, run_dir: Path, steps: int, overrides: list[str]) -> dict[str, Any]:
    os.environ["WANDB_SILENT"] = "true"
    return train_ddp(rank, steps, make_config(run_dir, *overrides))


def _wandb_log(run_dir: Path) -> list[Any]:
    logs = transaction_logs(run_dir)
    assert len(logs) == 1, f"expected exactly one W&B run, found {logs}"
    return read_records(logs[0])


def test_nan_flood_gives_bounded_alerts_a_summary_and_metrics_from_one_run(tmp_path: Path) -> None:
    """100 NaN steps on rank 1 of a 2-rank DDP run: one W&B run (rank 0's), one alert per key, a summary of the
    repeats, and the monitors' metrics under arc/."""
    overrides = _wandb_overrides(tmp_path, "faults.injections=[{kind: nan_grad, rank: 1, step: 5, steps: 100}]",
                                 "policy.max_consecutive_skips=1000")
    results = run_ranks(_train, 2, tmp_path, 110, overrides, timeout_s=300)
    assert all("aborted_at" not in r for r in results)
    records = _wandb_log(tmp_path)
    assert run_ids(records) == {"arc-test"}
    sent = alerts(records)
    titles = [a["title"] for a in sent]
    assert all(len(t) < 64 for t in titles)
    nan_alerts = [a for a in sent if a["title"].startswith("NaN/Inf values on rank 1 (")]
    assert len(nan_alerts) == 2, titles  # the first one, then the summary at close
    first, summary = nan_alerts
    assert first["level"] == "ERROR" and first["wait_duration"] == 600_000
    assert "step 5 (iteration 5)" in first["text"] and "detector: non_finite" in first["text"]
    assert "action taken: skip" in first["text"] and str(tmp_path) in first["text"]
    assert summary["title"].endswith(": 99 more in the last 10 min")
    assert len(sent) <= 4, titles  # bounded: 100 bad steps, a handful of alerts
    rows = history(records)
    keys = set().union(*rows)
    assert {"arc/iteration", "arc/step", "arc/skipped_by_policy"} <= keys
    assert any(k.startswith("arc/non_finite/") for k in keys) and any(k.startswith("arc/loss_spike/") for k in keys)
    skipped = [row["arc/skipped_by_policy"] for row in rows if "arc/skipped_by_policy" in row]
    assert skipped == sorted(skipped) and skipped[-1] == 100
    iterations = [row["arc/iteration"] for row in rows]
    assert iterations == sorted(iterations)


def _train_with_failing_sinks(rank: int, world: int, run_dir: Path, steps: int) -> dict[str, Any]:
    """wandb.init raising (online, a bogus key, an unreachable server) and a user sink that throws."""
    import arc_engine
    from tests.training import make_optimizer, tiny_model_and_data

    class ThrowingSink(Sink):
        name = "throwing"

        def emit(self, event: Event) -> None:
            raise RuntimeError("sink down")

        def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
            raise RuntimeError("sink down")

        def close(self) -> None:
            raise RuntimeError("sink down")

    os.environ.update(WANDB_API_KEY=FAKE_KEY, WANDB_BASE_URL="http://127.0.0.1:9", WANDB_SILENT="true")
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("arc_engine").addHandler(Capture())
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    config = make_config(run_dir, "sinks.wandb.enabled=true", "sinks.wandb.mode=online",
                         "sinks.wandb.init_timeout_s=5", "sinks.wandb.close_timeout_s=20", "sinks.metrics_interval=1",
                         "faults.injections=[{kind: nan_loss, rank: 0, step: 3}]")
    arc = arc_engine.attach(model, optimizer, config)
    arc.engine.sinks.add(ThrowingSink())
    started = time.monotonic()
    for step in range(steps):
        inputs, targets = data.batch(step, rank, 4)
        loss = arc.faults.on_loss(model(inputs, targets))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    train_s = time.monotonic() - started
    wandb_sink = next(s for s in arc.engine.sinks.sinks if s.name == "wandb")
    deadline = time.monotonic() + 60
    while wandb_sink.failed is None and time.monotonic() < deadline:
        time.sleep(0.2)
    summary = arc.summary()
    arc.close()
    return {"steps": summary["steps"], "skipped": summary["skipped_by_policy"], "failed": wandb_sink.failed,
            "logs": records, "train_s": train_s, "disabled": sorted(arc.engine.sinks.disabled),
            "undelivered_path": str(wandb_sink.undelivered_path), "undelivered": wandb_sink.undelivered}


def test_wandb_init_raising_and_a_throwing_sink_leave_training_running(tmp_path: Path) -> None:
    (result,) = run_ranks(_train_with_failing_sinks, 1, tmp_path, 30, timeout_s=240)
    assert result["steps"] == 30 and result["skipped"] == 1  # trained to the end, the NaN step skipped
    assert result["failed"] is not None  # W&B gave up (init raised), reported once
    assert "throwing" in result["disabled"]
    logs = "\n".join(result["logs"])
    assert logs.count("arc_engine W&B sink disabled") == 1
    assert FAKE_KEY not in logs and FAKE_KEY not in result["failed"]
    events = (tmp_path / "test" / "events.jsonl").read_text()
    assert FAKE_KEY not in events
    # the summary, then why the run stopped (docs/hardware.md): it completed
    assert [json.loads(line)["detector"] for line in events.splitlines()[-2:]] == ["summary", "stop"]
    assert json.loads(events.splitlines()[-1])["values"]["cause"] == "completed"
    # nothing lost at close: the NaN alert W&B never got is kept, the close says how many, and it can be resent
    kept = tmp_path / "test" / "undelivered_alerts.jsonl"
    assert result["undelivered_path"] == str(kept) and result["undelivered"] >= 1
    records = [json.loads(line) for line in kept.read_text().splitlines()]
    assert [r["event"]["detector"] for r in records if r["level"] == "ERROR"][:1] == ["non_finite"]
    assert any(f"{result['undelivered']} alert(s) were not delivered to W&B" in line for line in result["logs"])
    resend = subprocess.run([sys.executable, "-m", "arc_engine", "resend-alerts", str(kept), "--run-id", "test",
                             "--arc.sinks.wandb.mode=offline", f"--arc.sinks.wandb.dir={tmp_path / 'resent'}"],
                            capture_output=True, text=True, timeout=300,
                            env={k: v for k, v in os.environ.items() if not k.startswith("WANDB_")})
    assert resend.returncode == 0, resend.stderr
    assert f"{len(records)} alert(s) sent to W&B run arc-test" in resend.stdout
    sent = alerts(_wandb_log(tmp_path / "resent"))
    assert [a["title"] for a in sent] == [f"[resent] {r['title']}" for r in records]
    assert not kept.exists() and kept.with_name(kept.name + ".sent").exists()


def test_a_stalled_rank_triggers_the_watchdog_alert_and_stack_dumps(tmp_path: Path) -> None:
    """Rank 1 sleeps 10 s at step 12 (its peer waits in DDP's all-reduce). The derived timeout is clamped to
    [1.5 s, 5 s] whatever the machine's load makes of the steps, so it fires inside the stall: both ranks dump their
    stacks, rank 0 alerts through every sink, and training resumes when rank 1 wakes up. Nothing below depends on
    how long a step took: only on the clamp and on the order of events."""
    overrides = _wandb_overrides(tmp_path, "faults.injections=[{kind: stall, rank: 1, step: 12, seconds: 10}]",
                                 "watchdog.warmup_steps=3", "watchdog.safety_factor=3", "watchdog.min_timeout_s=1.5",
                                 "watchdog.max_timeout_s=5", "watchdog.action=alert")
    results = run_ranks(_train, 2, tmp_path, 20, overrides, timeout_s=300)
    assert all(r["summary"]["steps"] == 20 for r in results)
    stacks = tmp_path / "test" / "stacks"
    dumps = sorted(p.name for p in stacks.iterdir())
    assert dumps == ["rank0-iter12.txt", "rank1-iter12.txt"], dumps
    assert "_stall" in (stacks / "rank1-iter12.txt").read_text()  # the sleeping rank shows where it sleeps
    events = [json.loads(line) for line in (tmp_path / "test" / "events.jsonl").read_text().splitlines()]
    hangs = [e for e in events if e["detector"] == "hang"]
    assert [e["severity"] for e in hangs] == ["critical", "info"]  # the hang, then the step that ended it
    hang, resumed = (e["values"] for e in hangs)
    assert 1.5 <= hang["timeout_s"] <= 5.0  # the clamp, not the step times
    assert hang["timeout_s"] <= hang["stalled_s"] <= resumed["stalled_s"]  # after the timeout, before the stall ended
    hang_alerts = [a for a in alerts(_wandb_log(tmp_path)) if a["title"].startswith("No step completed")]
    assert len(hang_alerts) == 1 and hang_alerts[0]["level"] == "ERROR"
    assert "rank0-iter12.txt" in hang_alerts[0]["text"]


def test_a_restart_logs_to_the_same_wandb_run(tmp_path: Path) -> None:
    """Two launches with the same arc run id (a restart): both log to W&B run ``arc-test`` (``resume="allow"``);
    within each, W&B's step only increases. Offline, each launch writes its own log, merged by ``wandb sync``."""
    overrides = _wandb_overrides(tmp_path, "faults.injections=[{kind: nan_loss, rank: 0, step: 3}]")
    for _ in range(2):
        run_ranks(_train, 1, tmp_path, 12, overrides, timeout_s=180)
    logs = transaction_logs(tmp_path)
    assert len(logs) == 2
    for log in logs:
        records = read_records(log)
        assert run_ids(records) == {"arc-test"}
        steps = [row["_step"] for row in history(records)]
        assert steps == sorted(steps) and len(steps) >= 2
        assert [a["title"] for a in alerts(records)] == ["NaN/Inf values on rank 0 (" + _location() + ")"]


def _location() -> str:
    from arc_engine import runtime

    return runtime.gather_locations(None)[0]  # this process is not in a process group: rank 0, local


def _train_into_the_scripts_run(rank: int, world: int, run_dir: Path, steps: int) -> dict[str, Any]:
    """Megatron-style: the script's own W&B run lives on the last rank only, started before attach, and the script
    logs its loss there every step with an explicit step."""
    import wandb
    from torch.nn.parallel import DistributedDataParallel

    import arc_engine
    from tests.training import BATCH, make_optimizer, tiny_model_and_data

    os.environ["WANDB_SILENT"] = "true"
    run = wandb.init(project="user", mode="offline", dir=str(run_dir), id="user-run-1") if rank == world - 1 else None
    model, data = tiny_model_and_data()
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    arc = arc_engine.attach(ddp, optimizer, make_config(
        run_dir, "sinks.wandb.enabled=true", "sinks.metrics_interval=2",
        "faults.injections=[{kind: nan_grad, rank: 0, step: 4}]"))
    for step in range(steps):
        inputs, targets = data.batch(step, rank, BATCH)
        loss = ddp(inputs, targets)
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if run is not None:
            run.log({"user/loss": float(loss)}, step=step)
    owner = arc.engine.reporter.wandb_owner
    arc.close()
    if run is not None:
        run.finish()
    return {"owner": owner}


def test_an_active_run_on_another_rank_is_reused_and_its_step_kept(tmp_path: Path) -> None:
    results = run_ranks(_train_into_the_scripts_run, 2, tmp_path, 12, timeout_s=240)
    assert [r["owner"] for r in results] == [False, True]  # the rank holding the script's run talks to W&B
    records = _wandb_log(tmp_path)  # exactly one W&B run: the script's
    assert run_ids(records) == {"user-run-1"}
    assert [a["title"] for a in alerts(records)] == ["NaN/Inf values on rank 0 (" + _location() + ")"]
    rows = history(records)
    assert [row["_step"] for row in rows] == list(range(12))  # the script's steps, not moved by arc_engine
    assert any("arc/non_finite/nonfinite_steps" in row or "arc/skipped_by_policy" in row for row in rows)
    assert all("user/loss" in row for row in rows)

"""The device ledger (arc_engine/device_ledger.py): its rule, its crash safety, the sink that writes it, the
``arc-engine hosts`` command and the stop record (arc_engine/stop_record.py). In-process, except the writer killed
mid-write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from arc_engine import device_ledger as ledger
from arc_engine import stop_record
from arc_engine.cli import main as cli
from arc_engine.events import Action, Event, Finding, Severity
from arc_engine.policy.decision import EXIT_FAULTY_DEVICE, Decision
from arc_engine.sinks.base import Sink
from arc_engine.sinks.devices import DeviceLedgerSink
from tests.dist_harness import run_ranks
from tests.training import make_config, train_ddp

LOCATIONS = {0: "nodeA:cuda:0", 1: "nodeA:cuda:1", 2: "nodeB:cuda:0", 3: "nodeB:cuda:1"}


def entry(evidence: str, host: str = "nodeB", device: str = "cuda:0", *, step: int = 10, launch: str = "l1",
          position: int | None = None, iteration: int | None = None) -> dict[str, Any]:
    return {"host": host, "device": device, "evidence": evidence, "step": step, "launch": launch, "run": "r",
            "time": 1.0e9 + step, "data_position": position, "iteration": step if iteration is None else iteration}


def verdict(records: list[dict[str, Any]], location: str = "nodeB:cuda:0") -> str:
    return ledger.assess(records)[location].verdict


def test_the_rule_excludes_on_the_documented_evidence_only() -> None:
    assert verdict([entry("sdc_persistent")]) == "exclude"
    assert verdict([entry("sdc_transient", step=10)]) == "suspect"
    assert verdict([entry("sdc_transient", step=10), entry("sdc_transient", step=9000)]) == "exclude"
    assert verdict([entry("sdc_transient", step=10),
                    entry("sdc_transient", step=10 + ledger.TRANSIENT_WINDOW_STEPS + 1)]) == "suspect"
    for kind in ("straggler", "lost", "hung", "replica_divergence"):
        assert verdict([entry(kind, launch="l1"), entry(kind, step=20, launch="l1")]) == "suspect"
        assert verdict([entry(kind, launch="l1"), entry(kind, step=20, launch="l2")]) == "exclude"
    # a non-finite value on one device: its data or the device; never an exclusion by itself
    assert verdict([entry("non_finite", position=5)]) == "ok"
    many = [entry("non_finite", position=p, step=p) for p in range(5, 50, 5)]
    assert verdict(many) == "suspect"
    # the same batch non-finite at two step attempts is the data's: not counted
    replayed = [entry("non_finite", position=7, iteration=7), entry("non_finite", position=7, iteration=12)]
    assert verdict(replayed) == "ok"


def test_a_clear_forgets_the_hosts_earlier_evidence_only() -> None:
    records = [entry("sdc_persistent"), entry("sdc_persistent", host="nodeC"), {"clear": "nodeB", "time": 2e9}]
    verdicts = ledger.assess(records)
    assert ledger.excluded_hosts(verdicts) == ["nodeC"]
    assert "nodeB:cuda:0" not in verdicts
    assert verdict([*records, entry("sdc_transient", step=99)]) == "suspect"  # new evidence counts again


def test_exports_slurm_exclude_and_a_filtered_hostfile() -> None:
    verdicts = ledger.assess([entry("sdc_persistent", host="nodeB"), entry("straggler", host="nodeC")])
    assert ledger.slurm_exclude(verdicts) == "--exclude=nodeB"
    text, dropped = ledger.filter_hostfile("# the job\nnodeA slots=8\nnodeB slots=8  # rack 2\nnodeC slots=8\n",
                                           verdicts)
    assert text == "# the job\nnodeA slots=8\nnodeC slots=8\n" and dropped == ["nodeB"]
    assert ledger.slurm_exclude(ledger.assess([])) == ""
    shown = ledger.table(verdicts)
    assert "nodeB" in shown and "sdc_persistent x1" in shown and "exclude" in shown and "suspect" in shown


def test_a_torn_last_line_is_skipped_and_the_next_write_starts_a_new_line(tmp_path: Path) -> None:
    path = tmp_path / ledger.DEVICES_FILE
    ledger.append_line(path, entry("sdc_transient", step=1))
    with path.open("ab") as handle:  # a writer killed in the middle of its line
        handle.write(b'{"host": "nodeB", "evid')
    records, torn = ledger.read_devices(path)
    assert len(records) == 1 and torn == 1
    ledger.append_line(path, entry("sdc_transient", step=2))
    records, torn = ledger.read_devices(path)
    assert [r["step"] for r in records] == [1, 2] and torn == 1
    assert verdict(records) == "exclude"


WRITER = """
import sys
from arc_engine.device_ledger import append_line
step = 0
while True:
    append_line(__import__("pathlib").Path(sys.argv[1]), {"host": "nodeB", "device": "cuda:0",
                "evidence": "sdc_transient", "step": step, "pad": "x" * 20000})
    step += 1
"""


def test_the_ledger_survives_a_sigkill_during_its_writes(tmp_path: Path) -> None:
    path = tmp_path / ledger.DEVICES_FILE
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
    try:
        deadline = time.monotonic() + 60
        while (not path.exists() or path.stat().st_size < 400_000) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=30)
    records, torn = ledger.read_devices(path)
    assert len(records) >= 10 and torn <= 1
    assert [r["step"] for r in records] == list(range(len(records)))  # every complete line, in order
    ledger.append_line(path, entry("sdc_persistent", step=10**6))
    after, _ = ledger.read_devices(path)
    assert len(after) == len(records) + 1 and after[-1]["evidence"] == "sdc_persistent"


def event(detector: str, ranks: tuple[int, ...], values: dict[str, Any], *, iteration: int = 40) -> Event:
    return Event("r", 40, "detection", detector, Severity.ERROR, "warn", "found", ranks, values, iteration=iteration)


def test_the_sink_records_hardware_evidence_per_device_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / ledger.DEVICES_FILE
    sink = DeviceLedgerSink(path, LOCATIONS, "r")
    sink.emit(event("sdc_recompute", (2,), {"hardware": "sdc_persistent"}))
    sink.emit(event("sdc_recompute", (2,), {"hardware": "sdc_persistent"}))  # the same finding again: once
    sink.emit(event("loss_spike", (2,), {}))  # no evidence: the data's or the model's
    sink.emit(event("bad_data", (1,), {"data_position": 3}))
    sink.emit(event("non_finite", (0, 1, 2, 3), {"hardware": "non_finite"}))  # every rank: the whole job's
    sink.emit(event("hang", (0,), {"hardware": "lost", "hardware_ranks": [3]}, iteration=41))
    records, _ = ledger.read_devices(path)
    assert [(r["host"], r["device"], r["evidence"], r["rank"]) for r in records] == [
        ("nodeB", "cuda:0", "sdc_persistent", 2), ("nodeB", "cuda:1", "lost", 3)]
    assert ledger.excluded_hosts(ledger.assess(records)) == ["nodeB"]


def test_the_sink_reports_an_unwritable_ledger_once_and_goes_on(tmp_path: Path, caplog: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    sink = DeviceLedgerSink(blocker / ledger.DEVICES_FILE, LOCATIONS, "r")
    for iteration in (1, 2):
        sink.emit(event("sdc_recompute", (2,), {"hardware": "sdc_persistent"}, iteration=iteration))
    assert sum("device ledger" in r.getMessage() for r in caplog.records) == 1


def test_hosts_command_prints_checks_exports_and_clears(tmp_path: Path, capsys: Any) -> None:
    run_root = tmp_path / "runs"
    (run_root / "job1").mkdir(parents=True)
    assert cli(["hosts", str(run_root)]) == 0
    assert "no hardware evidence" in capsys.readouterr().out
    ledger.append_line(run_root / ledger.DEVICES_FILE, entry("sdc_persistent", host="nodeB"))
    ledger.append_line(run_root / ledger.DEVICES_FILE, entry("straggler", host="nodeA"))
    assert cli(["hosts", str(run_root / "job1")]) == 0  # a run's own directory finds the root's ledger
    out = capsys.readouterr().out
    assert "nodeB" in out and "excluded hosts: nodeB" in out and "nodeA:cuda:0: suspect" in out
    assert cli(["hosts", str(run_root), "--check", "nodeB"]) == 1
    assert "nodeB is excluded" in capsys.readouterr().out and cli(["hosts", str(run_root), "--check", "nodeA"]) == 0
    assert cli(["hosts", str(run_root), "--format", "slurm-exclude"]) == 0
    assert capsys.readouterr().out.strip() == "--exclude=nodeB"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA slots=2\nnodeB slots=2\n")
    assert cli(["hosts", str(run_root), "--format", "hostfile", "--hostfile", str(hostfile)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "nodeA slots=2\n" and "left out nodeB" in captured.err
    assert cli(["hosts", str(run_root), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["excluded_hosts"] == ["nodeB"]
    assert cli(["hosts", str(run_root), "--clear", "nodeB"]) == 0
    capsys.readouterr()
    assert cli(["hosts", str(run_root), "--check", "nodeB"]) == 0


def test_the_stop_record_names_the_cause_the_device_and_the_action() -> None:
    faulty = Finding("sdc_recompute", Action.ABORT, Severity.CRITICAL, "faulty device", (1,),
                     {"exit_code": EXIT_FAULTY_DEVICE}, hardware="sdc_persistent")
    record = stop_record.on_decision(Decision(30, Action.ABORT, (faulty,), exit_code=EXIT_FAULTY_DEVICE), "why")
    record = stop_record.complete(record, {0: "nodeA:cpu", 1: "nodeB:cpu"}, ["nodeB"])
    assert (record["cause"], record["exit_code"], record["step"], record["ranks"]) == ("faulty_device", 5, 30, [1])
    assert record["devices"] == ["nodeB:cpu"] and "without the faulty host" in record["suggested"]
    bad = Finding("non_finite", Action.SKIP, Severity.ERROR, "nan", (1,), {"data_position": 7}, data_suspect=True)
    policy = Finding("policy", Action.ABORT, Severity.CRITICAL, "too many skips")
    data_stop = stop_record.on_decision(Decision(9, Action.ABORT, (bad, policy)), "skips")
    assert data_stop["cause"] == "abort" and "data-ledger" in data_stop["suggested"]
    spike = Finding("loss_spike", Action.SKIP, Severity.WARNING, "spike")
    assert "lower learning rate" in stop_record.on_decision(Decision(9, Action.ABORT, (spike, policy)), "")[
        "suggested"]
    hang = stop_record.on_hang({"abort": True, "exit_code": 6, "hardware": "lost", "hardware_ranks": [3]}, 12)
    assert (hang["cause"], hang["ranks"]) == ("hang", [3])
    assert stop_record.on_hang({"error": "SIGTERM", "abort": False}, 12)["cause"] == "terminated"


def test_the_reporter_writes_hardware_findings_only_and_a_running_stop_record(tmp_path: Path) -> None:
    from arc_engine.config import load_config
    from arc_engine.reporter import Reporter

    config = load_config(None, [f"run.run_dir={tmp_path}", "sinks.console.enabled=false"])
    reporter = Reporter(config, 0)
    reporter.open("r", tmp_path / "r", leader=True, group=None, locations={0: "nodeA:cpu", 1: "nodeB:cpu"})
    assert stop_record.read(tmp_path / "r")["cause"] == "running"  # until the launch stops
    reporter.finding(5, 5, Finding("bad_data", Action.SKIP, Severity.WARNING, "x", (1,), bad_data=True))
    reporter.finding(5, 5, Finding("loss_spike", Action.SKIP, Severity.WARNING, "x", (1,)))
    reporter.finding(6, 6, Finding("straggler", Action.WARN, Severity.WARNING, "x", (1,), hardware="straggler"))
    reporter.close()
    records, _ = ledger.read_devices(tmp_path / ledger.DEVICES_FILE)
    assert [(r["host"], r["evidence"], r["step"]) for r in records] == [("nodeB", "straggler", 6)]


def test_a_training_loop_that_raises_while_it_closes_arc_is_an_error_stop_not_a_completed_run(tmp_path: Path) -> None:
    """``with arc:`` around a loop that raises (or ``arc.close()`` in its ``finally``): stop.json says ``error``, exit
    code 1, naming the exception; Ctrl-C is ``interrupted`` (130); ``sys.exit(0)`` and a plain close are completed."""
    import arc_engine
    from arc_engine.config import load_config

    def run(name: str, error: BaseException | None) -> dict:
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        config = load_config(None, [f"run.run_dir={tmp_path}", f"run.run_id={name}", "sinks.console.enabled=false"])
        try:
            with arc_engine.attach(model, optimizer, config) as arc:
                loss = model(torch.randn(3, 4)).square().mean()
                arc.record_loss(loss)
                loss.backward()
                optimizer.step()
                if error is not None:
                    raise error
        except BaseException as caught:  # what the loop raised goes on after arc closed
            assert caught is error
        return stop_record.read(tmp_path / name)

    raised = run("raised", ValueError("the data loader broke"))
    assert (raised["cause"], raised["exit_code"]) == ("error", 1)
    assert "ValueError: the data loader broke" in raised["message"]
    assert (run("interrupted", KeyboardInterrupt())["cause"], run("ctrl_c", KeyboardInterrupt())["exit_code"]) == \
        ("interrupted", 130)
    assert run("exit0", SystemExit(0))["cause"] == "completed"
    assert run("exit2", SystemExit(2))["exit_code"] == 2
    assert run("clean", None)["cause"] == "completed"


def test_a_relaunch_keeps_the_last_stop_record_inside_its_own(tmp_path: Path) -> None:
    from arc_engine.config import load_config
    from arc_engine.reporter import Reporter

    config = load_config(None, [f"run.run_dir={tmp_path}", "sinks.console.enabled=false"])
    first = Reporter(config, 0)
    first.open("r", tmp_path / "r", leader=True, group=None, locations={0: "nodeA:cpu", 1: "nodeB:cpu"})
    first.stopping = stop_record.on_hang({"abort": True, "exit_code": 6, "hardware": "lost",
                                          "hardware_ranks": [1]}, 17)
    seen: list[Event] = []

    class Capture(Sink):  # what W&B's sink receives: the stop as one critical event (one alert)
        def emit(self, event: Event) -> None:
            seen.append(event)

    first.sinks.add(Capture())
    first.close()
    [stop] = [e for e in seen if e.detector == "stop"]
    assert stop.severity == Severity.CRITICAL and stop.values["cause"] == "hang" and "nodeB:cpu" in stop.message
    assert stop_record.read(tmp_path / "r")["devices"] == ["nodeB:cpu"]
    second = Reporter(config, 0)
    second.open("r", tmp_path / "r", leader=True, group=None, locations={0: "nodeA:cpu"})
    second.stopping = stop_record.completed(40)
    second.close()
    record = stop_record.read(tmp_path / "r")
    assert (record["cause"], record["previous"]["cause"], record["previous"]["step"]) == ("completed", "hang", 17)


def _launch_with_device_events(rank: int, world: int, runs: Path) -> list[tuple]:
    os.environ["ARC_TEST_HOSTNAME"] = f"node{rank}"  # a host per rank (runtime.hostname: tests only)
    config = make_config(runs, "faults.injections=[{kind: hardware_events, rank: 1, step: 3, count: 2}]")
    return train_ddp(rank, 6, config)["decisions"]


def test_device_events_of_one_rank_are_named_and_exclude_its_host_after_two_launches(tmp_path: Path) -> None:
    """A device reporting hardware events (the ``hardware_events`` fault, NVML's stand-in on CPU ranks) on rank 1:
    every rank names rank 1 in a ``hardware_events`` finding with no action, the ledger records its device; seen in
    a second launch, its host is excluded, and rank 0's is not in the ledger at all."""
    runs = tmp_path / "runs"
    for launch in (1, 2):
        decisions = run_ranks(_launch_with_device_events, 2, runs)
        assert decisions[0] == decisions[1], "ranks disagree"
        named = [(step, action, findings) for step, action, findings in decisions[0]
                 if ("hardware_events", [1]) in findings]
        assert [(step, action) for step, action, _ in named] == [(3, "NONE")], decisions[0]
        records, torn = ledger.read_devices(runs / ledger.DEVICES_FILE)
        assert not torn and [(r["host"], r["evidence"], r["step"]) for r in records] == \
            [("node1", "hardware_event", 3)] * launch, records
        verdicts = ledger.assess(records)
        assert [v.verdict for v in verdicts.values()] == ["suspect" if launch == 1 else "exclude"], verdicts
    assert ledger.excluded_hosts(verdicts) == ["node1"]

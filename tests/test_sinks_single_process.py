"""Events and sinks, and the single-process (no torch.distributed) path of attach()."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

import arc_engine
from arc_engine.events import Event, Severity
from arc_engine.sinks import ConsoleSink, JsonlSink, Sink, SinkSet, format_event, read_jsonl
from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data


class ExplodingSink(Sink):
    name = "exploding"

    def __init__(self) -> None:
        self.calls = 0

    def emit(self, event: Event) -> None:
        self.calls += 1
        raise ConnectionError("sink backend is down")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.calls += 1
        raise ConnectionError("sink backend is down")

    def close(self) -> None:
        raise ConnectionError("sink backend is down")


def _train(arc: arc_engine.Arc, model, optimizer, data, steps: int) -> list[str]:
    actions = []
    for _ in range(steps):
        loss = arc.faults.on_loss(model(*data.batch(arc.progress.step, 0, BATCH)))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        actions.append(arc.engine.last_decision.action.name)
    return actions


def test_failing_sink_never_stops_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    config = make_config(tmp_path, "faults.injections=[{kind: nan_loss, rank: 0, step: 2}]")
    arc = arc_engine.attach(model, optimizer, config)
    broken = ExplodingSink()
    arc.engine.sinks.add(broken)
    actions = _train(arc, model, optimizer, data, 6)
    arc.close()
    assert actions[2] == "SKIP" and actions.count("SKIP") == 1
    assert "exploding" in arc.engine.sinks.disabled
    assert broken.calls == arc.engine.sinks.max_failures  # disabled after max_failures, not called again
    assert sum("sink 'exploding' failed" in r.message for r in caplog.records) == 1  # reported once
    events = read_jsonl(tmp_path / "test" / "events.jsonl")  # the healthy sink kept working
    assert [e["detector"] for e in events if e["kind"] == "detection"] == ["non_finite"]


def test_single_process_attach_detects_and_skips(tmp_path: Path) -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    config = make_config(tmp_path, "faults.injections=[{kind: inf_grad, rank: 0, step: 3, param: ln_f.bias}]")
    with arc_engine.attach(model, optimizer, config) as arc:
        assert _train(arc, model, optimizer, data, 3) == ["NONE"] * 3
        params_before = [p.detach().clone() for p in model.parameters()]
        adam_steps_before = {k: v["step"].clone() for k, v in optimizer.state.items()}
        assert _train(arc, model, optimizer, data, 1) == ["SKIP"]
        assert not arc.last_step_applied
        assert all(torch.equal(a, b) for a, b in zip(params_before, model.parameters(), strict=True))
        assert all(torch.equal(adam_steps_before[k], v["step"]) for k, v in optimizer.state.items())
        assert _train(arc, model, optimizer, data, 1) == ["NONE"]
        assert arc.last_step_applied
        summary = arc.summary()
    assert summary["skipped_by_policy"] == 1 and summary["steps"] == 5
    finding = next(e for e in read_jsonl(tmp_path / "test" / "events.jsonl") if e["kind"] == "detection")
    assert finding["values"]["first_group_name"] == "no_decay" and finding["ranks"] == [0]


def test_jsonl_sink_writes_strict_json_lines(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "events.jsonl", tmp_path / "metrics.jsonl")
    sink.emit(Event("run", 7, "detection", "loss_spike", Severity.WARNING, "skip", "spike",
                    (1, 2), {"loss": float("nan"), "ratio": float("inf")}))
    sink.log_metrics(7, {"arc/loss": 1.5})
    sink.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    record = json.loads(lines[0])  # strict JSON: no bare NaN
    assert record["values"] == {"loss": "nan", "ratio": "inf"} and record["ranks"] == [1, 2]
    assert record["severity"] == "warning" and record["step"] == 7
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 7, "arc/loss": 1.5}]
    with open(tmp_path / "events.jsonl", "a") as handle:
        handle.write('{"partial": ')  # a crash mid-line
    assert len(read_jsonl(tmp_path / "events.jsonl")) == 1


def test_console_sink_filters_by_severity() -> None:
    stream = io.StringIO()
    sinks = SinkSet([ConsoleSink(Severity.WARNING, "never", stream)])
    sinks.emit(Event("r", 1, "lifecycle", "start", Severity.INFO, "none", "hello"))
    sinks.emit(Event("r", 40, "detection", "non_finite", Severity.ERROR, "skip", "NaN", (1,)))
    out = stream.getvalue().splitlines()
    assert out == [format_event(Event("r", 40, "detection", "non_finite", Severity.ERROR, "skip", "NaN", (1,)))]
    assert "step     40" in out[0] and "-> SKIP" in out[0] and "ranks [1]" in out[0]


def test_attach_refuses_an_optimizer_of_another_model_and_a_second_engine(tmp_path: Path) -> None:
    model, _data = tiny_model_and_data()
    other, _ = tiny_model_and_data()
    with pytest.raises(ValueError, match=r"the optimizer holds none of the model's .* trainable parameters"):
        arc_engine.attach(model, make_optimizer(other), make_config(tmp_path))
    optimizer = make_optimizer(model)
    arc = arc_engine.attach(model, optimizer, make_config(tmp_path))
    with pytest.raises(ValueError, match="already has an arc_engine attached"):
        arc_engine.attach(model, optimizer, make_config(tmp_path))
    arc.close()
    arc_engine.attach(model, optimizer, make_config(tmp_path)).close()  # after close it attaches again


def test_record_loss_says_what_it_expects(tmp_path: Path) -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    with arc_engine.attach(model, optimizer, make_config(tmp_path)) as arc:
        loss = model(*data.batch(0, 0, BATCH))
        with pytest.raises(TypeError, match=r"record_loss expects the loss as a torch\.Tensor .* got float"):
            arc.record_loss(float(loss))


def test_the_batch_generator_draws_the_same_batch_for_the_same_data_position(tmp_path: Path) -> None:
    """A loop that draws random batches (nanoGPT) draws them from ``arc.batch_generator()``: the draw is a function
    of the data position (and seed), so a rewind to a position draws that position's batch again, and the counters a
    loop of its own keeps (applied and skipped steps) move with the steps."""
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    with arc_engine.attach(model, optimizer, make_config(tmp_path)) as arc:
        first = torch.randint(1000, (8,), generator=arc.batch_generator())
        assert torch.equal(first, torch.randint(1000, (8,), generator=arc.batch_generator()))
        assert not torch.equal(first, torch.randint(1000, (8,), generator=arc.batch_generator(seed=1)))
        _train(arc, model, optimizer, data, 2)
        progress = arc.progress
        assert progress.data_position == 2 and progress.applied_steps == 2 and progress.steps_not_applied == 0
        later = torch.randint(1000, (8,), generator=arc.batch_generator())
        assert not torch.equal(first, later)
        arc.engine.rewind(0, 0)  # what a rollback to the start does to the position
        assert torch.equal(first, torch.randint(1000, (8,), generator=arc.batch_generator()))

"""The pure parts of scripts/bench_scale.py: the router measurement on a small MoE shape and the tables' head."""

from __future__ import annotations

import pytest
import torch

from tests.scripts_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_scale")


def test_the_router_measurement_observes_every_layer_and_writes_their_sums(bench, monkeypatch) -> None:
    from arc_engine.monitors import router_health

    written = []
    real_write = router_health.RouterObserver.write

    def write(self, buffer, view):  # what the measurement's write leaves in the router slots
        real_write(self, buffer, view)
        written.append(buffer.view(router_health.ROUTER_SUMS).clone().view(self.parts.num_layers, self.size))

    monkeypatch.setattr(router_health.RouterObserver, "write", write)
    shape = bench.MoEShape("tiny", layers=3, experts=8, topk=2, hidden=16, tokens=64)
    row = bench.bench_router(shape, torch.device("cpu"), 1, torch.float32)
    assert row["observe_ms"] > 0 and row["write_ms"] >= 0
    sums = written[-1]  # the slots add up over the bench's writes: compare within a layer and across layers
    assert sums.shape == (3, router_health.router_partials_size(8))
    reports, tokens, counts = sums[:, 0], sums[:, 4], sums[:, 6:6 + 8]  # 4 weight slots, tokens, Σ H, per expert
    assert torch.all(tokens > 0) and torch.all(tokens % 64 == 0) and torch.all(tokens == tokens[0])
    assert torch.equal(counts.sum(dim=1), 2 * tokens)  # every token of every layer routed to its top 2
    assert torch.all(reports >= 1) and torch.all(reports == reports[0])  # each layer's weight reported alike


def test_table_head_prints_a_markdown_header(bench, capsys) -> None:
    bench.table_head("title", ["a", "b", "c"])
    assert capsys.readouterr().out.splitlines() == ["title", "| a | b | c |", "|---|---:|---:|"]

"""SDC recovery by localized recomputation on real gloo ranks: the suspect withholds its gradient before the
reduction, re-runs forward/backward alone, and the step goes on; a reproduced anomaly goes to a peer check that
tells a faulty device (quarantine, exit code 5) from a data-caused spike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine.device_ledger import DEVICES_FILE, assess, excluded_hosts, read_devices
from arc_engine.faults.bitflip import BitFlipInjector, BitFlipSpec
from arc_engine.monitors.sdc_local import (
    LocalGate,
    add_chunk_sums,
    add_gradient_sketch,
    chunk_length,
    chunk_sums,
    cosine_to_peers,
    gate_flags,
)
from arc_engine.recovery.recompute import classify
from arc_engine.sinks import read_jsonl
from tests.dist_harness import run_ranks
from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data

pytestmark = pytest.mark.timeout(300)

WARMUP = 20


def recompute_config(run_dir: Path, *overrides: str) -> Any:
    return make_config(run_dir, "detectors.sdc.enabled=true", f"detectors.sdc.warmup_steps={WARMUP}",
                       "detectors.sdc.recompute.enabled=true", "detectors.loss_spike.enabled=false",
                       "detectors.grad_norm.enabled=false", "detectors.consistency.enabled=false", *overrides)


# ------------------------------------------------------------------ pure parts

def test_gate_withholds_non_finite_and_jumps_after_warmup() -> None:
    norm_sq = torch.tensor([1.0, float("inf"), 100.0, 100.0], dtype=torch.float64)
    reference = torch.ones(4, dtype=torch.float64)
    seen = torch.tensor([5, 0, 5, 1])
    assert gate_flags(norm_sq, reference, seen, 8.0, 3).tolist() == [False, True, True, False]  # 100 > 64; warm-up
    gate = LocalGate(8.0, 2, torch.device("cpu"))
    for _ in range(3):
        assert not bool(gate.check(0, torch.tensor(1.0)))
    assert bool(gate.check(0, torch.tensor(1000.0), micro_batch=1))
    assert bool(gate.check(0, torch.tensor(1.0), micro_batch=2))  # withheld once: the rest of the step too
    assert gate.withheld() == {0: 1}
    assert gate.would_withhold(0, 1000.0) and not gate.would_withhold(0, 2.0)
    gate.reset_step()
    assert gate.withheld() == {} and not bool(gate.check(0, torch.tensor(1.2)))


def test_sketch_is_linear_and_the_corrupted_rank_points_away() -> None:
    torch.manual_seed(0)
    shared = torch.randn(4000)
    grads = [shared + 0.3 * torch.randn(4000) for _ in range(4)]
    grads[2] = grads[2].clone()
    grads[2][100:120] *= 2.0**16  # an exponent flip in a block
    sketches = np.zeros((4, 64))
    for rank, grad in enumerate(grads):
        sketch = torch.zeros(64, dtype=torch.float64)
        add_gradient_sketch(sketch, [grad[:1000].view(10, 100), grad[1000:]], [0, 1])
        sketches[rank] = sketch.numpy()
    cosines = cosine_to_peers(sketches)
    assert int(np.argmin(cosines)) == 2 and cosines[2] < 0.2 < min(np.delete(cosines, 2))
    both = torch.zeros(64, dtype=torch.float64)
    add_gradient_sketch(both, [grads[0] + grads[1]], [0])
    parts = torch.zeros(64, dtype=torch.float64)
    add_gradient_sketch(parts, [grads[0]], [0])
    add_gradient_sketch(parts, [grads[1]], [0])
    torch.testing.assert_close(both, parts, rtol=1e-5, atol=1e-4)  # float32 sums: rounding only


def test_batched_chunk_sums_give_the_per_tensor_sketch() -> None:
    """The ZeRO hooks queue each gradient's chunk sums and fold them in one batch: the same sketch as one call
    per tensor (sizes below, at and above the sketch size, with and without a remainder; a repeated tensor)."""
    torch.manual_seed(1)
    grads = [*(torch.randn(n) for n in (5, 64, 1000, 4097, 130)), torch.randn(7, 9)]
    indices = [3, 0, 1, 2, 5, 4]
    grads, indices = [*grads, grads[2]], [*indices, 1]  # a second micro-batch of tensor 1
    one_by_one = torch.zeros(64, dtype=torch.float64)
    for grad, index in zip(grads, indices, strict=True):
        add_gradient_sketch(one_by_one, [grad], [index])
    cache: dict = {}
    for _ in range(2):  # the second pass reuses the cached batch plan
        batched = torch.zeros(64, dtype=torch.float64)
        add_chunk_sums(batched, [chunk_sums(g, 64) for g in grads], indices, cache)
        torch.testing.assert_close(batched, one_by_one, rtol=1e-12, atol=1e-9)
    assert chunk_sums(torch.zeros(0), 64) is None


def test_chunk_sums_are_signed_sums_of_prime_length_chunks() -> None:
    """Each chunk's elements under one fixed ±1 pattern, the remainder under the pattern's start; linear."""
    values = torch.arange(1.0, 24.0)  # 23 elements; a sketch of 2 slots: chunks of the prime >= 23 // 8 = 2
    length = chunk_length(23, 2)
    assert length == 2
    sums = chunk_sums(values, 2)
    assert sums is not None and sums.numel() == 12
    pattern = chunk_sums(torch.tensor([1.0, 0.0]), 2), chunk_sums(torch.tensor([0.0, 1.0]), 2)
    signs = torch.tensor([float(pattern[0][0]), float(pattern[1][0])])
    assert set(signs.tolist()) <= {-1.0, 1.0}
    expected = torch.cat([values[:22].view(11, 2) @ signs, (values[22:] * signs[:1]).sum().reshape(1)])
    torch.testing.assert_close(sums, expected)
    assert chunk_length(4096 * 1000, 256) == 4001  # a prime, about 4 chunks per slot
    other = torch.randn(23)
    torch.testing.assert_close(chunk_sums(values + other, 2), sums + chunk_sums(other, 2))
    scaled = torch.full((4096,), 60000.0, dtype=torch.float16)  # loss-scaled fp16: sums far above fp16's range
    assert torch.isfinite(chunk_sums(scaled, 4)).all()
    torch.testing.assert_close(chunk_sums(scaled, 4), chunk_sums(scaled.float(), 4))


def test_peer_check_calls_agreement_data_and_disagreement_a_faulty_device() -> None:
    assert classify(10.0, 10.0001, 0.01) == "data"
    assert classify(float("inf"), float("inf"), 0.01) == "data"
    assert classify(1e12, 10.0, 0.01) == "device"
    assert classify(float("nan"), 10.0, 0.01) == "device"


# ------------------------------------------------------------------ DDP, 4 and 2 ranks

def _train(rank: int, world: int, run_dir: Path, steps: int, spec: dict[str, Any] | None,
           overrides: tuple[str, ...] = (), crafted: tuple[int, int] | None = None,
           broken: bool = False, blowup: tuple[int, int] | None = None) -> dict[str, Any]:
    """Train the tiny GPT under DDP with recomputation on; ``spec``: a bit flip; ``crafted``: (rank, step) whose
    batch is a pathological one (inputs scaled in the embedding: a genuine, reproducible gradient spike);
    ``blowup``: (rank, step) whose forward pass is transiently corrupted at its end (the loss x 2**16, as a flipped
    exponent bit of the last activation: loss and gradient both; not in the recomputation)."""
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    ddp = DistributedDataParallel(model)
    arc: Any = None

    def loss_of(module: torch.nn.Module, position: int, data_rank: int) -> torch.Tensor:
        loss = module(*data.batch(position, data_rank, BATCH))
        if crafted is not None and (data_rank, position) == crafted:
            loss = loss * 1000.0  # a pathological batch (e.g. a huge sample weight): real, and reproducible
        return loss

    def recompute(module: torch.nn.Module, data_rank: int) -> list[torch.Tensor]:
        if broken:
            raise RuntimeError("the data loader cannot rebuild this batch")
        return [loss_of(module, arc.progress.data_position, data_rank)]

    arc = arc_engine.attach(ddp, optimizer, recompute_config(run_dir, *overrides), recompute_fn=recompute)
    injector = None
    if spec is not None:
        injector = BitFlipInjector(BitFlipSpec(**spec), rank=rank, current_step=lambda: arc.engine.progress.iteration)
        injector.install(model)
    findings: dict[int, list[tuple[str, str, tuple[int, ...], str]]] = {}
    exit_code = None
    snapshots = {}
    try:
        while arc.progress.step < steps:
            step = arc.progress.step
            loss = loss_of(ddp, arc.progress.data_position, rank)
            if blowup == (rank, step):
                loss = loss * 2.0 ** 16
            arc.record_loss(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            snapshots[step] = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
            decision = arc.engine.last_decision
            if decision is not None and decision.step == step and decision.findings:
                findings[step] = [(f.detector, f.action.name.lower(), f.ranks, str(f.values.get("classification")))
                                  for f in decision.findings]
    except arc_engine.ArcAbort as err:
        exit_code = err.exit_code
        decision = arc.engine.last_decision
        findings[decision.step] = [(f.detector, f.action.name.lower(), f.ranks, str(f.values.get("classification")))
                                   for f in decision.findings]
    arc.close()
    key_bias = slice(model.blocks[0].attn.qkv.bias.numel() // 3, 2 * model.blocks[0].attn.qkv.bias.numel() // 3)
    return {"params": {name: p.detach().clone() for name, p in model.named_parameters()}, "snapshots": snapshots,
            "key_bias": key_bias, "eval_loss": float(model(*data.batch(10_000, 0, 16)).detach()),
            "calls": arc.engine.sdc_recompute.calls if arc.engine.sdc_recompute else 0, "findings": findings,
            "exit_code": exit_code,
            "step": arc.progress.step, "fired": [f["step"] for f in injector.fired] if injector else []}


def transient_flip(rank: int, step: int) -> dict[str, Any]:
    # fp32 exponent bit 30 on 4 values of a backward GEMM output: an enormous (or infinite) local gradient.
    return {"pattern": "blocks.0.mlp.0", "where": "backward", "rank": rank, "steps": [step], "count": 4, "bit": 30,
            "max_per_step": 1}


def test_transient_flip_on_rank_2_of_4_is_recomputed_there_only_and_training_matches_clean(tmp_path: Path) -> None:
    clean = run_ranks(_train, 4, tmp_path / "clean", 40, None)
    faulty = run_ranks(_train, 4, tmp_path / "faulty", 40, transient_flip(2, 30))
    assert [r["fired"] for r in faulty] == [[], [], [30], []]
    assert [r["calls"] for r in faulty] == [0, 0, 1, 0]  # only rank 2 re-ran forward/backward
    assert all(r["calls"] == 0 and r["findings"] == {} for r in clean)
    for result in faulty:
        assert result["findings"] == {30: [("sdc_recompute", "warn", (2,), "transient")]}
        assert result["step"] == 40
    for clean_rank, faulty_rank in zip(clean, faulty, strict=True):
        assert_matches_clean(clean_rank, faulty_rank, 30)
    events = [e for e in read_jsonl(tmp_path / "faulty" / "test" / "events.jsonl") if e["detector"] == "sdc_recompute"]
    assert "rank 2 (" in events[0]["message"] and events[0]["values"]["location"].endswith(":cpu")


def assert_matches_clean(clean: dict[str, Any], faulty: dict[str, Any], fault_step: int) -> None:
    """Right after the corrected step every parameter equals the fault-free run's at fp32 tolerance (the corrected
    reduction sums in another order). Later, every parameter still does except the attention key bias: its
    gradient is zero up to rounding (softmax ignores a shift shared by all keys), so Adam turns rounding noise into
    O(lr) moves that do not change the function -- the eval loss stays equal."""
    torch.testing.assert_close(faulty["snapshots"][fault_step], clean["snapshots"][fault_step], rtol=1e-5, atol=1e-6)
    for name, value in clean["params"].items():
        other = faulty["params"][name]
        if name.endswith("attn.qkv.bias"):
            value, other = value.clone(), other.clone()
            value[clean["key_bias"]] = other[clean["key_bias"]] = 0.0
        torch.testing.assert_close(other, value, rtol=1e-5, atol=1e-6, msg=name)
    assert faulty["eval_loss"] == pytest.approx(clean["eval_loss"], rel=1e-5)


def forward_flip(rank: int, step: int, bit: int) -> dict[str, Any]:
    """An exponent bit of 4 values of a forward GEMM output: the loss and the gradient of that rank both wrong."""
    return {"pattern": "blocks.0.attn.qkv", "where": "forward", "rank": rank, "steps": [step], "count": 4,
            "bit": bit, "max_per_step": 1}


@pytest.mark.parametrize("fault", ["loss-explodes", "nan"])
def test_a_forward_corruption_is_repaired_not_skipped(tmp_path: Path, fault: str) -> None:
    """The recomputation's loss replaces the corrupted one before the loss detectors judge the step: the step is
    applied on every rank and training goes on like the fault-free run (loss-spike and non-finite detectors on).

    ``nan``: bit 30 of 4 values of rank 1's QKV output (a NaN loss and gradient). ``loss-explodes``: rank 1's loss
    and gradient x 2**16 -- on this pre-LN model no single GEMM output flip gives a finite explosion (LayerNorm
    absorbs exponent bits 26-29; bit 30 overflows to NaN), so the corruption is put on the loss itself."""
    detectors = ("detectors.loss_spike.enabled=true",)
    spec = forward_flip(1, 30, 30) if fault == "nan" else None
    blowup = (1, 30) if fault == "loss-explodes" else None
    clean = run_ranks(_train, 3, tmp_path / "clean", 36, None, detectors)
    faulty = run_ranks(_train, 3, tmp_path / "faulty", 36, spec, detectors, None, False, blowup)
    if spec is not None:
        assert [r["fired"] for r in faulty] == [[], [30], []]
    assert [r["calls"] for r in faulty] == [0, 1, 0]
    for result in faulty:
        assert result["findings"] == {30: [("sdc_recompute", "warn", (1,), "transient")]}
        assert result["step"] == 36
    for clean_rank, faulty_rank in zip(clean, faulty, strict=True):
        assert_matches_clean(clean_rank, faulty_rank, 30)
    recompute = [e for e in read_jsonl(tmp_path / "faulty" / "test" / "events.jsonl")
                 if e["detector"] == "sdc_recompute"]
    assert len(recompute) == 1 and recompute[0]["step"] == 30
    records, _ = read_devices(tmp_path / "faulty" / DEVICES_FILE)  # a transient SDC: a suspect, not excluded
    assert [(r["rank"], r["evidence"]) for r in records] == [(1, "sdc_transient")]
    assert [v.verdict for v in assess(records).values()] == ["suspect"]


def persistent_flip(rank: int, start: int) -> dict[str, Any]:
    return {"pattern": "blocks.0.mlp.0", "where": "backward", "rank": rank, "persistent": True, "start_step": start,
            "count": 4, "bit": 30}


def test_persistent_fault_is_classified_as_a_faulty_device_quarantined_and_stops_with_exit_5(tmp_path: Path) -> None:
    results = run_ranks(_train, 2, tmp_path, 40, persistent_flip(1, 30))
    assert [r["exit_code"] for r in results] == [arc_engine.EXIT_FAULTY_DEVICE] * 2
    assert [r["step"] for r in results] == [30, 30]  # stopped at the same step on every rank
    assert [r["calls"] for r in results] == [1, 1]  # rank 1 recomputed its batch, then peer rank 0 did
    for result in results:
        assert ("sdc_recompute", "abort", (1,), "device") in result["findings"][30]
    quarantine = json.loads((tmp_path / "test" / "quarantine.json").read_text())["quarantined"]
    assert [(e["rank"], e["step"]) for e in quarantine] == [(1, 30)]
    assert quarantine[0]["location"].endswith(":cpu")
    # the device ledger (the run root's) excludes the device; stop.json says why and what to do
    records, _ = read_devices(tmp_path / DEVICES_FILE)
    assert [(r["rank"], r["evidence"], r["step"]) for r in records] == [(1, "sdc_persistent", 30)]
    assert excluded_hosts(assess(records)) == [quarantine[0]["location"].split(":")[0]]
    stop = json.loads((tmp_path / "test" / "stop.json").read_text())
    assert (stop["cause"], stop["exit_code"], stop["ranks"]) == ("faulty_device", 5, [1])
    assert stop["excluded_hosts"] == excluded_hosts(assess(records)) and "without the faulty host" in stop["suggested"]


def test_faulty_device_excluded_keeps_training_like_a_clean_run(tmp_path: Path) -> None:
    clean = run_ranks(_train, 2, tmp_path / "clean", 36, None)
    results = run_ranks(_train, 2, tmp_path / "faulty", 36, persistent_flip(1, 30),
                        ("detectors.sdc.recompute.on_faulty_device=exclude",))
    assert [r["exit_code"] for r in results] == [None, None] and [r["step"] for r in results] == [36, 36]
    assert [r["calls"] for r in results] == [6, 6]  # steps 30-35: the suspect once, its peer once
    assert all(r["findings"][step] == [("sdc_recompute", "warn", (1,), "device")] for r in results
               for step in range(30, 36))
    for clean_rank, faulty_rank in zip(clean, results, strict=True):  # the peer's recomputation replaced rank 1's
        assert_matches_clean(clean_rank, faulty_rank, 30)


def test_a_crafted_batch_is_classified_as_data_not_hardware(tmp_path: Path) -> None:
    results = run_ranks(_train, 2, tmp_path, 34, None, ("detectors.loss_spike.action=skip",), (1, 30))
    assert [r["calls"] for r in results] == [1, 1]  # the suspect reproduced it, so the peer checked it
    for result in results:
        assert ("sdc_recompute", "skip", (1,), "data") in result["findings"][30]
        assert all(f[3] != "device" for f in result["findings"][30])
        assert torch.equal(result["snapshots"][30], result["snapshots"][29])  # the spike policy skipped it
    assert not (tmp_path / "test" / "quarantine.json").exists()
    assert not (tmp_path / DEVICES_FILE).exists()  # the data's: never the hardware's


def test_no_recomputation_in_a_clean_1000_step_run(tmp_path: Path) -> None:
    results = run_ranks(_train, 2, tmp_path, 1000, None, ("detectors.sdc.warmup_steps=100",))
    assert [r["calls"] for r in results] == [0, 0]
    # every finding but the straggler family's, whose timing findings a loaded machine can raise on any rank
    untimed = [{step: found for step, findings in r["findings"].items()
                if (found := [f for f in findings if f[0] != "straggler"])} for r in results]
    assert untimed == [{}, {}]


# ------------------------------------------------------------------ DeepSpeed ZeRO-2

def _train_zero2(rank: int, world: int, run_dir: Path, steps: int, spec: dict[str, Any] | None,
                 clip: float) -> dict[str, Any]:
    from arc_engine.integrations.deepspeed import attach_deepspeed
    from tests.test_deepspeed_dist import ds_engine

    engine, data = ds_engine(rank, world, 2, clip=clip)
    arc: Any = None

    def recompute(module: torch.nn.Module, data_rank: int) -> list[torch.Tensor]:
        return [module(*data.batch(arc.progress.data_position, data_rank, BATCH))]

    arc = attach_deepspeed(engine, recompute_config(run_dir), recompute_fn=recompute)
    injector = None
    if spec is not None:
        injector = BitFlipInjector(BitFlipSpec(**spec), rank=rank, current_step=lambda: arc.engine.progress.iteration)
        injector.install(engine.module)
    from arc_engine.testing.host_syncs import HostSyncCounter

    findings, snapshots, reads = {}, {}, []
    while arc.progress.step < steps:
        step = arc.progress.step
        counter = HostSyncCounter()
        with counter:  # the host reads arc_engine makes in this step (the recomputation's, on the fault step)
            counter.begin(step)
            loss = engine(*data.batch(arc.progress.data_position, rank, BATCH))
            arc.record_loss(loss)
            engine.backward(loss)
            engine.step()
        if spec is not None and step == spec["steps"][0]:
            reads = [site for site in counter.by_step.get(step, []) if "recompute.py" in site]
        snapshots[step] = torch.cat([p.detach().flatten() for p in engine.module.parameters()]).clone()
        decision = arc.engine.last_decision
        if decision is not None and decision.step == step and decision.findings:
            findings[step] = [(f.detector, f.action.name.lower(), f.ranks, str(f.values.get("classification")))
                              for f in decision.findings]
    arc.close()
    model = engine.module
    key_bias = slice(model.blocks[0].attn.qkv.bias.numel() // 3, 2 * model.blocks[0].attn.qkv.bias.numel() // 3)
    return {"params": {name: p.detach().clone() for name, p in model.named_parameters()}, "snapshots": snapshots,
            "key_bias": key_bias, "eval_loss": float(model(*data.batch(10_000, 0, 16)).detach()),
            "calls": arc.engine.sdc_recompute.calls, "findings": findings, "recompute_reads": reads,
            "fired": [f["step"] for f in injector.fired] if injector else []}


@pytest.mark.parametrize("clip", [0.0, 0.5], ids=["no-clip", "clip"])
def test_transient_flip_under_zero2_is_recomputed_on_the_suspect_only(tmp_path: Path, clip: float) -> None:
    """With clipping on, the corrected step is clipped with the corrected gradient's norm (the one DeepSpeed
    computed lacked the withheld share)."""
    pytest.importorskip("deepspeed")
    clean = run_ranks(_train_zero2, 2, tmp_path / "clean", 36, None, clip)
    faulty = run_ranks(_train_zero2, 2, tmp_path / "faulty", 36, transient_flip(1, 30), clip)
    assert [r["fired"] for r in faulty] == [[], [30]]
    assert [r["calls"] for r in faulty] == [0, 1]
    assert all(r["findings"] == {30: [("sdc_recompute", "warn", (1,), "transient")]} for r in faulty)
    assert all(r["calls"] == 0 and r["findings"] == {} for r in clean)
    for clean_rank, faulty_rank in zip(clean, faulty, strict=True):
        assert_matches_clean(clean_rank, faulty_rank, 30)
    # the recomputation judges every (parameter, micro-batch) on the device: a fixed handful of host reads per
    # recomputation (its summary, the verdicts, the correction's flags), none per parameter
    for result in faulty:
        assert len(result["recompute_reads"]) <= 4, result["recompute_reads"]
        assert not [s for s in result["recompute_reads"] if "(_observe)" in s or "(apply)" in s or "(_judge)" in s]


def test_update_rms_jump_with_nothing_withheld_recomputes_every_rank_once(tmp_path: Path) -> None:
    """2^8 x 256 values of a backward GEMM output on rank 1, with the gate set too loose to see it: the ΔR / √ΔG
    rule catches it after the reduction, no rank was withheld, so every rank recomputes once; the recomputed step
    is clean and applied."""
    flip = {**transient_flip(1, 40), "bit": 26, "count": 256}
    loose = ("detectors.sdc.recompute.gate_factor=1000",)
    clean = run_ranks(_train, 2, tmp_path / "clean", 44, None, loose)
    faulty = run_ranks(_train, 2, tmp_path / "faulty", 44, flip, loose)
    assert [r["calls"] for r in faulty] == [1, 1]
    for result in faulty:
        detectors = [(f[0], f[1], f[2]) for f in result["findings"][40]]
        assert detectors == [("sdc", "warn", (1,)), ("sdc_recompute", "warn", ())]  # named, but after the fact
        assert set(result["findings"]) == {40}
    for clean_rank, faulty_rank in zip(clean, faulty, strict=True):
        assert_matches_clean(clean_rank, faulty_rank, 40)


BITFLIP_YAML = """
faults:
  injections:
    - {kind: bitflip, rank: 1, step: 30, pattern: "blocks.0.mlp.0", where: backward, bit: 30, count: 4}
"""


def _train_from_yaml(rank: int, world: int, run_dir: Path, config_file: Path) -> dict[str, Any]:
    from arc_engine.config import load_config

    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    ddp = DistributedDataParallel(model)
    config = load_config(config_file, ["run.run_id=test", f"run.run_dir={run_dir}", "sinks.console.enabled=false",
                                       "detectors.sdc.enabled=true", f"detectors.sdc.warmup_steps={WARMUP}",
                                       "detectors.sdc.recompute.enabled=true"])
    arc: Any = None
    arc = arc_engine.attach(ddp, optimizer, config,
                            recompute_fn=lambda module, r: [module(*data.batch(arc.progress.data_position, r, BATCH))])
    while arc.progress.step < 34:
        loss = ddp(*data.batch(arc.progress.data_position, rank, BATCH))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    arc.close()
    return {"fired": [(f["step"], f["bit"], f["where"]) for f in arc.faults.bitflips_fired()],
            "calls": arc.engine.sdc_recompute.calls, "recomputed": arc.summary()["detections"].get("sdc_recompute")}


def test_a_yaml_bitflip_fires_once_and_is_recomputed_on_its_rank(tmp_path: Path) -> None:
    config_file = tmp_path / "arc.yaml"
    config_file.write_text(BITFLIP_YAML)
    results = run_ranks(_train_from_yaml, 2, tmp_path, config_file)
    assert [r["fired"] for r in results] == [[], [(30, 30, "backward")]]  # once: the recomputation is clean
    assert [r["calls"] for r in results] == [0, 1] and [r["recomputed"] for r in results] == [1, 1]


def _attach_errors(rank: int, world: int, run_dir: Path) -> list[str]:
    model, _ = tiny_model_and_data()
    errors = []
    for wrapped, kwargs in ((DistributedDataParallel(model), {}), (model, {"recompute_fn": lambda m, r: []})):
        try:
            arc_engine.attach(wrapped, make_optimizer(model), recompute_config(run_dir), **kwargs).close()
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_recompute_without_a_function_or_on_a_plain_module_is_a_clear_error(tmp_path: Path) -> None:
    errors = run_ranks(_attach_errors, 2, tmp_path)[0]
    assert len(errors) == 2
    assert "pass recompute_fn=" in errors[0]
    assert "not supported on a plain (non-DDP) module" in errors[1]


def test_a_recomputation_that_raises_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_train, 2, tmp_path, 33, transient_flip(1, 30), (), None, True)
    for result in results:
        assert ("sdc_recompute", "skip", (1,), "failed") in result["findings"][30]
        assert torch.equal(result["snapshots"][30], result["snapshots"][29])  # nothing applied
        assert result["step"] == 33  # and training went on

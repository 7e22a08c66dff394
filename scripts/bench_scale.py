"""arc_engine's own cost at the sizes users train: GPT shapes of 125M, 350M and 1.3B parameters (OPT / GPT-3's
125M, 350M and XL: layers x hidden x heads 12 x 768 x 12, 24 x 1024 x 16, 24 x 2048 x 32, head dim 64).

    .venv/bin/python scripts/bench_scale.py qk                       # the QK spectra's measurement, every size
    .venv/bin/python scripts/bench_scale.py qk --sizes 1.3b --repeats 5
    .venv/bin/python scripts/bench_scale.py layout                   # the per-step agreement's size, every size
    .venv/bin/python scripts/bench_scale.py router                   # the router statistics at real MoE shapes
    .venv/bin/python scripts/bench_scale.py step --sizes 125m --backends ddp zero2   # a training step, 2 ranks
    .venv/bin/python scripts/bench_scale.py step --sizes 350m --seq 2048 --steps 5 --no-recovery \
        --activation-checkpointing --bucket-mb 25            # 350M at its context: how it fits 2 ranks in 24 GB
    .venv/bin/python scripts/bench_scale.py step --sizes 1.3b --backends fsdp2 --dtype bfloat16 --seq 2048 \
        --steps 3 --no-recovery --activation-checkpointing    # 1.3B: FSDP2 in pure bf16 fits 2 ranks in 24 GB

``qk``: one measurement of ``detectors.qk_spectra`` (:class:`arc_engine.monitors.qk_spectra.QKSpectraProducer`) on
one rank holding every layer (TP=1), on random ``linear_qkv`` weights of the real shapes moved by a small update:
the per-head SVDs batched over heads and layers as the producer runs them, beside the same work done one head at a
time (what the producer did before: one SVD call per head and spectrum, each a host synchronisation on a GPU).
Reported per size: the median time of a measurement of each (``--repeats``), the ``svdvals`` calls each makes, and
the cost per training step at the default period (``detectors.qk_spectra.every``: 50 steps). On a CUDA device
(``--device cuda``) the times are taken after a synchronisation.

``step``: a training step of the GPT at each size on 2 CPU ranks (torchrun, gloo, each rank pinned to a core), under
DDP, DeepSpeed ZeRO-2 or FSDP2 (``fully_shard`` per block; ``--dtype bfloat16``: parameters, gradients and AdamW's
moments in bf16, 8 bytes per parameter sharded over the ranks, the one way 1.3B fits here), AdamW, clipping 1.0,
sequence ``--seq`` x micro-batch ``--micro-batch`` of random tokens
(``--activation-checkpointing``: each block recomputed in the backward; ``--bucket-mb``: DDP's bucket cap, ZeRO-2's
reduce and all-gather buckets, whose DeepSpeed default of 500M elements is 2 GB each per rank).
In the same processes, one after the other: the model without arc_engine, then a new one with arc_engine's default
configuration (``stats.own_work`` on), each for a warm-up step and a block of steps that spans every periodic
schedule of the configuration (20 steps); then, with ``recovery.enabled`` (a snapshot every 5 healthy steps, no disk
checkpoints), the memory ring: the bytes of one snapshot per rank, the ring's capacity, the capture's time (own work
``recovery.snapshot``) and a restore's. Reported per size and backend, slowest rank: the step's median time with and
without arc_engine, arc_engine's own work per step (the timers' own cost taken out, as
``scripts/bench_overhead.py`` does) and its share of the step, the pieces over 1% of it, peak RSS.

``router``: one measured step of ``detectors.router`` (:class:`arc_engine.monitors.router_health.RouterObserver`) on
one rank holding every MoE layer, at the shapes of public MoE models (:data:`MOE_SHAPES`: layers, experts, top-k,
hidden size, tokens per rank and micro-batch): each layer's routing observed once per micro-batch (the partials of
its tokens: entropies, their histogram, tokens per expert), then the write at the agreement (each layer's
replicated router weight: similarity and conditioning). Reported per shape: the median time of the observations
per micro-batch and of the write (``--repeats``), per token and layer, and per training step at the default period
(``detectors.router.every``: 10 steps) with ``--micro-batches`` micro-batches per step. On a CUDA device the times are
taken after a synchronisation.

``layout``: the size of the one per-step all-reduce (the agreed statistics buffer) for arc_engine's default config
on the demo GPT built at each size on the meta device (no memory): it grows with the tensors and parameter groups,
never with the parameters' elements, nor with the ranks.

Figures and the commands that made them: docs/performance.md#at-scale.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from arc_engine.monitors.family import AttentionShard, ModelParts
from arc_engine.monitors.qk_spectra import (
    HEAD_ENTROPY,
    LAYER_FIELDS,
    LAYER_SUMS,
    LOGIT_BOUND,
    MEASURED,
    QKSpectraProducer,
)
from arc_engine.monitors.spectra import core_singular_values, head_spectra_t, split_qkv_rows


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int = 50272
    seq: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def parameters(self) -> int:
        """Decoder parameters: attention 4 h², MLP 8 h², two norms per layer; embeddings (tied) and positions."""
        per_layer = 12 * self.hidden * self.hidden + 13 * self.hidden
        return self.layers * per_layer + (self.vocab + self.seq) * self.hidden


SHAPES = {"125m": Shape("125m", 12, 768, 12), "350m": Shape("350m", 24, 1024, 16), "1.3b": Shape("1.3b", 24, 2048, 32)}
QK_EVERY = 50  # detectors.qk_spectra.every's default
ROUTER_EVERY = 10  # detectors.router.every's default


@dataclass(frozen=True)
class MoEShape:
    name: str
    layers: int      # MoE layers
    experts: int
    topk: int
    hidden: int
    tokens: int      # per rank and micro-batch (sequence x micro-batch)


#: Public MoE models' router shapes (their papers' and configs' layers, routed experts, top-k, hidden size), at a
#: 4,096-token micro-batch per rank.
MOE_SHAPES = {
    "mixtral-8x7b": MoEShape("mixtral-8x7b", 32, 8, 2, 4096, 4096),
    "olmoe-1b-7b": MoEShape("olmoe-1b-7b", 16, 64, 8, 2048, 4096),
    "deepseek-v3": MoEShape("deepseek-v3", 58, 256, 8, 7168, 4096),
}


def timed_ms(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


class CountedSVD:
    """Counts ``torch.linalg.svdvals`` calls while active."""

    def __enter__(self) -> CountedSVD:
        self.calls, self._real = 0, torch.linalg.svdvals

        def counted(*args: object, **kwargs: object) -> torch.Tensor:
            self.calls += 1
            return self._real(*args, **kwargs)

        torch.linalg.svdvals = counted
        return self

    def __exit__(self, *exc: object) -> None:
        torch.linalg.svdvals = self._real


def qk_model(shape: Shape, device: torch.device) -> tuple[ModelParts, list[torch.Tensor]]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    weights = [(torch.randn(3 * shape.hidden, shape.hidden, generator=gen) / math.sqrt(shape.hidden)).to(device)
               for _ in range(shape.layers)]
    shards = [AttentionShard(layer=i, weight=w, num_query_groups=shape.heads, heads_per_group=1,
                             head_dim=shape.head_dim, first_head=0, tp_rank=0, owner=True)
              for i, w in enumerate(weights)]
    return ModelParts(num_layers=shape.layers, num_heads=shape.heads, attention=shards), weights


def qk_buffer(shape: Shape, device: torch.device) -> SimpleNamespace:
    slots = {HEAD_ENTROPY: torch.zeros(shape.layers * shape.heads, device=device),
             LAYER_SUMS: torch.zeros(shape.layers * len(LAYER_FIELDS), device=device),
             MEASURED: torch.zeros(shape.layers, device=device),
             LOGIT_BOUND: torch.zeros(shape.layers * shape.heads, device=device)}
    return SimpleNamespace(device=device, view=lambda name: slots[name], slots=slots)


def per_head_measurement(parts: ModelParts, previous: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The same spectra one head at a time (the producer's former loop), summaries brought to the host once."""
    out = []
    for shard, (q_prev, k_prev) in zip(parts.attention, previous, strict=True):
        q, k = split_qkv_rows(shard.weight, shard.num_query_groups, shard.heads_per_group, shard.head_dim)
        bound = torch.stack([core_singular_values(q[h], k[h])[0] for h in range(q.shape[0])])
        heads = torch.stack([head_spectra_t(q[h], k[h], q_prev[h], k_prev[h]) for h in range(q.shape[0])])
        out.append(torch.cat([bound, heads.reshape(-1)]))
    return torch.cat(out).cpu()


def bench_qk(shape: Shape, device: torch.device, repeats: int) -> dict[str, float]:
    parts, weights = qk_model(shape, device)
    producer = QKSpectraProducer(parts, every=1)
    buffer = qk_buffer(shape, device)
    step = 0

    def measure() -> None:
        nonlocal step
        producer.write(buffer, SimpleNamespace(step=step))  # type: ignore[arg-type]
        step += 1
        for weight in weights:
            weight.mul_(1.0001)  # a small update: every head moved since the previous measurement

    measure()  # the reference W_q, W_k
    with CountedSVD() as counted:
        measure()
    batched_ms = timed_ms(measure, device, repeats)
    previous = []
    for shard in parts.attention:
        q, k = split_qkv_rows(shard.weight, shard.num_query_groups, shard.heads_per_group, shard.head_dim)
        previous.append((q.float().clone() * 0.999, k.float().clone() * 0.999))
    with CountedSVD() as looped:
        per_head_measurement(parts, previous)
    per_head_ms = timed_ms(lambda: per_head_measurement(parts, previous), device, repeats)
    return {"batched_ms": batched_ms, "batched_calls": counted.calls, "per_head_ms": per_head_ms,
            "per_head_calls": looped.calls, "heads": shape.layers * shape.heads}


def bench_router(shape: MoEShape, device: torch.device, repeats: int, dtype: torch.dtype) -> dict[str, float]:
    """One measured step of the router family on one rank holding every MoE layer (see the module docstring)."""
    from arc_engine.monitors.family import RouterShard
    from arc_engine.monitors.router import topk_routing_map
    from arc_engine.monitors.router_health import RANK_ENTROPY, ROUTER_SUMS, RouterObserver

    gen = torch.Generator(device="cpu").manual_seed(0)
    observers: dict[int, Callable[[torch.Tensor, torch.Tensor], None]] = {}

    def observe_routing(shard: RouterShard, fn: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[], None]:
        observers[shard.layer] = fn
        return lambda: None

    routers = [RouterShard(layer=i, module=torch.nn.Identity(), topk=shape.topk, ep_rank=0, report_weight=True,
                           report_tokens=True,
                           weight=(torch.randn(shape.experts, shape.hidden, generator=gen) * 0.02).to(device, dtype))
               for i in range(shape.layers)]
    parts = ModelParts(num_layers=shape.layers, num_experts=shape.experts, experts_per_rank=shape.experts,
                       routers=routers, observe_routing=observe_routing)
    observer = RouterObserver(parts, every=1)
    logits = (torch.randn(shape.tokens, shape.experts, generator=gen)).to(device, dtype)
    routing_map = topk_routing_map(logits, shape.topk)
    slots = {ROUTER_SUMS: torch.zeros(shape.layers * observer.size, dtype=torch.float64, device=device),
             RANK_ENTROPY: torch.zeros(shape.layers, dtype=torch.float64, device=device)}
    buffer = SimpleNamespace(device=device, view=lambda name: slots[name])
    view = SimpleNamespace(step=0)

    def observe_all() -> None:
        for layer in range(shape.layers):
            observers[layer](logits, routing_map)

    def write() -> None:
        observer.write(buffer, view)  # type: ignore[arg-type]

    observe_all()
    write()  # warm-up
    observe_ms = timed_ms(observe_all, device, repeats)
    write_ms = timed_ms(lambda: (observe_all(), write()), device, repeats) - observe_ms
    return {"observe_ms": observe_ms, "write_ms": max(write_ms, 0.0)}


def table_head(title: str, columns: list[str]) -> None:
    """A markdown table's title line, header and alignment row (the first column left, the others right)."""
    print(title)
    print("| " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * (len(columns) - 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("qk", "router", "layout", "step", "step-worker"))
    parser.add_argument("--moe", nargs="+", choices=sorted(MOE_SHAPES), default=list(MOE_SHAPES),
                        help="router: the MoE shapes")
    parser.add_argument("--micro-batches", type=int, default=8, help="router: micro-batches per training step")
    parser.add_argument("--logits-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="router: the router logits' and weights' dtype")
    parser.add_argument("--sizes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backends", nargs="+", choices=("ddp", "zero2", "fsdp2"),
                        default=["ddp", "zero2"], help="step: fsdp2 is FSDP2 (fully_shard per block) in --dtype")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="step, fsdp2 only: the parameters' and AdamW moments' dtype (bfloat16: pure bf16, "
                             "how 1.3B fits 2 ranks in 24 GB)")
    parser.add_argument("--seq", type=int, default=128, help="step: tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=1, help="step: sequences per rank and step")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="step: recompute each block's activations in the backward (how a long context fits)")
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="step: DDP bucket_cap_mb / ZeRO-2 reduce and all-gather bucket sizes (default: each "
                             "framework's own, 25 MB and 500M elements)")
    parser.add_argument("--steps", type=int, default=None,
                        help="step: timed steps per variant (default: the configuration's periodic block, 20)")
    parser.add_argument("--recovery", action=argparse.BooleanOptionalAction, default=True,
                        help="step: also measure the memory ring (recovery.enabled) after the own-work block")
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)  # step-worker: where to write its row
    args = parser.parse_args()
    if args.what == "step":
        return bench_step(args)
    if args.what == "step-worker":
        return step_worker(args)
    device = torch.device(args.device)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.what == "qk":
        table_head(f"QK spectra, one measurement on one rank holding every layer (TP=1), {device}, median of "
                   f"{args.repeats}; per step at every={QK_EVERY}",
                   ["size", "parameters", "layers x heads", "batched ms", "svdvals calls", "one head at a time ms",
                    "svdvals calls", "per step (batched) ms"])
        for name in args.sizes:
            shape = SHAPES[name]
            row = bench_qk(shape, device, args.repeats)
            print(f"| {name} | {shape.parameters / 1e6:.0f}M | {shape.layers} x {shape.heads} | "
                  f"{row['batched_ms']:.0f} | {row['batched_calls']} | {row['per_head_ms']:.0f} | "
                  f"{row['per_head_calls']} | {row['batched_ms'] / QK_EVERY:.1f} |", flush=True)
        return 0
    if args.what == "router":
        dtype = getattr(torch, args.logits_dtype)
        table_head(f"Router statistics, one measured step on one rank holding every MoE layer, {device}, {dtype}, "
                   f"median of {args.repeats}; per step at every={ROUTER_EVERY} with {args.micro_batches} "
                   "micro-batches",
                   ["shape", "MoE layers x experts (top-k)", "hidden", "tokens per micro-batch",
                    "observations per micro-batch ms", "per token and layer ns", "write ms", "per step ms"])
        for name in args.moe:
            moe = MOE_SHAPES[name]
            row = bench_router(moe, device, args.repeats, dtype)
            per_step = (row["observe_ms"] * args.micro_batches + row["write_ms"]) / ROUTER_EVERY
            print(f"| {name} | {moe.layers} x {moe.experts} ({moe.topk}) | {moe.hidden} | {moe.tokens} | "
                  f"{row['observe_ms']:.1f} | {row['observe_ms'] * 1e6 / (moe.tokens * moe.layers):.0f} | "
                  f"{row['write_ms']:.1f} | {per_step:.1f} |", flush=True)
        return 0
    return layout_sizes(args.sizes)


def layout_sizes(sizes: list[str]) -> int:
    """The agreed buffer's size for the default config on the demo GPT at each size (meta device)."""
    import arc_engine
    from arc_engine.config import load_config
    from arc_engine.demo.gpt import GPT, GPTConfig, param_groups

    print("| size | parameters | tensors | agreed buffer (values) | bytes (fp32) |")
    print("|---|---:|---:|---:|---:|")
    for name in sizes:
        shape = SHAPES[name]
        with torch.device("meta"):
            model = GPT(GPTConfig(vocab_size=shape.vocab, seq_len=shape.seq, num_layers=shape.layers,
                                  d_model=shape.hidden, num_heads=shape.heads))
        optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4)
        config = load_config(None, ["run.run_id=bench", "run.run_dir=/tmp/arc_bench_scale",
                                    "sinks.console.enabled=false", "sinks.jsonl.enabled=false"])
        arc = arc_engine.attach(model, optimizer, config)
        size = arc.engine.gathering.layout.size
        tensors = sum(1 for _ in model.parameters())
        arc.close()
        print(f"| {name} | {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M | {tensors} | {size} | "
              f"{size * 4} |", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------- step

def bench_step(args: argparse.Namespace) -> int:
    """``step``: one torchrun launch of 2 ranks per size and backend; prints a markdown table and one JSON line."""
    if args.dtype != "float32" and args.backends != ["fsdp2"]:
        raise SystemExit("bench_scale: --dtype bfloat16 is for --backends fsdp2 only")
    rows = []
    print(f"a training step on 2 CPU ranks (gloo, pinned), seq {args.seq} x micro-batch {args.micro_batch}, AdamW, "
          f"clip 1.0, {args.dtype}{', activation checkpointing' if args.activation_checkpointing else ''}; buckets "
          f"{'default' if args.bucket_mb is None else f'{args.bucket_mb:g} MB'}; arc_engine's default config; "
          f"slowest rank", flush=True)
    print("| size | parameters | tensors | backend | step without, ms | step with, ms | own work, ms | own work, % of "
          "step | largest pieces (ms) | snapshot per rank, MB | ring | capture, ms | restore, ms | peak RSS per "
          "rank, MB |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for name in args.sizes:
        for backend in args.backends:
            with tempfile.TemporaryDirectory() as tmp:
                result = Path(tmp) / "row.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       __file__, "step-worker", "--sizes", name, "--backends", backend, "--seq", str(args.seq),
                       "--micro-batch", str(args.micro_batch), "--result", str(result), "--dtype", args.dtype,
                       *(["--activation-checkpointing"] if args.activation_checkpointing else []),
                       *(["--bucket-mb", str(args.bucket_mb)] if args.bucket_mb is not None else []),
                       "--recovery" if args.recovery else "--no-recovery",
                       *(["--steps", str(args.steps)] if args.steps else [])]
                env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
                code = subprocess.call(cmd, env=env)
                if code != 0 or not result.is_file():
                    print(f"| {name} | | | {backend} | failed: exit code {code} |", flush=True)
                    continue
                row = json.loads(result.read_text())
            rows.append(row)
            pieces = ", ".join(f"{piece} {ms:.1f}" for piece, ms in row["pieces"])
            ring = "-" if row["ring_capacity"] is None else str(row["ring_capacity"])
            print(f"| {name} | {row['parameters'] / 1e6:.0f}M | {row['tensors']} | {backend} | {row['bare_ms']:.0f} "
                  f"| {row['arc_ms']:.0f} | {row['own_ms']:.1f} | {row['own_fraction'] * 100:.3f}% | {pieces} | "
                  f"{_maybe(row['snapshot_mb'], '.0f')} | {ring} | {_maybe(row['capture_ms'], '.0f')} | "
                  f"{_maybe(row['restore_ms'], '.0f')} | {row['rss_mb']:.0f} |", flush=True)
    print(json.dumps(rows))
    return 0 if len(rows) == len(args.sizes) * len(args.backends) else 1


def _maybe(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def step_worker(args: argparse.Namespace) -> int:
    """One size and backend on this rank (under torchrun); rank 0 writes the slowest rank's figures."""
    import gc
    import resource
    from datetime import timedelta

    import torch.distributed as dist
    from bench_overhead import periodic_block, pin_to_core, slowest_rank, timer_cost_ns, without_timers

    from arc_engine.config import load_config
    from arc_engine.recovery.snapshot import restore

    pin_to_core(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=3600))
    rank = dist.get_rank()
    shape, backend = SHAPES[args.sizes[0]], args.backends[0]
    run_dir = os.path.join(tempfile.gettempdir(), f"arc_bench_scale_{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}")
    overrides = ["run.run_id=bench", f"run.run_dir={run_dir}", "sinks.console.enabled=false",
                 "sinks.jsonl.enabled=false", "stats.own_work=true"]
    config = load_config(None, overrides)
    steps = args.steps or periodic_block(config)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        tokens = torch.randint(0, shape.vocab, (args.micro_batch, args.seq + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    def timed_steps(step_fn: Callable[[torch.Tensor, torch.Tensor], None], first: int, count: int) -> list[float]:
        times = []
        for step in range(first, first + count):
            inputs, targets = batch(step)
            dist.barrier()
            start = time.perf_counter()
            step_fn(inputs, targets)
            dist.barrier()
            times.append(time.perf_counter() - start)
        return times

    # without arc_engine, then with it: one model at a time (two of 350M do not fit 2 ranks in 24 GB)
    bare_fn, _ = _train_step(shape, backend, args, None)
    timed_steps(bare_fn, 0, 1)
    bare_ms = statistics.median(timed_steps(bare_fn, 1, steps)) * 1e3
    del bare_fn
    gc.collect()
    arc_fn, arc = _train_step(shape, backend, args, config)
    timed_steps(arc_fn, 0, 1)
    arc.engine.own_work.reset()
    arc_times = timed_steps(arc_fn, 1, steps)
    arc_ms = statistics.median(arc_times) * 1e3
    own = arc.engine.own_work.report()
    mine = {"host_ms": own.host_ms, "parameters": sum(p.numel() for p in arc.engine.gathering.params),
            "timed_calls": sum(p["calls"] for p in own.pieces.values()),
            "pieces": {name: p["host_ms"] for name, p in own.pieces.items()}}
    tensors = len(arc.engine.gathering.params)
    arc.close()
    del arc_fn, arc
    gc.collect()
    ring = {"snapshot_mb": None, "ring_capacity": None, "capture_ms": None, "restore_ms": None}
    if args.recovery:
        rconfig = load_config(None, [*overrides, "recovery.enabled=true", "recovery.checkpoint_freq=5",
                                               "recovery.checkpoint.every_steps=0"])  # the memory ring only
        rec_fn, rarc = _train_step(shape, backend, args, rconfig)
        timed_steps(rec_fn, 0, 1)
        rarc.engine.own_work.reset()
        timed_steps(rec_fn, 1, 7)  # at least one snapshot captured and verified
        recovery = rarc.engine.recovery
        capture = rarc.engine.own_work.report().pieces.get("recovery.snapshot", {"host_ms": 0.0, "calls": 0.0})
        latest = recovery.ring.latest()
        if latest is None:
            raise SystemExit(f"bench_scale: no snapshot in the memory ring after 7 steps ({recovery.summary()})")
        restores = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            restore(latest, recovery.state)
            restores.append(time.perf_counter() - start)
        ring = {"snapshot_mb": latest.nbytes / 2**20, "ring_capacity": recovery.ring.capacity,
                "capture_ms": capture["host_ms"] / capture["calls"] if capture["calls"] else None,
                "restore_ms": statistics.median(restores) * 1e3}
        rarc.close()
    mine["ring"] = ring
    mine["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, mine)
    if rank == 0:
        timer_ms = timer_cost_ns() / 1e6
        for report in reports:
            report["untimed_ms"] = without_timers(report["host_ms"], report["timed_calls"], timer_ms)
            report["fraction"] = report["untimed_ms"] / arc_ms
        slowest = slowest_rank(reports)
        pieces = sorted(((name, ms) for name, ms in slowest["pieces"].items() if ms >= 0.01 * slowest["host_ms"]),
                        key=lambda item: -item[1])[:4]
        # FSDP2's parameters are this rank's shards; every other backend's are the whole model's
        parameters = sum(r["parameters"] for r in reports) if backend == "fsdp2" else reports[0]["parameters"]
        row = {"size": shape.name, "backend": backend, "parameters": parameters, "tensors": tensors,
               "seq": args.seq, "micro_batch": args.micro_batch, "steps": steps,
               "activation_checkpointing": args.activation_checkpointing, "bucket_mb": args.bucket_mb,
               "dtype": args.dtype,
               "bare_ms": bare_ms,
               "arc_ms": arc_ms, "own_ms": slowest["untimed_ms"], "own_fraction": slowest["untimed_ms"] / arc_ms,
               "pieces": pieces, "all_pieces": slowest["pieces"], "rss_mb": max(r["rss_mb"] for r in reports),
               **{key: max((r["ring"][key] for r in reports if r["ring"][key] is not None), default=None)
                  for key in ("snapshot_mb", "ring_capacity", "capture_ms", "restore_ms")}}
        Path(args.result).write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _train_step(shape: Shape, backend: str, args: argparse.Namespace, config: object) -> tuple[Callable, object]:
    """A fresh model of ``shape`` under ``backend`` and its ``step(inputs, targets)`` (scripts/bench_overhead.py's
    ``build``: its GPT has ``d_model / 64`` heads, the shapes' own); with arc_engine attached when ``config`` is
    given."""
    from bench_overhead import build

    spec = argparse.Namespace(seq_len=args.seq, layers=shape.layers, d_model=shape.hidden, micro_batch=args.micro_batch,
                              bucket_mb=args.bucket_mb, backend={"zero2": "deepspeed"}.get(backend, backend),
                              activation_checkpointing=args.activation_checkpointing, dtype=args.dtype)
    return build(spec, SimpleNamespace(vocab_size=shape.vocab), config)

if __name__ == "__main__":
    sys.exit(main())

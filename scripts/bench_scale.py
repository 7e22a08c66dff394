"""arc_engine's own cost at the sizes users train: GPT shapes of 125M, 350M and 1.3B parameters (OPT / GPT-3's
125M, 350M and XL: layers x hidden x heads 12 x 768 x 12, 24 x 1024 x 16, 24 x 2048 x 32, head dim 64).

    .venv/bin/python scripts/bench_scale.py qk                       # the QK spectra's measurement, every size
    .venv/bin/python scripts/bench_scale.py qk --sizes 1.3b --repeats 5
    .venv/bin/python scripts/bench_scale.py layout                   # the per-step agreement's size, every size

``qk``: one measurement of ``detectors.qk_spectra`` (:class:`arc_engine.monitors.qk_spectra.QKSpectraProducer`) on
one rank holding every layer (TP=1), on random ``linear_qkv`` weights of the real shapes moved by a small update:
the per-head SVDs batched over heads and layers as the producer runs them, beside the same work done one head at a
time (what the producer did before: one SVD call per head and spectrum, each a host synchronisation on a GPU).
Reported per size: the median time of a measurement of each (``--repeats``), the ``svdvals`` calls each makes, and
the cost per training step at the default period (``detectors.qk_spectra.every``: 50 steps). On a CUDA device
(``--device cuda``) the times are taken after a synchronisation.

``layout``: the size of the one per-step all-reduce (the agreed statistics buffer) for arc_engine's default config
on the demo GPT built at each size on the meta device (no memory): it grows with the tensors and parameter groups,
never with the parameters' elements, nor with the ranks.

Figures and the commands that made them: docs/performance.md#at-scale.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("qk", "layout"))
    parser.add_argument("--sizes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.what == "qk":
        print(f"QK spectra, one measurement on one rank holding every layer (TP=1), {device}, median of "
              f"{args.repeats}; per step at every={QK_EVERY}")
        print("| size | parameters | layers x heads | batched ms | svdvals calls | one head at a time ms | svdvals "
              "calls | per step (batched) ms |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name in args.sizes:
            shape = SHAPES[name]
            row = bench_qk(shape, device, args.repeats)
            print(f"| {name} | {shape.parameters / 1e6:.0f}M | {shape.layers} x {shape.heads} | "
                  f"{row['batched_ms']:.0f} | {row['batched_calls']} | {row['per_head_ms']:.0f} | "
                  f"{row['per_head_calls']} | {row['batched_ms'] / QK_EVERY:.1f} |", flush=True)
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


if __name__ == "__main__":
    sys.exit(main())

"""A small CPU replication of the SDC paper's Table I: final loss on held-out text of a LLaMA-style model trained
with exponent-bit flips injected into backward GEMM outputs: no detection, detect-and-skip, detect-and-recompute.

Four arms, each over several seeds, each a real 2-rank DDP job (gloo) in bf16 autocast:

* ``baseline``: no fault, with ``detectors.sdc`` watching (every action a warning): its flags are false positives;
* ``faults``: a transient flip of ``--bits`` (cycled) in ``--count`` elements of the backward-data GEMM output of
  the ``--pattern`` layers on rank 1, every ``--every`` steps, nothing detecting it (the paper's "no detection");
* ``skip``: the same faults, ``detectors.sdc`` skipping the flagged steps on every rank;
* ``recompute``: the same faults, ``detectors.sdc.recompute`` recomputing the flagged step on the suspect rank.

The evaluation text is not drawn from the training stream: a corpus generated with another seed (tokenized with the
training vocabulary), 8 fixed batches. Prints a Markdown table (mean and spread of the final held-out loss per arm,
SDC flags, skips, recomputations) and writes it with the per-seed numbers to ``--out`` (JSON).

    python scripts/replicate_sdc_table.py --seeds 3 --steps 600
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine.config import load_config
from arc_engine.demo.corpus import CharDataset, generate_corpus
from arc_engine.demo.llama import Llama, LlamaConfig
from arc_engine.faults import BitFlipInjector, BitFlipSpec

ARMS = ("baseline", "faults", "skip", "recompute")
HELD_OUT_SEED = 987_654
EVAL_BATCHES = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=100, help="steps between injections")
    parser.add_argument("--bits", default="11,12", help="bf16 bit positions, cycled over the injections")
    parser.add_argument("--count", type=int, default=16, help="elements flipped per injection")
    parser.add_argument("--pattern", default="layers.*.mlp.down")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", type=Path, default=Path("arc_runs/sdc_table.json"))
    return parser.parse_args()


def run_arm(rank: int, world: int, arm: str, seed: int, args: argparse.Namespace, store: str, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(seed)
    data = CharDataset(generate_corpus(2000, seed=1234 + seed), 32, seed=seed)
    model = Llama(LlamaConfig(vocab_size=data.vocab_size, seq_len=32, num_layers=2, d_model=64, num_heads=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    ddp = DistributedDataParallel(model)
    arc: Any = None

    held_out = CharDataset(generate_corpus(400, seed=HELD_OUT_SEED + seed), 32, seed=HELD_OUT_SEED, vocabulary=data)

    def loss_of(module: torch.nn.Module, position: int, data_rank: int, source: CharDataset = data) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return module(*source.batch(position, data_rank, args.batch))

    if arm != "faults":
        overrides = [f"run.run_dir={Path(out).parent / 'runs'}", f"run.run_id={arm}-{seed}",
                     "sinks.console.enabled=false", "detectors.sdc.enabled=true", "detectors.sdc.warmup_steps=50",
                     "detectors.sdc.update_sample=1.0", f"detectors.sdc.recompute.enabled={arm == 'recompute'}",
                     f"detectors.sdc.action={'warn' if arm == 'baseline' else 'skip'}"]
        recompute = (lambda module, r: [loss_of(module, arc.progress.data_position, r)]) if arm == "recompute" else None
        arc = arc_engine.attach(ddp, optimizer, load_config(None, overrides), recompute_fn=recompute)
    injectors = []
    if arm != "baseline":
        bits = [int(b) for b in args.bits.split(",")]
        for k, step in enumerate(range(args.every, args.steps, args.every)):
            spec = BitFlipSpec(pattern=args.pattern, where="backward", rank=1, steps=[step], bit=bits[k % len(bits)],
                               count=args.count, seed=seed * 1000 + k, max_per_step=1)
            injector = BitFlipInjector(spec, rank=rank,
                                       current_step=lambda: arc.engine.progress.iteration if arc else step_now)
            injector.install(model)
            injectors.append(injector)
    step_now = 0
    while (arc.progress.step if arc else step_now) < args.steps:
        position = arc.progress.data_position if arc else step_now
        loss = loss_of(ddp, position, rank)
        if arc:
            arc.record_loss(loss)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_now += 1
    with torch.no_grad():
        eval_loss = sum(float(loss_of(model, i, 0, held_out)) for i in range(EVAL_BATCHES)) / EVAL_BATCHES
    summary = arc.summary() if arc else {}
    result = {"arm": arm, "seed": seed, "eval_loss": eval_loss,
              "injections": sum(len(i.fired) for i in injectors),
              "recomputations": arc.engine.sdc_recompute.calls if arc and arc.engine.sdc_recompute else 0,
              "skipped_by_policy": summary["skipped_by_policy"], "detections": summary.get("detections", {})}
    if arc:
        arc.close()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: gloo's threads can abort it after the results are written


def run_job(arm: str, seed: int, args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    store = workdir / f"store-{arm}-{seed}"
    out = workdir / f"{arm}-{seed}.json"
    mp.spawn(run_arm, args=(2, arm, seed, args, str(store), str(out)), nprocs=2, join=True)
    return json.loads(out.read_text())


def summarize(results: dict[str, list[list[dict[str, Any]]]]) -> str:
    lines = ["| arm | final held-out loss (mean ± sd over seeds) | per seed | minus baseline, per seed | "
             "flips injected | SDC flags | skipped steps | recomputations (rank 0 / rank 1) |",
             "|---|---|---|---|---|---|---|---|"]
    baseline = [ranks[0]["eval_loss"] for ranks in results["baseline"]]
    for arm, runs in results.items():
        losses = [ranks[0]["eval_loss"] for ranks in runs]
        spread = statistics.stdev(losses) if len(losses) > 1 else 0.0
        flips = sum(r["injections"] for ranks in runs for r in ranks)
        calls = [sum(ranks[k]["recomputations"] for ranks in runs) for k in range(2)]
        flags = sum(ranks[0]["detections"].get("sdc", 0) for ranks in runs)
        skipped = sum(ranks[0].get("skipped_by_policy", 0) for ranks in runs)
        paired = ", ".join(f"{x - b:+.4f}" for x, b in zip(losses, baseline, strict=False))
        lines.append(f"| {arm} | {statistics.mean(losses):.4f} ± {spread:.4f} | "
                     f"{', '.join(f'{x:.4f}' for x in losses)} | {paired} | {flips} | {flags} | {skipped} | "
                     f"{calls[0]} / {calls[1]} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    results: dict[str, list[list[dict[str, Any]]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for arm in ARMS:
                results[arm].append(run_job(arm, seed, args, Path(tmp)))
                print(f"seed {seed} {arm}: eval loss {results[arm][-1][0]['eval_loss']:.4f}", flush=True)
    table = summarize(results)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                    "table": table}, indent=2))


if __name__ == "__main__":
    main()

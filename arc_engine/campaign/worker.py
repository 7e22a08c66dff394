"""One campaign job: the runs of one backend, one after another, in one torchrun process group (starting ranks once
per backend, not once per run, is what makes a campaign of hundreds of runs fit in an hour on two cores).

    torchrun --standalone --nproc_per_node 2 -m arc_engine.campaign.worker PLAN.json

``PLAN.json`` (written by :mod:`arc_engine.campaign.runner`) holds the backend, the model and a list of runs, each
with its arm (``bare``: no arc_engine, clean runs only; ``observe``: arc_engine attached, every action a warning,
no recovery; ``protect``: arc_engine as a user runs it, recovery on), its seed, its step target and its faults.
Each run trains a fresh small GPT (:mod:`arc_engine.demo.gpt`) on the generated corpus; rank 0 appends one JSON
record per run to the plan's ``results`` file and prints ``@@progress DONE TOTAL NAME`` lines that the runner
turns into a progress bar. A run stops at the terminal failure of the R-Metric paper (loss > 100 or non-finite,
agreed across ranks) once it has lasted ``CONFIRM_STEPS`` steps in the ``observe`` and ``bare`` arms, and after
``CRASH_PATIENCE`` terminal losses in a row in the ``protect`` arm; ``terminal_step`` is where that streak began.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import arc_engine
from arc_engine.config import load_config
from arc_engine.demo.corpus import CharDataset, generate_corpus
from arc_engine.demo.gpt import GPT, GPTConfig, param_groups
from arc_engine.sinks import read_jsonl

TERMINAL_LOSS = 100.0
"""The R-Metric paper's terminal failure (its Appendix F.3): a training loss above 100, or a non-finite one."""
CONFIRM_STEPS = 5
"""A terminal failure is confirmed when it lasts this many steps (or to the run's end): a framework that skips a
non-finite step on its own (DeepSpeed's overflow check) has not crashed."""
CRASH_PATIENCE = 20
"""Terminal losses in a row after which a protected run counts as crashed and stops."""
HELD_OUT_SEED = 987_654
"""The generated corpus's seed for the held-out evaluation text (the training text uses the default, 1234)."""
EVAL_BATCHES = 8


def terminal(loss: float) -> bool:
    return not math.isfinite(loss) or loss > TERMINAL_LOSS


class HeldOut:
    """Evaluation text that is not drawn from the training stream: a corpus generated with another seed, tokenized
    with the training vocabulary; ``EVAL_BATCHES`` fixed batches, the same on every rank."""

    def __init__(self, train: CharDataset, seq_len: int, batch_size: int) -> None:
        text = "".join(c for c in generate_corpus(num_sentences=600, seed=HELD_OUT_SEED) if c in train.stoi)
        tokens = torch.tensor([train.stoi[c] for c in text], dtype=torch.long)
        gen = torch.Generator().manual_seed(HELD_OUT_SEED)
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (EVAL_BATCHES, batch_size), generator=gen)
        window = tokens[starts[..., None] + torch.arange(seq_len + 1)]
        self.batches = [(window[k, :, :-1], window[k, :, 1:]) for k in range(EVAL_BATCHES)]

    @torch.no_grad()
    def loss(self, module: torch.nn.Module, device: torch.device) -> float:
        values = [float(module(x.to(device), y.to(device))) for x, y in self.batches]
        return sum(values) / len(values)


class _Bare:
    """The ``bare`` arm's stand-in for an attached arc_engine (clean runs only: the overhead's reference)."""

    def __init__(self) -> None:
        self.step = 0
        self.faults = self

    @property
    def data_position(self) -> int:
        return self.step

    def on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def record_loss(self, loss: torch.Tensor) -> None:
        self.step += 1

    def summary(self) -> dict[str, Any]:
        return {"steps": self.step, "iterations": self.step, "skipped_steps": 0}

    def close(self) -> None:
        pass


def _build(plan: dict, run: dict, data: CharDataset, device: torch.device) -> tuple[Any, Any, torch.nn.Module]:
    """(the trained object: a DDP model or a DeepSpeed engine, its optimizer or None, the bare module)."""
    model_cfg = plan["model"]
    torch.manual_seed(run["seed"])
    model = GPT(GPTConfig(vocab_size=data.vocab_size, seq_len=model_cfg["seq_len"], num_layers=model_cfg["layers"],
                          d_model=model_cfg["d_model"], num_heads=model_cfg["heads"])).to(device)
    groups = param_groups(model, 0.1)
    if plan["backend"] == "ddp":
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = torch.optim.AdamW(groups, lr=model_cfg["lr"], betas=(0.9, 0.95))
        return ddp, optimizer, model
    import deepspeed

    ds_config = {"train_micro_batch_size_per_gpu": model_cfg["batch_size"], "gradient_accumulation_steps": 1,
                 "gradient_clipping": 1.0, "steps_per_print": 10**9, "wall_clock_breakdown": False,
                 "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True}}
    optimizer = torch.optim.AdamW(groups, lr=model_cfg["lr"], betas=(0.9, 0.95))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine, None, model


def run_one(plan: dict, run: dict, data: CharDataset, held_out: HeldOut, device: torch.device) -> dict[str, Any]:
    """Train one run; returns its record (the same on every rank except ``events``, read on rank 0)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    backend, model_cfg = plan["backend"], plan["model"]
    trained, optimizer, module = _build(plan, run, data, device)
    config = load_config(base=run["config"]) if run["arm"] != "bare" else None
    arc = arc_engine.attach(trained, optimizer, config) if config is not None else _Bare()
    losses: list[float] = []
    step_ms: list[float] = []
    terminal_at: int | None = None
    in_a_row = 0
    aborted: int | None = None
    attempts = 0
    evals: dict[str, float] = {}
    try:
        while arc.step < run["steps"]:
            inputs, targets = (t.to(device) for t in data.batch(arc.data_position, rank, model_cfg["batch_size"]))
            start = time.perf_counter()
            loss = arc.faults.on_loss(trained(inputs, targets))
            arc.record_loss(loss)
            if backend == "ddp":
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                trained.backward(loss)
                trained.step()
            step_ms.append((time.perf_counter() - start) * 1e3)
            attempts += 1
            agreed = loss.detach().float().clone()
            dist.all_reduce(agreed)
            value = float(agreed) / world
            losses.append(value)
            in_a_row = in_a_row + 1 if terminal(value) else 0
            if in_a_row and terminal_at is None and in_a_row >= min(CONFIRM_STEPS, run["steps"] - arc.step + in_a_row):
                terminal_at = attempts - in_a_row  # confirmed, or lasting to the run's end
            if arc.step in run["eval_at"] and str(arc.step) not in evals:
                evals[str(arc.step)] = held_out.loss(module, device)
            if in_a_row >= CONFIRM_STEPS and run["arm"] != "protect":
                break
            if in_a_row >= CRASH_PATIENCE:
                break
    except arc_engine.ArcAbort as abort:
        aborted = abort.exit_code
    eval_loss = held_out.loss(module, device)
    summary = arc.summary()
    arc.close()
    record: dict[str, Any] = {
        "name": run["name"], "backend": backend, "fault": run["fault"], "seed": run["seed"], "arm": run["arm"],
        "fault_step": run["fault_step"], "fault_end": run.get("fault_end"), "steps_target": run["steps"],
        "attempts": attempts,
        "steps_done": summary["steps"], "completed": aborted is None and summary["steps"] >= run["steps"] and
        in_a_row < CRASH_PATIENCE, "aborted": aborted, "terminal_step": terminal_at, "losses": losses,
        "eval_loss": eval_loss, "eval_at": evals, "step_ms_median": statistics.median(step_ms) if step_ms else None,
        "skipped_steps": summary.get("skipped_steps", 0), "recovery": summary.get("recovery", {}),
        "grad_norms": [], "events": []}
    if config is not None and rank == 0:
        run_dir = Path(summary["run_dir"])
        record["events"] = [_compact(e) for e in read_jsonl(run_dir / config.sinks.jsonl.events_file)
                            if e["kind"] in ("detection", "action")]
        norms = {int(m["arc/iteration"]): float(m["arc/grad_norm/norm"])  # "nan" / "inf" as strings
                 for m in read_jsonl(run_dir / config.sinks.jsonl.metrics_file)
                 if "arc/iteration" in m and "arc/grad_norm/norm" in m}
        record["grad_norms"] = [norms.get(attempt, math.nan) for attempt in range(len(losses))]
    return record


def _compact(event: dict) -> dict:
    return {key: event.get(key) for key in ("kind", "detector", "action", "severity", "step", "iteration", "ranks",
                                            "message")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    plan = json.loads(Path(argv[0]).read_text())
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=plan.get("timeout_s", 300)))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    model_cfg = plan["model"]
    data = CharDataset(generate_corpus(), model_cfg["seq_len"])
    held_out = HeldOut(data, model_cfg["seq_len"], model_cfg["batch_size"])
    results = Path(plan["results"])
    runs = plan["runs"]
    for index, run in enumerate(runs):
        record = run_one(plan, run, data, held_out, device)
        if dist.get_rank() == 0:
            with results.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
            print(f"@@progress {index + 1} {len(runs)} {run['name']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # see arc_engine.demo.train.exit_hard

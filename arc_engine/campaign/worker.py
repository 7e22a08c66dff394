"""One campaign job: the runs of one backend, one after another, in one torchrun process group (starting ranks once
per backend, not once per run, is what makes a campaign of hundreds of runs fit in an hour on two cores).

    torchrun --standalone --nproc_per_node 2 -m arc_engine.campaign.worker PLAN.json

``PLAN.json`` (written by :mod:`arc_engine.campaign.runner`) holds the backend, the model and a list of runs, each
with its arm (``bare``: no arc_engine, clean runs only; ``observe``: arc_engine attached, every action a warning,
no recovery; ``protect``: arc_engine as a user runs it, recovery on), its seed, its step target and its faults.
Each run trains a fresh model on the generated corpus (the demo GPT, :mod:`arc_engine.demo.gpt`, under DDP or
DeepSpeed ZeRO-2; megatron-core's GPT under TP or EP, :mod:`arc_engine.campaign.megatron_backend`); rank 0 appends
one JSON record per run to the plan's ``results`` file and prints ``@@progress DONE TOTAL NAME`` lines that the runner
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
from arc_engine.demo.realtext import MixedText, build_corpus, shards
from arc_engine.demo.train import exit_hard
from arc_engine.progress import Progress
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


def lr_factor(step: int, decay_steps: int, min_ratio: float) -> float:
    """The campaign's schedule at optimizer step ``step``: a cosine from 1 to ``min_ratio`` over ``decay_steps``,
    then ``min_ratio`` (Megatron-LM's ``--lr-decay-style cosine`` with ``--min-lr``, no warmup). A decayed rate is
    what makes "the final loss within 5% of the clean run" a statement about recovery rather than about the noise of
    the last updates: at a constant rate, one skipped batch moves this model's final held-out loss by several
    percent."""
    progress = min(max(step, 0), decay_steps) / max(decay_steps, 1)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def terminal(loss: float) -> bool:
    return not math.isfinite(loss) or loss > TERMINAL_LOSS


class HeldOut:
    """Evaluation text that is not drawn from the training stream: a corpus generated with another seed, tokenized
    with the training vocabulary (real text: the corpus's held-out documents); ``EVAL_BATCHES`` fixed batches, the
    same on every rank."""

    def __init__(self, train: CharDataset | MixedText, seq_len: int, batch_size: int) -> None:
        if isinstance(train, MixedText):  # real text: the corpus's held-out documents, every kind
            tokens = torch.cat([train.held_out[kind] for kind in train.kinds])
        else:
            tokens = CharDataset(generate_corpus(num_sentences=600, seed=HELD_OUT_SEED), seq_len,
                                 vocabulary=train).tokens
        gen = torch.Generator().manual_seed(HELD_OUT_SEED)
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (EVAL_BATCHES, batch_size), generator=gen)
        window = tokens[starts[..., None] + torch.arange(seq_len + 1)]
        self.batches = [(window[k, :, :-1], window[k, :, 1:]) for k in range(EVAL_BATCHES)]

    def loss(self, trainer: Any) -> float:
        values = [trainer.loss(x, y) for x, y in self.batches]
        return sum(values) / len(values)


class _Counter:
    """The ``bare`` arm's step counter, where an attached arc_engine would keep it (clean runs only: the overhead's
    reference)."""

    faults = None  # nothing injected

    def __init__(self) -> None:
        self.progress = Progress()  # step and data position move together: every step is applied

    def summary(self) -> dict[str, Any]:
        return self.progress.counts()

    def close(self) -> None:
        pass


class TorchTrainer:
    """The demo GPT under torch DDP (``ddp``) or a DeepSpeed ZeRO-2 engine (``zero2``, gradient clipping 1)."""

    def __init__(self, plan: dict, run: dict, data: CharDataset, device: torch.device) -> None:
        model_cfg = plan["model"]
        self.backend, self.data, self.device = plan["backend"], data, device
        self.batch_size = model_cfg["batch_size"]
        self.arc: arc_engine.Arc | None = None
        torch.manual_seed(run["seed"])
        self.module = GPT(GPTConfig(vocab_size=data.vocab_size, seq_len=model_cfg["seq_len"],
                                    num_layers=model_cfg["layers"], d_model=model_cfg["d_model"],
                                    num_heads=model_cfg["heads"])).to(device)
        groups = param_groups(self.module, 0.1)
        optimizer = torch.optim.AdamW(groups, lr=model_cfg["lr"], betas=(0.9, 0.95))
        if self.backend == "ddp":
            self.trained: Any = DistributedDataParallel(
                self.module, device_ids=[device.index] if device.type == "cuda" else None)
            self.optimizer: torch.optim.Optimizer | None = optimizer
            return
        import deepspeed

        ds_config = {"train_micro_batch_size_per_gpu": self.batch_size, "gradient_accumulation_steps": 1,
                     "gradient_clipping": 1.0, "steps_per_print": 10**9, "wall_clock_breakdown": False,
                     "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True}}
        self.trained, *_ = deepspeed.initialize(model=self.module, optimizer=optimizer, config=ds_config)
        self.optimizer = None

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's groups as they are now (a rollback may have replaced the dicts)."""
        return (self.optimizer if self.optimizer is not None else self.trained.optimizer).param_groups

    def attach(self, config: Any) -> arc_engine.Arc:
        self.arc = arc_engine.attach(self.trained, self.optimizer, config)
        return self.arc

    def step(self, position: int) -> float:
        """One optimizer step on batch ``position``; this rank's loss."""
        inputs, targets = (t.to(self.device) for t in self.data.batch(position, dist.get_rank(), self.batch_size))
        loss = self.trained(inputs, targets)
        if self.arc is not None:
            loss = self.arc.faults.on_loss(loss)
            self.arc.record_loss(loss)
        if self.optimizer is not None:
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.trained.backward(loss)
            self.trained.step()
        return float(loss.detach())

    @torch.no_grad()
    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        return float(self.module(inputs.to(self.device), targets.to(self.device)))

    def close(self) -> None:
        pass


def make_trainer(plan: dict, run: dict, data: CharDataset, device: torch.device) -> Any:
    if plan["backend"].startswith("megatron"):
        from arc_engine.campaign.megatron_backend import MegatronTrainer

        return MegatronTrainer(plan["backend"], plan["model"], run["seed"], run["steps"])
    return TorchTrainer(plan, run, data, device)


def run_one(plan: dict, run: dict, data: CharDataset, device: torch.device) -> dict[str, Any]:
    """Train one run; returns its record (the same on every rank except ``events``, read on rank 0)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = make_trainer(plan, run, data, device)
    held_out = HeldOut(trainer.data, plan["model"]["seq_len"], plan["model"]["batch_size"])
    config = load_config(base=run["config"]) if run["arm"] != "bare" else None
    arc: Any = trainer.attach(config) if config is not None else _Counter()
    peak_lrs = [float(group["lr"]) for group in trainer.param_groups()]
    schedule = plan["schedule"]
    losses: list[float] = []
    step_ms: list[float] = []
    terminal_at: int | None = None
    in_a_row = 0
    aborted: int | None = None
    attempts = 0
    evals: dict[str, float] = {}
    try:
        while arc.progress.step < run["steps"]:
            factor = lr_factor(arc.progress.step, schedule["decay_steps"], schedule["min_ratio"])
            for group, peak in zip(trainer.param_groups(), peak_lrs, strict=True):
                group["lr"] = peak * factor  # recovery's LR cut and an injected LR fault multiply this for a step
            start = time.perf_counter()
            local = trainer.step(arc.progress.data_position)
            step_ms.append((time.perf_counter() - start) * 1e3)
            if isinstance(arc, _Counter):
                arc.progress.close_step(None)
            attempts += 1
            agreed = torch.tensor([local], dtype=torch.float64, device=device)
            dist.all_reduce(agreed)
            value = float(agreed) / world
            losses.append(value)
            in_a_row = in_a_row + 1 if terminal(value) else 0
            remaining = run["steps"] - arc.progress.step
            if in_a_row and terminal_at is None and in_a_row >= min(CONFIRM_STEPS, remaining + in_a_row):
                terminal_at = attempts - in_a_row  # confirmed, or lasting to the run's end
            if arc.progress.step in run["eval_at"] and str(arc.progress.step) not in evals:
                evals[str(arc.progress.step)] = held_out.loss(trainer)
            if in_a_row >= CONFIRM_STEPS and run["arm"] != "protect":
                break
            if in_a_row >= CRASH_PATIENCE:
                break
    except arc_engine.ArcAbort as abort:
        aborted = abort.exit_code
    eval_loss = held_out.loss(trainer)
    injector = arc.faults
    fired = torch.tensor([len(injector.fired) + len(injector.bitflips_fired()) if injector is not None else 0],
                         dtype=torch.float64, device=device)
    dist.all_reduce(fired)  # the faults act on one rank; every rank's record says how often
    summary = arc.summary()
    arc.close()
    trainer.close()
    record: dict[str, Any] = {
        "name": run["name"], "backend": plan["backend"], "fault": run["fault"], "seed": run["seed"],
        "arm": run["arm"], "fault_step": run["fault_step"], "fault_end": run.get("fault_end"),
        "steps_target": run["steps"], "attempts": attempts, "steps_done": summary["steps"],
        "completed": aborted is None and summary["steps"] >= run["steps"] and in_a_row < CRASH_PATIENCE,
        "aborted": aborted, "terminal_step": terminal_at, "faults_fired": int(fired), "losses": losses,
        "eval_loss": eval_loss,
        "eval_at": evals, "step_ms_median": statistics.median(step_ms) if step_ms else None,
        "skipped_by_policy": summary["skipped_by_policy"], "recovery": summary.get("recovery", {}),
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


def training_data(plan: dict) -> CharDataset | MixedText:
    """The plan's training text: the generated corpus, or (``"data": "realtext"``) the machine's own real text with
    per-rank shards of different kinds (:mod:`arc_engine.demo.realtext`)."""
    seq_len = plan["model"]["seq_len"]
    if plan.get("data", "generated") == "realtext":
        corpus = build_corpus()
        return MixedText(corpus.train, seq_len, shards, held_out=corpus.held_out)
    return CharDataset(generate_corpus(), seq_len)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    plan = json.loads(Path(argv[0]).read_text())
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=plan.get("timeout_s", 300)))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    data = training_data(plan)
    results = Path(plan["results"])
    runs = plan["runs"]
    for index, run in enumerate(runs):
        record = run_one(plan, run, data, device)
        if dist.get_rank() == 0:
            with results.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
            print(f"@@progress {index + 1} {len(runs)} {run['name']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_hard(main())

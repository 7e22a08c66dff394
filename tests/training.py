"""A tiny real training setup (demo GPT, generated corpus, AdamW, DDP) shared by the distributed tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

import arc_engine
from arc_engine.config import ArcConfig, load_config
from arc_engine.demo.corpus import CharDataset, generate_corpus
from arc_engine.demo.gpt import GPT, GPTConfig, param_groups
from arc_engine.stats import Reduce, StatLayout, names

SEQ_LEN = 16
BATCH = 4


#: Override for tests that compare the update RMS with the optimizer's own: every element, not the default sample.
EXACT_UPDATE_RMS = "detectors.sdc.update_sample=1.0"


def family_stats_layout(decls: list[Any], groups: int) -> StatLayout:
    """The adapters' standard slots for ``groups`` parameter groups (shards summed) plus a family's ``decls``
    (:class:`~arc_engine.monitors.family.StatDecl`), frozen: what simulated ranks' buffers are laid out by."""
    layout = StatLayout()
    for name, size, reduce in names.adapter_statistics(groups, Reduce.SUM):
        layout.add(name, size, reduce)
    for decl in decls:
        layout.add(decl.name, decl.size, decl.reduce)
    layout.freeze()
    return layout


def make_config(run_dir: Path, *overrides: str) -> ArcConfig:
    """Defaults with a quiet console, the run under ``run_dir``, plus dotted overrides."""
    return load_config(None, ["run.run_id=test", f"run.run_dir={run_dir}", "sinks.console.enabled=false",
                              *overrides])


def tiny_model_and_data(seed: int = 0) -> tuple[GPT, CharDataset]:
    torch.manual_seed(seed)
    data = CharDataset(generate_corpus(400), SEQ_LEN, seed=seed)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, seq_len=SEQ_LEN, num_layers=1, d_model=32, num_heads=2))
    return model, data


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)


def train_ddp(rank: int, steps: int, config: ArcConfig | None, seed: int = 0) -> dict[str, Any]:
    """Train the tiny GPT under DDP for ``steps`` steps on this rank (process group already initialised).

    Returns the final parameters, a snapshot of the parameters after each step, and (with arc) each step's
    decision and the engine summary.
    """
    model, data = tiny_model_and_data(seed)
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    arc = arc_engine.attach(ddp, optimizer, config) if config is not None else None
    snapshots, decisions, grad_norms = [], [], []
    try:
        for step in range(steps):
            inputs, targets = data.batch(step, rank, BATCH)
            loss = ddp(inputs, targets)
            if arc is not None:
                loss = arc.faults.on_loss(loss)
                arc.record_loss(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            snapshots.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())
            if arc is not None and arc.engine.last_decision is not None:
                decision = arc.engine.last_decision
                decisions.append((decision.step, decision.action.name,
                                  [(f.detector, list(f.ranks)) for f in decision.findings]))
                stats = arc.engine.last_stats
                grad_norms.append(float(stats.total("grad_sq").sum()) ** 0.5)
    except arc_engine.ArcAbort as abort:
        return {"aborted_at": abort.step, "exit_code": abort.exit_code, "decisions": decisions}
    summary = arc.summary() if arc is not None else {}
    if arc is not None:
        arc.close()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "snapshots": snapshots,
            "decisions": decisions, "summary": summary, "grad_norms": grad_norms}


def mean_rank_gradients(model: torch.nn.Module, data: CharDataset, step: int, world: int) -> None:
    """Set every parameter's ``.grad`` to the mean of the ``world`` ranks' gradients on their batches of ``step``
    (what a data-parallel reduction hands the optimizer)."""
    grads = []
    for rank in range(world):
        model.zero_grad()
        model(*data.batch(step, rank, BATCH)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for i, param in enumerate(model.parameters()):
        param.grad = sum(g[i] for g in grads) / world


def reference_clipped_adamw(world: int, steps: int, clip: float) -> tuple[list[dict], torch.Tensor]:
    """The unsharded reference for sharded runs: one process, full tensors, the mean of the ranks' gradients,
    torch clipping (DeepSpeed's formula), AdamW. Per step: pre-clip grad / weight squared norms and the applied
    update RMS per group (U = m̂/(√v̂+ε) from the state after the step); plus the final parameters."""
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    out = []
    for step in range(steps):
        mean_rank_gradients(model, data, step, world)
        groups = optimizer.param_groups
        grad_sq = [sum(float(p.grad.double().square().sum()) for p in g["params"]) for g in groups]
        weight_sq = [sum(float(p.detach().double().square().sum()) for p in g["params"]) for g in groups]
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        update_rms = []
        for group in groups:
            beta1, beta2 = group["betas"]
            sq = count = 0.0
            for param in group["params"]:
                state = optimizer.state[param]
                t = int(state["step"])
                update = (state["exp_avg"] / (1 - beta1**t)) / ((state["exp_avg_sq"] / (1 - beta2**t)).sqrt()
                                                                 + group["eps"])
                sq, count = sq + float(update.double().square().sum()), count + param.numel()
            update_rms.append((sq / count) ** 0.5)
        out.append({"grad_sq": grad_sq, "weight_sq": weight_sq, "update_rms": update_rms,
                    "num_params": [sum(p.numel() for p in g["params"]) for g in groups]})
    return out, torch.cat([p.detach().flatten() for p in model.parameters()])


def count_c10d_ops(run: Callable[[], None]) -> int:
    """Number of torch.distributed collectives (profiler ``c10d::`` events) issued by ``run()``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("c10d::"))


def optimizer_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: CharDataset, arc: Any,
                    rank: int, steps: int) -> None:
    """``steps`` plain training steps (arc may be None) on this rank's batches."""
    for step in range(steps):
        loss = model(*data.batch(step, rank, BATCH))
        if arc is not None:
            arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

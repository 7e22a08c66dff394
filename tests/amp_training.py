"""Mixed-precision training loops for the tests: the demo GPT under ``torch.autocast`` on CPU (fp16 or bf16), with
a ``torch.amp.GradScaler`` (DDP, a plain module) or FSDP2's ``ShardedGradScaler``, with or without arc_engine."""

from __future__ import annotations

from typing import Any

import torch

import arc_engine
from arc_engine.config import ArcConfig
from tests.training import BATCH, make_optimizer, tiny_model_and_data

#: The scaler's first scale in these tests: far above what the tiny GPT's fp16 backward can hold, so the scaler
#: skips its first steps while it halves the scale (its routine search), as a real fp16 run does with 2^16.
SEARCH_SCALE = 2.0**30


def train_amp(rank: int, steps: int, config: ArcConfig | None, *, wrap: str = "ddp", dtype: str = "float16",
              scaler: bool = True, order: str = "step", init_scale: float = SEARCH_SCALE, fused: bool = False,
              seed: int = 0, pass_scaler: bool = True, end_step: bool = False) -> dict[str, Any]:
    """Train the tiny GPT for ``steps`` steps (process group already initialised unless ``wrap`` is "plain").

    ``wrap``: "ddp", "fsdp" (FSDP2 ``fully_shard``, ``ShardedGradScaler``) or "plain". ``order``: "step"
    (``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``) or "clip" (``unscale_``, then
    ``clip_grad_norm_``, then ``step`` and ``update``). ``pass_scaler``: False attaches without ``grad_scaler=``
    (the scaler still scales the loss and steps the optimizer: a forgotten argument). ``end_step``: call
    ``arc.end_step()`` after ``scaler.update()`` (as the trainer callbacks do) and record the scaler's state at each
    step's start (first visit) and after each rollback's step. Returns the final
    parameters, per step whether the parameters changed, the norm torch measured after ``unscale_`` ("clip" only),
    the scale before each step, and with arc_engine each monitored step's decision, agreed gradient norm and the
    summary."""
    model, data = tiny_model_and_data(seed)
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped: torch.nn.Module = DistributedDataParallel(model, bucket_cap_mb=0.01)
    elif wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        wrapped = fully_shard(model)
    else:
        wrapped = model
    optimizer = make_optimizer(wrapped) if not fused else torch.optim.AdamW(wrapped.parameters(), lr=1e-2,
                                                                           fused=True)
    grad_scaler = None
    if scaler:
        if wrap == "fsdp":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            grad_scaler = ShardedGradScaler("cpu", init_scale=init_scale)
        else:
            grad_scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    passed = grad_scaler if pass_scaler else None
    arc = arc_engine.attach(wrapped, optimizer, config, grad_scaler=passed) if config is not None else None
    changed, clip_norms, scales, decisions, grad_norms = [], [], [], [], []
    if arc is not None:  # every decision the policy commits (a scaler's skip is closed at the next forward)
        commit = arc.engine.policy.commit

        def record(decision: Any) -> None:
            decisions.append((decision.step, decision.action.name, decision.overflow,
                              [(f.detector, list(f.ranks), f.severity.name) for f in decision.findings]))
            stats = arc.engine.last_stats
            if stats is not None and arc.engine.last_decision is decision:
                grad_norms.append((decision.step, float(stats.total("grad_sq").sum()) ** 0.5))
            commit(decision)

        arc.engine.policy.commit = record
    precision = getattr(torch, dtype)
    scaler_at: dict[int, dict] = {}
    after_rollbacks: list[tuple[int, dict]] = []
    try:
        for step in range(steps):
            if end_step and grad_scaler is not None:
                scaler_at.setdefault(arc.progress.step, grad_scaler.state_dict())
                rollbacks = arc.progress.rolled_back
            before = _flat(wrapped)
            inputs, targets = data.batch(step, rank, BATCH)
            with torch.autocast("cpu", dtype=precision):
                loss = wrapped(inputs, targets)
            if arc is not None:
                loss = arc.faults.on_loss(loss)
                arc.record_loss(loss)
            scales.append(grad_scaler.get_scale() if grad_scaler is not None else 1.0)
            (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
            if order == "clip":
                if grad_scaler is not None:
                    grad_scaler.unscale_(optimizer)
                clip_norms.append(float(torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1e9)))
            if grad_scaler is not None:
                grad_scaler.step(optimizer)
                grad_scaler.update()
                if end_step:
                    arc.end_step()
                    if arc.progress.rolled_back > rollbacks:
                        after_rollbacks.append((arc.progress.step, grad_scaler.state_dict()))
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            changed.append(not torch.equal(before, _flat(wrapped)))
    except arc_engine.ArcAbort as abort:
        return {"aborted_at": abort.step, "exit_code": abort.exit_code, "decisions": decisions,
                "changed": changed, "message": str(abort)}
    summary = arc.summary() if arc is not None else {}
    if arc is not None:
        arc.close()
        summary = arc.summary()
    return {"params": _flat(wrapped), "changed": changed, "clip_norms": clip_norms, "scales": scales,
            "decisions": decisions, "grad_norms": grad_norms, "summary": summary, "scaler_at": scaler_at,
            "after_rollbacks": after_rollbacks}


def _flat(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter (an FSDP2 shard: this rank's local piece), flattened and copied."""
    return torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().flatten() for p in
                      model.parameters()]).clone()

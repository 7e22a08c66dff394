"""The ARC paper's stress scenarios (its Table 7) as named fault presets over arc_engine's injectable kinds
(:class:`~arc_engine.config.schema.FaultSpec`), each parameterized by step, rank, severity and seed.

The paper names the scenarios and gives two magnitudes (a 50x and a 100,000x learning-rate spike); the others are
arc_engine's stand-ins, chosen so that an unprotected run crashes (a non-finite or exploding loss), and ``severity``
scales each magnitude (1 = the preset; ``steps`` grows with it where the scenario lasts):

| scenario | faults |
|---|---|
| ``lr_spike`` | the learning rate x 50 for one step (the paper's NanoGPT row) |
| ``catastrophic_lr`` | the learning rate x 100,000 for one step (the paper's "100,000x LR spikes") |
| ``nan_bomb`` | the loss NaN on ``rank`` (every rank with -1) for one step |
| ``inf_nuke`` | one gradient element +inf on ``rank`` before the reduction, for one step |
| ``loss_supernova`` | the loss (so the gradient) x 10^6 for one step |
| ``gradient_apocalypse`` | the loss x 10^4 for three consecutive steps |
"""

from __future__ import annotations

import math

from arc_engine.config.schema import FaultSpec

SCENARIOS = ("lr_spike", "catastrophic_lr", "nan_bomb", "inf_nuke", "loss_supernova", "gradient_apocalypse")


def scenario(name: str, step: int, *, rank: int = -1, severity: float = 1.0, seed: int = 0) -> list[FaultSpec]:
    """The faults of stress scenario ``name`` starting at optimizer step ``step``. Raises ValueError for an unknown
    name or a severity <= 0."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown stress scenario {name!r}; known: {', '.join(SCENARIOS)}")
    if not severity > 0 or not math.isfinite(severity):
        raise ValueError(f"severity must be a finite number > 0, got {severity}")
    if name == "lr_spike":
        return [FaultSpec(kind="lr_scale", rank=-1, step=step, scale=50.0 * severity, seed=seed)]
    if name == "catastrophic_lr":
        return [FaultSpec(kind="lr_scale", rank=-1, step=step, scale=1e5 * severity, seed=seed)]
    if name == "nan_bomb":
        return [FaultSpec(kind="nan_loss", rank=rank, step=step, seed=seed)]
    if name == "inf_nuke":
        return [FaultSpec(kind="inf_grad", rank=rank, step=step, seed=seed)]
    if name == "loss_supernova":
        return [FaultSpec(kind="loss_scale", rank=rank, step=step, scale=1e6 * severity, seed=seed)]
    return [FaultSpec(kind="loss_scale", rank=rank, step=step, steps=max(1, round(3 * severity)), scale=1e4,
                      seed=seed)]


__all__ = ["SCENARIOS", "scenario"]

"""The named fault library: every fault the campaign injects, as presets over arc_engine's injectable kinds
(:class:`~arc_engine.config.schema.FaultSpec`), each parameterized by step, rank, severity and seed.

Three sources, one entry per fault (:data:`LIBRARY`):

* the 17 fault types of the R-Metric paper (its Appendix F), in its four classes;
* the ARC paper's stress scenarios (its Tables 6-7: NaN bomb, Inf nuke, loss supernova, the 50x and 100,000x
  learning-rate spikes, weight and optimizer sabotage, silent weight corruption);
* the SDC paper's bit flips in a GEMM's backward (transient, and a faulty device that keeps flipping).

``severity`` scales each preset's magnitude (1 = the preset); where a paper gives a range the preset takes a value in
it, and where it gives none the value is arc_engine's own, said so in :attr:`LibraryFault.source`. Faults that act on
named modules or parameters take their patterns from a :class:`Targets` (the demo GPT's names by default; see
:data:`MEGATRON_TARGETS`), and faults that need a part a model may lack (experts, routers) say so in ``needs``.

The R-Metric paper's own implementation simulates most faults by multiplying the logged loss and gradient norms;
here each one acts on the real training step (a gradient, a learning rate, the optimizer's state, the weights, a
batch, a module's compute time, a rank's memory, its hardware-event count), so what a detector sees is what the run
does. Three are approximations, said in their ``source``: ``network_degradation`` delays a rank at the step's start
(its peers then wait in the gradient reduction, as behind a slow link), ``nccl_bug`` corrupts the reduced gradient a
rank applies, and ``memory_leak`` holds host or device memory that nothing in arc_engine watches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from arc_engine.config.schema import FaultSpec


@dataclass(frozen=True)
class Targets:
    """Module and parameter name patterns (fnmatch) of one model family, for the faults that act on named parts.

    ``gemm``: Linear modules for bit flips; ``compute``: a module whose forward a slowed device lengthens;
    ``attention_k``: the parameters holding the attention's K projection; ``norm``: the normalization weights;
    ``weights``: the weight matrices a sabotage hits; ``sparse``: the matrix a silent corruption zeroes;
    ``expert``: one expert's weights; ``router``: the MoE routers (None: the model has no experts).
    """

    gemm: str = "*mlp.2"
    compute: str = "*blocks.0.mlp"
    attention_k: str = "*attn.qkv.weight"
    norm: str = "*ln*.weight"
    weights: str = "*blocks.*.weight"
    sparse: str = "*blocks.0.mlp.0.weight"
    expert: str | None = None
    router: str | None = None


DEMO_TARGETS = Targets()
"""The demo GPT (:mod:`arc_engine.demo.gpt`): ``blocks.N.attn.qkv``, ``blocks.N.mlp.{0,2}``, ``blocks.N.ln{1,2}``."""

MEGATRON_TARGETS = Targets(gemm="*mlp.linear_fc2", compute="*decoder.layers.0.mlp",
                           attention_k="*self_attention.linear_qkv.weight", norm="*layernorm.weight",
                           weights="*decoder.layers.*.weight", sparse="*decoder.layers.0.mlp.linear_fc1.weight")
"""megatron-core's GPT (local layer spec): ``decoder.layers.N.self_attention.linear_qkv``, ``mlp.linear_fc{1,2}``."""

MEGATRON_MOE_TARGETS = Targets(gemm="*linear_fc2", compute="*decoder.layers.0.mlp",
                               attention_k="*self_attention.linear_qkv.weight", norm="*layernorm.weight",
                               weights="*decoder.layers.*.weight",
                               sparse="*decoder.layers.0.self_attention.linear_proj.weight",
                               expert="*experts.local_experts.0.*weight*", router="*router")
"""megatron-core's MoE GPT (local experts, ``SequentialMLP``): expert 0 of each rank and the ``TopKRouter``s."""


@dataclass(frozen=True)
class LibraryFault:
    """One named fault. ``build(step, rank, severity, seed, targets)`` gives its specs; ``needs`` the model parts
    it acts on (``"moe"``: experts and routers); ``crash``: whether it is meant to end an unprotected run (the
    campaign measures that instead of trusting it); ``source``: where the fault and its magnitude come from."""

    name: str
    family: str
    source: str
    build: Callable[[int, int, float, int, Targets], list[FaultSpec]]
    needs: tuple[str, ...] = ()
    crash: bool = False

    def specs(self, step: int, *, rank: int = -1, severity: float = 1.0, seed: int = 0,
              targets: Targets = DEMO_TARGETS) -> list[FaultSpec]:
        """The fault's specs starting at step attempt ``step``. Raises ValueError for a severity that is not a
        finite number > 0, or when ``targets`` lacks a part the fault needs."""
        if not severity > 0 or not math.isfinite(severity):
            raise ValueError(f"severity must be a finite number > 0, got {severity}")
        if "moe" in self.needs and (targets.expert is None or targets.router is None):
            raise ValueError(f"fault {self.name!r} needs a mixture-of-experts model (targets with expert and router "
                             f"patterns)")
        return self.build(step, rank, severity, seed, targets)


def _spec(**fields: object) -> list[FaultSpec]:
    return [FaultSpec(**fields)]  # type: ignore[arg-type]


WINDOW = 50
"""Steps a sustained R-Metric fault lasts (its LR_SPIKE's Δt = 50 and ECC burst's 50 steps)."""

_FAULTS: list[LibraryFault] = [
    # ---- R-Metric Appendix F: training dynamics
    LibraryFault("gradient_explosion", "training dynamics", "R-Metric F (Eq. 17): g <- alpha g + N(0, beta^2), "
                 "alpha in [50, 200], beta in [10, 50] (here beta relative to the gradient's RMS); one step",
                 lambda s, r, v, seed, t: _spec(kind="grad_scale", rank=r, step=s, scale=100.0 * v, noise=20.0 * v,
                                                seed=seed), crash=True),
    LibraryFault("lr_spike_sustained", "training dynamics", "R-Metric F (Eq. 18): the learning rate x gamma, gamma "
                 "in [15, 100], for 50 steps (here gamma = 20)",
                 lambda s, r, v, seed, t: _spec(kind="lr_scale", rank=-1, step=s, steps=WINDOW, scale=20.0 * v,
                                                seed=seed), crash=True),
    LibraryFault("data_corruption", "training dynamics", "R-Metric F (Eq. 19): input tokens replaced by random ones "
                 "with probability rho in [0.05, 0.30] (here 0.3) on one rank, for 50 steps",
                 lambda s, r, v, seed, t: _spec(kind="data_corruption", rank=r, step=s, steps=WINDOW,
                                                rate=min(1.0, 0.3 * v), seed=seed)),
    LibraryFault("grad_accumulation_error", "training dynamics", "R-Metric F (Eq. 20): accumulation drift, "
                 "N(0, 0.01 ||g||) per element (here 3x the gradient's RMS), on one rank for 50 steps",
                 lambda s, r, v, seed, t: _spec(kind="grad_scale", rank=r, step=s, steps=WINDOW, scale=1.0,
                                                noise=3.0 * v, seed=seed)),
    LibraryFault("optimizer_state_corruption", "distributed", "R-Metric F (Eq. 21): Adam's first moment x xi, xi in "
                 "[0.1, 5] (here 5), on one rank",
                 lambda s, r, v, seed, t: _spec(kind="optimizer_state", rank=r, step=s, scale=5.0 * v,
                                                state_key="exp_avg", seed=seed)),
    # ---- R-Metric Appendix F.1.1: architecture
    LibraryFault("expert_failure", "architecture", "R-Metric F (Eq. 22): one expert's weights zeroed from the "
                 "injection on",
                 lambda s, r, v, seed, t: _spec(kind="weight_corruption", rank=-1, step=s, persistent=True,
                                                pattern=t.expert, scale=0.0, seed=seed), needs=("moe",)),
    LibraryFault("router_imbalance", "architecture", "R-Metric F (Eq. 23, its listing): +0.95 x 10 on one "
                 "expert's router logit from the injection on",
                 lambda s, r, v, seed, t: _spec(kind="router_collapse", rank=-1, step=s, persistent=True,
                                                pattern=t.router, scale=9.5 * v, expert=0, seed=seed),
                 needs=("moe",)),
    LibraryFault("gqa_mismatch", "architecture", "R-Metric F (Eq. 24, its listing): the K-projection weights x a "
                 "factor in [0.1, 10] (here 10)",
                 lambda s, r, v, seed, t: _spec(kind="weight_corruption", rank=-1, step=s, pattern=t.attention_k,
                                                scale=10.0 * v, seed=seed)),
    LibraryFault("rmsnorm_error", "architecture", "R-Metric F (Eq. 25, its listing): N(0, 10^2) added to the "
                 "normalization weights (here relative to their RMS)",
                 lambda s, r, v, seed, t: _spec(kind="weight_corruption", rank=-1, step=s, pattern=t.norm,
                                                scale=1.0, noise=10.0 * v, seed=seed)),
    # ---- R-Metric Appendix F.1.2: hardware
    LibraryFault("bit_flip", "hardware", "R-Metric F (Eq. 26, its listing): gradient elements x -U(10, 100) with "
                 "probability rho in [1e-5, 1e-3] (here 1e-4, x -50) on one rank",
                 lambda s, r, v, seed, t: _spec(kind="grad_scale", rank=r, step=s, scale=-50.0,
                                                rate=min(1.0, 1e-4 * v), seed=seed)),
    LibraryFault("memory_leak", "hardware", "R-Metric F (Eq. 27): 0.5 MB held per step from the injection on, "
                 "on one rank (approximation: nothing in arc_engine watches memory)",
                 lambda s, r, v, seed, t: _spec(kind="memory_leak", rank=r, step=s, persistent=True,
                                                megabytes=0.5 * v, seed=seed)),
    LibraryFault("gpu_throttling", "hardware", "R-Metric F (Eq. 28): one rank's compute slowed (here 20 ms "
                 "added to one module's forward) for 50 steps",
                 lambda s, r, v, seed, t: _spec(kind="stall", rank=r, step=s, steps=WINDOW, pattern=t.compute,
                                                seconds=0.02 * v, seed=seed)),
    LibraryFault("ecc_burst", "hardware", "R-Metric F (Eq. 29): a burst of ECC errors for 50 steps (here one "
                 "hardware event per step on one rank)",
                 lambda s, r, v, seed, t: _spec(kind="hardware_events", rank=r, step=s, steps=WINDOW,
                                                count=max(1, round(v)), seed=seed)),
    # ---- R-Metric Appendix F.1.3: communication and I/O
    LibraryFault("io_bottleneck", "communication", "R-Metric F (Eq. 30): I/O latency spikes in [0.1, 2] s (here "
                 "0.5 s at the start of 4 steps) on one rank",
                 lambda s, r, v, seed, t: _spec(kind="stall", rank=r, step=s, steps=4, seconds=0.5 * v,
                                                seed=seed)),
    LibraryFault("nccl_bug", "communication", "R-Metric F (Eq. 31): a collective returns a wrong result, with "
                 "probability 0.05 per step in its listing (here 0.1 over 50 steps, the reduced gradient x 30 on "
                 "one rank; approximation: the corruption enters after arc_engine's checks of the step)",
                 lambda s, r, v, seed, t: _spec(kind="collective_corruption", rank=r, step=s, steps=WINDOW,
                                                rate=min(1.0, 0.1 * v), scale=30.0, seed=seed)),
    LibraryFault("network_degradation", "communication", "R-Metric F (Eq. 32): bandwidth x (1 - delta) (here one "
                 "rank delayed 30 ms per step for 50 steps; approximation: its peers wait in the reduction)",
                 lambda s, r, v, seed, t: _spec(kind="stall", rank=r, step=s, steps=WINDOW, seconds=0.03 * v,
                                                seed=seed)),
    LibraryFault("straggler", "communication", "R-Metric F (Eq. 33): one worker's compute x kappa, kappa in [2, 10] "
                 "(here 50 ms added to one module's forward) for 50 steps",
                 lambda s, r, v, seed, t: _spec(kind="stall", rank=r, step=s, steps=WINDOW, pattern=t.compute,
                                                seconds=0.05 * v, seed=seed)),
    # ---- ARC Tables 6-7: stress scenarios
    LibraryFault("lr_spike", "stress", "ARC Table 7 (NanoGPT): the learning rate x 50 for one step",
                 lambda s, r, v, seed, t: _spec(kind="lr_scale", rank=-1, step=s, scale=50.0 * v, seed=seed),
                 crash=True),
    LibraryFault("catastrophic_lr", "stress", "ARC Table 7: the learning rate x 100,000 for one step",
                 lambda s, r, v, seed, t: _spec(kind="lr_scale", rank=-1, step=s, scale=1e5 * v, seed=seed),
                 crash=True),
    LibraryFault("nan_bomb", "stress", "ARC Table 7: the loss NaN on one rank for one step",
                 lambda s, r, v, seed, t: _spec(kind="nan_loss", rank=r, step=s, seed=seed), crash=True),
    LibraryFault("inf_nuke", "stress", "ARC Table 7: one gradient element +inf on one rank, before the reduction",
                 lambda s, r, v, seed, t: _spec(kind="inf_grad", rank=r, step=s, seed=seed), crash=True),
    LibraryFault("loss_supernova", "stress", "ARC Table 7 (arc_engine's magnitude): the loss x 10^6 for one step",
                 lambda s, r, v, seed, t: _spec(kind="loss_scale", rank=r, step=s, scale=1e6 * v, seed=seed),
                 crash=True),
    LibraryFault("gradient_apocalypse", "stress", "ARC Table 7 (arc_engine's magnitude): the loss x 10^4 for "
                 "three consecutive steps",
                 lambda s, r, v, seed, t: _spec(kind="loss_scale", rank=r, step=s, steps=max(1, round(3 * v)),
                                                scale=1e4, seed=seed), crash=True),
    LibraryFault("weight_sabotage", "stress", "ARC §4 (arc_engine's magnitude): Gaussian noise of 100x their RMS "
                 "added to every block weight on every rank",
                 lambda s, r, v, seed, t: _spec(kind="weight_corruption", rank=-1, step=s, pattern=t.weights,
                                                scale=1.0, noise=100.0 * v, seed=seed), crash=True),
    LibraryFault("optimizer_sabotage", "stress", "ARC §4 (arc_engine's magnitude): Adam's second moment x 1e-8 "
                 "on every rank, so the next update is about 10^4 x larger",
                 lambda s, r, v, seed, t: _spec(kind="optimizer_state", rank=-1, step=s, scale=1e-8 / v,
                                                state_key="exp_avg_sq", seed=seed), crash=True),
    LibraryFault("silent_weight_corruption", "stress", "ARC §3 (weight health: sparsity): 30% of one weight "
                 "matrix's elements set to zero on every rank",
                 lambda s, r, v, seed, t: _spec(kind="weight_corruption", rank=-1, step=s, pattern=t.sparse,
                                                scale=0.0, rate=min(1.0, 0.3 * v), seed=seed)),
    # ---- SDC paper: bit flips in the backward GEMM
    LibraryFault("sdc_bitflip", "sdc", "SDC paper §IV: exponent-bit flips (16 elements, the dtype's NaN-prone "
                 "exponent bit) in one GEMM's backward output on one rank, one step",
                 lambda s, r, v, seed, t: _spec(kind="bitflip", rank=r, step=s, pattern=t.gemm, where="backward",
                                                count=max(1, round(16 * v)), seed=seed)),
    LibraryFault("sdc_faulty_device", "sdc", "SDC paper §IV: a faulty device: the same flips on every GEMM call "
                 "from the injection on, recomputations included",
                 lambda s, r, v, seed, t: _spec(kind="bitflip", rank=r, step=s, pattern=t.gemm, where="backward",
                                                count=max(1, round(4 * v)), persistent=True, seed=seed)),
]

LIBRARY: dict[str, LibraryFault] = {fault.name: fault for fault in _FAULTS}
R_METRIC_FAULTS = ("gradient_explosion", "lr_spike_sustained", "data_corruption", "grad_accumulation_error",
                   "optimizer_state_corruption", "expert_failure", "router_imbalance", "gqa_mismatch",
                   "rmsnorm_error", "bit_flip", "memory_leak", "gpu_throttling", "ecc_burst", "io_bottleneck",
                   "nccl_bug", "network_degradation", "straggler")
ARC_SCENARIOS = ("lr_spike", "catastrophic_lr", "nan_bomb", "inf_nuke", "loss_supernova", "gradient_apocalypse",
                 "weight_sabotage", "optimizer_sabotage", "silent_weight_corruption")
SDC_FAULTS = ("sdc_bitflip", "sdc_faulty_device")


def fault(name: str) -> LibraryFault:
    """The library fault ``name``; ValueError naming the known ones otherwise."""
    if name not in LIBRARY:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(LIBRARY)}")
    return LIBRARY[name]


def fault_specs(name: str, step: int, *, rank: int = -1, severity: float = 1.0, seed: int = 0,
                targets: Targets = DEMO_TARGETS) -> list[FaultSpec]:
    """The specs of library fault ``name`` at step attempt ``step`` (see :meth:`LibraryFault.specs`)."""
    return fault(name).specs(step, rank=rank, severity=severity, seed=seed, targets=targets)


__all__ = ["ARC_SCENARIOS", "DEMO_TARGETS", "LIBRARY", "MEGATRON_MOE_TARGETS", "MEGATRON_TARGETS", "R_METRIC_FAULTS",
           "SDC_FAULTS", "LibraryFault", "Targets", "fault", "fault_specs"]

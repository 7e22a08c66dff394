"""What a campaign runs: its profiles (``quick`` for CI, ``full`` for docs/results.md), the arc_engine configuration
of each arm, and the list of runs per backend that :mod:`arc_engine.campaign.worker` executes.

Per backend and seed, every library fault that the backend's model has the parts for runs twice:

* ``observe``: arc_engine attached with every action turned into a warning and no recovery. The run is what it would
  be unprotected (the hot path changes nothing without an intervention), arc_engine's alarms are recorded on it, and
  the baselines replay its loss and gradient-norm series: every detector judges the same trajectory.
* ``protect``: arc_engine as a user runs it (:data:`PROTECT`): skips, rollbacks and healing, recovery on.

and the clean runs (no fault) run in both arms plus ``bare`` (no arc_engine at all, the overhead's reference).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arc_engine.config import load_config, to_dict
from arc_engine.faults.library import DEMO_TARGETS, LIBRARY, MEGATRON_MOE_TARGETS, MEGATRON_TARGETS, WINDOW, Targets

BACKENDS = ("ddp", "zero2", "megatron_tp2", "megatron_ep2")
"""``ddp``: torch DDP over the demo GPT; ``zero2``: a real DeepSpeed ZeRO-2 engine over it (gradient clipping 1);
``megatron_tp2`` / ``megatron_ep2``: megatron-core's GPT with tensor parallelism 2 / a 4-expert MoE with expert
parallelism 2 (:mod:`arc_engine.campaign.megatron_backend`)."""
TARGETS: dict[str, Targets] = {"ddp": DEMO_TARGETS, "zero2": DEMO_TARGETS, "megatron_tp2": MEGATRON_TARGETS,
                               "megatron_ep2": MEGATRON_MOE_TARGETS}
PARTS: dict[str, frozenset[str]] = {"ddp": frozenset(), "zero2": frozenset(), "megatron_tp2": frozenset(),
                                    "megatron_ep2": frozenset({"moe"})}
"""The optional model parts (``moe``) each backend's model has: faults that need others do not run there."""
BACKEND_CONFIG: dict[str, dict[str, Any]] = {
    backend: {"detectors": {"qk_spectra": {"every": 10}, "router": {"every": 10}}}
    for backend in ("megatron_tp2", "megatron_ep2")}
"""Per-backend additions to both arms' configuration: the mechanism monitors measure every 10 steps (default 50),
so that their trajectories have a baseline before a fault in a run of a few hundred steps."""

PROTECT: dict[str, Any] = {
    "stats": {"interval": 1},
    "detectors": {
        "non_finite": {"action": "skip"},
        "loss_spike": {"warmup_steps": 20, "factor": 6.0, "min_relative_increase": 0.25, "action": "skip"},
        "grad_norm": {"explosion_threshold": 1.0e4},
        "weight_health": {"enabled": True, "every": 10},
    },
    "policy": {"max_consecutive_skips": 3, "on_persistent_failure": "rollback"},
    "recovery": {"enabled": True, "checkpoint_freq": 10, "lr_recovery_steps": 20,
                 "checkpoint": {"every_steps": 0, "resume": False}},
    "sinks": {"console": {"enabled": False}, "metrics_interval": 1, "wandb": {"enabled": False}},
}
"""The protected arm's arc_engine configuration (the demo's, with weight health on and no disk checkpoints)."""


def observe_config(protect: dict[str, Any]) -> dict[str, Any]:
    """``protect`` with every detector action a warning (``action`` and ``*_action`` keys), the SDC recomputation
    and recovery off: arc_engine watches and reports, and changes nothing."""
    full = to_dict(load_config(base=protect))
    for section in full["detectors"].values():
        if not isinstance(section, dict):
            continue
        for key in section:
            if key == "action" or key.endswith("_action"):
                section[key] = "warn"
        recompute = section.get("recompute")
        if isinstance(recompute, dict):
            recompute["enabled"] = False
    full["recovery"]["enabled"] = False
    full["detectors"].pop("plugins", None)
    return full


@dataclass(frozen=True)
class Profile:
    """A campaign's size. ``steps``: optimizer steps of a faulted run, whose fault starts at ``fault_step`` plus a
    seed-dependent offset below ``jitter``; ``clean_steps``: steps of the first seed's clean runs (the false-alarm
    and false-intervention runs; the other seeds' are ``steps`` long). Every clean run's held-out loss is also taken
    at ``steps``: the faulted runs' reference."""

    name: str
    backends: tuple[str, ...]
    faults: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int
    fault_step: int
    jitter: int
    clean_steps: int
    world: int = 2
    min_lr_ratio: float = 0.1
    """The learning rate's cosine decay, over ``steps``, ends at this fraction of the peak and stays there (a clean
    run longer than ``steps`` trains on at the floor): every run, faulted or clean, has the same rate at each step."""
    model: dict[str, Any] = field(default_factory=lambda: {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 64,
                                                           "batch_size": 8, "lr": 3e-3})
    per_backend: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Backend -> fields that differ there (e.g. fewer faults and seeds for the slower Megatron models)."""
    data: str = "generated"
    """The training text: ``generated`` (the demo's grammar) or ``realtext`` (the machine's own files, rank 0 code
    and rank 1 prose: :mod:`arc_engine.demo.realtext`; demo GPT backends only)."""

    def for_backend(self, backend: str) -> Profile:
        return dataclasses.replace(self, **self.per_backend.get(backend, {}), per_backend={})


CRASH_SCENARIOS = ("nan_bomb", "inf_nuke", "loss_supernova", "catastrophic_lr", "lr_spike", "gradient_apocalypse")
MEGATRON_TP2_FAULTS = ("gqa_mismatch", "rmsnorm_error", "nan_bomb", "catastrophic_lr", "sdc_bitflip")
"""Under TP=2: the attention and normalization faults, two crash scenarios, a bit flip in a parallel linear."""
MEGATRON_EP2_FAULTS = ("router_imbalance", "expert_failure", "nan_bomb")
"""Under EP=2: the router and expert faults, and a crash scenario."""
REALTEXT_FAULTS = ("data_corruption", "lr_spike", "gradient_explosion")
"""On the machine's real text (rank 0 code, rank 1 prose): the faults whose signal a heavy-tailed loss could hide."""
MEGATRON_SIZE: dict[str, Any] = {"steps": 200, "fault_step": 110, "jitter": 20, "clean_steps": 200,
                                 "model": {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 32, "batch_size": 8}}
"""The Megatron runs: 200 steps (a Megatron step costs several of the demo GPT's on CPU), a smaller fault set."""

PROFILES: dict[str, Profile] = {
    "quick": Profile("quick", backends=("ddp",), faults=CRASH_SCENARIOS, seeds=(0,), steps=100, fault_step=60,
                     jitter=0, clean_steps=100),
    "full": Profile("full", backends=BACKENDS, faults=tuple(LIBRARY), seeds=(0, 1), steps=360, fault_step=180,
                    jitter=40, clean_steps=2000, per_backend={
                        "megatron_tp2": {"faults": MEGATRON_TP2_FAULTS, **MEGATRON_SIZE},
                        "megatron_ep2": {"faults": MEGATRON_EP2_FAULTS, **MEGATRON_SIZE}}),
    "realtext": Profile("realtext", backends=("ddp",), faults=REALTEXT_FAULTS, seeds=(0, 1), steps=600,
                        fault_step=300, jitter=60, clean_steps=600, data="realtext",
                        model={"layers": 4, "d_model": 128, "heads": 4, "seq_len": 64, "batch_size": 8, "lr": 2e-3}),
}


def fault_step(profile: Profile, seed: int) -> int:
    return profile.fault_step + (seed * 7919) % profile.jitter if profile.jitter else profile.fault_step


def fault_rank(profile: Profile, seed: int) -> int:
    """The rank a single-rank fault hits: 1, 0, 1, ... over the seeds (never always rank 0)."""
    return (seed + 1) % profile.world


def applicable(backend: str, fault: str) -> bool:
    return set(LIBRARY[fault].needs) <= PARTS[backend]


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``base`` with ``extra``'s keys set (nested mappings merged)."""
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        merged[key] = _merged(merged.get(key, {}), value) if isinstance(value, dict) else copy.deepcopy(value)
    return merged


def fault_end(specs: list) -> int:
    """The last step attempt a fault acts on (a persistent one: the first ``WINDOW`` steps, the span it is judged
    on)."""
    return max(spec.step + (WINDOW if spec.persistent else spec.steps) - 1 for spec in specs)


def run_spec(name: str, arm: str, backend: str, fault: str, seed: int, steps: int, at: int | None, injections: list,
             run_dir: Path, eval_at: tuple[int, ...] = (), end: int | None = None,
             base: dict[str, Any] = PROTECT) -> dict[str, Any]:
    """One run of a worker plan: ``base`` (the protected arm's configuration) with the backend's additions, turned
    into the observe arm's for ``arm == "observe"``, writing under ``run_dir``, with ``injections`` from ``at``."""
    run_id = name.replace("/", "-")
    config: dict[str, Any] = _merged(base, BACKEND_CONFIG.get(backend, {}))
    config = observe_config(config) if arm == "observe" else config
    config["run"] = {"run_id": run_id, "run_dir": str(run_dir)}
    config["faults"] = {"injections": injections}
    return {"name": name, "arm": arm, "backend": backend, "fault": fault, "seed": seed, "steps": steps,
            "fault_step": at, "fault_end": end, "eval_at": list(eval_at), "config": config}


def backend_plan(profile: Profile, backend: str, out: Path, faults: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The worker's plan for one backend: clean runs first (observe and protect per seed, ``clean_steps`` long for
    the first seed, with a bare run as long, and ``steps`` for the others), then each applicable fault in both
    arms per seed. ``profile``'s ``per_backend`` fields apply."""
    profile = profile.for_backend(backend)
    runs: list[dict[str, Any]] = []
    run_dir = out / "runs"
    for seed in profile.seeds:
        first = seed == profile.seeds[0]
        for arm in ("bare", "observe", "protect") if first else ("observe", "protect"):
            steps = profile.clean_steps if first else profile.steps
            runs.append(run_spec(f"{backend}/clean/s{seed}/{arm}", arm, backend, "clean", seed, steps, None, [],
                                 run_dir, eval_at=(profile.steps,)))
    for fault in faults if faults is not None else profile.faults:
        if not applicable(backend, fault):
            continue
        for seed in profile.seeds:
            at = fault_step(profile, seed)
            specs = LIBRARY[fault].specs(at, rank=fault_rank(profile, seed), seed=seed, targets=TARGETS[backend])
            injections = [dataclasses.asdict(spec) for spec in specs]
            for arm in ("observe", "protect"):
                runs.append(run_spec(f"{backend}/{fault}/s{seed}/{arm}", arm, backend, fault, seed, profile.steps,
                                     at, injections, run_dir, end=fault_end(specs)))
    schedule = {"decay_steps": profile.steps, "min_ratio": profile.min_lr_ratio}
    return {"backend": backend, "model": profile.model, "schedule": schedule, "results": str(out / "results.jsonl"),
            "runs": runs, "data": profile.data}


__all__ = ["BACKENDS", "CRASH_SCENARIOS", "PROFILES", "PROTECT", "Profile", "applicable", "backend_plan",
           "fault_rank", "fault_step", "observe_config", "run_spec"]

"""The mechanism monitors' separability on megatron-core, on any seed (CI runs seed 1234:
tests/test_megatron_qk_separability_dist.py).

    torchrun --nproc-per-node 2 scripts/separability_megatron.py --seed 1234

(defaults: 4 layers x 128, 8 heads, 160 steps, faults from step 96, measured every 4 steps; about a minute per
seed on 2 idle cores.)

Trains the reference script's MoE GPT (EP=2, 4 experts, CPU) three times with the same seed and data -- healthy,
``attention_lowbit`` and ``router_collapse`` from ``--fault-step`` on every rank -- with the QK spectra and the
routers measured every ``--every`` steps, and prints, per run, the steps at which the ``qk_spectra`` and ``router``
monitors alarmed, then per measurement the last layer's mean Δ₂ spectral entropy of the healthy run and how far
each faulted run is from it. The paper's separability holds when the QK monitor alarms under the attention fault
only and the router monitor under the router fault only. Figures: docs/megatron.md.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_megatron_gpt as train

MOE = ["--cpu", "--seq-length", "32", "--num-experts", "4", "--expert-model-parallel-size", "2",
       "--moe-aux-loss-coeff", "0.1"]
FAULTS = {"healthy": None,
          "attention_lowbit": {"kind": "attention_lowbit", "bits": 7},
          "router_collapse": {"kind": "router_collapse", "scale": 2.0, "expert": 0}}


def _config(folder: Path, name: str, fault: dict | None, args: argparse.Namespace) -> str:
    injections = [] if fault is None else [{**fault, "rank": -1, "step": args.fault_step, "persistent": True}]
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "run": {"run_id": name, "run_dir": str(folder / "runs")}, "stats": {"interval": 1},
        "sinks": {"console": {"enabled": False}, "jsonl": {"enabled": False}},
        "detectors": {"qk_spectra": {"every": args.every},  # its alarm at the defaults
                      "router": {"every": args.every, "warmup_measurements": 3}},
        "faults": {"injections": injections}}))
    return str(path)


def _run(config: str, args: argparse.Namespace) -> tuple[dict[str, list[int]], dict[int, np.ndarray]]:
    """One training run: {monitor: alarm steps} and {measurement step: Δ₂ entropy [layers, heads]}."""
    shape = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads",
             str(args.num_attention_heads)]
    parsed = train.build_parser().parse_args([*MOE, *shape, "--seed", str(args.seed), "--arc-config", config])
    train.initialize(parsed)
    state = train.build_model_and_optimizer(parsed)
    engine = state.arc.engine
    alarms: dict[str, list[int]] = {"qk_spectra": [], "router": []}
    entropy: dict[int, np.ndarray] = {}
    while state.arc.progress.step < args.steps:
        train.train_step(state, parsed, state.arc.progress.data_position)
        step, stats = engine.progress.step - 1, engine.last_stats
        for finding in engine.last_decision.findings:
            if finding.detector in alarms:
                alarms[finding.detector].append(step)
        if np.asarray(stats.total("qk_measured")).any():
            layers = len(np.asarray(stats.total("qk_measured")))
            entropy[step] = np.asarray(stats.total("qk_delta2_entropy"), dtype=np.float64).reshape(layers, -1)
    state.arc.close()
    return alarms, entropy


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--fault-step", type=int, default=96)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--dump", type=Path, help="also write every run's alarms and per-head entropies (pickle)")
    return parser


def run_all(args: argparse.Namespace) -> dict[str, tuple[dict[str, list[int]], dict[int, np.ndarray]]]:
    """Every run of :data:`FAULTS`: {name: ({monitor: alarm steps}, {step: Δ₂ entropy [layers, heads]})}."""
    with tempfile.TemporaryDirectory() as tmp:
        return {name: _run(_config(Path(tmp), name, fault, args), args) for name, fault in FAULTS.items()}


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    results = run_all(args)
    if torch.distributed.get_rank() != 0:
        return 0
    if args.dump is not None:
        args.dump.write_bytes(pickle.dumps(results))
    print(f"seed {args.seed}, {args.num_layers} layers x {args.hidden_size}, {args.steps} steps, faults from step "
          f"{args.fault_step}, measured every {args.every}")
    for name, (alarms, _) in results.items():
        print(f"  {name:17s} qk_spectra alarms at {sorted(set(alarms['qk_spectra']))}, "
              f"router alarms at {sorted(set(alarms['router']))}")
    healthy = results["healthy"][1]
    print("  step | healthy Δ₂ entropy (last layer mean) | attention - healthy | router - healthy")
    for step in sorted(healthy):
        last = healthy[step][-1].mean()
        diffs = [float((results[name][1][step][-1] - healthy[step][-1]).mean()) for name in list(FAULTS)[1:]]
        print(f"  {step:4d} | {last:.3f} | {diffs[0]:+.3f} | {diffs[1]:+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

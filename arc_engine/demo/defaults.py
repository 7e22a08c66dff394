"""The demo's embedded default configuration (``configs/demo.yaml`` is its commented twin; a test keeps the
two equal)."""

from __future__ import annotations

from typing import Any

DEMO_CONFIG: dict[str, Any] = {
    "run": {"run_id": "demo", "run_dir": "arc_runs"},
    "stats": {"interval": 1},
    "detectors": {
        "non_finite": {"action": "skip"},
        "loss_spike": {"warmup_steps": 20, "factor": 6.0, "min_relative_increase": 0.25, "action": "skip"},
        "grad_norm": {"explosion_threshold": 1.0e4},
    },
    "policy": {"max_consecutive_skips": 3, "on_persistent_failure": "rollback"},
    "sinks": {"console": {"min_severity": "info"}, "metrics_interval": 10,
              "wandb": {"enabled": True, "mode": "offline", "project": "arc-demo"}},
    "faults": {"injections": [
        {"kind": "nan_grad", "rank": 1, "step": 40, "param": "blocks.0.ln1.weight"},
        {"kind": "loss_scale", "rank": -1, "step": 80, "scale": 30.0},
        {"kind": "nan_loss", "rank": 0, "step": 120},
        {"kind": "lr_scale", "rank": -1, "step": 160, "scale": 50.0},
    ]},
    "recovery": {"enabled": True, "checkpoint_freq": 10, "lr_recovery_steps": 20,
                 "checkpoint": {"every_steps": 50, "resume": False}},
}

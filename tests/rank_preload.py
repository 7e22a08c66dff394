"""What the test ranks' fork server imports once, so that each rank starts as a fork of it (``tests/dist_harness.py``).

A rank spawned from scratch imports torch, arc_engine (with torch.distributed.checkpoint), and DeepSpeed or
megatron-core before its first step: 5-10 s of CPU per rank, 2-4 ranks per test, on a 2-core machine; 10-15 s with
transformers or Lightning, for the trainers' scripts that ``run_script`` starts. Forked from a process that has
imported them, a rank starts in a fraction of a second. A module that does not import here (not installed in this
lane, or failing) is simply not preloaded: the rank imports it itself, as a spawned one would.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings

MODULES = (
    "numpy", "yaml", "pytest", "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.nn.parallel",
    "torch.distributed.fsdp", "arc_engine", "tests.dist_harness", "tests.training",
    "deepspeed", "arc_engine.integrations.deepspeed",
    "megatron.core", "megatron.core.parallel_state", "megatron.core.distributed", "megatron.core.optimizer",
    "megatron.core.models.gpt", "megatron.core.dist_checkpointing", "arc_engine.integrations.megatron",
    # the trainers' example scripts (tests/trainer_runs.py) and Megatron-LM's pretrain() (the Python 3.12 lane)
    "transformers", "transformers.trainer", "accelerate", "arc_engine.integrations.hf",
    "lightning", "lightning.pytorch", "arc_engine.integrations.lightning", "megatron.training",
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for _name in MODULES:  # best effort: a rank imports what is missing itself
        with contextlib.suppress(Exception):
            importlib.import_module(_name)

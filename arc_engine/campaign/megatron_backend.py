"""The campaign's megatron-core backends: the reference script's GPT (``scripts/train_megatron_gpt.py``, loaded from
the repository checkout; megatron-core 0.16.1, local layer spec, fp32, Adam, gradient clipping 1.0) on 2 CPU ranks
with the megatron CPU shims (``arc_engine.testing.megatron_cpu``, which the script's ``--cpu`` installs):

* ``megatron_tp2``: tensor parallelism 2 (the attention's QKV split across the ranks): the attention faults;
* ``megatron_ep2``: expert parallelism 2, 4 experts of which each rank holds 2, top-2 routing: the router and
  expert faults.

The script's own pieces build and step the model (``initialize``, ``build_model_and_optimizer``, ``train_step``), so
the campaign trains exactly what the Megatron tests and demo train; arc_engine attaches to its model chunks and
Megatron optimizer as a user's Megatron-LM job does.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import arc_engine
from arc_engine.config import ArcConfig

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_megatron_gpt.py"
LAYOUTS: dict[str, list[str]] = {
    "megatron_tp2": ["--tensor-model-parallel-size", "2"],
    "megatron_ep2": ["--expert-model-parallel-size", "2", "--num-experts", "4", "--moe-aux-loss-coeff", "0.1"],
}
LEARNING_RATE = 1e-3
"""The script's default: at 3e-3 this model's gradient norm spikes on its own (its ``--lr`` help)."""


def load_script() -> ModuleType:
    """``scripts/train_megatron_gpt.py`` as a module. FileNotFoundError outside a repository checkout."""
    if not SCRIPT.is_file():
        raise FileNotFoundError(f"the megatron campaign backends train {SCRIPT}, which is not here: run the campaign "
                                "from a checkout of the arc_engine repository")
    name = "arc_campaign_train_megatron_gpt"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses need it registered
    spec.loader.exec_module(module)
    return module


class MegatronTrainer:
    """One run's model, optimizer and data under ``backend``'s layout. Collective to build: every rank."""

    def __init__(self, backend: str, model: dict[str, Any], seed: int, steps: int) -> None:
        self.script = load_script()
        self.args = self.script.build_parser().parse_args([
            "--cpu", "--no-arc", "--num-layers", str(model["layers"]), "--hidden-size", str(model["d_model"]),
            "--num-attention-heads", str(model["heads"]), "--seq-length", str(model["seq_len"]),
            "--micro-batch-size", str(model["batch_size"]), "--lr", str(LEARNING_RATE), "--seed", str(seed),
            "--train-iters", str(steps), *LAYOUTS[backend]])
        self.script.initialize(self.args)
        self.state = self.script.build_model_and_optimizer(self.args)
        self.data = self.state.data

    def attach(self, config: ArcConfig) -> arc_engine.Arc:
        self.state.arc = arc_engine.attach(self.state.model, self.state.optimizer, config)
        return self.state.arc

    def param_groups(self) -> list[dict[str, Any]]:
        """The Megatron optimizer's groups (ChainedOptimizer's are its chained optimizers', collected anew)."""
        return self.state.optimizer.param_groups

    def step(self, position: int) -> float:
        """One optimizer step on batch ``position``; the loss, averaged over the data-parallel ranks."""
        loss, _, _ = self.script.train_step(self.state, self.args, position)
        return float("nan") if loss is None else loss

    @torch.no_grad()
    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The mean token loss of one batch (collective over the model-parallel ranks, which all call it)."""
        inputs, targets = inputs.to(self.state.device), targets.to(self.state.device)
        positions = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0).expand_as(inputs)
        return float(self.state.model[0](inputs, positions, None, labels=targets).float().mean())

    def close(self) -> None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()


__all__ = ["LAYOUTS", "MegatronTrainer", "load_script"]

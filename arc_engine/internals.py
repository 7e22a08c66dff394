"""What arc_engine's core reads of objects it does not own, where the attribute may be absent: torch's releases and
private members, DeepSpeed's parameter attributes, megatron-core's and Transformer Engine's modules, W&B, NVML.

Every such probe is here (and, for one framework, in ``integrations/<framework>/internals.py``), named by what it
reads, so that the rest of the code calls functions instead of asking objects whether they have a member, and a
release that renames a member is one place to look. Each function is local and cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# ------------------------------------------------------------------ torch

#: ``dist.all_gather_single`` where this torch has it, else ``all_gather_into_tensor`` (one flat buffer per rank)
all_gather_flat: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs through ``torch.compile`` (the wrapper, or a module compiled in place)."""
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


def accumulate_grad_variable(node: Any) -> Any:
    """The tensor an autograd ``AccumulateGrad`` node accumulates into (None for any other node)."""
    return getattr(node, "variable", None)


def cuda_pci_parts(properties: object) -> list[Any]:
    """A CUDA device's ``pci_domain_id``, ``pci_bus_id``, ``pci_device_id`` from its torch properties (None where
    this torch does not give one)."""
    return [getattr(properties, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]


def dcp_save_id(dcp_metadata: Any) -> str | None:
    """The ``save_id`` a torch.distributed.checkpoint ``.metadata`` recorded (its ``storage_meta``; None where this
    torch writes none)."""
    storage_meta = getattr(dcp_metadata, "storage_meta", None)
    return getattr(storage_meta, "save_id", None)


def dcp_storage_data_missing(dcp_metadata: Any) -> bool:
    """Whether a DCP ``.metadata`` object lacks its ``storage_data`` (torch < 2.10 fills in a copy at save)."""
    return getattr(dcp_metadata, "storage_data", None) is None


def optimizer_param_groups(optimizer: Any) -> list[dict[str, Any]]:
    """A torch optimizer's ``param_groups`` (none for an object without them)."""
    return getattr(optimizer, "param_groups", [])


def accelerate_unwrapped(optimizer: Any) -> tuple[Any, Any]:
    """Hugging Face Accelerate's ``AcceleratedOptimizer``: (the optimizer it wraps, its ``scaler``), None for
    what it lacks."""
    return getattr(optimizer, "optimizer", None), getattr(optimizer, "scaler", None)


# ------------------------------------------------------------------ DeepSpeed's parameters

def is_zero3_param(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DeepSpeed ZeRO-3 partitioned parameter (it carries ``ds_id``/``ds_shape``)."""
    return hasattr(tensor, "ds_id") or hasattr(tensor, "ds_shape")


def zero3_full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """A parameter's whole shape: DeepSpeed ZeRO-3 keeps it in ``ds_shape`` (the tensor is empty between
    gathers)."""
    return tuple(getattr(tensor, "ds_shape", None) or tensor.shape)


def deepspeed_adam_w_mode(optimizer: Any) -> bool | None:
    """DeepSpeed's fused Adam's ``adam_w_mode`` (decoupled weight decay), None for another optimizer."""
    return bool(optimizer.adam_w_mode) if hasattr(optimizer, "adam_w_mode") else None


# ------------------------------------------------------------------ model modules (megatron-core, Transformer Engine)

def embedding_size(module: nn.Module) -> int | None:
    """``num_embeddings`` of an embedding (``nn.Embedding``, megatron-core's ``VocabParallelEmbedding``), else None."""
    size = getattr(module, "num_embeddings", None)
    return size if isinstance(size, int) and size > 0 else None


def is_router(module: nn.Module) -> bool:
    """Whether ``module`` is an MoE router (megatron-core's: callable ``gating`` and ``routing``)."""
    return callable(getattr(module, "gating", None)) and callable(getattr(module, "routing", None))


def router_experts(router: nn.Module) -> int | None:
    """Experts of a router: megatron-core's ``config.num_moe_experts``, else the rows of its ``weight``; None if
    neither says."""
    configured = getattr(getattr(router, "config", None), "num_moe_experts", None)
    if configured:
        return int(configured)
    weight = getattr(router, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def child_module(module: nn.Module, name: str) -> nn.Module | None:
    """``module``'s child ``name`` where it has one (an unfused softmax inside an attention core), else None."""
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Module) else None


def softmax_scale(softmax: nn.Module) -> float:
    """The scale an attention softmax applies to its input (megatron-core's ``FusedScaleMaskSoftmax.scale``; 1
    where it has none)."""
    return float(getattr(softmax, "scale", None) or 1.0)


def recorded_max_logits(core_attention: nn.Module) -> torch.Tensor | None:
    """The per-head max attention logits an attention core recorded (Transformer Engine's
    ``current_max_attn_logits``, with Megatron's ``qk_clip`` or ``log_max_attention_logit``), else None."""
    recorded = getattr(core_attention, "current_max_attn_logits", None)
    return recorded if isinstance(recorded, torch.Tensor) else None


def records_max_logits(core_attention: nn.Module) -> bool:
    """Whether an attention core keeps ``current_max_attn_logits`` at all."""
    return hasattr(core_attention, "current_max_attn_logits")


# ------------------------------------------------------------------ NVML, W&B

def nvml_clock_event_reasons(nvml: Any, handle: Any) -> int:
    """The device's current clock event reasons (``nvmlDeviceGetCurrentClocksEventReasons``, called
    ``...ThrottleReasons`` by older NVML bindings)."""
    if hasattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons"):
        return int(nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    return int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def wandb_active_run(module: Any) -> Any:
    """The W&B run active in this process (``wandb.run``), None without one."""
    return getattr(module, "run", None) if module is not None else None


def wandb_run_id(run: Any) -> str:
    return str(getattr(run, "id", "?"))

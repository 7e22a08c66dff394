"""What recovery needs from one rank's training state, per backend: :class:`TrainState`.

Rollback and checkpoints work on *this rank's* state only (its parameters or shards, its optimizer state), so
they never gather a full model. The protocol has two views of the same state:

* ``live_tensors()``: the tensors in a fixed order, for in-place host snapshots (the memory ring);
* ``dcp_state_dict()``: a torch.distributed.checkpoint state dict with stable keys, for the disk tier.

:class:`TorchTrainState` serves plain modules, DDP and FSDP2 with any ``torch.optim`` optimizer; DeepSpeed ZeRO
has its own in ``arc_engine.integrations.deepspeed.state``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from arc_engine.recovery.state_dict_cache import StateDictCache
from arc_engine.seams import check_overrides

if TYPE_CHECKING:
    from arc_engine.recovery.checkpoint import DiskFormat


class TrainState:
    """One rank's training state as recovery sees it: the base class of every backend's (no-op defaults for the
    optional members). Every method is local (no communication) unless noted; ``load_extra_state`` and ``perturb``
    may be collective over the data-parallel group (ZeRO-3 re-gathers the parameters it keeps whole), so recovery
    calls them on every rank together, as every restore is agreed."""

    #: whether torch.distributed.checkpoint can load this state into a job of another world size
    reshardable: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_overrides(cls, TrainState, ())

    def live_tensors(self) -> list[torch.Tensor]:
        """This rank's state tensors (parameters or local shards, buffers, optimizer state) in a fixed order;
        writing into them in place changes the training state."""
        raise NotImplementedError

    def extra_state(self) -> dict[str, Any]:
        """Picklable python-side state: scheduler, loss scaler, hyper-parameters, framework counters."""
        raise NotImplementedError

    def load_extra_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def dcp_state_dict(self) -> dict[str, Any]:
        """The live state for ``dcp.save`` / in-place ``dcp.load`` (keys agreed across ranks; replicated tensors
        under the same key, rank-local ones under rank-unique keys)."""
        raise NotImplementedError

    def after_dcp_load(self, state_dict: dict[str, Any]) -> None:
        """Apply what ``dcp.load`` wrote into ``state_dict`` (the dict :meth:`dcp_state_dict` returned)."""
        raise NotImplementedError

    def perturb(self, scale: float, seed: int) -> None:
        """Add ``scale`` x RMS x N(0, 1) noise to every trainable parameter (ARC's escape). Replicated parameters
        get the same noise on every rank (same ``seed``), so replicas stay identical."""
        raise NotImplementedError

    def masters_changed(self) -> None:
        """The tensors the optimizer steps were edited in place (an importance-weighted rollback): bring the
        model's copies in line (ZeRO's bit16 parameters, gathered again). Collective where those are gathered:
        recovery calls it on every rank together. Default: nothing to bring in line."""

    # ------------------------------------------------------------------ optional (defaults)

    def forward_written(self) -> Iterable[int] | None:
        """The indices in :meth:`live_tensors` a forward pass may write (module buffers). On CUDA a snapshot copies
        the others on a side stream overlapping the next forward. Default None: any (every copy is queued before
        the forward: no overlap, still no host sync)."""
        return None

    def replicated(self) -> tuple[Any, list[int]] | None:
        """(group, indices in :meth:`live_tensors`) of tensors every rank of ``group`` holds identical, so that a
        snapshot keeps one copy per group. Default None: none."""
        return None

    def native_disk_format(self) -> DiskFormat | None:
        """The backend's own checkpoint format for the disk tier (``recovery.checkpoint.format: auto``). Default
        None: arc_engine's DCP layout."""
        return None


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor``: the local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every parameter group's settings except its parameters (the learning rate a scheduler writes, ...)."""
    return [copy.deepcopy({k: v for k, v in group.items() if k != "params"}) for group in optimizer.param_groups]


def load_group_hyperparameters(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise RuntimeError(f"arc_engine: saved state has {len(saved)} parameter groups, the optimizer "
                           f"{len(optimizer.param_groups)}")
    for group, values in zip(optimizer.param_groups, saved, strict=True):
        group.update(copy.deepcopy(values))


@torch.no_grad()
def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of every parameter that has none yet (optimizers create it lazily at their first step),
    so that a checkpoint can be loaded into it in place: one step with zero gradients and a learning rate of 0,
    which leaves the parameters unchanged. Local. Call before any arc_engine step hook is registered."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p not in optimizer.state]
    if not params:
        return
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    saved_grads = [p.grad for p in params]
    for param in params:
        param.grad = torch.zeros_like(param)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
            group["lr"] = lr
        for param, grad in zip(params, saved_grads, strict=True):
            param.grad = grad


@torch.no_grad()
@torch.no_grad()
def add_relative_noise(tensors: list[torch.Tensor], scale: float, seed: int) -> None:
    """``t += scale * rms(t) * N(0, 1)`` for each tensor: the noise drawn on the tensor's own device from a generator
    seeded with ``seed`` (one per device, tensors in order), the RMS kept on the device -- no host sync, no
    host-to-device copy. Replicas calling it with the same seed on the same kind of device (a job's GPUs are one
    model) get the same numbers."""
    generators: dict[torch.device, torch.Generator] = {}
    for tensor in tensors:
        generator = generators.get(tensor.device)
        if generator is None:
            generator = generators[tensor.device] = torch.Generator(device=tensor.device).manual_seed(seed)
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32, device=tensor.device)
        rms = tensor.detach().float().pow(2).mean().sqrt()
        tensor.add_((noise * (scale * rms)).to(tensor.dtype))


class TorchTrainState(TrainState):
    """Plain module, DDP or FSDP2 model plus any ``torch.optim`` optimizer (and an optional LR scheduler).

    The disk view goes through ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
    ``set_state_dict``: fully-qualified parameter names, DTensor shards for FSDP2, so DCP reshards to another
    world size (DDP state is replicated, FSDP2 state is DTensors).
    """

    reshardable = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any | None = None, *, rank: int = 0, grad_scaler: Any | None = None,
                 replicated: bool = False, replica_group: Any = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.rank = rank
        self.grad_scaler = grad_scaler  # a torch.amp GradScaler: its scale and growth tracker roll back too
        self._scaler_restored: dict[str, Any] | None = None  # loaded again once the step's update() has run
        #: DDP: parameters and optimizer state are identical on every rank of ``replica_group`` (None: the default)
        self._replicated, self._replica_group = replicated, replica_group
        self._state_dicts = StateDictCache(get_state_dict)

    def live_tensors(self) -> list[torch.Tensor]:
        tensors = [local_tensor(p) for p in self.model.parameters()]
        tensors += [local_tensor(b) for b in self.model.buffers()]
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = self.optimizer.state.get(param, {})
                tensors += [local_tensor(state[k]) for k in sorted(state) if isinstance(state[k], torch.Tensor)]
        return [t.detach() for t in tensors]

    def replicated(self) -> tuple[Any, list[int]] | None:
        """Under DDP: (the data-parallel group, the indices in :meth:`live_tensors` of the parameters and the
        optimizer state), identical on its ranks, so a snapshot keeps one copy per group. None otherwise."""
        if not self._replicated:
            return None
        params = sum(1 for _ in self.model.parameters())
        buffers = sum(1 for _ in self.model.buffers())
        total = len(self.live_tensors())
        return self._replica_group, [*range(params), *range(params + buffers, total)]

    def forward_written(self) -> range:
        """Indices in :meth:`live_tensors` of what a forward pass may write: the module buffers."""
        params = sum(1 for _ in self.model.parameters())
        return range(params, params + sum(1 for _ in self.model.buffers()))

    def extra_state(self) -> dict[str, Any]:
        scheduler = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        extra = {"param_groups": group_hyperparameters(self.optimizer), "lr_scheduler": scheduler}
        if self.grad_scaler is not None:  # (a host read of the scale, at snapshot time only)
            extra["grad_scaler"] = self.grad_scaler.state_dict()
        return extra

    def load_extra_state(self, state: dict[str, Any]) -> None:
        load_group_hyperparameters(self.optimizer, state["param_groups"])
        if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.grad_scaler is not None and state.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state["grad_scaler"])
            self._scaler_restored = state["grad_scaler"]

    def settle_scaler(self) -> None:
        """Where the loop's ``scaler.update()`` has returned (``Arc.end_step``, else the next forward): a restore
        inside ``scaler.step()`` was followed by that update, which moved the restored scale and growth tracker on;
        load the restored state again. Local; nothing to do without a restore."""
        if self._scaler_restored is not None and self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(self._scaler_restored)
        self._scaler_restored = None

    def dcp_state_dict(self) -> dict[str, Any]:
        """``get_state_dict``'s, built at the first save and reused while it still holds the live tensors
        (:mod:`arc_engine.recovery.state_dict_cache`)."""
        model_sd, optim_sd = self._state_dicts.get(self.model, self.optimizer, self.live_tensors())
        return {"model": model_sd, "optim": optim_sd}

    def after_dcp_load(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])

    def masters_changed(self) -> None:
        """Nothing to do: the optimizer steps the parameters (or their FSDP2 shards) themselves."""

    def perturb(self, scale: float, seed: int) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        sharded = any(isinstance(p, DTensor) for p in params)
        # FSDP2 shards differ per rank: their noise may too. DDP replicas must draw identical noise.
        add_relative_noise([local_tensor(p) for p in params], scale, seed + (self.rank * 7919 if sharded else 0))

"""PyTorch DDP (and a plain module): :class:`TorchAdapter`, through DDP's own extension points: the communication
hook of :mod:`arc_engine.integrations.pytorch.ddp_hook` (each bucket's local statistics before DDP's reduction, the
reduced ones after), the optimizer's step hooks, and a tensor hook per parameter for a quarantine. Under DDP each
replicated parameter's reduced statistics come from its owner in DDP's process group (``Reduce.SUM``); a plain
module's from ``param.grad`` on every rank (``Reduce.REPLICATED``)."""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from arc_engine import internals, runtime
from arc_engine.config import ArcConfig
from arc_engine.engine import ArcEngine
from arc_engine.integrations.pytorch import internals as pytorch_internals
from arc_engine.integrations.pytorch.amp import ScalerFinder, ScalerWatch
from arc_engine.integrations.pytorch.ddp_hook import DDPGradientTarget, StatsHookState, register_stats_hook
from arc_engine.integrations.pytorch.optim import ScalerSkips, ScalerSkipsHooks, register_optimizer_hooks
from arc_engine.monitors.family import LocalGrads, section_of
from arc_engine.monitors.sdc import SDCFamily
from arc_engine.recovery.recompute import RecomputeFn, SDCRecompute
from arc_engine.recovery.state import TorchTrainState
from arc_engine.stats import Reduce
from arc_engine.stats.grad_stats import ParamGroupIndex
from arc_engine.stats.partition import owned_ids


class TorchAdapter(ScalerSkipsHooks):
    """:class:`arc_engine.adapter.Adapter` for a ``DistributedDataParallel`` model or a plain module, with any
    ``torch.optim`` optimizer. Under DDP, statistics come from the comm hook and each replicated parameter's
    reduced statistics from its owner in DDP's process group (``Reduce.SUM``); a plain module's come from
    ``param.grad`` on every rank (``Reduce.REPLICATED``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any | None = None,
                 ddp_comm_hook: tuple[Callable[..., Any], object] | None = None, grad_scaler: Any | None = None
                 ) -> None:
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.ddp_comm_hook = ddp_comm_hook
        self.scaler = ScalerWatch(grad_scaler, optimizer) if grad_scaler is not None else None
        self.scaler_skips: ScalerSkips | None = None
        self.hook_state: StatsHookState | None = None
        self.state: TorchTrainState | None = None  # what a rollback restores (recovery.enabled)
        self.is_ddp = isinstance(model, DistributedDataParallel)
        self.name = "DDP" if self.is_ddp else "a plain (non-DDP) module"
        self.module = model.module if self.is_ddp else model
        self.groups = ParamGroupIndex(optimizer.param_groups)
        self.group_names = self.groups.names
        self.owned = ddp_owned_params(model) if self.is_ddp else None
        self.shard_reduce = Reduce.REPLICATED if self.owned is None else Reduce.SUM
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        # the comm hook can write the whole local gradient as the sketch (detectors.consistency.exact_max_params)
        self.exact_sketch_size = sum(p.numel() for p in self.params) if self.is_ddp else 0
        self.data_parallel_group = model.process_group if self.is_ddp else None
        # a parameter's tensor hook runs before DDP's reducer reads its gradient, averaged over DDP's own group
        self.local_grad_reduction = LocalGrads(tuple(self.params), self.data_parallel_group)
        self.recompute_group = self.data_parallel_group
        self.supports_recompute = self.is_ddp

    def check_config(self, config: ArcConfig) -> None:
        check_ddp_comm_hook(self.model, self.ddp_comm_hook, config)
        check_scaler_config(self.scaler, config)

    def decision_group(self, requested: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        return requested

    def train_state(self) -> TorchTrainState:
        self.state = TorchTrainState(self.model, self.optimizer, self.lr_scheduler, rank=runtime.global_rank(),
                                     grad_scaler=self.scaler.scaler if self.scaler is not None else None,
                                     replicated=self.is_ddp, replica_group=self.data_parallel_group)
        return self.state

    def holds_whole_model(self) -> bool:
        return not any(isinstance(p, DTensor) or internals.is_zero3_param(p) for p in self.params)

    def fault_step(self, engine: ArcEngine) -> Callable[[], int]:
        return lambda: engine.progress.iteration

    def install(self, engine: ArcEngine, recompute_fn: RecomputeFn | None) -> list[Callable[[], None]]:
        removers = []
        if self.scaler is None:  # a GradScaler the loop forgot to pass is found at the first step (before deciding)
            removers.append(ScalerFinder(engine, self.optimizer, lambda watch: self.adopt_scaler(engine, watch)
                                         ).remove)
        if self.is_ddp:
            inner_hook, inner_state = self.ddp_comm_hook if self.ddp_comm_hook is not None else (None, None)
            hook_state = self.hook_state = register_stats_hook(engine, self.model, self.groups, inner_hook,
                                                               inner_state, owned=self.owned, scaler=self.scaler)
            if recompute_fn is not None:
                target = DDPGradientTarget(self.model, hook_state, self.optimizer)
                recompute = section_of(engine.config, SDCFamily()).recompute
                engine.use_recompute(SDCRecompute(engine, recompute, hook_state.gate, target, recompute_fn),
                                     target.record_stats)
        hooks = register_optimizer_hooks(engine, self.optimizer, self.groups, grads_from_hook=self.is_ddp,
                                         owned=self.owned, scaler=self.scaler)
        if self.scaler is not None:
            self.scaler_skips = ScalerSkips(engine, self.scaler)
        return [*removers, hooks.remove]

    def adopt_scaler(self, engine: ArcEngine, scaler: ScalerWatch) -> None:
        """A GradScaler that was not passed, found stepping the optimizer (:class:`ScalerFinder`): from this step on
        as if passed -- the comm hook's statistics unscaled (this step's too), its skipped steps closed, its state
        rolled back with the training state. ValueError (before anything changes) for what it rules out."""
        check_scaler_config(scaler, engine.config)
        self.scaler = scaler
        if self.hook_state is not None:
            self.hook_state.adopt_scaler(scaler)
        self.scaler_skips = ScalerSkips(engine, scaler)
        if self.state is not None:
            self.state.grad_scaler = scaler.scaler


def check_ddp_comm_hook(model: torch.nn.Module, ddp_comm_hook: tuple[Callable[..., Any], object] | None,
                        config: ArcConfig) -> None:
    """Refuse, before anything is registered (the same verdict on every rank), a ``ddp_comm_hook`` that cannot be
    honoured, and a DDP model that already has a comm hook (DDP would refuse arc_engine's own with a less helpful
    message)."""
    is_ddp = isinstance(model, DistributedDataParallel)
    if ddp_comm_hook is not None:
        if not (isinstance(ddp_comm_hook, tuple) and len(ddp_comm_hook) == 2 and callable(ddp_comm_hook[0])):
            raise ValueError("arc_engine.attach: ddp_comm_hook must be a (hook, state) pair, as DDP's "
                             "register_comm_hook(state, hook) takes them")
        sdc = section_of(config, SDCFamily())
        if sdc.enabled and sdc.recompute.enabled:
            raise ValueError("arc_engine.attach: detectors.sdc.recompute cannot be combined with ddp_comm_hook "
                             "(a withheld bucket would reach your hook's state); turn one of them off")
    if is_ddp and pytorch_internals.ddp_has_comm_hook(model):
        raise ValueError("arc_engine.attach: this DDP model already has a comm hook and DDP accepts only one; "
                         "register it through arc_engine instead: attach(..., ddp_comm_hook=(hook, state))")


def check_scaler_config(scaler: ScalerWatch | None, config: ArcConfig) -> None:
    """Refuse what a GradScaler rules out: the SDC recomputation, since the scaler checks and unscales the
    gradients before arc_engine's decision, so a recomputed gradient would bypass its overflow check."""
    sdc = section_of(config, SDCFamily())
    if scaler is not None and sdc.enabled and sdc.recompute.enabled:
        raise ValueError("detectors.sdc.recompute is not supported with a loss scaler (grad_scaler=): the scaler "
                         "unscales and checks the gradients before arc_engine decides, so a recomputed gradient "
                         "would bypass its overflow check; turn the recomputation off (SDC detection and skipping "
                         "still work)")


def ddp_owned_params(model: DistributedDataParallel) -> set[int] | None:
    """The parameters (``id()``) whose replicated statistics -- reduced-gradient, weight and update norms -- this
    rank computes (:mod:`arc_engine.stats.partition`): each parameter has one owner among the ranks of DDP's
    process group (which all hold the same replica after the all-reduce), so the SUM over the decision group counts
    it once -- also when the decision group spans several DDP groups, each holding other model-parallel shards.
    None without torch.distributed."""
    if not dist.is_initialized():
        return None
    group = model.process_group
    trainable = [p for p in model.module.parameters() if p.requires_grad]
    return owned_ids(trainable, dist.get_rank(group), dist.get_world_size(group))

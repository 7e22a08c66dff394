"""The framework seam: :class:`Adapter`, one framework's side of the contract, with no-op defaults.

Every framework is a subclass in ``integrations/`` (``pytorch.ddp.TorchAdapter``, ``pytorch.fsdp.FSDPAdapter``,
``deepspeed.ZeroAdapter``, ``megatron.MegatronAdapter``). :func:`arc_engine.wiring.wire` and
:class:`arc_engine.wiring.Arc` call its methods directly: an adapter overrides what its framework needs, the base
does nothing for the rest. A method a subclass defines with a hook's prefix that is not one of the hooks (a
misspelt override, which would silently never run) is a TypeError when the class is defined.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from arc_engine.seams import check_overrides
from arc_engine.stats import Reduce

if TYPE_CHECKING:
    from arc_engine.config import ArcConfig
    from arc_engine.engine import ArcEngine
    from arc_engine.monitors.family import LocalGrads, ModelParts
    from arc_engine.recovery.recompute import RecomputeFn
    from arc_engine.recovery.state import TrainState


class Adapter:
    """One framework's side of the contract. Built before :func:`~arc_engine.wiring.wire`; every method runs on
    every rank. A subclass sets the attributes below in its ``__init__`` and implements :meth:`check_config`,
    :meth:`decision_group`, :meth:`train_state`, :meth:`fault_step` and :meth:`install`; the other methods are
    optional hooks with no-op defaults."""

    #: for messages, e.g. "DDP", "FSDP2", "DeepSpeed ZeRO-2"
    name: str = ""
    #: the unwrapped model: fault hooks, the step-start hook, recompute_fn
    module: torch.nn.Module
    #: the optimizer's parameter groups (G slots per gradient statistic)
    group_names: list[str]
    #: SUM: each rank holds its shard / owned part; REPLICATED: the whole value
    shard_reduce: Reduce = Reduce.REPLICATED
    #: this rank's trainable parameters as held (family producers read them)
    params: list[torch.Tensor]
    #: what the decision group must be for the SDC recomputation (None: any)
    recompute_group: dist.ProcessGroup | None = None
    supports_recompute: bool = False
    #: the model's structure for the mechanism families (attention spectra, routers); only adapters that know it
    #: (megatron-core) set it
    parts: ModelParts | None = None
    #: the exact gradient sketch's size where the framework's reduction hooks serve it (0: none)
    exact_sketch_size: int = 0
    #: where a tensor hook sees each rank's local gradient before the framework's reduction, and over which group
    #: that reduction averages (None: nowhere)
    local_grad_reduction: LocalGrads | None = None

    #: the optional hooks' prefixes: a subclass method with one of them must be a hook of this class
    HOOK_PREFIXES = ("before_", "after_", "close_", "framework_", "effective_", "on_")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_overrides(cls, Adapter, Adapter.HOOK_PREFIXES)

    # ------------------------------------------------------------------ required

    def check_config(self, config: ArcConfig) -> None:
        """ValueError for a setting this framework cannot honour (before anything is registered)."""
        raise NotImplementedError

    def decision_group(self, requested: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        """The decision group to use (None: the whole job), ValueError for one this framework cannot serve."""
        raise NotImplementedError

    def train_state(self) -> TrainState:
        """What a rollback restores (``recovery.enabled``); ValueError when this framework cannot roll back."""
        raise NotImplementedError

    def fault_step(self, engine: ArcEngine) -> Callable[[], int]:
        """The step attempt that fault injection is timed by (after recovery resumed, if it did)."""
        raise NotImplementedError

    def install(self, engine: ArcEngine, recompute_fn: RecomputeFn | None) -> list[Callable[[], None]]:
        """Register the statistics producers and the optimizer-step hooks (decide, drop or apply the step, heal);
        with ``recompute_fn``, wire the SDC recomputation. After the fault hooks, so producers see their output.
        Returns the removers."""
        raise NotImplementedError

    # ------------------------------------------------------------------ optional hooks (no-op defaults)

    def effective_config(self, config: ArcConfig) -> ArcConfig:
        """The config with what the installed framework release cannot serve turned off (a copy; e.g. a detector
        whose internals are missing), reported by the adapter at install. Default: ``config`` itself."""
        return config

    def compute_modules(self, limit: int) -> list[torch.nn.Module] | None:
        """The modules whose forward makes no collective, for the straggler family's compute probe (at most
        ``limit``). Default None: the leaf modules with parameters of :attr:`module`."""
        return None

    def holds_whole_model(self) -> bool:
        """Whether every rank holds every parameter whole (what a curvature measurement needs: no FSDP2 or ZeRO-3
        shards, no model parallelism). Default True."""
        return True

    def diagnosing(self) -> contextlib.AbstractContextManager[None]:
        """Around a curvature measurement (DeepSpeed: the engine's forward without its backward machinery, which a
        Hessian-vector product would otherwise set off). Default: nothing."""
        return contextlib.nullcontext()

    def before_step_start(self) -> None:
        """At every training forward, before the engine opens a step: where the framework skips steps without an
        optimizer hook firing (a GradScaler's overflow), close them."""

    def before_record_loss(self) -> None:
        """Before each recorded loss (DeepSpeed: close the steps it skipped on its own)."""

    def framework_skip_pending(self) -> bool:
        """Whether the framework skipped the step that just returned and arc_engine has not closed it yet (local,
        never a collective). Default False."""
        return False

    def close_framework_skips(self) -> None:
        """Where the loop's step has returned (:meth:`Arc.end_step`): close a step the framework skipped."""

    def before_close(self) -> None:
        """In :meth:`Arc.close`, before the engine closes: e.g. a last step the loss scaler skipped."""

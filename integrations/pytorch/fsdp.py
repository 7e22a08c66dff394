"""PyTorch FSDP2 (``fully_shard``): gradient statistics from tensor hooks on FSDP's parameters, optimizer
statistics on the DTensor local shards (``local_shards=True``), one agreed decision per monitored step.

Each rank holds only its shard, so gradient/weight/update slots are partial sums (``Reduce.SUM``) whose sum
over ranks is the exact global value. On monitored steps:

* ``grad_sq_local`` / ``grad_nonfinite_local``: this rank's *unsharded* gradient, before the reduce-scatter.
  During forward FSDP registers the unsharded parameters on each module (``fully_shard`` docs); a forward
  pre-hook, run after FSDP's, gives each a post-accumulate-grad hook once. A NaN is thus named on the rank
  that produced it, before the reduction spreads it to every shard. Squares add up over the gradients handed
  to successive reduce-scatters (one per micro-batch by default; one per step under
  ``set_requires_gradient_sync(False)``), as DDP's comm hook reports them -- except that without gradient
  sync and with a ``reduce_dtype`` other than the parameters', FSDP moves each micro-batch's gradient to its
  own accumulator and the squares add up per micro-batch. NaN/Inf detection is exact in every mode.
* ``grad_sq`` (reduced, pre-clip): FSDP calls ``register_post_accumulate_grad_hook`` hooks of each sharded
  parameter right after the reduce-scatter writes ``param.grad``, before any user clipping; each hook notes its
  parameter, and at the end of the backward (an autograd final callback, queued by the first hook: after FSDP's
  own, which waits for the last reduce-scatters) the noted shards' norms are taken at once, in one multi-tensor
  kernel instead of one per parameter. The last backward's (the accumulated gradient's) are kept per parameter
  and written to the step's buffer by an optimizer pre-hook.

When a sharded parameter holds a gradient at the optimizer step but its post-accumulate-grad hook did not run
(compiled autograd runs no such Python hooks), its reduced norm is read from ``param.grad`` in the optimizer
pre-hook and its local norm is taken to be that reduced one; a ``hooks_missed`` warning event says so, once.

With ``pre_reduce_stats=False`` the local slots come from the reduced shard: a NaN then names every rank whose
shard holds it, not the rank that produced it. Plain ``register_hook`` never fires on FSDP2's sharded
parameters, so ``nan_grad`` / ``inf_grad`` / ``grad_scale`` fault injection is refused here.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, get_args

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from arc_engine import runtime
from arc_engine.config import ArcConfig
from arc_engine.config.schema import FaultKind
from arc_engine.engine import ArcEngine
from arc_engine.events import Severity
from arc_engine.integrations.pytorch import internals as torch_internals
from arc_engine.integrations.pytorch.amp import ScalerFinder, ScalerWatch
from arc_engine.integrations.pytorch.optim import ScalerSkips, ScalerSkipsHooks
from arc_engine.monitors.sdc_local import add_chunk_sums, chunk_sums
from arc_engine.recovery.recompute import RecomputeFn
from arc_engine.recovery.state import TorchTrainState
from arc_engine.stats import Reduce, names
from arc_engine.stats.grad_stats import DeviceIndex, ParamGroupIndex, add_norm_stats, float32_norms
from arc_engine.wiring import Arc, wire

#: fault kinds injected through tensor hooks on the parameters, which FSDP2's sharded parameters never run
TENSOR_HOOK_FAULTS = ("nan_grad", "inf_grad", "grad_scale")


class FSDPGradStats:
    """The gradient-statistics producer: tensor hooks on the unsharded (local) and the sharded (reduced)
    parameters. One instance serves every FSDP module of the model; every method is local (no communication,
    no host sync) and runs on every rank."""

    def __init__(self, engine: ArcEngine, groups: ParamGroupIndex, params: Sequence[DTensor], *,
                 pre_reduce: bool, scaler: ScalerWatch | None = None) -> None:
        self.engine, self.pre_reduce, self.active = engine, pre_reduce, True
        self.params = list(params)
        self._reduced_seen: set[int] = set()  # this step's parameters whose reduced-gradient hook ran
        #: CUDA streams the gradient hooks ran on this step (FSDP2 calls the reduced-gradient hooks on its
        #: post-reduce stream): the optimizer pre-hook orders its reads after their work
        self._hook_streams: dict[int, Any] = {}
        self._local_seen: set[int] = set()
        self.missed_hooks_reported = False
        self.scaler = scaler  # the (Sharded)GradScaler whose scale the backward's gradients carry
        self.position = {id(p): i for i, p in enumerate(params)}
        device = engine.gathering.pipeline.device
        self.group_index_p = groups.index_tensor(list(params), device)
        # Per parameter, this step: norm of the reduced shard (overwritten: FSDP accumulates into param.grad).
        self.reduced_norm_p = torch.zeros(len(params), dtype=torch.float32, device=device)
        self._index = DeviceIndex(device)  # the positions the flush scatters to, one copy per distinct list
        # the reduced shards' norms, kept as the hooks' 0-dim results (the last one per parameter: FSDP adds each
        # reduction into param.grad) and written into reduced_norm_p once at the flush: a write per hook would be
        # one more kernel launch per parameter on a GPU
        self._reduced_cur: dict[int, torch.Tensor] = {}
        self._reduced_pending: list[int] = []  # noted by the reduced hooks, normed at the end of the backward
        self._reduced_queued = False  # the end-of-backward callback is queued
        self.reduced_norms_at_end = engine.own_work.wrap("fsdp.reduced_norms", self._reduced_norms_at_end)
        # The local norms, kept as the hooks' own 0-dim results and folded once at the flush (a tensor write per
        # hook cost more host time than the norm of a small gradient): of the gradients already handed to a
        # reduce-scatter (added in quadrature) and of the current one, by parameter.
        self._local_done: list[tuple[int, torch.Tensor]] = []
        self._local_cur: dict[int, torch.Tensor] = {}
        self._cur_grad: dict[int, weakref.ref] = {}
        self._hooked: dict[int, tuple[weakref.ref, torch.utils.hooks.RemovableHandle]] = {}
        # the gradient sketch (grad_sketch_local) of the unsharded local gradients, per parameter: the current
        # gradient's part (replaced while autograd accumulates into it) and the parts of those already reduced
        layout = engine.gathering.layout
        self.sketch_size = layout[names.GRAD_SKETCH_LOCAL].size if names.GRAD_SKETCH_LOCAL in layout \
            else 0
        self.offsets = [0]  # the exact sketch: parameter i's elements at [offsets[i], offsets[i + 1])
        for param in params:
            self.offsets.append(self.offsets[-1] + param.numel())
        self.exact = self.sketch_size == self.offsets[-1]
        self._sketch_cur: dict[int, torch.Tensor] = {}
        self._sketch_done: list[tuple[int, torch.Tensor]] = []
        self._sketch_cache: dict = {}
        self._places: dict[int, torch.Tensor] = {}

    def monitored(self) -> bool:
        """Whether this step's statistics are collected (monitored step, engine started, not detached); under a
        GradScaler, also takes the step's loss scale at its first gradient."""
        on = self.active and self.engine.buffer is not None and self.engine.is_monitored()
        if on and self.scaler is not None:
            self.scaler.inverse_scale(self.engine.progress.step)
        return on

    def hook_unsharded(self, index_by_name: dict[str, int], module: torch.nn.Module, args: object) -> None:
        """Forward pre-hook on an FSDP module (FSDP prepends its own, so it runs first): the module's registered
        parameters are now the unsharded ones; give each, once per tensor object, a post-accumulate-grad hook."""
        for name, param in module.named_parameters():
            known = self._hooked.get(id(param))
            if isinstance(param, DTensor) or name not in index_by_name or (known and known[0]() is param):
                continue
            hook = self.engine.own_work.wrap("fsdp.local_grad", functools.partial(self.on_local_grad,
                                                                                   index_by_name[name]))
            self._hooked[id(param)] = (weakref.ref(param), param.register_post_accumulate_grad_hook(hook))

    @torch.no_grad()
    def on_local_grad(self, i: int, param: torch.Tensor) -> None:
        """Autograd accumulated this rank's unsharded gradient of parameter ``i``, before FSDP reduces it."""
        if not self.monitored():
            return
        self._local_seen.add(i)
        self._note_stream(param.grad)
        norm = float32_norms([param.grad])[0]
        current = self._cur_grad.get(i)
        new = current is None or current() is not param.grad
        if new:  # a new gradient: the previous one was reduced
            previous = self._local_cur.get(i)
            if previous is not None:
                self._local_done.append((i, previous))
            self._cur_grad[i] = weakref.ref(param.grad)
        self._local_cur[i] = norm  # else: autograd added into the same tensor (no reduction in between)
        if self.sketch_size and self.engine.wants_sketch():
            if new and i in self._sketch_cur:
                self._sketch_done.append((i, self._sketch_cur.pop(i)))
            # exact: the gradient itself (copied: FSDP frees it after the reduce-scatter); else its chunk sums
            part = param.grad.detach().reshape(-1).double().clone() if self.exact else \
                chunk_sums(param.grad, self.sketch_size)
            if part is not None:
                self._sketch_cur[i] = part

    @torch.no_grad()
    def on_reduced_grad(self, param: DTensor) -> None:
        """Post-accumulate-grad hook on a sharded parameter: FSDP calls it right after writing the reduced shard
        to ``param.grad`` (before any user clipping)."""
        if not self.monitored():
            return
        i = self.position[id(param)]
        self._reduced_seen.add(i)
        self._note_stream(param.grad)
        self._reduced_pending.append(i)
        if not self._reduced_queued:
            self._reduced_queued = True
            torch_internals.queue_backward_callback(self.reduced_norms_at_end)

    @torch.no_grad()
    def _reduced_norms_at_end(self) -> None:
        """End of the backward: the norms of the reduced shards whose hooks ran since the last call, all at once
        (ordered after the hooks' streams, device-side); a later backward's (gradient accumulation) replace them."""
        self._reduced_queued = False
        pending, self._reduced_pending = self._reduced_pending, []
        self._wait_for_hooks(forget=False)  # the flush waits again, for the local hooks' streams as well
        shards = [self.params[i].grad for i in pending]
        present = [(i, grad.to_local() if isinstance(grad, DTensor) else grad)
                   for i, grad in zip(pending, shards, strict=True) if grad is not None]
        if present:
            self._reduced_cur.update(zip([i for i, _ in present], float32_norms([g for _, g in present]),
                                         strict=True))

    def _note_stream(self, grad: torch.Tensor) -> None:
        """Remember the CUDA stream this hook's kernels go to (a no-op on CPU)."""
        if grad.is_cuda:
            stream = torch.cuda.current_stream(grad.device)
            self._hook_streams.setdefault(stream.cuda_stream, stream)

    def _wait_for_hooks(self, forget: bool = True) -> None:
        """Make the current stream wait for the work the hooks queued on other streams (device-side, no host
        sync): the norms are complete before they are read, whether or not the framework waited at the end of its
        backward. ``forget``: the streams noted so far are done with (the flush; not the end of a backward)."""
        for stream in self._hook_streams.values():
            current = torch.cuda.current_stream(stream.device)
            if stream.cuda_stream != current.cuda_stream:
                current.wait_stream(stream)
        if forget:
            self._hook_streams.clear()

    @torch.no_grad()
    def flush(self, *unused: object) -> None:
        """Optimizer pre-hook, registered before the deciding one: write this step's per-parameter norms to the
        buffer, then reset them."""
        if not self.monitored():
            return
        self._wait_for_hooks()
        missed = self._read_missed_gradients()
        if self._reduced_cur:  # the hooks' reduced norms, into their places at once
            self.reduced_norm_p.index_copy_(0, self._index(list(self._reduced_cur)),
                                            torch.stack(list(self._reduced_cur.values())).to(self.reduced_norm_p))
            self._reduced_cur.clear()
        unseen = [i for i in missed if i not in self._local_seen]
        if self.pre_reduce:
            local_norm_p = self._local_norms()
            if unseen:  # no local hook either: the reduced norm stands in for the local one
                index = self._index(unseen)
                local_norm_p.index_copy_(0, index, self.reduced_norm_p.index_select(0, index))
        else:
            local_norm_p = self.reduced_norm_p
        inverse = self.scaler.inverse_scale(self.engine.progress.step) if self.scaler is not None else None
        if inverse is not None:  # gradients of a scaled loss: unscaled here, exactly (the scale is a power of 2)
            inverse = inverse.to(local_norm_p.device)
            self.reduced_norm_p.mul_(inverse)
            local_norm_p = local_norm_p * inverse
        # the kept norms straight into the per-group sums and non-finite counts
        add_norm_stats(self.engine.buffer, local_norm_p, self.group_index_p, names.GRAD_SQ_LOCAL,
                       names.GRAD_NONFINITE_LOCAL)
        add_norm_stats(self.engine.buffer, self.reduced_norm_p, self.group_index_p, names.GRAD_SQ)
        self._flush_sketch(inverse)
        self.reduced_norm_p.zero_()
        self._local_done.clear()
        self._local_cur.clear()
        self._reduced_cur.clear()
        self._reduced_pending.clear()  # a backward that raised left them (its callback never ran)
        self._reduced_queued = False
        self._cur_grad.clear()
        self._reduced_seen.clear()
        self._local_seen.clear()

    def _local_norms(self) -> torch.Tensor:
        """``[params]`` float32: each parameter's local gradient norm this step, its gradients' norms in quadrature
        (one per reduce-scatter: gradient accumulation with a reduction per micro-batch), 0 where none."""
        entries = [*self._local_done, *self._local_cur.items()]
        out = torch.zeros(len(self.params), dtype=torch.float64, device=self.reduced_norm_p.device)
        if entries:
            index = self._index([i for i, _ in entries])
            norms = torch.stack([norm.to(out.device) for _, norm in entries]).double()
            out.index_add_(0, index, norms.square())
        return out.sqrt().float()

    def _read_missed_gradients(self) -> list[int]:
        """The parameters holding a gradient whose reduced-gradient hook did not run this step: their reduced norms
        read from ``param.grad`` now (device-side), a warning event the first time. Host bookkeeping only."""
        if len(self._reduced_seen) == len(self.params):  # every hook ran (the usual step): no walk over parameters
            return []
        missed = [i for i, param in enumerate(self.params) if i not in self._reduced_seen and param.grad is not None]
        for i in missed:
            grad = self.params[i].grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            self._reduced_cur[i] = float32_norms([local])[0]
        if missed and not self.missed_hooks_reported:
            self.missed_hooks_reported = True
            self.engine.emit_action(
                self.engine.progress.step, "hooks_missed", Severity.WARNING,
                f"FSDP2: {len(missed)} of {len(self.params)} sharded parameters hold a gradient whose hooks did not "
                "run (compiled autograd runs no Python tensor hooks): their reduced norms are read from param.grad "
                "at the optimizer step and stand in for their local ones, so a NaN there names every rank whose "
                "shard holds it", {"parameters": len(missed)}, detector="fsdp")
        return missed

    def _flush_sketch(self, inverse: torch.Tensor | None) -> None:
        """Add this step's local-gradient sketch (or, exact, the local gradient at its elements' places), times
        ``inverse`` (1 / the loss scale) when given."""
        parts = [*self._sketch_done, *self._sketch_cur.items()]
        self._sketch_done, self._sketch_cur = [], {}
        if not parts:
            return
        if inverse is not None:
            parts = [(i, part * inverse.to(part.device)) for i, part in parts]
        slot = self.engine.buffer.view(names.GRAD_SKETCH_LOCAL)
        if not self.exact:
            add_chunk_sums(slot, [part for _, part in parts], [i for i, _ in parts], self._sketch_cache)
            return
        for i, values in parts:
            places = self._places.get(i)
            if places is None or places.device != slot.device:
                places = self._places[i] = torch.arange(self.offsets[i], self.offsets[i + 1], device=slot.device)
            slot.index_add_(0, places, values.to(slot.device))

    def adopt_scaler(self, scaler: ScalerWatch) -> None:
        """A ShardedGradScaler found at the step (:class:`~arc_engine.integrations.pytorch.amp.ScalerFinder`): divide
        its scale out from this step's flush on, keeping only the step's last backward's local gradients (the
        earlier ones are iterations the scaler skipped before arc_engine knew it: the step stayed open)."""
        self.scaler = scaler
        self._local_done.clear()
        self._sketch_done.clear()

    def remove_hooks(self) -> None:
        """Stop collecting and remove the hooks on unsharded parameters (local, idempotent)."""
        self.active = False
        for _, handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()


def fsdp_group(params: Sequence[torch.Tensor]) -> dist.ProcessGroup:
    """The process group of the one 1-D FSDP mesh all ``params`` live on (ValueError otherwise). Local."""
    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    plain = sum(not isinstance(p, DTensor) for p in params)
    if len(meshes) != 1 or plain:
        raise ValueError("attach_fsdp: every trainable parameter must be a DTensor sharded by fully_shard on one "
                         f"device mesh; found {len(meshes)} meshes and {plain} plain tensors")
    mesh = meshes.pop()
    if mesh.ndim != 1:
        raise ValueError(f"attach_fsdp: a {mesh.ndim}-D device mesh (HSDP, FSDP+TP) is not supported yet: the "
                         "shard slots would be summed over replicas; allowed: a 1-D FSDP mesh")
    return mesh.get_group()


class FSDPAdapter(ScalerSkipsHooks):
    """:class:`arc_engine.adapter.Adapter` for a model sharded with FSDP2 ``fully_shard`` (one 1-D mesh) and its
    ``torch.optim`` optimizer: every slot is a partial sum over the ranks' shards (``Reduce.SUM``)."""

    name = "FSDP2"
    supports_recompute = False

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, pre_reduce_stats: bool = True,
                 lr_scheduler: Any | None = None, grad_scaler: Any | None = None) -> None:
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.scaler = ScalerWatch(grad_scaler, optimizer) if grad_scaler is not None else None
        self.scaler_skips: ScalerSkips | None = None
        self.producer: FSDPGradStats | None = None
        self.state: TorchTrainState | None = None  # what a rollback restores (recovery.enabled)
        self.module = model
        self.pre_reduce_stats = pre_reduce_stats
        self.sharded = [p for p in model.parameters() if p.requires_grad]  # in or outside the optimizer (group 0)
        self.data_parallel_group = fsdp_group(self.sharded)
        self.recompute_group = None
        self.groups = ParamGroupIndex(optimizer.param_groups)
        self.group_names = self.groups.names
        self.shard_reduce = Reduce.SUM
        self.params = [p.to_local() for p in self.sharded]
        #: the whole local gradient's elements (every rank's unsharded gradient has them all): the exact sketch
        self.exact_sketch_size = sum(p.numel() for p in self.sharded) if pre_reduce_stats else 0

    @staticmethod
    def check_config(config: ArcConfig) -> None:
        grad_faults = [f.kind for f in config.faults.injections if f.kind in TENSOR_HOOK_FAULTS]
        if grad_faults:
            allowed = [kind for kind in get_args(FaultKind) if kind not in TENSOR_HOOK_FAULTS]
            raise ValueError(f"faults.injections: {grad_faults} are not supported under FSDP2 (tensor hooks do not "
                             f"fire on sharded parameters); allowed here: {', '.join(allowed)}")

    def decision_group(self, requested: dist.ProcessGroup | None) -> dist.ProcessGroup:
        mesh_ranks = dist.get_process_group_ranks(self.data_parallel_group)
        if requested is not None and dist.get_process_group_ranks(requested) != mesh_ranks:
            raise ValueError(f"attach_fsdp: group= has ranks {dist.get_process_group_ranks(requested)}; allowed: "
                             f"the FSDP mesh's ranks {mesh_ranks}")
        return requested or self.data_parallel_group

    def train_state(self) -> TorchTrainState:
        self.state = TorchTrainState(self.model, self.optimizer, self.lr_scheduler, rank=runtime.global_rank(),
                                     grad_scaler=self.scaler.scaler if self.scaler is not None else None)
        return self.state

    def holds_whole_model(self) -> bool:
        return False  # FSDP2 shards

    def fault_step(self, engine: ArcEngine) -> Callable[[], int]:
        return lambda: engine.progress.iteration

    def install(self, engine: ArcEngine, recompute_fn: object) -> list[Callable[[], None]]:
        from arc_engine.integrations.pytorch.optim import register_optimizer_hooks

        producer = self.producer = FSDPGradStats(engine, self.groups, self.sharded, pre_reduce=self.pre_reduce_stats,
                                                 scaler=self.scaler)
        timed = engine.own_work.wrap
        on_reduced_grad = timed("fsdp.reduced_grad", producer.on_reduced_grad)
        handles = [p.register_post_accumulate_grad_hook(on_reduced_grad) for p in self.sharded]
        removers = []
        if self.scaler is None:  # a ShardedGradScaler the loop forgot to pass: found at the first step (before flush)
            removers.append(ScalerFinder(engine, self.optimizer, lambda watch: self.adopt_scaler(engine, watch)
                                         ).remove)
        for module in self.model.modules():
            if self.pre_reduce_stats and isinstance(module, FSDPModule):
                index_by_name = {n: producer.position[id(p)] for n, p in module.named_parameters()
                                 if id(p) in producer.position}
                hook = timed("fsdp.unsharded", functools.partial(producer.hook_unsharded, index_by_name))
                handles.append(module.register_forward_pre_hook(hook))
        # before the deciding pre-hook
        handles.append(self.optimizer.register_step_pre_hook(timed("fsdp.flush", producer.flush)))
        hooks = register_optimizer_hooks(engine, self.optimizer, self.groups, grads_from_hook=True,
                                         local_shards=True, scaler=self.scaler)
        if self.scaler is not None:  # a skipped step's norms are flushed where it is closed
            self.scaler_skips = ScalerSkips(engine, self.scaler, (producer.flush,))
        return [producer.remove_hooks, *removers, *(h.remove for h in handles), hooks.remove]

    def adopt_scaler(self, engine: ArcEngine, scaler: ScalerWatch) -> None:
        """A ShardedGradScaler that was not passed, found stepping the optimizer (:class:`ScalerFinder`): from this
        step on as if passed (statistics unscaled, its skipped steps closed, its state rolled back)."""
        assert self.producer is not None, "found at a step, after install"
        self.scaler = scaler
        self.producer.adopt_scaler(scaler)
        self.scaler_skips = ScalerSkips(engine, scaler, (self.producer.flush,))
        if self.state is not None:
            self.state.grad_scaler = scaler.scaler


def attach_fsdp(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                config: ArcConfig | str | Path | None = None, *, group: dist.ProcessGroup | None = None,
                pre_reduce_stats: bool = True, lr_scheduler: Any | None = None,
                recompute_fn: RecomputeFn | None = None, grad_scaler: Any | None = None) -> Arc:
    """Attach arc_engine to a model sharded with FSDP2 ``fully_shard`` and its optimizer. Collective: call on
    every rank of the FSDP group, once, after ``fully_shard`` and the optimizer are built, before the first
    forward. Then use the returned :class:`Arc` as with :func:`arc_engine.attach`.

    ``group``: the group the decision is agreed on; default: the FSDP mesh's group. Another group must have the
    same ranks (e.g. a gloo group beside NCCL). ``pre_reduce_stats``: local statistics from the unsharded
    gradients (default) or from the reduced shards (see the module docstring). Raises ValueError for
    parameters not sharded by ``fully_shard``, N-D meshes, a group with other ranks, gradient faults, and the SDC
    recomputation (not supported under FSDP2). ``grad_scaler``: the ``ShardedGradScaler`` the loop steps the
    optimizer with (fp16): statistics are unscaled and its own skips reported (:mod:`.amp`).
    """
    return wire(FSDPAdapter(model, optimizer, pre_reduce_stats=pre_reduce_stats, lr_scheduler=lr_scheduler,
                            grad_scaler=grad_scaler), config, group=group, recompute_fn=recompute_fn)

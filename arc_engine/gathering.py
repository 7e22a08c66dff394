"""What one monitored step gathers on this rank, and its agreement across the decision group.

The adapters' standard slots and the enabled families' slots make one layout (checked across ranks at start). On
a monitored step the loop's losses, the adapters' per-bucket results (folds), the families' producers and the
monitors' own values go into one device buffer, agreed in one collective; after a correction of the reduced
gradient, the reduced slots are recorded again and agreed once more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from arc_engine.config.schema import ArcConfig
from arc_engine.monitors.assembly import assemble
from arc_engine.monitors.family import LocalGrads, ModelParts, StepView
from arc_engine.own_work import OwnWork
from arc_engine.stats import AgreedStats, Reduce, StatBuffer, StatLayout, StatsPipeline, names
from arc_engine.stats.timing import ComputeProbe, SectionClock

PartitionParts = Callable[[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor]]]
Prepare = Callable[[StatBuffer], None]


class StepGathering:
    """This rank's statistics of the current step (see the module docstring)."""

    def __init__(self, config: ArcConfig, group: dist.ProcessGroup | None, device: torch.device,
                 own_work: OwnWork, *, group_names: list[str], shard_reduce: Reduce, params: Sequence[torch.Tensor],
                 parts: ModelParts | None, exact_sketch_size: int, local_grads: LocalGrads | None,
                 current_step: Callable[[], int]) -> None:
        self.layout = StatLayout()
        for name, size, reduce in names.adapter_statistics(len(group_names), shard_reduce):
            self.layout.add(name, size, reduce)
        self.assembly = assemble(config, self.layout, group_names=group_names, shard_reduce=shard_reduce, parts=parts,
                                 exact_sketch_size=exact_sketch_size, local_grads=local_grads,
                                 wrap=own_work.wrap, current_step=current_step)
        self.pipeline = StatsPipeline(self.layout, group, device)
        self.clock = SectionClock(device)  # this rank's forward and iteration times (families read them)
        self.own_work = own_work
        self.params = list(params)
        self.buffer: StatBuffer | None = None
        self.probe: ComputeProbe | None = None
        self.partition_parts: PartitionParts | None = None  # where the optimizer partitions parameters (ZeRO)
        self.losses = 0  # losses recorded in the current step
        self._folds: list[Callable[[], None]] = []
        self._own_values: list[tuple[str, Prepare]] = []
        self._sketch = (-1, False)  # (step, whether a family wants the sketch on it)
        self._recomputed: list[torch.Tensor] | None = None  # the losses recorded while a recomputation runs

    def start(self, own_values: list[tuple[str, Prepare]]) -> StatBuffer:
        """Collective: freeze and verify the layout. ``own_values``: the monitors' ``before_agreement`` methods."""
        self._own_values = own_values
        self.buffer = self.pipeline.start()
        return self.buffer

    def add_fold(self, fold: Callable[[], None]) -> None:
        self._folds.append(fold)

    def use_probe(self, probe: ComputeProbe) -> None:
        self.probe = probe

    def use_partition_parts(self, parts: PartitionParts) -> None:
        self.partition_parts = parts

    def sketch_due(self, step: int) -> bool:
        """Whether a family wants the local gradient sketch on monitored step ``step`` (cached per step)."""
        if self._sketch[0] != step:
            self._sketch = (step, names.GRAD_SKETCH_LOCAL in self.layout and self.assembly.sketch_due(step))
        return self._sketch[1]

    def record_loss(self, loss: torch.Tensor, monitored: bool) -> bool:
        """A micro-batch's loss (device-side): the step's, or, while a recomputation runs, the recomputation's.
        False for the latter."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"record_loss expects the loss as a torch.Tensor (one number, e.g. the micro-batch's "
                            f"mean loss); got {type(loss).__name__}")
        if self._recomputed is not None:
            self._recomputed.append(loss.detach().float().reshape(()))
            return False
        self.clock.loss()  # on every step: on CUDA a monitored step reads the previous step's marks
        if self.buffer is not None and monitored:
            self.buffer.add(names.LOSS, loss.detach().float())
            self.losses += 1
        return True

    @property
    def recomputing(self) -> bool:
        """True while a recomputation re-runs the step (reduction-side hooks and faults stand aside)."""
        return self._recomputed is not None

    @contextlib.contextmanager
    def recording_recomputation(self) -> Iterator[list[torch.Tensor]]:
        """While a recomputation runs, :meth:`record_loss` appends to the yielded list instead."""
        self._recomputed = []
        try:
            yield self._recomputed
        finally:
            self._recomputed = None

    def agree(self, step: int, events: tuple[int, int], waiting: Callable[[], None]) -> AgreedStats:
        """Collective: the recorded losses' mean, the folds, the producers, the monitors' own values, then the
        agreement (``waiting()`` right before it: a peer's hang report shows this rank as waiting). ``events``: this
        rank's running counts of system events and of its device's own (:class:`StepView`)."""
        assert self.buffer is not None, "ArcEngine.start() was not called"
        if self.losses:
            self.buffer.view(names.LOSS).div_(self.losses)
        self.buffer.put(names.LOSS_COUNT, float(self.losses))
        self.buffer.put(names.LOSS_RANKS, float(self.losses > 0))
        return self._agree(step, events, waiting)

    def regather(self, step: int, events: tuple[int, int], waiting: Callable[[], None], write_local: Prepare,
                 rerecord: Callable[[], None]) -> AgreedStats:
        """Collective, after a correction of the reduced gradient: the reduced slots recorded again (``rerecord``),
        the pre-reduction ones kept except what ``write_local`` replaces, and agreed again."""
        assert self.buffer is not None
        for name in names.REDUCED_GRADIENT_SLOTS:
            if name in self.layout:
                self.buffer.view(name).zero_()
        write_local(self.buffer)
        rerecord()
        return self._agree(step, events, waiting)

    def _agree(self, step: int, events: tuple[int, int], waiting: Callable[[], None]) -> AgreedStats:
        assert self.buffer is not None
        for fold in self._folds:
            fold()
        if self.assembly.producers:
            view = StepView(step, self.params, self.clock.times(), events[0],
                            tuple(self.probe.take()) if self.probe is not None else (), self.partition_parts,
                            device_events=events[1])
            for producer in self.assembly.producers:
                producer.write(self.buffer, view)
        for name, prepare in self._own_values:
            with self.own_work.section(f"{name}.before_agreement"):
                prepare(self.buffer)
        waiting()
        with self.own_work.section("agree"):
            return self.pipeline.agree(self.buffer, reduce_max=self.assembly.max_due(step))

    def reset(self) -> None:
        """The step closed: an empty buffer for the next one."""
        if self.buffer is not None:
            self.buffer.reset()
        self.losses = 0

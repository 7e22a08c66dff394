"""The disk tier under megatron-core in Megatron's own checkpoint format: :class:`MegatronDiskFormat`.

Each committed checkpoint directory is a ``dist_checkpointing`` checkpoint (backend ``torch_dist``: DCP files and
``metadata.json``, plus ``common.pt`` before megatron-core 0.19, which keeps the common state in the DCP files) with
Megatron-LM's top-level layout, so Megatron users load it with their own
tools (``dist_checkpointing.load`` with the model's and optimizer's sharded state dicts, or Megatron-LM's
``--load`` pointed at it with ``--no-load-rng``: the RNG is ``arc_rng``, not Megatron-LM's ``rng_state``; and with
torch's Adam, no Transformer Engine or apex, ``--no-load-optim``: Megatron-LM's optimizer load asserts on a fresh
Adam)::

    model (model0, model1, ... with several chunks)   the sharded model state dict (ShardedTensors)
    optimizer                                         the optimizer's, DistributedOptimizer shards ``dp_reshardable``
    opt_param_scheduler                               the LR scheduler's state (when one was given to attach)
    iteration, checkpoint_version (3.0), args         as Megatron-LM writes them (``args``: Megatron-LM's own
                                                      arguments under the launcher, else the model's shape and
                                                      parallel layout, which Megatron-LM's load checks)
    content_metadata                                  the sharding options used (Megatron-LM reads them at load)
    arc                                               arc_engine's own state (recovery, monitors, counters)
    arc_rng                                           each rank's RNG states (a per-rank ShardedObject)

arc_engine's commit protocol wraps it as it wraps plain DCP: the files are checksummed per rank, the commit marker
``COMMITTED.json`` is written last, and a directory without it is not a checkpoint. After each commit the root also
gets Megatron-LM's names (:meth:`MegatronDiskFormat.publish`): ``iter_0000100`` (a relative symlink to arc_engine's
``step_00000100``) for each committed checkpoint, and ``latest_checkpointed_iteration.txt`` naming the newest, so
Megatron-LM's ``--load <root>`` finds it. The write runs in the
background on arc_engine's checkpoint group; what precedes it (building the sharded state dicts, Megatron's
integrity check on the first save, the common state) runs on the training thread at the save, as in Megatron-LM.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlanner

from arc_engine.integrations.megatron import internals as mi
from arc_engine.recovery.commit import CommitInfo

RNG_PREFIX = "arc_rng/rank"
#: Megatron-LM's names: its loader reads the tracker file and opens ``iter_{iteration:07d}`` beside it
TRACKER_FILE = "latest_checkpointed_iteration.txt"
ITER_PREFIX = "iter_"
#: the sharding options Megatron-LM uses by default (it reads them back at load from ``content_metadata``)
CONTENT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}


class MegatronDiskFormat:
    """:class:`arc_engine.recovery.checkpoint.DiskFormat` for megatron DDP chunks and a Megatron optimizer."""

    name = "megatron"

    def __init__(self, chunks: list[Any], optimizer: Any, lr_scheduler: Any | None = None,
                 checkpoint_args: Callable[[], Any] | None = None) -> None:
        self.chunks, self.optimizer, self.lr_scheduler = chunks, optimizer, lr_scheduler
        self.checkpoint_args = checkpoint_args
        self._validated = False  # Megatron's integrity check (a gather over the job) on the first save only

    @property
    def common_files(self) -> tuple[str, ...]:
        """The files beside the DCP shards that the coordinator writes (and arc_engine checksums): the installed
        release's (``metadata.json``, and ``common.pt`` before 0.19)."""
        layout = mi.dist_checkpoint_layout()
        assert layout is not None, "checked at attach (the megatron_checkpoint feature)"
        return layout.common_files

    def _sharded_state_dict(self, *, loading: bool) -> dict[str, Any]:
        from megatron.core import parallel_state

        metadata = {**CONTENT_METADATA,
                    "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
        state: dict[str, Any] = {"checkpoint_version": 3.0}
        for index, chunk in enumerate(self.chunks):
            key = "model" if len(self.chunks) == 1 else f"model{index}"
            state[key] = mi.unwrap_chunk(chunk).sharded_state_dict(metadata=metadata)
        state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
        return state

    def prepare_save(self, step: int, state_dict: dict[str, Any], step_dir: Path, *, coordinator: bool,
                     stage: Callable[[dict], dict]) -> tuple[dict[str, Any], SavePlanner | None]:
        """Megatron's sharded state dicts of the live model and optimizer, plus arc_engine's entries of
        ``state_dict`` (everything but ``train``, the plain-DCP view of the same tensors). Collective over the job."""
        state = self._sharded_state_dict(loading=False)
        state["iteration"] = step
        state["args"] = self.checkpoint_args() if self.checkpoint_args is not None else mi.layout_args(self.chunks)
        state["content_metadata"] = dict(CONTENT_METADATA)
        if self.lr_scheduler is not None:
            state["opt_param_scheduler"] = self.lr_scheduler.state_dict()
        state["arc"] = {key: value for key, value in state_dict.items()
                        if key != "train" and not key.startswith(RNG_PREFIX)}
        rng = [value for key, value in state_dict.items() if key.startswith(RNG_PREFIX)]
        if rng:
            state["arc_rng"] = mi.sharded_object("arc_rng", rng[0], dist.get_rank(), dist.get_world_size())
        staged, planner = mi.prepare_dist_checkpoint(state, step_dir, coordinator=coordinator,
                                                     validate=not self._validated, stage=stage)
        self._validated = True
        return staged, planner

    def load(self, path: Path, state_dict: dict[str, Any]) -> None:
        """Load the checkpoint into the live model chunks and optimizer (collective over the job), and put its
        arc_engine entries into ``state_dict``."""
        state = self._sharded_state_dict(loading=True)
        rng_keys = [key for key in state_dict if key.startswith(RNG_PREFIX)]
        if rng_keys:
            state["arc_rng"] = mi.sharded_object("arc_rng", None, dist.get_rank(), dist.get_world_size())
        loaded = mi.load_dist_checkpoint(state, path)
        for index, chunk in enumerate(self.chunks):
            mi.unwrap_chunk(chunk).load_state_dict(loaded["model" if len(self.chunks) == 1 else f"model{index}"])
        mi.load_optimizer_state(self.optimizer, loaded["optimizer"])
        for key, value in loaded.get("arc", {}).items():
            state_dict[key] = value
        for key in rng_keys:
            state_dict[key] = loaded["arc_rng"]

    def publish(self, root: Path, committed: list[CommitInfo]) -> None:
        """Megatron-LM's index of ``root`` (coordinator, after a commit and retention): an ``iter_XXXXXXX`` symlink
        to each committed checkpoint, none to a removed one, and the tracker file naming the newest (written to a
        temporary file and renamed: a reader never sees half of it)."""
        wanted = {f"{ITER_PREFIX}{info.step:07d}": info.path.name for info in committed}
        for link in root.glob(f"{ITER_PREFIX}*"):
            if link.is_symlink() and wanted.get(link.name) != str(link.readlink()):
                link.unlink()
        for name, target in wanted.items():
            if not (root / name).is_symlink():
                (root / name).symlink_to(target, target_is_directory=True)
        if committed:
            tmp = root / f".{TRACKER_FILE}.tmp"
            tmp.write_text(str(committed[-1].step))
            tmp.replace(root / TRACKER_FILE)

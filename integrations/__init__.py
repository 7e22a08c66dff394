"""Framework adapters, installed as ``arc_engine.integrations``: thin layers over each framework's own extension
points, one package per framework.

- ``torch``: ``ddp`` (DDP comm hook; a plain module too), ``fsdp`` (FSDP2 post-accumulate-grad hooks on the
  shards), ``optim`` (optimizer step hooks), ``amp`` (what is read of a ``GradScaler``), ``loops`` (what the
  trainer callbacks share for loops arc_engine does not own).
- ``deepspeed``: the ZeRO adapter (``attach_deepspeed``) in its ``__init__``; ``internals`` (every read of ZeRO's
  private state), ``local``, ``zero3``, ``state``, ``recompute``.
- ``megatron``: the megatron-core adapter (``attach_megatron``) in its ``__init__``; ``internals``, ``state``,
  ``checkpoint``, ``recompute``.
- ``hf``, ``lightning``: ``ArcCallback`` for the Hugging Face Trainer and for PyTorch Lightning.

The flat module paths of earlier releases (``arc_engine.integrations.ddp``, ``.deepspeed_internals``, ...) still
import, as the very module at its new home: :data:`MOVED`, resolved on first import of an old path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

#: old flat module -> its module now, both relative to this package
MOVED = {
    "ddp": "torch.ddp",
    "fsdp": "torch.fsdp",
    "torch_optim": "torch.optim",
    "torch_amp": "torch.amp",
    "loops": "torch.loops",
    "deepspeed_internals": "deepspeed.internals",
    "deepspeed_local": "deepspeed.local",
    "deepspeed_recompute": "deepspeed.recompute",
    "deepspeed_state": "deepspeed.state",
    "deepspeed_zero3": "deepspeed.zero3",
    "megatron_internals": "megatron.internals",
    "megatron_checkpoint": "megatron.checkpoint",
    "megatron_recompute": "megatron.recompute",
    "megatron_state": "megatron.state",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths in :data:`MOVED` (and nothing else); importing one imports its new home and binds that
    module, unchanged, under the old name too."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module: ModuleType) -> None:
        # the import system returns what sys.modules holds under the name after this call
        new_home = importlib.import_module(f"{__name__}.{MOVED[module.__name__.rpartition('.')[2]]}")
        sys.modules[module.__name__] = new_home


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    # first: an old path is always its new home, never a stale file of an earlier install at that path
    sys.meta_path.insert(0, _MovedModules())

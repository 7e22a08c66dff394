"""The one place arc_engine reads the process environment (launcher variables), plus rank helpers.

Precedence: an explicit config value wins over the environment; the environment wins over generated
defaults. Variables read: ``TORCHELASTIC_RUN_ID`` (run id), ``LOCAL_RANK`` (device naming).
"""

from __future__ import annotations

import os
import socket
import time

import torch.distributed as dist


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def launcher_run_id() -> str | None:
    """torchrun's rendezvous run id, when it is a real one (torchrun's default is the string ``none``)."""
    value = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return value if value and value != "none" else None


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def hostname() -> str:
    return socket.gethostname()


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def agree_on_run_id(configured: str | None, group: dist.ProcessGroup | None) -> str:
    """The run id every rank of ``group`` uses. Collective when nothing fixes it (rank 0's choice wins)."""
    choice = configured or launcher_run_id()
    if choice is not None:
        return choice
    choice = new_run_id()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        box = [choice]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
        choice = box[0]
    return choice


def device_name() -> str:
    """This rank's accelerator as an operator would look for it: ``cuda:<local rank>`` or ``cpu``."""
    import torch

    return f"cuda:{local_rank()}" if torch.cuda.is_available() else "cpu"


def gather_locations(group: dist.ProcessGroup | None) -> dict[int, str]:
    """``{global rank: "host:device"}`` for every rank of ``group``. Collective (one ``all_gather_object``) when
    distributed; call it once, at attach time."""
    here = (global_rank(), f"{hostname()}:{device_name()}")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return dict([here])
    gathered: list[tuple[int, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, here, group=group)
    return dict(item for item in gathered if item is not None)


def elect_rank(candidate: bool, group: dist.ProcessGroup | None) -> int:
    """The lowest global rank of ``group`` whose ``candidate`` is true, else the group's lowest global rank.
    Collective (one ``all_gather_object``) when distributed; call it at attach time, on every rank of ``group``."""
    here = (global_rank(), bool(candidate))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return here[0]
    gathered: list[tuple[int, bool] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, here, group=group)
    items = [item for item in gathered if item is not None]
    chosen = [rank for rank, wanted in items if wanted]
    return min(chosen) if chosen else min(rank for rank, _ in items)

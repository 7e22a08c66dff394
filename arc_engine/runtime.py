"""The one place arc_engine reads the process environment (launcher variables), plus rank helpers.

Precedence: an explicit config value wins over the environment; the environment wins over generated
defaults. Variables read: ``TORCHELASTIC_RUN_ID`` (run id), ``LOCAL_RANK`` (device naming).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch.distributed as dist


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def launcher_run_id() -> str | None:
    """torchrun's rendezvous run id, when it is a real one (torchrun's default is the string ``none``)."""
    value = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return value if value and value != "none" else None


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def local_world_size() -> int:
    """Ranks on this host (torchrun's ``LOCAL_WORLD_SIZE``; 1 when not set)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def host_memory_bytes() -> int:
    """This host's physical memory (0 when the platform does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return 0


def hostname() -> str:
    """This machine's name, as the device ledger records it. ``ARC_TEST_HOSTNAME`` replaces it: for tests only, which
    play several hosts on one machine (docs/hardware.md)."""
    return os.environ.get("ARC_TEST_HOSTNAME") or socket.gethostname()


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


def gather_by_rank(value: Any, group: dist.ProcessGroup | None) -> dict[int, Any]:
    """``{global rank: value}`` for every rank of ``group`` (each passes its own picklable ``value``). Collective
    (one ``all_gather_object``) when distributed; for attach-time facts, never on the training path."""
    here = (global_rank(), value)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return dict([here])
    gathered: list[tuple[int, Any] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, here, group=group)
    return dict(item for item in gathered if item is not None)


def raise_on_every_rank(error: Exception | None, group: dist.ProcessGroup | None, what: str) -> None:
    """Collective (attach time only): raise ValueError on every rank of ``group`` when any rank passes an
    ``error``, naming each failing rank and its message; so a setting that is wrong on one rank only (a fault's
    parameter that exists on another pipeline stage) stops the whole job at attach instead of leaving the others
    waiting in the first collective."""
    failures = {rank: message for rank, message in gather_by_rank(None if error is None else str(error),
                                                                  group).items() if message is not None}
    if failures:
        detail = "; ".join(f"rank {rank}: {message}" for rank, message in sorted(failures.items()))
        raise ValueError(f"arc_engine: {what} failed on {len(failures)} rank(s): {detail}") from error


def gather_locations(group: dist.ProcessGroup | None) -> dict[int, str]:
    """``{global rank: "host:device"}`` for every rank of ``group`` (collective: :func:`gather_by_rank`)."""
    return gather_by_rank(f"{hostname()}:{device_name()}", group)


def default_store() -> Any | None:
    """The c10d store the default process group was created with (None without one): where the hang watchdog
    publishes each rank's progress. (``torch.distributed`` exposes it only through a private accessor.)"""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # an older / newer torch without it: the watchdog names no peers
        return None


def new_gloo_group(what: str, timeout: Any, **kwargs: Any) -> dist.ProcessGroup:
    """``dist.new_group(backend="gloo", timeout=timeout, **kwargs)`` (collective), its connection set-up bounded by
    ``timeout``; a failure is one clear error naming the group and the usual cause under torchrun restarts."""
    try:
        return dist.new_group(backend="gloo", timeout=timeout, **kwargs)
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RuntimeError(
            f"arc_engine: creating its {what} gloo group failed ({type(err).__name__}: {first[:300]}). After a "
            "torchrun restart this is usually the rendezvous store shared across restarts: set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (launch/torchrun.sh and launch/slurm.sbatch do)") from err

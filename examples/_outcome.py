"""What the example scripts share: writing a rank's outcome for the tests, and ending the process."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def add_example_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every example takes: the run's length and batch, and what the tests need (``--result``,
    ``--no-arc``)."""
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--result", default=None, help="write this rank's outcome to PATH.rank<N>.pt")
    parser.add_argument("--no-arc", action="store_true", help="train without arc_engine")
    return parser


def save_outcome(result: str | None, rank: int, params: Any, callback: Any, **outcome: Any) -> None:
    """With ``--result PATH``: this rank's parameters (flat, fp32), the adapter arc_engine attached (None without
    it) and ``outcome`` to ``PATH.rank<N>.pt``, which the tests compare."""
    if not result:
        return
    flat = torch.cat([p.detach().float().flatten() for p in params])
    path = Path(f"{result}.rank{rank}.pt")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"params": flat, "adapter": callback.arc.adapter.name if callback is not None else None, **outcome},
               path)


def run(main: Callable[[], None]) -> None:
    """Run ``main`` and end the process with its exit code (arc_engine's after a stop, 2 for a usage error) without
    the interpreter's teardown, where torch 2.13's CPU collectives now and then abort a finished process ("terminate
    called without an active exception", seen with and without arc_engine): the process group is destroyed and the
    output flushed first."""
    try:
        main()
        code = 0
    except SystemExit as stop:  # ArcCallback's stop, or argparse's
        code = stop.code if isinstance(stop.code, int) else 1
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""The test harness itself: a rank's native crash is rerun once from clean directories; a second one fails."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks


def _crash_rank1(rank: int, world: int, marker: str, run_dir: Path, crashes: int) -> int:
    """Rank 1 dies of SIGSEGV on the first ``crashes`` attempts (counted in ``marker``); ``run_dir`` is written to,
    and must be empty when an attempt starts."""
    assert not run_dir.exists() or not any(run_dir.iterdir()), "the rerun did not start from a clean directory"
    dist.barrier()
    (run_dir / str(rank)).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    attempts = Path(marker)
    if rank == 1:
        seen = int(attempts.read_text()) if attempts.exists() else 0
        attempts.write_text(str(seen + 1))
        if seen < crashes:
            os.kill(os.getpid(), signal.SIGSEGV)
    value = torch.ones(1)
    dist.all_reduce(value)
    return int(value.item())


def test_a_rank_that_dies_of_a_signal_is_rerun_once_from_clean_directories(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"rerunning _crash_rank1 once: .*died of a signal \{1: 11\}"):
        results = run_ranks(_crash_rank1, 2, str(tmp_path / "attempts"), tmp_path / "run", 1, timeout_s=60.0,
                            collective_timeout_s=10.0)
    assert results == [2, 2]
    assert (tmp_path / "attempts").read_text() == "2"


def test_a_second_crash_fails_the_test_naming_the_rank_and_signal(tmp_path: Path) -> None:
    with pytest.warns(UserWarning), pytest.raises(AssertionError, match=r"died of a signal \{1: 11\}"):
        run_ranks(_crash_rank1, 2, str(tmp_path / "attempts"), tmp_path / "run", 2, timeout_s=60.0,
                  collective_timeout_s=10.0)
    assert (tmp_path / "attempts").read_text() == "2"

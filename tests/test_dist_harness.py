"""The test harness itself: a rank's native crash is rerun once from clean directories; a second one fails."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks, run_script


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


RENDEZVOUS = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")  # env://, as a script under torchrun does
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
print(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
      f"elastic {'TORCHELASTIC_RUN_ID' in os.environ} argv {sys.argv[1:]} sum {total.item():g}")
if sys.argv[1] == "fail":
    if dist.get_rank() == 1:
        sys.exit(3)
    time.sleep(600)  # rank 0 hangs outside a collective: stopped by the harness, as torchrun would stop it
"""


def test_a_script_runs_on_forked_ranks_with_torchruns_environment_and_a_failed_rank_stops_the_others(
        tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(RENDEZVOUS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_script(script, ["ok"], 2, tmp_path, env)
    assert done.returncode == 0 and done.codes == [0, 0], done.output
    for rank in range(2):
        assert f"rank {rank}/2 local {rank} elastic True argv ['ok'] sum 3" in done.output, done.output
    failed = run_script(script, ["fail"], 2, tmp_path, env, grace_s=2.0)
    assert failed.returncode == 1 and failed.codes[1] == 3, failed.output
    assert failed.codes[0] != 0 and "(stopped)" in failed.output.split("[rank 1]")[0], failed.output

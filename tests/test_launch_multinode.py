"""The launch scripts in launch/: two simulated nodes on localhost, end to end.

- launch/torchrun.sh: two torchrun agents (separate processes, one worker each) join one c10d (or static)
  rendezvous on 127.0.0.1 and run the demo trainer; a NaN loss injected on global rank 1 is detected and skipped.
- launch/slurm.sbatch: the same job through the batch script, with `srun` and `scontrol` replaced by small
  local stand-ins (this machine has no Slurm) that run the job step once per "node".
- launch/deepspeed.sh: DeepSpeed's own launcher on this CPU machine, one node with 2 processes, and two nodes from
  a hostfile without ssh (NODE_RANK), where arc_engine's abort exit code (3) reaches the caller.
- every script: bash syntax, usage + exit code 2 without arguments or with an invalid arc_engine config.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import dist_harness

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
DEMO_TRAIN = REPO / "arc_engine" / "demo" / "train.py"
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
SCRIPTS = ["torchrun.sh", "deepspeed.sh", "slurm.sbatch"]
NAN_LOSS_ON_RANK_1 = "--arc.faults.injections=[{kind: nan_loss, rank: 1, step: 45}]"
AGENT_TIMEOUT_S = 150.0
# Launcher variables of an enclosing job would leak into the agents and change what they do.
LEAKY_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "NNODES",
                   "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "RDZV_ID", "RDZV_BACKEND", "RDZV_CONF",
                   "MAX_RESTARTS", "TORCHRUN_ARGS", "HOSTFILE", "NUM_NODES", "NUM_GPUS", "LAUNCHER",
                   "DS_LAUNCHER_ARGS", "ARC_PREFLIGHT", "GPUS_PER_NODE", "ARC_LAUNCH_DIR", "CUDA_VISIBLE_DEVICES",
                   "ARC_RUN_DIR", "ARC_TEST_HOSTNAME", "ARC_HOST_CHECK", "ARC_RELAUNCHES", "MIN_NODES", "ARC_REQUEUE")


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str

    def tail(self) -> str:
        return f"rc={self.returncode}\n--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-5000:]}"


def clean_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in LEAKY_VARIABLES and not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(overrides)
    return env


def free_port(low: int | None = None, high: int | None = None) -> int:
    """A TCP port free on 127.0.0.1 now: any (:func:`tests.dist_harness.free_port`: outside the ephemeral range,
    which the launchers' outgoing connections take from) or the first free one in [low, high)."""
    return dist_harness.free_port() if low is None else dist_harness.first_free(range(low, high or low + 1))


def run_agents(commands: list[list[str]], envs: list[dict[str, str]], cwd: Path, logs: Path,
               timeout_s: float = AGENT_TIMEOUT_S) -> list[Finished]:
    """Start every command at once (each in its own session), wait for all; on timeout kill every process tree
    and fail the test with their output."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, (command, env) in enumerate(zip(commands, envs, strict=True)):
        with open(logs / f"agent{i}.out", "w") as out, open(logs / f"agent{i}.err", "w") as err:
            procs.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
    deadline = time.monotonic() + timeout_s
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()
    results = [Finished(proc.returncode, (logs / f"agent{i}.out").read_text(), (logs / f"agent{i}.err").read_text())
               for i, proc in enumerate(procs)]
    if timed_out:
        pytest.fail(f"launch agents did not finish within {timeout_s:.0f} s; killed all of them\n"
                    + "\n".join(f"=== agent {i} ===\n{r.tail()}" for i, r in enumerate(results)))
    return results


def demo_args(run_dir: Path, *extra: str) -> list[str]:
    # run_id null: arc_engine takes the launcher's rendezvous id (TORCHELASTIC_RUN_ID) as its run id.
    return ["--arc-config", str(DEMO_CONFIG), "--steps", "60", "--log-every", "30", f"--arc.run.run_dir={run_dir}",
            "--arc.run.run_id=null", *extra]


def single_rank0_output(results: list[Finished]) -> tuple[int, Finished]:
    """The one agent whose worker is global rank 0 (only rank 0 writes arc_engine's console and summary)."""
    with_summary = [(i, r) for i, r in enumerate(results) if "arc_engine demo summary" in r.stdout]
    assert len(with_summary) == 1, "\n".join(r.tail() for r in results)
    return with_summary[0]


def assert_nan_on_rank1_detected_and_skipped(rank0_stdout: str, events_file: Path) -> None:
    assert "arc_engine attached: 2 ranks" in rank0_stdout  # one world across both agents
    assert re.search(r"step\s+45 ERROR\s+non_finite -> SKIP \| ranks \[1\] \| non-finite values: rank 1 loss",
                     rank0_stdout), rank0_stdout
    assert re.search(r"step\s+45 WARNING\s+engine -> SKIP \| ranks \[1\]", rank0_stdout), rank0_stdout
    assert "steps 60, skipped 1" in rank0_stdout and "MISSED" not in rank0_stdout
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    detections = [e for e in events if e["kind"] == "detection"]
    assert [(e["detector"], e["step"], e["ranks"], e["action"]) for e in detections] == [
        ("non_finite", 45, [1], "skip")]


@pytest.mark.parametrize("rdzv_backend", ["c10d", "static"])
def test_two_nodes_torchrun_detect_nan_on_rank_1(tmp_path: Path, rdzv_backend: str) -> None:
    port = free_port()
    rdzv_id = f"arc-test-{rdzv_backend}-{port}"
    command = ["bash", str(LAUNCH / "torchrun.sh"), str(DEMO_TRAIN),
               *demo_args(tmp_path / "runs", NAN_LOSS_ON_RANK_1)]
    envs = [clean_env(NNODES="2", NPROC_PER_NODE="1", NODE_RANK=str(node), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), RDZV_ID=rdzv_id, RDZV_BACKEND=rdzv_backend) for node in (0, 1)]
    results = run_agents([command, command], envs, cwd=tmp_path, logs=tmp_path / "logs")

    for node, result in enumerate(results):
        assert result.returncode == 0, f"agent {node}: {result.tail()}"
        launched = f"--nnodes 2 --nproc_per_node 1 --max_restarts 0 --rdzv_backend {rdzv_backend} " \
                   f"--rdzv_endpoint 127.0.0.1:{port} --rdzv_id {rdzv_id}"
        assert launched in result.stderr
        assert NAN_LOSS_ON_RANK_1 in result.stderr  # the override reached torchrun as one argument, unchanged
    rank0_node, rank0 = single_rank0_output(results)
    if rdzv_backend == "static":
        assert rank0_node == 0  # static rendezvous: node NODE_RANK holds global ranks NODE_RANK * nproc ...
    assert "[arc]" not in results[1 - rank0_node].stdout
    assert_nan_on_rank1_detected_and_skipped(rank0.stdout, tmp_path / "runs" / rdzv_id / "events.jsonl")


FAKE_SCONTROL = """#!/usr/bin/env bash
# stand-in for `scontrol show hostnames NODELIST`: the two "nodes" of this test
[ "$1 $2" = "show hostnames" ] || { echo "fake scontrol: unsupported: $*" >&2; exit 1; }
printf '%s\\n' localhost 127.0.0.1
"""

FAKE_SRUN = """#!/usr/bin/env bash
# stand-in for srun: records its arguments, then runs the step's command once per node (--nodes=N) on this
# machine with SLURM_NODEID/SLURM_PROCID set, and exits with the largest exit status, as srun does.
printf '%s\\n' "$@" > "$FAKE_SLURM_DIR/srun.args"
nodes=1
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do
  case "$1" in --nodes=*) nodes="${1#--nodes=}" ;; esac
  shift
done
pids=()
for ((i = 0; i < nodes; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" >"$FAKE_SLURM_DIR/node$i.out" 2>"$FAKE_SLURM_DIR/node$i.err" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" && code=0 || code=$?
  if [ "$code" -gt "$status" ]; then status=$code; fi
done
exit "$status"
"""


def test_slurm_sbatch_runs_two_nodes_through_srun_and_detects_the_nan(tmp_path: Path) -> None:
    bin_dir, slurm_dir = tmp_path / "bin", tmp_path / "slurm"
    bin_dir.mkdir()
    slurm_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    port = free_port(29500, 30500)
    job_id = 7000 + (port - 29500)  # the batch script derives MASTER_PORT = 29500 + SLURM_JOB_ID % 1000
    env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_DIR=str(slurm_dir),
                    SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST="fake[0-1]", SLURM_JOB_NUM_NODES="2",
                    SLURM_SUBMIT_DIR=str(REPO), GPUS_PER_NODE="1")
    command = ["bash", str(LAUNCH / "slurm.sbatch"), str(DEMO_TRAIN),
               *demo_args(tmp_path / "runs", NAN_LOSS_ON_RANK_1)]
    [batch] = run_agents([command], [env], cwd=tmp_path, logs=tmp_path / "logs")

    nodes = [Finished(batch.returncode, (slurm_dir / f"node{i}.out").read_text(),
                      (slurm_dir / f"node{i}.err").read_text()) for i in (0, 1)]
    assert batch.returncode == 0, batch.tail() + "".join(node.tail() for node in nodes)
    srun_args = (slurm_dir / "srun.args").read_text().splitlines()
    assert srun_args[:4] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    for node in nodes:
        # MASTER_ADDR is the first host of the allocation; RDZV_ID the job id; one worker per node
        assert f"--nnodes 2 --nproc_per_node 1 --max_restarts 0 --rdzv_backend c10d --rdzv_endpoint " \
               f"localhost:{port} --rdzv_id {job_id}" in node.stderr, node.tail()
        assert NAN_LOSS_ON_RANK_1 in node.stderr
    _, rank0 = single_rank0_output(nodes)
    assert_nan_on_rank1_detected_and_skipped(rank0.stdout, tmp_path / "runs" / str(job_id) / "events.jsonl")


DS_TRAIN = '''"""A minimal DeepSpeed-style entry point: arc_engine + DeepSpeed arguments, DeepSpeed's process group."""
import argparse
import os

import deepspeed
import torch.distributed as dist

import arc_engine

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--local_rank", type=int, default=-1)  # added by DeepSpeed's launcher
parser.add_argument("--expect-arc-config", required=True)
arc_engine.add_arc_args(parser)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
config = arc_engine.config_from_args(args)
deepspeed.init_distributed(dist_backend="gloo")
assert args.arc_config == args.expect_arc_config, args.arc_config
assert args.deepspeed_config is not None and os.path.isfile(args.deepspeed_config), args.deepspeed_config
assert [(f.kind, f.rank, f.step) for f in config.faults.injections] == [("nan_loss", 1, 45)]
assert dist.get_world_size() == 2, dist.get_world_size()
assert args.local_rank == int(os.environ["LOCAL_RANK"])
dist.barrier()
print(f"ds-worker rank={dist.get_rank()} world={dist.get_world_size()} local_rank={args.local_rank}", flush=True)
dist.destroy_process_group()
'''


def test_deepspeed_launcher_starts_two_ranks_on_one_cpu_node(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")
    (tmp_path / "ds_train.py").write_text(DS_TRAIN)
    (tmp_path / "ds.json").write_text('{"train_batch_size": 2}')
    # no hostfile: this machine only; on CPU DeepSpeed counts NUMA nodes as devices, so ask for 2 explicitly
    env = clean_env(NUM_GPUS="2", MASTER_PORT=str(free_port()))
    command = ["bash", str(LAUNCH / "deepspeed.sh"), "ds_train.py", "--deepspeed_config", "ds.json",
               "--arc-config", str(DEMO_CONFIG), "--expect-arc-config", str(DEMO_CONFIG), NAN_LOSS_ON_RANK_1]
    [result] = run_agents([command], [env], cwd=tmp_path, logs=tmp_path / "logs")

    assert result.returncode == 0, result.tail()
    assert "--num_gpus 2 ds_train.py --deepspeed_config ds.json" in result.stderr
    workers = sorted(re.findall(r"ds-worker rank=(\d) world=2 local_rank=(\d)", result.stdout))
    assert workers == [("0", "0"), ("1", "1")], result.tail()


def test_deepspeed_launcher_two_nodes_from_hostfile_without_ssh_propagates_abort(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two simulated nodes; with NODE_RANK the names are only labels\n"
                        "node-a slots=1\nnode-b slots=1\n")
    port = free_port()
    persistent_nan = "--arc.faults.injections=[{kind: nan_grad, rank: 1, step: 10, steps: 20}]"
    # the demo trainer has no --local_rank option: the launcher must not add it
    command = ["bash", str(LAUNCH / "deepspeed.sh"), "-m", "arc_engine.demo.train",
               *demo_args(tmp_path / "runs", persistent_nan, "--arc.run.run_id=ds-two-nodes")]
    envs = [clean_env(HOSTFILE=str(hostfile), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node),
                      DS_LAUNCHER_ARGS="--no_local_rank") for node in (0, 1)]
    results = run_agents([command, command], envs, cwd=tmp_path, logs=tmp_path / "logs")

    for node, result in enumerate(results):
        assert f"--no_ssh --node_rank {node} --no_local_rank --module arc_engine.demo.train" in result.stderr
        # the launcher returns the worker's own exit code: arc_engine's abort (3), not a generic failure
        assert result.returncode == 3, f"node {node}: {result.tail()}"
    rank0 = results[0].stdout  # the hostfile order fixes the ranks: node-a holds global rank 0
    assert "arc_engine attached: 2 ranks" in rank0
    assert re.search(r"step\s+13 CRITICAL policy -> ABORT", rank0), results[0].tail()
    events = [json.loads(line) for line in (tmp_path / "runs" / "ds-two-nodes" / "events.jsonl").read_text()
              .splitlines()]
    assert {tuple(e["ranks"]) for e in events if e.get("detector") == "non_finite"} == {(1,)}
    assert any(e["action"] == "abort" and e["step"] == 13 for e in events)


def test_hostfile_example_parses_with_deepspeed() -> None:
    pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")
    from deepspeed.launcher.runner import fetch_hostfile

    assert dict(fetch_hostfile(str(LAUNCH / "hostfile.example"))) == {"worker-0": 8, "worker-1": 8}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_launch_script_parses_and_exits_2_with_usage_without_arguments(script: str) -> None:
    path = LAUNCH / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr
    text = path.read_text()
    assert "set -euo pipefail" in text
    usage = subprocess.run(["bash", str(path)], env=clean_env(), capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2, usage.stderr
    assert usage.stderr.startswith("usage:"), usage.stderr


@pytest.mark.parametrize(("script", "env", "message"), [
    ("torchrun.sh", {"NNODES": "2"}, "NNODES=2 needs MASTER_ADDR"),
    ("torchrun.sh", {"NNODES": "2", "MASTER_ADDR": "node0", "RDZV_BACKEND": "static"}, "needs NODE_RANK"),
    ("torchrun.sh", {"RDZV_BACKEND": "etcd"}, "expected c10d or static"),
    ("deepspeed.sh", {"NODE_RANK": "1"}, "needs HOSTFILE and MASTER_ADDR"),
    ("deepspeed.sh", {"HOSTFILE": "/nonexistent/hosts"}, "no such file"),
    ("slurm.sbatch", {}, "not inside a Slurm job"),
])
def test_script_rejects_incomplete_environment(tmp_path: Path, script: str, env: dict[str, str],
                                               message: str) -> None:
    proc = subprocess.run(["bash", str(LAUNCH / script), "train.py", "--arc-config", str(DEMO_CONFIG)], cwd=tmp_path,
                          env=clean_env(**env), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "[launch]" not in proc.stderr  # nothing was launched


@pytest.mark.parametrize("script", ["torchrun.sh", "deepspeed.sh"])
def test_invalid_arc_config_stops_the_launch_with_exit_2(tmp_path: Path, script: str) -> None:
    proc = subprocess.run(["bash", str(LAUNCH / script), "train.py", "--steps", "5", "--arc-config", str(DEMO_CONFIG),
                           "--arc.detectors.loss_spike.factor", "-3"], cwd=tmp_path, env=clean_env(NUM_GPUS="2"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "detectors.loss_spike.factor = -3.0: must be > 0" in proc.stderr
    assert "[launch] not launching: invalid arc_engine config" in proc.stderr
    assert "torch.distributed.run" not in proc.stderr and "deepspeed.launcher" not in proc.stderr

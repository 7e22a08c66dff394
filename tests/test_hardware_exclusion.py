"""Relaunches that leave a bad node out (docs/hardware.md), on simulated hosts of this one machine
(``ARC_TEST_HOSTNAME`` names each "node").

- torchrun: a persistent SDC on nodeB's device stops the job with exit code 5 and the device ledger excludes nodeB;
  the elastic relaunch (``NNODES=1:2``) starts on both nodes, nodeB refuses to join with one line naming the
  evidence, and the job trains to the end on nodeA.
- launch/slurm.sbatch against stub ``srun``/``scontrol``: the failed job step's relaunch runs without the excluded
  host; too few hosts left stops (or requeues the job without them) instead of looping.
- launch/deepspeed.sh: the hostfile it hands DeepSpeed's launcher leaves the excluded host out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arc_engine import device_ledger as ledger
from tests.test_launch_multinode import DEMO_CONFIG, DEMO_TRAIN, LAUNCH, clean_env, demo_args, free_port, run_agents

pytestmark = pytest.mark.timeout(300)

PERSISTENT_SDC_ON_RANK_1 = ("--arc.faults.injections=[{kind: bitflip, rank: 1, step: 30, pattern: blocks.0.mlp.0, "
                            "where: backward, bit: 30, count: 4, persistent: true}]")
SDC = ("--arc.detectors.sdc.enabled=true", "--arc.detectors.sdc.warmup_steps=20",
       "--arc.detectors.sdc.recompute.enabled=true", "--steps=40")


def test_a_faulty_device_is_excluded_and_the_elastic_relaunch_trains_without_its_host(tmp_path: Path) -> None:
    runs, rdzv_id = tmp_path / "runs", "job-sdc"
    command = ["bash", str(LAUNCH / "torchrun.sh"), str(DEMO_TRAIN), *demo_args(runs, *SDC, PERSISTENT_SDC_ON_RANK_1)]
    port = free_port()
    # launch 1: static rendezvous, so that nodeB holds global rank 1, whose device flips bits on every GEMM
    envs = [clean_env(NNODES="2", NPROC_PER_NODE="1", NODE_RANK=str(node), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), RDZV_ID=rdzv_id, RDZV_BACKEND="static", ARC_TEST_HOSTNAME=host)
            for node, host in enumerate(("nodeA", "nodeB"))]
    first = run_agents([command, command], envs, cwd=tmp_path, logs=tmp_path / "logs1")
    assert all(r.returncode != 0 for r in first), "\n".join(r.tail() for r in first)
    assert any("exitcode  : 5" in r.stderr or "exitcode: 5" in r.stderr.replace(" ", "") for r in first)
    records, _ = ledger.read_devices(runs / ledger.DEVICES_FILE)
    assert {(r["host"], r["evidence"]) for r in records} == {("nodeB", "sdc_persistent")}
    assert ledger.excluded_hosts(ledger.assess(records)) == ["nodeB"]
    stop = json.loads((runs / rdzv_id / "stop.json").read_text())
    assert (stop["cause"], stop["exit_code"], stop["devices"]) == ("faulty_device", 5, ["nodeB:cpu"])

    # launch 2: elastic, 1 to 2 nodes of 2 workers; both try, nodeB refuses, the job goes on without it (the fault
    # was nodeB's device: nothing is injected any more)
    port = free_port()
    command = ["bash", str(LAUNCH / "torchrun.sh"), str(DEMO_TRAIN),
               *demo_args(runs, *SDC, "--arc.faults.injections=[]")]
    envs = [clean_env(NNODES="1:2", NPROC_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RDZV_ID=rdzv_id, RDZV_CONF="last_call_timeout=1", ARC_TEST_HOSTNAME=host)
            for host in ("nodeA", "nodeB")]
    second = run_agents([command, command], envs, cwd=tmp_path, logs=tmp_path / "logs2")
    node_a, node_b = second
    assert node_b.returncode == 0 and "torch.distributed.run" not in node_b.stderr, node_b.tail()
    refusals = [line for line in node_b.stderr.splitlines() if "not joining" in line]
    assert len(refusals) == 1 and "nodeB is excluded" in refusals[0] and "SDC reproduced" in refusals[0]
    assert node_a.returncode == 0, node_a.tail()
    assert "arc_engine attached: 2 ranks" in node_a.stdout and "steps 40" in node_a.stdout, node_a.tail()
    assert ledger.excluded_hosts(ledger.assess(ledger.read_devices(runs / ledger.DEVICES_FILE)[0])) == ["nodeB"]
    stop = json.loads((runs / rdzv_id / "stop.json").read_text())
    assert (stop["cause"], stop["exit_code"]) == ("completed", 0)


FAKE_SCONTROL = """#!/usr/bin/env bash
# stand-in for scontrol: the allocation's two hosts; update and requeue are recorded
case "$1" in
  show) printf '%s\\n' nodeA nodeB ;;
  update | requeue) echo "$*" >> "$FAKE_SLURM_DIR/scontrol.calls" ;;
  *) echo "fake scontrol: unsupported: $*" >&2; exit 1 ;;
esac
"""

FAKE_SRUN = """#!/usr/bin/env bash
# stand-in for srun: records each job step's options; the first step "finds" a faulty device on nodeB (the line the
# job's device ledger would get) and fails, as the job would with exit code 5 on a worker; later steps succeed
n=$(ls "$FAKE_SLURM_DIR" | grep -c '^srun' || true)
printf '%s\\n' "$@" > "$FAKE_SLURM_DIR/srun.$n.args"
if [ "$n" = 0 ]; then
  printf '%s\\n' '{"host": "nodeB", "device": "cpu", "evidence": "sdc_persistent", "step": 30, "launch": "l1"}' \\
    >> "$FAKE_RUNS/devices.jsonl"
  exit 1
fi
exit 0
"""


def slurm_job(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[list[str]], str]:
    bin_dir, slurm_dir, runs = tmp_path / "bin", tmp_path / "slurm", tmp_path / "runs"
    for folder in (bin_dir, slurm_dir, runs):
        folder.mkdir(parents=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    environment = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_DIR=str(slurm_dir),
                            FAKE_RUNS=str(runs), SLURM_JOB_ID="7100", SLURM_JOB_NODELIST="node[A-B]",
                            SLURM_JOB_NUM_NODES="2", SLURM_SUBMIT_DIR=str(Path(LAUNCH).parent), GPUS_PER_NODE="1",
                            **env)
    proc = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "train.py", "--arc-config", str(DEMO_CONFIG),
                           f"--arc.run.run_dir={runs}"], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=240)
    steps = [(slurm_dir / f"srun.{i}.args").read_text().splitlines()
             for i in range(len(list(slurm_dir.glob("srun.*.args"))))]
    calls = (slurm_dir / "scontrol.calls").read_text() if (slurm_dir / "scontrol.calls").exists() else ""
    return proc, steps, calls


def test_the_slurm_relaunch_runs_without_the_excluded_host(tmp_path: Path) -> None:
    proc, steps, _ = slurm_job(tmp_path, ARC_RELAUNCHES="2", MIN_NODES="1")
    assert proc.returncode == 0, proc.stderr
    assert len(steps) == 2, proc.stderr  # the failed step, then one relaunch that succeeded
    assert steps[0][:2] == ["--nodes=2", "--ntasks=2"] and not any(a.startswith("--exclude") for a in steps[0])
    assert steps[1][:2] == ["--nodes=1", "--ntasks=1"] and "--exclude=nodeB" in steps[1]
    assert "relaunch 1 of 2" in proc.stderr and "(without nodeB)" in proc.stderr


def test_the_slurm_job_stops_below_the_minimum_or_requeues_without_the_host(tmp_path: Path) -> None:
    # (the run root given: no config check, which the test above covers, and which costs a torch import)
    proc, steps, calls = slurm_job(tmp_path / "stop", ARC_RELAUNCHES="2", ARC_PREFLIGHT="0",
                                   ARC_RUN_DIR=str(tmp_path / "stop" / "runs"))  # MIN_NODES: the allocation's 2
    assert proc.returncode == 2 and len(steps) == 1 and calls == "", proc.stderr
    assert "1 host(s) left without nodeB" in proc.stderr and "fewer than MIN_NODES=2" in proc.stderr
    proc, steps, calls = slurm_job(tmp_path / "requeue", ARC_RELAUNCHES="2", ARC_REQUEUE="1", ARC_PREFLIGHT="0",
                                   ARC_RUN_DIR=str(tmp_path / "requeue" / "runs"))
    assert proc.returncode == 0 and len(steps) == 1, proc.stderr
    assert calls.splitlines() == ["update JobId=7100 ExcNodeList=nodeB", "requeue 7100"]


FAKE_PYTHON = """#!/usr/bin/env bash
# the real interpreter, except for DeepSpeed's launcher: print the hostfile it was given instead of launching
if [ "$1 $2" = "-m deepspeed.launcher.runner" ]; then
  while [ $# -gt 0 ]; do
    if [ "$1" = "--hostfile" ]; then echo "hostfile given:"; cat "$2"; fi
    shift
  done
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def test_the_deepspeed_launcher_gets_the_hostfile_without_the_excluded_host(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    ledger.append_line(runs / ledger.DEVICES_FILE, {"host": "node-b", "device": "cuda:3", "evidence":
                                                    "sdc_persistent", "step": 30, "launch": "l1"})
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=8\nnode-b slots=8\nnode-c slots=8\n")
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    command = ["bash", str(LAUNCH / "deepspeed.sh"), "train.py", "--arc-config", str(DEMO_CONFIG),
               f"--arc.run.run_dir={runs}"]
    env = clean_env(HOSTFILE=str(hostfile), PYTHON=str(python), REAL_PYTHON=sys.executable, ARC_PREFLIGHT="0",
                    ARC_RUN_DIR=str(runs))  # (the run root given: no config check, see the SLURM test)
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("hostfile given:\n", 1)[1] == "node-a slots=8\nnode-c slots=8\n"
    assert (runs / "hostfile.launch").read_text() == "node-a slots=8\nnode-c slots=8\n"  # in the run root
    assert "left out node-b" in proc.stderr and "SDC reproduced" in proc.stderr
    short = subprocess.run(command, cwd=tmp_path, env={**env, "MIN_NODES": "3"}, capture_output=True, text=True,
                           timeout=120)
    assert short.returncode == 2 and "fewer than MIN_NODES=3" in short.stderr, short.stderr

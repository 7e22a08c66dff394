#!/usr/bin/env bash
# Launch a training script that calls arc_engine.add_arc_args() (and usually deepspeed.add_config_arguments())
# with DeepSpeed's launcher. Every argument after SCRIPT (or after -m MODULE) goes to the training script
# unchanged; the launcher also adds --local_rank=N to them unless DS_LAUNCHER_ARGS contains --no_local_rank.
#
#   multi-node, from one node over pdsh/ssh (DeepSpeed's default; needs passwordless ssh to every host):
#     HOSTFILE=hosts MASTER_ADDR=node0 launch/deepspeed.sh train.py --deepspeed_config ds.json --arc-config arc.yaml
#   multi-node without ssh: run on every node, each with its own NODE_RANK (its line in the hostfile, from 0):
#     HOSTFILE=hosts MASTER_ADDR=node0 NODE_RANK=1 launch/deepspeed.sh train.py ...
#   one machine, no hostfile (on a CPU-only machine DeepSpeed counts NUMA nodes, so set NUM_GPUS):
#     NUM_GPUS=2 launch/deepspeed.sh train.py --deepspeed_config ds.json --arc-config arc.yaml
#
# Environment (default):
#   HOSTFILE (unset)        DeepSpeed hostfile, one "HOST slots=N" line per node (see hostfile.example); unset: this
#                           machine only (DeepSpeed would otherwise look for /job/hostfile)
#   NUM_NODES (unset)       use the first NUM_NODES hosts of the hostfile (--num_nodes); unset: all of them
#   NUM_GPUS (unset)        processes per node, on accelerators 0..N-1 (--num_gpus, alias --num_accelerators);
#                           unset: every slot of the hostfile, or every device of this machine
#   MASTER_ADDR (unset)     address of the first host, reachable from all nodes; unset with a hostfile, DeepSpeed
#                           asks the first host over ssh (hostname -I); required with NODE_RANK
#   MASTER_PORT (29500)     port of the process group's store on MASTER_ADDR
#   NODE_RANK (unset)       set: launch only this node's processes, without ssh (--no_ssh --node_rank)
#   LAUNCHER (pdsh)         multi-node backend: pdsh, openmpi, mvapich, mpich, impi, slurm
#   DS_LAUNCHER_ARGS (unset) extra launcher options, split on spaces, e.g. "--no_local_rank" or
#                           "--include worker-0@worker-1:0,2" (not together with NUM_NODES/NUM_GPUS)
#   PYTHON (python)         interpreter with deepspeed installed (runs deepspeed.launcher.runner, and the workers)
#   OMP_NUM_THREADS (1)     threads per worker
#   ARC_PREFLIGHT (1)       0 skips checking the --arc-config file and --arc.* overrides before launching
#   ARC_RUN_DIR (run.run_dir of --arc-config)  the run root holding arc_engine's device ledger (devices.jsonl): the
#                           hosts it excludes are left out of HOSTFILE (with NODE_RANK: such a host does not join);
#                           ARC_HOST_CHECK=0 skips it
#   MIN_NODES (1)           fewer hosts than this left after the exclusions: say so and exit 2 instead of launching
#
# Exit status: 2 for a usage error or an invalid arc_engine config (checked before any worker starts); otherwise
# the launcher's: 0 when all workers exited 0, else the exit code of the first worker that failed (arc_engine's 3
# reaches the caller on a single node and with NODE_RANK; pdsh returns the largest remote exit code).
set -euo pipefail

usage() {
  cat >&2 <<EOF
usage: [HOSTFILE=hosts] $0 SCRIPT [script args...]   (e.g. train.py --deepspeed_config ds.json --arc-config arc.yaml)
       [HOSTFILE=hosts] $0 -m MODULE [script args...]
environment: HOSTFILE, NUM_NODES, NUM_GPUS, MASTER_ADDR, MASTER_PORT, NODE_RANK, LAUNCHER, DS_LAUNCHER_ARGS, PYTHON,
             OMP_NUM_THREADS, ARC_PREFLIGHT (see the header of this file)
EOF
}

if [ $# -lt 1 ] || { [ "$1" = "-m" ] && [ $# -lt 2 ]; }; then usage; exit 2; fi
case "$1" in -h | --help) usage; exit 0 ;; esac

PYTHON="${PYTHON:-python}"
MASTER_PORT="${MASTER_PORT:-29500}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

if [ -n "${HOSTFILE:-}" ] && [ ! -f "$HOSTFILE" ]; then echo "$0: HOSTFILE=$HOSTFILE: no such file" >&2; exit 2; fi
if [ -n "${NODE_RANK:-}" ] && { [ -z "${HOSTFILE:-}" ] || [ -z "${MASTER_ADDR:-}" ]; }; then
  echo "$0: NODE_RANK=$NODE_RANK (launch without ssh) needs HOSTFILE and MASTER_ADDR" >&2
  usage
  exit 2
fi
read -r -a extra <<<"${DS_LAUNCHER_ARGS:-}"

target=("$1")
if [ "$1" = "-m" ]; then target=(--module "$2"); shift; fi
shift

# shellcheck source=launch/_preflight.sh
source "$(dirname "${BASH_SOURCE[0]}")/_preflight.sh"
arc_preflight "$@"
if [ -n "${NODE_RANK:-}" ]; then
  arc_host_check  # launched per node: a host the device ledger excludes does not join (docs/hardware.md)
elif [ -n "${HOSTFILE:-}" ] && [ -f "${ARC_RUN_DIR:-.}/devices.jsonl" ] && [ "${ARC_HOST_CHECK:-1}" != "0" ]; then
  # from one node: the hostfile without the hosts arc_engine's device ledger excludes (docs/hardware.md)
  # kept in the run root beside the ledger it came from (the launcher is exec'd: nothing could remove a temporary)
  filtered="${ARC_RUN_DIR}/hostfile.launch"
  "$PYTHON" -m arc_engine.cli hosts "$ARC_RUN_DIR" --format hostfile --hostfile "$HOSTFILE" >"$filtered"
  left=$(grep -cvE '^[[:space:]]*(#|$)' "$filtered" || true)
  if [ "$left" -lt "${MIN_NODES:-1}" ]; then
    echo "$0: not launching: ${left} host(s) of $HOSTFILE left after the device ledger's exclusions, fewer than" \
         "MIN_NODES=${MIN_NODES:-1} (arc-engine hosts $ARC_RUN_DIR)" >&2
    exit 2
  fi
  HOSTFILE="$filtered"
fi
launcher=(--master_port "$MASTER_PORT" --launcher "${LAUNCHER:-pdsh}")
if [ -n "${HOSTFILE:-}" ]; then launcher+=(--hostfile "$HOSTFILE"); fi
if [ -n "${MASTER_ADDR:-}" ]; then launcher+=(--master_addr "$MASTER_ADDR"); fi
if [ -n "${NUM_NODES:-}" ]; then launcher+=(--num_nodes "$NUM_NODES"); fi
if [ -n "${NUM_GPUS:-}" ]; then launcher+=(--num_gpus "$NUM_GPUS"); fi
if [ -n "${NODE_RANK:-}" ]; then launcher+=(--no_ssh --node_rank "$NODE_RANK"); fi

command=("$PYTHON" -m deepspeed.launcher.runner "${launcher[@]}" ${extra[@]+"${extra[@]}"} "${target[@]}" "$@")
echo "[launch] ${command[*]}" >&2
exec "${command[@]}"

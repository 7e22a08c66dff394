#!/usr/bin/env bash
# Launch a training script that calls arc_engine.add_arc_args() under torchrun (c10d rendezvous), single or
# multi-node. Every argument after SCRIPT (or after -m MODULE) goes to the training script unchanged.
#
#   single node: launch/torchrun.sh train.py --arc-config arc.yaml [script args...]
#   multi-node : run on every node (same RDZV_ID and MASTER_ADDR/MASTER_PORT everywhere):
#                NNODES=2 MASTER_ADDR=node0.example MASTER_PORT=29500 RDZV_ID=job42 \
#                  launch/torchrun.sh train.py --arc-config arc.yaml
#   a module   : launch/torchrun.sh -m arc_engine.demo.train --arc-config configs/demo.yaml
#
# Environment (default):
#   NNODES (1)            number of nodes, or MIN:MAX for an elastic job
#   NPROC_PER_NODE (auto) workers per node: a number, or auto (one per GPU, else one per CPU core), gpu, cpu
#   RDZV_BACKEND (c10d)   c10d: nodes join in any order and get their ranks from the rendezvous (global rank 0
#                         may be on any node); static: fixed NNODES, node NODE_RANK gets global ranks
#                         NODE_RANK*NPROC_PER_NODE.. (node 0 hosts the store on MASTER_ADDR, so run it there)
#   NODE_RANK (unset)     required with static when NNODES != 1; not needed with c10d (not passed to torchrun,
#                         which ignores it there)
#   MASTER_ADDR           rendezvous host (any node; its agent hosts the c10d store); required when NNODES != 1,
#                         else 127.0.0.1
#   MASTER_PORT (29500)   rendezvous port on MASTER_ADDR
#   RDZV_ID (arc)         job id shared by all nodes; workers see it as TORCHELASTIC_RUN_ID, which arc_engine
#                         uses as its run id (run dir <run.run_dir>/<RDZV_ID>) unless run.run_id is set
#   MAX_RESTARTS (0)      elastic restarts of the whole worker group after a worker fails
#   TORCH_DISABLE_SHARE_RDZV_TCP_STORE (1)  set here: each restart gets a fresh store for the workers' process
#                         groups. With torch 2.13's default (the agent's rendezvous store shared across restarts)
#                         a restart often fails in init_process_group or in later gloo groups ("Gloo
#                         connectFullMesh failed ... Connection refused") or hangs; 1 made every try succeed.
#   RDZV_CONF (unset)     extra rendezvous options, e.g. join_timeout=900 (c10d's default join timeout is 600 s)
#   TORCHRUN_ARGS (unset) extra torchrun options, split on spaces, e.g. "--log_dir logs --redirects 3 --tee 3"
#   PYTHON (python)       the interpreter of the training environment (runs torch.distributed.run)
#   OMP_NUM_THREADS (1)   threads per worker
#   ARC_PREFLIGHT (1)     0 skips checking the --arc-config file and --arc.* overrides before launching
#   ARC_RUN_DIR (run.run_dir of --arc-config)  the run root holding the device ledger (devices.jsonl): a host it
#                         excludes does not join; one line names the evidence; exit ARC_EXCLUDED_EXIT (0), so that
#                         an elastic job (NNODES=MIN:MAX) carries on without it. ARC_HOST_CHECK=0 skips the check
#
# Exit status: 2 for a usage error or an invalid arc_engine config (checked here, before any worker starts);
# otherwise torchrun's: 0 when every worker exited 0, 1 when a worker failed after MAX_RESTARTS restarts
# (torchrun does not forward the worker's own code, e.g. arc_engine's 3; its failure report names each rank's
# exitcode).
set -euo pipefail

usage() {
  cat >&2 <<EOF
usage: $0 SCRIPT [script args...]      (e.g. train.py --arc-config arc.yaml)
       $0 -m MODULE [script args...]
environment: NNODES, NPROC_PER_NODE, RDZV_BACKEND, NODE_RANK, MASTER_ADDR, MASTER_PORT, RDZV_ID, MAX_RESTARTS,
             RDZV_CONF, TORCHRUN_ARGS, PYTHON, OMP_NUM_THREADS, ARC_PREFLIGHT (see the header of this file)
EOF
}

if [ $# -lt 1 ] || { [ "$1" = "-m" ] && [ $# -lt 2 ]; }; then usage; exit 2; fi
case "$1" in -h | --help) usage; exit 0 ;; esac

PYTHON="${PYTHON:-python}"
NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-auto}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-arc}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
RDZV_BACKEND="${RDZV_BACKEND:-c10d}"
case "$RDZV_BACKEND" in
  c10d) ;;
  static)
    if [ "$NNODES" != "1" ] && [ -z "${NODE_RANK:-}" ]; then
      echo "$0: RDZV_BACKEND=static with NNODES=$NNODES needs NODE_RANK (0..NNODES-1, 0 on MASTER_ADDR)" >&2
      exit 2
    fi ;;
  *) echo "$0: RDZV_BACKEND=$RDZV_BACKEND: expected c10d or static" >&2; exit 2 ;;
esac
if [ -z "${MASTER_ADDR:-}" ]; then
  if [ "$NNODES" != "1" ]; then
    echo "$0: NNODES=$NNODES needs MASTER_ADDR (the rendezvous host, reachable from every node)" >&2
    usage
    exit 2
  fi
  MASTER_ADDR=127.0.0.1
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"  # restarts that work

target=("$1")
if [ "$1" = "-m" ]; then target=(--module "$2"); shift; fi
shift

# shellcheck source=launch/_preflight.sh
source "$(dirname "${BASH_SOURCE[0]}")/_preflight.sh"
arc_preflight "$@"
arc_host_check  # a host that arc_engine's device ledger excludes does not join (docs/hardware.md)

launcher=(--nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" --max_restarts "$MAX_RESTARTS"
          --rdzv_backend "$RDZV_BACKEND" --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID")
if [ "$RDZV_BACKEND" = "static" ]; then launcher+=(--node_rank "${NODE_RANK:-0}"); fi
if [ -n "${RDZV_CONF:-}" ]; then launcher+=(--rdzv_conf "$RDZV_CONF"); fi
read -r -a extra <<<"${TORCHRUN_ARGS:-}"

command=("$PYTHON" -m torch.distributed.run "${launcher[@]}" ${extra[@]+"${extra[@]}"} "${target[@]}" "$@")
echo "[launch] ${command[*]}" >&2
exec "${command[@]}"

#!/usr/bin/env bash
# Launch any training script that calls arc_engine.add_arc_args() under torchrun, passing --arc-config.
#
#   single node:  launch/torchrun.sh train.py --arc-config configs/default.yaml [script args...]
#   multi-node :  NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<host of node 0> launch/torchrun.sh train.py ...
#
# Environment: NNODES (1), NPROC_PER_NODE (2), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500), RDZV_ID (arc).
set -euo pipefail
if [ $# -lt 1 ]; then echo "usage: $0 SCRIPT [--arc-config FILE] [args...]" >&2; exit 2; fi
SCRIPT="$1"; shift
NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-2}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
PYTHON="${PYTHON:-python}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" \
  --rdzv_backend c10d --rdzv_endpoint "${MASTER_ADDR}:${MASTER_PORT}" --rdzv_id "${RDZV_ID:-arc}" \
  "$SCRIPT" "$@"

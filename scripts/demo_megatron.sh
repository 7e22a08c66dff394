#!/usr/bin/env bash
# arc_engine on megatron-core: the reference GPT script on 4 CPU ranks (torchrun, gloo), first TP=2 x DP=2 (dense,
# bf16, DistributedOptimizer), then EP=2 (MoE, 4 experts), with faults injected (configs/megatron_demo.yaml, configs/megatron_demo_moe.yaml).
# Prints detections and agreed actions as they happen and a summary per run. Extra args go to both runs,
# e.g. `bash scripts/demo_megatron.sh --train-iters 60 --arc.detectors.qk_spectra.every=10`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
COMMON=(--cpu --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --train-iters 60
        --log-interval 10 --use-distributed-optimizer)
run() {
  local name="$1"; shift
  rm -rf "arc_runs/megatron_demo_${name}"
  echo "=== ${name}: $* ==="
  .venv/bin/torchrun --nproc-per-node 4 --master-port "${MASTER_PORT:-29511}" scripts/train_megatron_gpt.py \
    "${COMMON[@]}" "$@" 2> >(grep -v -E "Warning|warn|return func" >&2)
  echo "events: arc_runs/megatron_demo_${name}/events.jsonl"
}
run tp2_dp2 --arc-config configs/megatron_demo.yaml --tensor-model-parallel-size 2 --bf16 "$@"
run ep2_moe --arc-config configs/megatron_demo_moe.yaml --expert-model-parallel-size 2 --num-experts 4 \
  --moe-aux-loss-coeff 0.1 "$@"

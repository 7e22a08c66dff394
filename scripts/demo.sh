#!/usr/bin/env bash
# The main job: set up (if needed), then train the demo GPT on 2 CPU ranks (torchrun, gloo) with faults
# injected, printing detections and agreed actions as they happen, and a summary at the end.
# Extra args go to the trainer, e.g. `bash scripts/demo.sh --steps 400 --arc.detectors.loss_spike.factor=8`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
rm -rf arc_runs/demo  # each demo run starts fresh (its config sets run_id: demo, recovery.checkpoint.resume: false)
exec .venv/bin/arc-engine demo --nproc 2 --arc-config configs/demo.yaml "$@"

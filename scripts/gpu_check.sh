#!/usr/bin/env bash
# The GPU check, in one go, on the lent GPU machine (docs/gpu.md). After scripts/gpu_wheels.sh ran here:
#
#   run(command="bash scripts/gpu_check.sh", carry=["gpu_wheels"], timeout_s=540)
#
# It installs gpu_wheels/ into a scratch folder with pip --target (nothing of that machine's Python changes; no
# registry is needed), records the machine (nvidia-smi, torch, CUDA, the framework releases) and runs the CUDA tests
# (pytest -m cuda: arc_engine's own CUDA paths, the trainer callbacks where only a GPU runs them, DeepSpeed and
# megatron-core on CUDA), then the
# overhead benchmark (scripts/bench_gpu_overhead.py: a ~1B-parameter GPT in bf16, with and without arc_engine in one
# process; BENCH_SIZES="125m 350m 1.3b" for the scale bench's shapes instead). Everything it prints also goes under
# $OUT. Without CUDA (this repository's machine) it runs the same
# steps: the tests skip and the benchmark makes a small CPU dry run. Exit status: the tests'.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
site="$(mktemp -d)/site"  # not under $OUT: what is there comes back
log() { echo "[gpu_check] $*" | tee -a "$OUT/summary.txt"; }

log "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
"$PY" -m pip install -q --disable-pip-version-check --no-index --find-links gpu_wheels --target "$site" --no-deps \
  gpu_wheels/arc_engine-*.whl > "$OUT/install.txt" 2>&1 \
  && "$PY" -m pip install -q --disable-pip-version-check --no-index --find-links gpu_wheels --target "$site" \
  pytest pytest-timeout pyyaml >> "$OUT/install.txt" 2>&1 || { log "install failed (install.txt)"; exit 3; }
# the frameworks of tests/test_cuda_frameworks.py (their tests skip without them), and each dependency of theirs
# that this machine's own Python cannot import (module:wheels)
"$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$site" \
  gpu_wheels/deepspeed-*.whl gpu_wheels/megatron_core-*.whl >> "$OUT/install.txt" 2>&1 \
  || log "framework install failed (install.txt): their CUDA tests will skip"
for pair in hjson:hjson msgpack:msgpack ninja:ninja psutil:psutil cpuinfo:py_cpuinfo einops:einops tqdm:tqdm \
    pynvml:nvidia_ml_py \
    "pydantic:pydantic pydantic_core annotated_types typing_inspection typing_extensions"; do
  module="${pair%%:*}"
  "$PY" -c "import $module" > /dev/null 2>&1 && continue
  for wheel in ${pair#*:}; do
    ls gpu_wheels/"$wheel"-*.whl > /dev/null 2>&1 || continue
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$site" \
      gpu_wheels/"$wheel"-*.whl >> "$OUT/install.txt" 2>&1 || log "could not install $wheel"
  done
done
# the tests, examples and scripts run from a copy that holds no source package: arc_engine (with
# arc_engine.integrations, which the source tree keeps in integrations/) is the installed wheel's, as users have it
stage="$(dirname "$site")/repo"
mkdir -p "$stage" && cp -r tests examples scripts configs launch pyproject.toml "$stage"/
cd "$stage"
export PYTHONPATH="$site"
{ nvidia-smi 2>&1 || echo "no nvidia-smi"
  "$PY" - <<'PYEOF'
import importlib, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"available {torch.cuda.is_available()}, devices {torch.cuda.device_count()}")
if torch.cuda.is_available():
    print(f"device 0: {torch.cuda.get_device_name(0)}")
for name in ("arc_engine", "transformers", "accelerate", "lightning", "deepspeed", "megatron.core"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')} from {module.__file__}")
    except Exception as error:  # what the machine lacks is part of the record
        print(f"{name}: not importable ({type(error).__name__}: {error})")
PYEOF
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
# one file at a time, verbose: a file that runs out of time loses its own report only (the first H200 run's single
# pytest was killed at its limit with 8 results and no failure text). CUDA_TESTS_TIMEOUT_S is shared among them:
# each file may take what is left over the files left, so one that hangs cannot starve the others.
: > "$OUT/cuda_tests.txt"
status=0
budget="${CUDA_TESTS_TIMEOUT_S:-330}"
files=(tests/test_cuda_paths.py tests/test_cuda_frameworks.py tests/test_cuda_trainers.py)
left=${#files[@]}
for file in "${files[@]}"; do
  started=$(date +%s)
  cap=$((budget / left))
  left=$((left - 1))
  [ "$cap" -gt 10 ] || { echo "$file: not run (no time left)" >> "$OUT/cuda_tests.txt"; status=124; continue; }
  timeout "$cap" "$PY" -m pytest -m cuda -v -p no:cacheprovider -o addopts="-ra" --tb=short "$file" \
    >> "$OUT/cuda_tests.txt" 2>&1
  code=$?
  [ "$code" -eq 124 ] && echo "$file: stopped at its ${cap} s" >> "$OUT/cuda_tests.txt"
  [ "$code" -eq 0 ] || [ "$code" -eq 5 ] || status=$code  # 5: nothing collected
  budget=$((budget - $(date +%s) + started))
done
grep -E "PASSED|FAILED|SKIPPED|ERROR" "$OUT/cuda_tests.txt" | tail -n 30
log "cuda tests: exit $status ($(grep -cE " PASSED" "$OUT/cuda_tests.txt") passed, \
$(grep -cE " FAILED| ERROR" "$OUT/cuda_tests.txt") failed)"
# the overhead benchmark: a ~1B-parameter GPT in bf16, default configuration against none (a small dry run on CPU);
# BENCH_SIZES="125m 350m 1.3b" runs the scale bench's shapes instead (shorter blocks), each line of bench_gpu.jsonl one
bench_args=(--blocks 8)
sizes=("")
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  [ -n "${BENCH_SIZES:-}" ] && read -r -a sizes <<< "$BENCH_SIZES" && bench_args=(--blocks 4 --steps-per-block 10)
  [ -n "${BENCH_ARGS:-}" ] && read -r -a extra <<< "$BENCH_ARGS" && bench_args+=("${extra[@]}")  # --profile 5, say
else
  bench_args=(--tiny --blocks 2)
fi
: > "$OUT/bench_gpu.txt"
: > "$OUT/bench_gpu.jsonl"
bench_status=0
for size in "${sizes[@]}"; do
  one="$(mktemp)"
  timeout "${BENCH_TIMEOUT_S:-150}" "$PY" scripts/bench_gpu_overhead.py "${bench_args[@]}" ${size:+--size "$size"} \
    --out "$one" >> "$OUT/bench_gpu.txt" 2>&1 || bench_status=$?
  [ -s "$one" ] && "$PY" -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))))" "$one" \
    >> "$OUT/bench_gpu.jsonl"
  rm -f "$one"
done
tail -n 5 "$OUT/bench_gpu.txt"
log "overhead benchmark: exit $bench_status ($(grep '^\[bench_gpu\]' "$OUT/bench_gpu.txt" | tr '\n' ' '))"
exit $status

#!/usr/bin/env bash
# The wheels the lent GPU machine lacks, downloaded here (this machine reaches the package registry; that one does
# not), for CPython 3.12 on x86-64 Linux, into gpu_wheels/ (ignored by git; the device tool carries it:
# carry=["gpu_wheels"]): arc_engine's own wheel, pytest and pytest-timeout with their pure-Python dependencies,
# PyYAML, and the frameworks of the CUDA framework tests: DeepSpeed (built here as a pure-Python wheel, its ops
# JIT-only, with the Python 3.12 lane's interpreter: PY312, default .venv312/bin/python) and megatron-core with
# their dependencies (gpu_check.sh installs a dependency only where that machine cannot import it). That machine
# has Python 3.12, torch with CUDA, numpy, transformers, accelerate and lightning (docs/gpu.md). Under 50 MB. Then:
# scripts/gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=gpu_wheels
py="${PYTHON:-.venv/bin/python}"
rm -rf "$dest"
mkdir -p "$dest"
quiet() { "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true; }
quiet "$py" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$dest" .
quiet "$py" -m pip download -q --disable-pip-version-check -d "$dest" --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  "pytest>=8" "pytest-timeout>=2.3" "pyyaml>=6.0"
# the frameworks (versions of the Python 3.12 lane) and their dependencies, without resolving torch
quiet "$py" -m pip download -q --disable-pip-version-check -d "$dest" --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  "megatron-core==${MEGATRON_CORE_VERSION:-0.19.2}" einops hjson msgpack ninja psutil py-cpuinfo tqdm nvidia-ml-py
# pydantic with the pydantic-core its release pins (pure dependencies, no torch)
quiet "$py" -m pip download -q --disable-pip-version-check -d "$dest" --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  "pydantic>=2,<3"
py312="${PY312:-.venv312/bin/python}"
if [ -x "$py312" ]; then
  DS_BUILD_OPS=0 quiet "$py312" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
    -w "$dest" "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
else
  echo "[gpu_wheels] no $py312: DeepSpeed's wheel is not built (its CUDA tests will skip)" >&2
fi
ls "$dest"
size_kb=$(du -sk "$dest" | cut -f1)
echo "[gpu_wheels] $(ls "$dest" | wc -l) wheels, ${size_kb} KB in $dest"
[ "$size_kb" -lt 51200 ] || { echo "[gpu_wheels] over 50 MB" >&2; exit 1; }
ls "$dest"/arc_engine-*.whl >/dev/null

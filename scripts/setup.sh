#!/usr/bin/env bash
# Create ./.venv and install arc_engine with its dev tools. Idempotent; safe to re-run.
# torch is installed first and pinned, so pip never resolves it on its own (an unpinned torch would pull
# the multi-GB CUDA build). Override with TORCH_SPEC, e.g. TORCH_SPEC="torch==2.13.0" (the default).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true; }
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing ${TORCH_SPEC} (first, pinned)"
  pip_install "${TORCH_SPEC}"
fi
if ! .venv/bin/python -c "import deepspeed" >/dev/null 2>&1; then
  echo "[setup] installing deepspeed==0.19.8 (after torch, no build isolation, so it builds against this torch)"
  pip_install --no-build-isolation "deepspeed==0.19.8"
fi
if ! .venv/bin/python -c "import megatron.core, psutil" >/dev/null 2>&1; then
  echo "[setup] installing megatron-core==0.16.1 and psutil (its checkpointing needs it)"
  pip_install "megatron-core==0.16.1" "psutil>=5.9"
fi
if ! .venv/bin/python -c "import arc_engine, pytest, pytest_timeout, ruff, wandb, matplotlib" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.arc_engine_installed ]; then
  echo "[setup] installing arc_engine (editable) with the dev extra"
  pip_install -e ".[dev]"
  touch .venv/.arc_engine_installed
fi
.venv/bin/python -c "import torch, arc_engine; print(f'[setup] ready: torch {torch.__version__}, arc_engine {arc_engine.__version__}')"

#!/usr/bin/env bash
# Create a virtual environment and install arc_engine (editable) with its dev tools and the frameworks of one test
# lane. Idempotent; safe to re-run. ARC_LANE picks the lane (docs/compatibility.md):
#
#   py311 (default)  .venv         Python 3.11, torch 2.13.0 (the CPU wheel on this machine's disk),
#                                  deepspeed 0.19.8, megatron-core 0.16.1: the whole suite
#   py312            .venv312      Python 3.12, torch 2.15.0 (the newest on PyPI: the CUDA build, run on the CPU),
#                                  deepspeed 0.19.8, megatron-core 0.19.2 (ships Megatron-LM's megatron.training)
#   floor            .venv-floor   Python 3.10, torch 2.9.1, deepspeed 0.18.0: the oldest releases supported
#
# torch is installed first and pinned, so pip never resolves it on its own (an unpinned torch pulls a multi-GB CUDA
# build). This machine's pip constraint file caps torch at 2.14.1; the py312 lane lifts it for its own installs only
# (PIP_CONSTRAINT=/dev/null). The py311 lane also installs the trainers: transformers, accelerate, lightning.
# Override any pin with TORCH_SPEC, DEEPSPEED_SPEC, MEGATRON_SPEC, TRAINERS_SPEC, PYTHON, VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
LANE="${ARC_LANE:-py311}"
TRAINERS_DEFAULT=""
case "$LANE" in
  py311) defaults=(python3.11 .venv "torch==2.13.0" "deepspeed==0.19.8" "megatron-core==0.16.1")
         TRAINERS_DEFAULT="transformers==5.24.0 accelerate==1.15.0 lightning==2.6.6" ;;
  py312) defaults=(python3.12 .venv312 "torch==2.15.0" "deepspeed==0.19.8" "megatron-core==0.19.2")
         export PIP_CONSTRAINT=/dev/null ;;
  floor) defaults=(python3.10 .venv-floor "torch==2.9.1" "deepspeed==0.18.0" "") ;;
  *) echo "scripts/setup.sh: unknown ARC_LANE=${LANE} (allowed: py311, py312, floor)" >&2; exit 2 ;;
esac
find_python() {  # find_python python3.12: that interpreter, also where pyenv's shims do not expose it
  local want="${1#python}" candidate
  for candidate in "$1" "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/${want}."*/bin/python; do
    if "$candidate" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '${want}')" \
        >/dev/null 2>&1; then
      echo "$candidate"
      return
    fi
  done
  echo "$1"
}
PYTHON="${PYTHON:-$(find_python "${defaults[0]}")}"
VENV="${VENV:-${defaults[1]}}"
TORCH_SPEC="${TORCH_SPEC:-${defaults[2]}}"
DEEPSPEED_SPEC="${DEEPSPEED_SPEC:-${defaults[3]}}"
MEGATRON_SPEC="${MEGATRON_SPEC-${defaults[4]}}"
TRAINERS_SPEC="${TRAINERS_SPEC-${TRAINERS_DEFAULT}}"  # the trainers of examples/: Hugging Face's, Lightning's
if ! "$PYTHON" --version >/dev/null 2>&1 && [ "$LANE" = py311 ]; then
  PYTHON=python3  # a machine whose default Python is the 3.11 this lane wants
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
py="$VENV/bin/python"
# DeepSpeed's JIT-built CPU op goes to this environment's own cache (tests/conftest.py sets the same): another
# environment of the same Python and torch (a second clone) would otherwise rebuild it in turns with this one
TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$(cd "$VENV" && pwd)/torch_extensions}"
export TORCH_EXTENSIONS_DIR
# missing MODULE...: those of MODULE... this environment does not have. Found without importing them: a check that
# imported torch, DeepSpeed, transformers... cost 30-40 s of CPU per run of this script, which every lane runs twice
# in CI and the Megatron demo's test once more. Isolated (-I): the checkout's own folder is not an installed package
missing() { "$py" -I -c "import importlib.util as u, sys
print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))" "$@" 2>/dev/null || echo "$@"; }
# --no-compile: no byte-compilation of the ~10,000 modules each lane installs (torch, transformers, DeepSpeed...),
# 5 minutes of CPU for the three lanes' torch builds alone. Python compiles the few thousand the tests import on
# their first import and caches them: scripts/test.sh and .ci/run unset PYTHONDONTWRITEBYTECODE, which this
# project's machines set; with it, every process that imports torch compiled its 2,000 modules from source again
# (a CI run took 3,905 s instead of 3,317 s)
pip_install() { "$py" -m pip install --quiet --disable-pip-version-check --no-compile "$@" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true; }
if [ -n "$(missing torch)" ]; then
  echo "[setup:${LANE} +${SECONDS}s] installing ${TORCH_SPEC} (first, pinned)"
  pip_install "${TORCH_SPEC}"
fi
if [ -n "$DEEPSPEED_SPEC" ] && [ -n "$(missing deepspeed)" ]; then
  echo "[setup:${LANE} +${SECONDS}s] installing ${DEEPSPEED_SPEC} (after torch, no build isolation: built against it)"
  pip_install --no-build-isolation "${DEEPSPEED_SPEC}"
fi
if [ -n "$DEEPSPEED_SPEC" ] && ! compgen -G "${TORCH_EXTENSIONS_DIR}/deepspeed_shm_comm/*.so" >/dev/null; then
  # DeepSpeed JIT-builds its CPU shared-memory op on first use (about 90 s, cached in TORCH_EXTENSIONS_DIR):
  # build it here, so no test's time limit pays for it
  echo "[setup:${LANE} +${SECONDS}s] building DeepSpeed's CPU communication op"
  timeout 600 "$py" -c "from deepspeed.accelerator import get_accelerator as a
b = a().create_op_builder('ShareMemCommBuilder')
b is None or b.load()" >/dev/null 2>&1 || {
    echo "[setup:${LANE} +${SECONDS}s] (DeepSpeed's CPU op did not build; its tests build it)"
    # a build cut short leaves torch's file lock behind, and every later load would wait on it for ever
    "$py" -c "import os; from torch.utils.cpp_extension import _get_build_directory as d
lock = os.path.join(d('deepspeed_shm_comm', False), 'lock'); os.path.exists(lock) and os.remove(lock)" || true
  }
fi
if [ -n "$MEGATRON_SPEC" ] && [ -n "$(missing megatron.core psutil)" ]; then
  echo "[setup:${LANE} +${SECONDS}s] installing ${MEGATRON_SPEC} and psutil (its checkpointing needs it)"
  pip_install "${MEGATRON_SPEC}" "psutil>=5.9"
fi
if [ -n "$TRAINERS_SPEC" ] && [ -n "$(missing transformers accelerate lightning)" ]; then
  echo "[setup:${LANE} +${SECONDS}s] installing ${TRAINERS_SPEC} (with this torch pinned)"
  pinned="$(mktemp)"
  "$py" -c "from importlib.metadata import version; print(f'torch=={version(\"torch\")}')" > "$pinned"
  # shellcheck disable=SC2086  # the spec is a list of requirements
  pip_install -c "$pinned" ${TRAINERS_SPEC}
  rm -f "$pinned"
fi
marker="$VENV/.arc_engine_installed"
if [ -n "$(missing arc_engine pytest pytest_timeout xdist ruff wandb matplotlib)" ] \
   || [ pyproject.toml -nt "$marker" ] || [ setup.py -nt "$marker" ]; then
  echo "[setup:${LANE} +${SECONDS}s] installing arc_engine (editable) with the dev extra"
  pip_install -e ".[dev]"
  touch "$marker"
fi
"$py" -c "import sys; from importlib.metadata import version as v
print(f'[setup:${LANE} +${SECONDS}s] ready in ${VENV}: Python {sys.version.split()[0]}, torch {v(\"torch\")}, arc_engine {v(\"arc_engine\")}')"

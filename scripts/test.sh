#!/usr/bin/env bash
# The test command: set up the lane's environment (if needed), lint, run the lane's tests. Extra args go to pytest.
# ARC_LANE (scripts/setup.sh): py311 (default) runs the whole suite; py312 and floor run the tests that exercise
# the frameworks' releases (docs/testing.md#lanes says which and why).
set -euo pipefail
cd "$(dirname "$0")/.."
LANE="${ARC_LANE:-py311}"
# Python caches the bytecode of what it imports (scripts/setup.sh installs without compiling; with
# PYTHONDONTWRITEBYTECODE, which this project's machines set, every test process compiled torch from source)
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
case "$LANE" in
  py311) venv=.venv; tests=() ;;
  py312) venv=.venv312
         tests=(tests/test_ddp_dist.py tests/test_fsdp_dist.py tests/test_amp_dist.py tests/test_deepspeed_amp_dist.py
                tests/test_deepspeed_dist.py tests/test_deepspeed_zero3_dist.py tests/test_zero3_sampling_dist.py
                tests/test_deepspeed_zero3_recovery_dist.py tests/test_deepspeed_internals.py
                tests/test_megatron_dist.py tests/test_megatron_recovery_dist.py tests/test_megatron_recompute_dist.py
                tests/test_megatron_separability_dist.py tests/test_megatron_qk_separability_dist.py
                tests/test_megatron_internals.py tests/test_megatron_amp_dist.py tests/test_megatron_lm_launcher.py
                tests/test_host_syncs_dist.py) ;;
  floor) venv=.venv-floor
         tests=(tests/test_ddp_dist.py tests/test_fsdp_dist.py tests/test_amp_dist.py tests/test_checkpoint_dist.py
                tests/test_deepspeed_dist.py tests/test_deepspeed_internals.py tests/test_deepspeed_amp_dist.py
                tests/test_host_syncs_dist.py) ;;
  *) echo "scripts/test.sh: unknown ARC_LANE=${LANE}" >&2; exit 2 ;;
esac
VENV="${VENV:-$venv}"
# Three pytest-xdist workers by default (ARC_TEST_WORKERS; 0 runs the tests in this one process), a test file per unit
# of work, taken in the order tests/conftest.py sorts them (the longest first): a multi-process test leaves a core
# idle while its ranks wait on each other, a timer or a launcher, and another worker's test takes it; on 2 cores a
# third worker fills what two leave idle (the py311 lane in 544 s against 587 s: docs/testing.md#workers).
workers="${ARC_TEST_WORKERS:-3}"
parallel=()
[ "$workers" = 0 ] || parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
"$VENV/bin/ruff" check arc_engine integrations tests scripts launch examples
exec "$VENV/bin/python" -m pytest -q --durations=25 "${parallel[@]}" "${tests[@]}" "$@"

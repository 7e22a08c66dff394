#!/usr/bin/env bash
# The test command: set up (if needed), lint, run the whole suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check arc_engine integrations tests scripts launch
exec .venv/bin/python -m pytest -q --durations=25 "$@"

#!/usr/bin/env bash
# Build arc_engine's wheel, install it (not editable) into a fresh virtual environment outside the checkout, import
# every module of arc_engine and arc_engine.integrations from it, and run the CLI: validate-config, show-config,
# report (of a run it trains itself, 30 steps of a plain module with a NaN injected) and demo --help.
# PYTHON: the interpreter of the new environment (default python3); TORCH_SPEC: the torch it gets first (pinned,
# so pip never resolves torch itself; default torch==2.13.0, the CPU wheel on this machine's disk).
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
quiet() { "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true; }

echo "[wheel] building"
"$PYTHON" -m venv "$work/build"
quiet "$work/build/bin/pip" install -q --disable-pip-version-check "setuptools>=68" wheel
quiet "$work/build/bin/pip" wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$work/dist" .
wheel="$(ls "$work"/dist/arc_engine-*.whl)"
echo "[wheel] built $(basename "$wheel")"

"$PYTHON" -m venv "$work/venv"
unset PYTHONDONTWRITEBYTECODE  # the modules are compiled on their first import, and cached (scripts/setup.sh)
quiet "$work/venv/bin/pip" install -q --disable-pip-version-check --no-compile "$TORCH_SPEC"
quiet "$work/venv/bin/pip" install -q --disable-pip-version-check --no-compile "${wheel}[report]"
cd "$work"  # nothing of the checkout on sys.path: everything below comes from the installed wheel

venv/bin/python - <<'EOF'
import importlib
import pkgutil

import arc_engine
import arc_engine.integrations

assert "site-packages" in arc_engine.__file__, arc_engine.__file__
names = sorted({m.name for pkg in (arc_engine, arc_engine.integrations)
                for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")} - {"arc_engine.__main__"})
extras = []
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as error:  # only a module whose extra is not installed, and it must say which
        assert "pip install 'arc-engine[" in str(error), (name, error)
        extras.append(name)
print(f"[wheel] imported {len(names) - len(extras)} modules of arc_engine {arc_engine.__version__} from "
      f"{arc_engine.__path__[0]}; {extras or 'none'} named the extra they need")
EOF

venv/bin/arc-engine validate-config "$repo/configs/default.yaml"
venv/bin/arc-engine show-config --arc-config "$repo/configs/demo.yaml" --arc.policy.max_consecutive_skips=4 \
  | grep -q "max_consecutive_skips: 4"
echo "[wheel] show-config: ok"

venv/bin/python - <<'EOF'
import torch

import arc_engine

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
config = arc_engine.load_config(None, ["run.run_id=wheel", "run.run_dir=runs", "sinks.console.enabled=false",
                                       "faults.injections=[{kind: nan_loss, rank: 0, step: 12}]"])
arc = arc_engine.attach(model, optimizer, config)
for step in range(30):
    x = torch.randn(32, 8)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    loss = arc.faults.on_loss(loss)
    arc.record_loss(loss)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
summary = arc.summary()
arc.close()
assert summary["skipped_by_policy"] == 1, summary
EOF
venv/bin/arc-engine report runs/wheel >/dev/null
test -s runs/wheel/report/index.html
echo "[wheel] report: ok ($(ls runs/wheel/report | wc -l) files)"
venv/bin/arc-engine demo --help >/dev/null
echo "[wheel] demo --help: ok"

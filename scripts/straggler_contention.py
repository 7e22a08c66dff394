"""Straggler warnings on a contended machine, and the campaign's slow-rank faults: what the straggler family says when
another job shares the cores, and whether it still finds a rank that is really slow.

    .venv/bin/python scripts/straggler_contention.py                    # loads none, steady, bursty; 2 repeats
    .venv/bin/python scripts/straggler_contention.py --loads steady --steps 1000 --repeats 3
    PYTHONPATH=/tmp/older-tree .venv/bin/python scripts/straggler_contention.py --out before.json

Each run is the demo job (``python -m arc_engine.demo.train``: the demo GPT under DDP, ``--ranks`` CPU ranks, gloo)
with arc_engine's default configuration, started as its own torchrun job. Per load -- ``none`` (the machine alone),
``steady`` (one busy process per core: another job's compute), ``bursty`` (the same processes busy and idle in turns
of 0.5-4 s, seeded) -- and per repeat:

* a **clean run** of ``--steps`` steps: the straggler family's warnings (false: nothing is slow but the machine) and
  its info events, per 1,000 steps;
* one run per campaign fault -- ``straggler``, ``gpu_throttling``, ``network_degradation``, the library's presets
  (:mod:`arc_engine.faults.library`: 50, 20 and 30 ms per step on one rank for 50 steps) on rank 1 from step
  ``--fault-step`` -- detected when a straggler warning names rank 1 between the fault's first step and
  ``GRACE`` steps after its last (the campaign's rule, :mod:`arc_engine.campaign.scoring`).

The arc_engine measured is the one Python imports: the environment's (``scripts/setup.sh`` installs this checkout),
or the checkout ``PYTHONPATH`` names first (the before/after figures in docs/detectors.md: a worktree of the earlier
commit, with ``arc_engine/integrations`` linked to its ``integrations/`` as the installed package maps it).
Prints a table and writes every run's counts to ``--out`` (JSON). No assertion on times: the script reports what
happened.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from arc_engine.campaign.scoring import GRACE
from arc_engine.faults.library import LIBRARY, WINDOW

FAULTS = ("straggler", "gpu_throttling", "network_degradation")
FAULT_RANK = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--loads", nargs="+", choices=("none", "steady", "bursty"),
                        default=["none", "steady", "bursty"])
    parser.add_argument("--steps", type=int, default=1000, help="steps of each clean run")
    parser.add_argument("--fault-step", type=int, default=150, help="the faults' first step (a run ends 60 after)")
    parser.add_argument("--faults", nargs="*", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy processes of a loaded machine")
    parser.add_argument("--out", type=Path, default=Path("straggler_contention.json"))
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' directories here (default: removed)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for every run, e.g. detectors.straggler.persist_reports=3")
    return parser.parse_args(argv)


def _busy(seed: int, bursty: bool) -> None:
    """Another job: a busy loop, or busy and idle in turns of 0.5-4 s."""
    rng = random.Random(seed)
    while True:
        until = time.perf_counter() + (rng.uniform(0.5, 4.0) if bursty else 3600.0)
        total = 0
        while time.perf_counter() < until:
            total += sum(i * i for i in range(2000))
        if bursty:
            time.sleep(rng.uniform(0.5, 4.0))


class Load:
    """``hogs`` busy processes while the ``with`` block runs (none for the ``none`` load)."""

    def __init__(self, kind: str, hogs: int, seed: int) -> None:
        self.kind, self.hogs, self.seed = kind, hogs, seed
        self.processes: list[multiprocessing.Process] = []

    def __enter__(self) -> Load:
        if self.kind != "none":
            for index in range(self.hogs):
                process = multiprocessing.Process(target=_busy, args=(self.seed * 100 + index, self.kind == "bursty"),
                                                  daemon=True)
                process.start()
                self.processes.append(process)
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            process.terminate()
            process.join(10)


def _fault_injections(name: str, step: int) -> list[dict[str, Any]]:
    specs = LIBRARY[name].specs(step, rank=FAULT_RANK, seed=0)
    return [{key: value for key, value in dataclasses.asdict(spec).items() if value is not None} for spec in specs]


def run_job(run_dir: Path, name: str, steps: int, injections: list[dict[str, Any]], ranks: int,
            overrides: list[str]) -> list[dict]:
    """One torchrun job of the demo with the default configuration (the sinks quiet); its events."""
    config = {"run": {"run_id": name, "run_dir": str(run_dir)}, "faults": {"injections": injections},
              "sinks": {"console": {"min_severity": "critical"}, "wandb": {"enabled": False}}}
    config_path = run_dir / f"{name}.yaml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "-m", "arc_engine.demo.train", "--steps", str(steps), "--log-every", str(10 * steps),
           "--arc-config", str(config_path), *(f"--arc.{item}" for item in overrides)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    events_file = run_dir / name / "events.jsonl"
    return [json.loads(line) for line in events_file.read_text().splitlines() if line.strip()]


def straggler_events(events: list[dict]) -> tuple[list[dict], list[dict]]:
    """(warnings, info events) of the straggler family."""
    own = [e for e in events if e["kind"] == "detection" and e["detector"] == "straggler"]
    return ([e for e in own if e["severity"] in ("warning", "error", "critical")],
            [e for e in own if e["severity"] == "info"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import arc_engine

    where = Path(arc_engine.__file__).resolve().parent.parent
    print(f"[contention] arc_engine {arc_engine.__version__} from {where}; {args.ranks} ranks, {args.hogs} busy "
          f"processes on a loaded machine, {os.cpu_count()} cores", flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="arc-contention-") as scratch:
        tmp = str(args.keep or scratch)
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for repeat in range(args.repeats):
            for load in args.loads:
                with Load(load, args.hogs, seed=repeat):
                    started = time.perf_counter()
                    name = f"clean-{load}-{repeat}"
                    warnings, infos = straggler_events(run_job(Path(tmp), name, args.steps, [], args.ranks, args.set))
                    rows.append({"load": load, "repeat": repeat, "run": "clean", "steps": args.steps,
                                 "warnings": len(warnings), "info": len(infos),
                                 "warned_ranks": sorted({r for e in warnings for r in e["ranks"]}),
                                 "seconds": round(time.perf_counter() - started, 1)})
                    print(f"[contention] {json.dumps(rows[-1])}", flush=True)
                    for fault in args.faults:
                        started = time.perf_counter()
                        first, last = args.fault_step, args.fault_step + WINDOW - 1
                        events = run_job(Path(tmp), f"{fault}-{load}-{repeat}", last + GRACE + 1,
                                         _fault_injections(fault, first), args.ranks, args.set)
                        warnings, infos = straggler_events(events)
                        hits = [e for e in warnings if first <= e["iteration"] <= last + GRACE
                                and FAULT_RANK in e["ranks"]]
                        rows.append({"load": load, "repeat": repeat, "run": fault, "steps": last + GRACE + 1,
                                     "detected": bool(hits), "at": hits[0]["iteration"] if hits else None,
                                     "warnings": len(warnings), "info": len(infos),
                                     "warned_ranks": sorted({r for e in warnings for r in e["ranks"]}),
                                     "seconds": round(time.perf_counter() - started, 1)})
                        print(f"[contention] {json.dumps(rows[-1])}", flush=True)
    args.out.write_text(json.dumps({"arc_engine": str(where), "args": {k: str(v) for k, v in vars(args).items()},
                                    "rows": rows}, indent=1))
    print(f"\n{'load':<8} {'clean warnings /1k steps':>25} {'info /1k':>9}  " +
          "  ".join(f"{fault:>20}" for fault in args.faults))
    for load in args.loads:
        clean = [r for r in rows if r["load"] == load and r["run"] == "clean"]
        steps = sum(r["steps"] for r in clean)
        detected = [[r for r in rows if r["load"] == load and r["run"] == fault] for fault in args.faults]
        print(f"{load:<8} {1000 * sum(r['warnings'] for r in clean) / steps:>25.2f} "
              f"{1000 * sum(r['info'] for r in clean) / steps:>9.2f}  " +
              "  ".join(f"{sum(r['detected'] for r in runs):>14}/{len(runs)} found" for runs in detected))
    print(f"[contention] every run's counts: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``arc-engine campaign`` (and ``scripts/campaign.py``): run a fault-injection campaign and write its table.

    arc-engine campaign --profile quick            # CI: the crash scenarios on DDP, one seed (about a minute)
    arc-engine campaign --profile full --out docs/campaign_full   # docs/results.md (under an hour on 2 cores)
    arc-engine campaign --profile realtext         # three faults on the machine's real text (docs/results.md#real-text)

Per backend, one torchrun job (:mod:`arc_engine.campaign.worker`) runs the profile's runs one after another; a
progress bar follows them. The output folder gets ``plan-<backend>.json``, ``worker-<backend>.log``,
``results.jsonl`` (one record per run), ``scores.json`` and ``table.md`` (:mod:`arc_engine.campaign.scoring`), and
``runs/<run id>/`` with each arc_engine run's event log and metrics (``arc-engine report`` reads them).
Exit codes: 0 done, 1 a worker job failed (its log's tail is printed), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from arc_engine.campaign.plan import BACKENDS, PROFILES, backend_plan
from arc_engine.campaign.scoring import score, table
from arc_engine.faults.library import LIBRARY

PROGRESS = "@@progress"
WORKER_TIMEOUT_S = 3 * 3600


class ProgressBar:
    """One line, redrawn in place on a terminal; one line per finished run otherwise (CI logs)."""

    def __init__(self, total: int, stream: IO[str] = sys.stderr, width: int = 30) -> None:
        self.total, self.done, self.stream, self.width = total, 0, stream, width
        self.start = time.monotonic()
        self.tty = stream.isatty()

    def update(self, name: str) -> None:
        self.done += 1
        filled = self.width * self.done // max(1, self.total)
        elapsed = time.monotonic() - self.start
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} runs "
                f"{int(elapsed) // 60}m{int(elapsed) % 60:02d}s  {name}")
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arc-engine campaign", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=None, help="default: the profile's")
    parser.add_argument("--faults", nargs="+", metavar="FAULT", default=None,
                        help="library faults to run (default: the profile's): " + ", ".join(LIBRARY))
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default: the profile's")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: arc_campaign/<profile>)")
    return parser


def run_backend(plan: dict, out: Path, bar: ProgressBar, nproc: int) -> int:
    """One torchrun job for one backend's plan; returns its exit code."""
    backend = plan["backend"]
    plan_path = out / f"plan-{backend}.json"
    plan_path.write_text(json.dumps(plan, indent=1))
    log_path = out / f"worker-{backend}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "arc_engine.campaign.worker", str(plan_path)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with log_path.open("w") as log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                     text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.startswith(PROGRESS):
                bar.update(line.split(maxsplit=3)[3].strip())
        try:
            return proc.wait(timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            return 124


def run_plans(plans: list[dict], out: Path, bar: ProgressBar, nproc: int, tag: str = "campaign") -> list[dict] | None:
    """Run each backend's plan (one torchrun job each, in order); the records of ``out/results.jsonl``, or None
    after printing the failed job's log tail when one fails."""
    for plan in plans:
        code = run_backend(plan, out, bar, nproc)
        if code != 0:
            log = (out / f"worker-{plan['backend']}.log").read_text().splitlines()
            print("\n".join(log[-40:]), file=sys.stderr)
            print(f"[{tag}] the {plan['backend']} job failed (exit {code}); its log: "
                  f"{out / ('worker-' + plan['backend'] + '.log')}", file=sys.stderr)
            return None
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = sorted(set(args.faults or ()) - set(LIBRARY))
    if unknown:
        parser.error(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(LIBRARY)}")
    profile = PROFILES[args.profile]
    if args.seeds is not None:
        profile = dataclasses.replace(profile, seeds=tuple(args.seeds))
    backends = tuple(args.backends or profile.backends)
    other_data = [backend for backend in backends if backend.startswith("megatron")] if profile.data != "generated" \
        else []
    if other_data:  # the Megatron backends train their own model on their own data: the profile's would not apply
        parser.error(f"profile {profile.name} trains on {profile.data} text, which the demo GPT backends (ddp, zero2) "
                     f"read and {', '.join(other_data)} does not")
    out: Path = args.out or Path("arc_campaign") / profile.name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    plans = [backend_plan(profile, backend, out.resolve(), tuple(args.faults) if args.faults else None)
             for backend in backends]
    total = sum(len(plan["runs"]) for plan in plans)
    print(f"[campaign] profile {profile.name}: {total} runs on {', '.join(backends)}, {profile.world} ranks each; "
          f"output in {out}", flush=True)
    bar = ProgressBar(total)
    records = run_plans(plans, out, bar, profile.world)
    if records is None:
        return 1
    scores = score(records)
    (out / "scores.json").write_text(json.dumps(scores, indent=1))
    text = table(scores)
    (out / "table.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

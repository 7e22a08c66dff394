"""``arc-engine``: validate a config, print the defaults, run the demo, resend undelivered W&B alerts, run the
fault-injection campaign, write a run's report, export a run's data ledger, list the job's suspect and excluded
hosts (the device ledger).

Exit codes: 0 ok, 1 W&B could not be reached (resend-alerts), a campaign job failed, or the host named by
``hosts --check`` is excluded, 2 bad config or usage, 3 (EXIT_ABORT) the demo was stopped by arc_engine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def _validate(args: argparse.Namespace) -> int:
    from arc_engine.config import ConfigError, load_config
    from arc_engine.config.cli_args import exit_with_config_error

    try:
        config = load_config(args.file, args.arc_overrides)
    except (ConfigError, OSError, UnicodeDecodeError) as err:
        exit_with_config_error(err)
    faults = len(config.faults.injections)
    print(f"{args.file}: OK ({faults} fault injection(s) configured)" if faults else f"{args.file}: OK")
    return 0


def _show(args: argparse.Namespace) -> int:
    import yaml

    from arc_engine.config import config_from_args, to_dict

    config = to_dict(config_from_args(args))
    if args.get is not None:  # one dotted key's value (what a launch script needs, e.g. run.run_dir)
        for part in args.get.split("."):
            if not isinstance(config, dict) or part not in config:
                print(f"arc-engine show-config: no key {args.get!r}", file=sys.stderr)
                return 2
            config = config[part]
        print(config)
        return 0
    print(yaml.safe_dump(config, sort_keys=False), end="")
    return 0


def _hosts(args: argparse.Namespace) -> int:
    """The device ledger of a job: the table, the exclusion in the asked form, a host checked or cleared."""
    import json

    from arc_engine import device_ledger as ledger

    path = ledger.devices_file(args.run_dir)
    if args.clear is not None:
        try:
            ledger.clear_host(path, args.clear)
        except OSError as err:
            print(f"arc-engine hosts: {path}: {err}", file=sys.stderr)
            return 2
        print(f"{args.clear}: its earlier evidence no longer counts ({path})")
        return 0
    try:
        records, torn = ledger.read_devices(path)
    except OSError as err:
        print(f"arc-engine hosts: {path}: {err}", file=sys.stderr)
        return 2
    if torn:
        print(f"arc-engine hosts: {path}: {torn} unreadable line(s) skipped (a write cut short)", file=sys.stderr)
    verdicts = ledger.assess(records)
    if args.check is not None:
        why = ledger.host_evidence(verdicts, args.check)
        if why:
            print(f"{args.check} is excluded by arc_engine's device ledger ({path}): {why}")
            return 1
        return 0
    if args.format == "json":
        print(json.dumps({"ledger": str(path), "excluded_hosts": ledger.excluded_hosts(verdicts),
                          "devices": [v.to_dict() for v in verdicts.values()]}, indent=1))
    elif args.format == "slurm-exclude":
        print(ledger.slurm_exclude(verdicts))
    elif args.format == "hostfile":
        if args.hostfile is None or not args.hostfile.is_file():
            print(f"arc-engine hosts: --format hostfile needs --hostfile IN (got {args.hostfile})", file=sys.stderr)
            return 2
        text, dropped = ledger.filter_hostfile(args.hostfile.read_text(encoding="utf-8"), verdicts)
        print(text, end="")
        for host in dropped:
            print(f"arc-engine hosts: left out {host}: {ledger.host_evidence(verdicts, host)}", file=sys.stderr)
    elif not verdicts:
        print(f"{path}: no hardware evidence")
    else:
        print(ledger.table(verdicts))
        for v in verdicts.values():
            if v.verdict != "ok":
                print(f"{v.location}: {v.verdict}: {'; '.join(v.reasons)}")
        excluded = ledger.excluded_hosts(verdicts)
        print(f"excluded hosts: {', '.join(excluded) if excluded else 'none'}")
    return 0


def _demo(args: argparse.Namespace, extra: list[str]) -> int:
    """Launch the demo job under torchrun (standalone rendezvous on this machine)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "arc_engine.demo.train", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.call(cmd, env=env)


def _resend(args: argparse.Namespace) -> int:
    """Send an ``undelivered_alerts.jsonl`` to W&B (``sinks.wandb`` of the config, the run ``arc-<run id>``)."""
    from arc_engine.config import config_from_args
    from arc_engine.sinks.wandb_sink import resend_alerts

    config = config_from_args(args)
    run_id = args.run_id or config.run.run_id or args.file.resolve().parent.name
    if not args.file.is_file():
        print(f"arc-engine resend-alerts: {args.file}: no such file", file=sys.stderr)
        return 2
    try:
        sent = resend_alerts(args.file, config.sinks.wandb, run_id)
    except Exception as err:
        print(f"arc-engine resend-alerts: W&B could not be reached ({type(err).__name__}: {err}); nothing was "
              f"removed, run it again later", file=sys.stderr)
        return 1
    done = args.file.with_name(args.file.name + ".sent")
    args.file.replace(done)
    print(f"{sent} alert(s) sent to W&B run arc-{run_id}; {args.file} moved to {done}")
    return 0


def _report(args: argparse.Namespace) -> int:
    """Write ``RUN_DIR/report/index.html`` (or into ``--out``) and print its path."""
    from arc_engine import stop_record
    from arc_engine.report import write_report

    stop = stop_record.read(args.run_dir)
    if stop is not None:  # first: why the run stopped
        print(stop_record.describe(stop))
    try:
        page = write_report(args.run_dir, args.out)
    except (FileNotFoundError, NotADirectoryError, RuntimeError) as err:
        print(f"arc-engine report: {err}", file=sys.stderr)
        return 2
    print(f"report: {page}")
    return 0


def _data_ledger(args: argparse.Namespace) -> int:
    """Print a run's data ledger summary and its bad-data positions in the asked form (``--format``)."""
    import json

    from arc_engine.data_ledger import (
        LEDGER_FILE,
        SKIP_BATCHES_FILE,
        describe,
        megatron_iterations,
        read_ledger,
        skip_batches,
    )

    path = args.run_dir / LEDGER_FILE if args.run_dir.is_dir() else args.run_dir
    if not path.is_file():
        print(f"arc-engine data-ledger: {path}: no such file", file=sys.stderr)
        return 2
    try:
        entries = read_ledger(path)
    except (OSError, ValueError) as err:
        print(f"arc-engine data-ledger: {err}", file=sys.stderr)
        return 2
    if args.format == "megatron":
        iterations = megatron_iterations(entries)
        print("--iterations-to-skip " + " ".join(map(str, iterations)) if iterations else "")
    elif args.format == "skip-batches":
        out = args.out or path.with_name(SKIP_BATCHES_FILE)
        out.write_text(json.dumps(skip_batches(entries), indent=1) + "\n", encoding="utf-8")
        print(f"{out}")
    else:
        print(f"{path}: {describe(entries)}")
        for entry in entries:
            span = str(entry["first"]) if entry["first"] == entry["last"] else f"{entry['first']}..{entry['last']}"
            ranks = f" ranks {entry['ranks']}" if entry.get("ranks") else ""
            bad = " bad data" if entry.get("bad_data") else ""
            print(f"  data {span}  step {entry['step']}  {entry['action']}{bad}{ranks}  {entry.get('reason', '')}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from arc_engine.config import add_arc_args

    parser = argparse.ArgumentParser(prog="arc-engine", description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate-config", help="check an arc config file (exit 0 ok, 2 invalid)")
    validate.add_argument("file", type=Path)
    validate.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides to check too")
    show = sub.add_parser("show-config", help="print the effective config (defaults when no file is given)",
                          allow_abbrev=False)
    add_arc_args(show)
    show.add_argument("--get", default=None, metavar="KEY", help="print one dotted key's value (e.g. run.run_dir)")
    demo = sub.add_parser("demo", help="run the demo job (torchrun, gloo, CPU); extra args go to the trainer")
    demo.add_argument("--nproc", type=int, default=2)
    sub.add_parser("campaign", help="the fault-injection campaign: faults x seeds against arc_engine and the "
                   "baselines, a table (arguments: arc-engine campaign --help)", add_help=False)
    report = sub.add_parser("report", help="write a run's report: a static HTML page with PNG figures "
                            "(RUN_DIR/report/index.html)", allow_abbrev=False)
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="an arc_engine run directory (events.jsonl)")
    report.add_argument("--out", type=Path, default=None, help="output folder (default: RUN_DIR/report)")
    resend = sub.add_parser("resend-alerts", help="send a run's undelivered_alerts.jsonl to W&B (exit 1: W&B "
                            "still unreachable, nothing removed)", allow_abbrev=False)
    resend.add_argument("file", type=Path)
    resend.add_argument("--run-id", default=None, help="the arc run id (default: run.run_id, else the file's "
                        "directory name)")
    add_arc_args(resend)
    ledger = sub.add_parser("data-ledger", help="a run's skipped and suspect data positions (data_ledger.jsonl), "
                            "or its bad-data batches for Megatron-LM or a skip_batches.json", allow_abbrev=False)
    ledger.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="an arc_engine run directory (or the file)")
    ledger.add_argument("--format", choices=("summary", "megatron", "skip-batches"), default="summary",
                        help="megatron: print --iterations-to-skip ...; skip-batches: write skip_batches.json")
    ledger.add_argument("--out", type=Path, default=None, help="skip-batches: the file (default: beside the ledger)")
    _hosts_arguments(sub.add_parser("hosts", help="the job's device ledger (devices.jsonl): hardware evidence per host "
                                    "and device, and the hosts to leave out", allow_abbrev=False))
    return parser


def _hosts_arguments(hosts: argparse.ArgumentParser) -> None:
    hosts.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run root (run.run_dir), a run directory in "
                       "it, or the ledger file")
    hosts.add_argument("--format", choices=("table", "json", "slurm-exclude", "hostfile"), default="table",
                       help="slurm-exclude: --exclude=HOST,...; hostfile: --hostfile IN without the excluded hosts")
    hosts.add_argument("--hostfile", type=Path, default=None, help="a DeepSpeed/MPI hostfile (--format hostfile)")
    hosts.add_argument("--clear", default=None, metavar="HOST", help="forget HOST's evidence (after a repair)")
    hosts.add_argument("--check", default=None, metavar="HOST", help="exit 1, with one line naming the evidence, "
                       "when HOST is excluded (a launcher's check before joining)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["hosts"]:  # run by the launchers on every node before it joins: no torch import (the config is)
        hosts = argparse.ArgumentParser(prog="arc-engine hosts", allow_abbrev=False)
        _hosts_arguments(hosts)
        return _hosts(hosts.parse_args(argv[1:]))
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "demo":
        return _demo(args, extra)
    if args.command == "campaign":
        from arc_engine.campaign.runner import main as campaign

        return campaign(extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "resend-alerts":
        return _resend(args)
    if args.command == "report":
        return _report(args)
    if args.command == "data-ledger":
        return _data_ledger(args)
    if args.command == "hosts":
        return _hosts(args)
    if args.command == "validate-config":
        args.arc_overrides = args.overrides
        return _validate(args)
    return _show(args)


if __name__ == "__main__":
    sys.exit(main())

"""The typed config (schema, YAML loader, argparse glue) and the ``arc-engine`` CLI."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from arc_engine.config import (
    EXIT_BAD_CONFIG,
    ArcConfig,
    ConfigError,
    add_arc_args,
    config_from_args,
    from_dict,
    load_config,
    to_dict,
)
from arc_engine.demo.defaults import DEMO_CONFIG
from arc_engine.monitors.family import section_of
from arc_engine.monitors.loss_spike import LossSpikeFamily
from arc_engine.monitors.numerics import GradNormFamily

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted((REPO_ROOT / "configs").glob("*.yaml"))
DEMO_YAML = REPO_ROOT / "configs" / "demo.yaml"


def write_yaml(tmp_path: Path, text: str, name: str = "arc.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load_error(path: Path, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert isinstance(info.value, ValueError)  # ConfigError is the ValueError for bad user input
    return str(info.value)


# ------------------------------------------------------------------ good configs


def test_defaults_build_and_round_trip_through_dict():
    config = ArcConfig()
    assert config.stats.interval == 1
    assert section_of(config, LossSpikeFamily()).window >= section_of(config, LossSpikeFamily()).warmup_steps
    assert config.faults.injections == []
    assert from_dict(ArcConfig, to_dict(config)) == config
    assert load_config(None) == config


def test_configs_folder_is_not_empty():
    assert CONFIG_FILES, "configs/ should hold at least one *.yaml"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_every_shipped_config_validates(path):
    config = load_config(path)
    assert isinstance(config, ArcConfig)
    assert from_dict(ArcConfig, to_dict(config)) == config


def test_default_yaml_holds_every_default():
    assert load_config(REPO_ROOT / "configs" / "default.yaml") == load_config(None)


def test_demo_yaml_equals_embedded_demo_default():
    from_file = load_config(DEMO_YAML)
    embedded = load_config(None, base=DEMO_CONFIG)
    assert from_file == embedded
    assert len(embedded.faults.injections) == 4  # not trivially equal: both hold the injected faults


def test_embedded_base_is_not_mutated_by_overrides():
    before = yaml.safe_dump(DEMO_CONFIG)
    config = load_config(None, ["policy.max_consecutive_skips=9"], base=DEMO_CONFIG)
    assert config.policy.max_consecutive_skips == 9
    assert yaml.safe_dump(DEMO_CONFIG) == before


@pytest.mark.parametrize("text", ["1e4", "1.0e4", "1E+4", "10000"])
def test_yaml_scientific_notation_accepted_for_float_keys(tmp_path, text):
    path = write_yaml(tmp_path, f"detectors:\n  grad_norm:\n    explosion_threshold: {text}\n")
    threshold = section_of(load_config(path), GradNormFamily()).explosion_threshold
    assert threshold == 1.0e4
    assert isinstance(threshold, float)


def test_empty_file_gives_defaults(tmp_path):
    assert load_config(write_yaml(tmp_path, "# nothing here\n")) == ArcConfig()


# ------------------------------------------------------------------ bad configs: file, key, value, allowed


BAD_CONFIGS = {
    "unknown_top_level": ("bogus: 1\n", "bogus", "1", "unknown key; allowed keys here: detectors, diagnostics, faults"),
    "unknown_nested": ("detectors:\n  loss_spike:\n    fctor: 8\n", "detectors.loss_spike.fctor", "8",
                       "unknown key (did you mean `factor`?); allowed keys here: action, enabled, factor"),
    "unknown_section": ("detectors:\n  los_spike:\n    factor: 8\n", "detectors.los_spike", "{'factor': 8}",
                        "unknown key (did you mean `loss_spike`?)"),
    "string_for_int": ("stats:\n  interval: ten\n", "stats.interval", "'ten'", "expected an integer"),
    "bool_for_int": ("stats:\n  interval: true\n", "stats.interval", "True", "expected an integer"),
    "int_for_literal": ("detectors:\n  loss_spike:\n    action: 3\n", "detectors.loss_spike.action", "3",
                        "expected one of 'warn', 'checkpoint', 'skip', 'rollback', 'abort'"),
    "interval_zero": ("stats:\n  interval: 0\n", "stats.interval", "0", "must be an integer >= 1"),
    "negative_factor": ("detectors:\n  loss_spike:\n    factor: -1\n", "detectors.loss_spike.factor", "-1",
                        "must be > 0"),
    "window_below_warmup": ("detectors:\n  loss_spike:\n    warmup_steps: 20\n    window: 10\n",
                            "detectors.loss_spike.window", "10", "must be >= warmup_steps"),
    "fault_missing_step": ("faults:\n  injections:\n    - {kind: nan_loss, rank: 0}\n",
                           "faults.injections[0].step", "None", "required key is missing"),
    "fault_bad_kind": ("faults:\n  injections:\n    - {kind: nan_weights, rank: 0, step: 1}\n",
                       "faults.injections[0].kind", "'nan_weights'", "expected one of 'nan_grad'"),
    "fault_bad_rank": ("faults:\n  injections:\n    - {kind: nan_loss, rank: -2, step: 1}\n",
                       "faults.injections[0].rank", "-2", "-1 for every rank"),
    "run_id_not_string": ("run:\n  run_id: [a, b]\n", "run.run_id", "['a', 'b']",
                          "expected a string or null"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_message_names_file_key_value_and_allowed(tmp_path, case):
    text, key, value, allowed = BAD_CONFIGS[case]
    path = write_yaml(tmp_path, text)
    message = load_error(path)
    assert message.startswith(f"{path}: "), message
    assert f"{key} = " in message, message
    assert message.split(" = ", 1)[1].startswith(value), message
    assert allowed in message, message
    assert "\n" not in message


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = write_yaml(tmp_path, "stats:\n  interval: 1\n\tdevice: cpu\n")
    message = load_error(path)
    assert message.startswith(f"{path}: ")
    assert "not valid YAML" in message
    assert re.search(r"\(line 3, column \d+\)", message), message


def test_list_root_is_rejected(tmp_path):
    message = load_error(write_yaml(tmp_path, "- stats\n- detectors\n"))
    assert "<root> = ['stats', 'detectors']" in message
    assert "must hold a mapping" in message


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "absent.yaml")


def test_int_key_rejects_float(tmp_path):
    message = load_error(write_yaml(tmp_path, "detectors:\n  loss_spike:\n    warmup_steps: 20.5\n"))
    assert "detectors.loss_spike.warmup_steps = 20.5: expected an integer" in message


# ------------------------------------------------------------------ dotted overrides


def test_overrides_win_over_the_file(tmp_path):
    path = write_yaml(tmp_path, "detectors:\n  loss_spike:\n    factor: 4.0\n    window: 50\n")
    assert section_of(load_config(path), LossSpikeFamily()).factor == 4.0
    config = load_config(path, ["detectors.loss_spike.factor=8"])
    assert section_of(config, LossSpikeFamily()).factor == 8.0
    assert section_of(config, LossSpikeFamily()).window == 50  # the rest of the file still applies
    later = load_config(path, ["detectors.loss_spike.factor=8", "detectors.loss_spike.factor=9"])
    assert section_of(later, LossSpikeFamily()).factor == 9.0


def test_bad_override_names_command_line_and_key(tmp_path):
    path = write_yaml(tmp_path, "stats:\n  interval: 2\n")
    message = load_error(path, ("detectors.loss_spike.factor=-1",))
    assert message.startswith(f"{path} + command line: detectors.loss_spike.factor = -1")
    assert "must be > 0" in message
    assert "KEY=VALUE" in load_error(path, ("detectors.loss_spike.factor",))
    assert "'interval' is not a section" in load_error(path, ("stats.interval.every=3",))
    assert "unknown key" in load_error(path, ("detectors.nope=3",))


def test_override_sets_a_list_of_faults():
    config = load_config(None, ["faults.injections=[{kind: nan_loss, rank: 1, step: 7}]"])
    (fault,) = config.faults.injections
    assert (fault.kind, fault.rank, fault.step, fault.steps) == ("nan_loss", 1, 7, 1)


# ------------------------------------------------------------------ argparse glue


def arc_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train.py")
    parser.add_argument("--lr", type=float, default=1e-3)
    return add_arc_args(parser)


@pytest.mark.parametrize("override", [["--arc.detectors.loss_spike.factor=8"],
                                      ["--arc.detectors.loss_spike.factor", "8"]])
def test_add_arc_args_reads_file_and_overrides(override):
    args = arc_parser().parse_args(["--lr", "0.1", "--arc-config", str(DEMO_YAML), *override])
    assert args.lr == 0.1
    config = config_from_args(args)
    assert section_of(config, LossSpikeFamily()).factor == 8.0
    assert config.policy.max_consecutive_skips == 3  # from demo.yaml, not the default 5
    assert config.run.run_id == "demo"


def test_config_from_args_without_file_uses_default_mapping():
    args = arc_parser().parse_args(["--arc.stats.interval=4"])
    assert config_from_args(args) == load_config(None, ["stats.interval=4"])
    from_demo = config_from_args(args, default=DEMO_CONFIG)
    assert (from_demo.run.run_id, from_demo.stats.interval) == ("demo", 4)


def test_unknown_arc_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        arc_parser().parse_args(["--arc.foo=1"])
    assert info.value.code == 2
    assert "arc_engine: invalid config: --arc.foo: unknown key;" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--arc.detectors.loss_spike.factr=3"], ["--arc.detectors.loss_spike.factr", "3"]])
def test_a_mistyped_arc_option_names_the_nearest_key(capsys, argv):
    with pytest.raises(SystemExit) as info:
        arc_parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--arc.detectors.loss_spike.factr: unknown key (did you mean `detectors.loss_spike.factor`?)" in err
    assert err.count("\n") == 1


def test_other_argparse_errors_stay_argparse_errors(capsys):
    parser = arc_parser()
    parser.add_argument("--steps", type=int)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--steps", "x"])
    assert info.value.code == 2
    assert "invalid int value" in capsys.readouterr().err


def test_config_from_args_exits_2_with_one_line(capsys):
    args = arc_parser().parse_args(["--arc.detectors.loss_spike.factor=-1"])
    with pytest.raises(SystemExit) as info:
        config_from_args(args)
    assert info.value.code == EXIT_BAD_CONFIG == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("arc_engine: invalid config:")
    assert "detectors.loss_spike.factor = -1" in lines[0]


def test_config_from_args_raises_when_asked(tmp_path):
    args = arc_parser().parse_args(["--arc-config", str(write_yaml(tmp_path, "stats:\n  interval: 0\n"))])
    with pytest.raises(ConfigError, match=r"stats\.interval = 0"):
        config_from_args(args, exit_on_error=False)
    missing = arc_parser().parse_args(["--arc-config", str(tmp_path / "absent.yaml")])
    with pytest.raises(FileNotFoundError):
        config_from_args(missing, exit_on_error=False)


# ------------------------------------------------------------------ the arc-engine CLI (a real subprocess)


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "arc_engine.cli", *argv], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def test_cli_validate_config_accepts_demo():
    result = run_cli("validate-config", "configs/demo.yaml")
    assert result.returncode == 0, result.stderr
    assert "configs/demo.yaml: OK" in result.stdout
    assert "4 fault injection(s)" in result.stdout


@pytest.mark.parametrize("text, key", [("stats:\n  interval: 0\n", "stats.interval"),
                                       ("detectors:\n  bogus: {}\n", "detectors.bogus"),
                                       ("stats: [1\n", "not valid YAML")])
def test_cli_validate_config_rejects_bad_file(tmp_path, text, key):
    path = write_yaml(tmp_path, text)
    result = run_cli("validate-config", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"arc_engine: invalid config: {path}: ")
    assert key in lines[0]
    assert result.stdout == ""


def test_python_dash_m_arc_engine_is_the_cli():
    result = subprocess.run([sys.executable, "-m", "arc_engine", "validate-config", "configs/demo.yaml",
                             "detectors.loss_spike.factr=3"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "did you mean `factor`?" in result.stderr


def test_cli_validate_config_checks_overrides_too():
    result = run_cli("validate-config", "configs/demo.yaml", "policy.max_consecutive_skips=-1")
    assert result.returncode == 2
    assert "policy.max_consecutive_skips = -1" in result.stderr


def test_cli_validate_config_of_a_missing_file_exits_2_naming_it(tmp_path):
    missing = tmp_path / "absent.yaml"
    result = run_cli("validate-config", str(missing))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == f"arc_engine: invalid config: {missing}: file not found"


def test_cli_show_config_round_trips_to_defaults(tmp_path):
    result = run_cli("show-config")
    assert result.returncode == 0, result.stderr
    assert isinstance(yaml.safe_load(result.stdout), dict)
    path = write_yaml(tmp_path, result.stdout, "shown.yaml")
    assert load_config(path) == ArcConfig()


def test_cli_show_config_of_a_file_prints_the_file_with_overrides_applied(tmp_path):
    result = run_cli("show-config", "--arc-config", "configs/demo.yaml", "--arc.stats.interval=5")
    assert result.returncode == 0, result.stderr
    shown = load_config(write_yaml(tmp_path, result.stdout, "shown.yaml"))
    assert shown == load_config(DEMO_YAML, ["stats.interval=5"])


def test_non_utf8_file_is_a_config_error(tmp_path):
    bad = tmp_path / "binary.yaml"
    bad.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)
    proc = subprocess.run([sys.executable, "-m", "arc_engine.cli", "validate-config", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_empty_section_means_defaults(tmp_path):
    path = tmp_path / "empty_section.yaml"
    path.write_text("detectors:\n#  loss_spike:\n#    factor: 3\n")
    assert load_config(path) == ArcConfig()


def test_show_config_applies_overrides_without_a_file():
    proc = subprocess.run([sys.executable, "-m", "arc_engine.cli", "show-config",
                           "--arc.detectors.loss_spike.factor=8"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert yaml.safe_load(proc.stdout)["detectors"]["loss_spike"]["factor"] == 8.0


def test_pop_arc_args_takes_arc_engines_arguments_out_of_a_foreign_command_line(tmp_path):
    """For scripts that parse sys.argv their own way (nanoGPT's configurator): arc_engine's options leave the list,
    every other argument stays in order, and the config is the file's with the overrides applied."""
    from arc_engine.config import pop_arc_args

    config_file = tmp_path / "arc.yaml"
    config_file.write_text("stats: {interval: 4}\n")
    argv = ["train.py", "config/train_gpt2.py", "--arc-config", str(config_file), "--batch_size=8",
            "--arc.detectors.loss_spike.factor=6", "--arc.stats.interval", "2", "--compile=False"]
    config = pop_arc_args(argv)
    assert argv == ["train.py", "config/train_gpt2.py", "--batch_size=8", "--compile=False"]
    assert config.stats.interval == 2 and section_of(config, LossSpikeFamily()).factor == 6
    with pytest.raises(ConfigError, match="factr"):
        pop_arc_args(["train.py", "--arc.detectors.loss_spike.factr=6"], exit_on_error=False)
    with pytest.raises(ConfigError):
        pop_arc_args(["train.py", "--arc.stats.interval"], exit_on_error=False)

# shellcheck shell=bash
# Sourced by the launchers in this folder (not executable on its own).
#
# arc_preflight ARGS...: when ARGS (the training script's arguments) contain --arc-config, check the arc_engine
# configuration they name (the file plus every --arc.<key> override, exactly as the training script will load it)
# once, on the launching host, before any worker starts. A bad configuration then stops the launch with exit code
# 2 and one message, instead of failing every rank of every node (and, under torchrun, being restarted
# MAX_RESTARTS times and reported as exit code 1). Skipped with ARC_PREFLIGHT=0, when no --arc-config is given
# (the script's own default config applies then), and when arc_engine cannot be imported by $PYTHON on this host.

arc_preflight() {
  [ "${ARC_PREFLIGHT:-1}" = "0" ] && return 0
  local -a arc_args=()
  local has_config=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --arc-config=* | --arc_config=*) arc_args+=("$1"); has_config=1 ;;
      --arc.*=*) arc_args+=("$1") ;;
      --arc-config | --arc_config)
        has_config=1
        arc_args+=("$1")
        if [ $# -gt 1 ]; then arc_args+=("$2"); shift; fi ;;
      --arc.*)
        arc_args+=("$1")
        if [ $# -gt 1 ]; then arc_args+=("$2"); shift; fi ;;
    esac
    shift
  done
  [ "$has_config" = "1" ] || return 0
  local status=0 errors errors_file
  errors_file=$(mktemp)
  # the run root (run.run_dir) as the script will see it: arc_host_check looks for the device ledger there
  ARC_RUN_ROOT=$("$PYTHON" -m arc_engine.cli show-config "${arc_args[@]}" --get run.run_dir 2>"$errors_file") \
    || status=$?
  errors=$(cat "$errors_file"); rm -f "$errors_file"
  if [ "$status" = "0" ] && [ -z "${ARC_RUN_DIR:-}" ]; then export ARC_RUN_DIR="$ARC_RUN_ROOT"; fi
  if [ "$status" = "2" ]; then
    printf '%s\n' "$errors" >&2
    echo "[launch] not launching: invalid arc_engine config (exit 2; ARC_PREFLIGHT=0 skips this check)" >&2
    exit 2
  elif [ "$status" != "0" ]; then
    echo "[launch] arc_engine config check skipped: '$PYTHON -m arc_engine.cli' failed (exit $status)" >&2
  fi
  return 0
}

# arc_host_check: before this node joins, ask arc_engine's device ledger (ARC_RUN_DIR: the run root, run.run_dir;
# set by arc_preflight from --arc-config) whether this host is excluded (docs/hardware.md). An excluded host does not
# join: one line names the evidence and the launcher exits ARC_EXCLUDED_EXIT (0: the other nodes carry on, an
# elastic job (NNODES=MIN:MAX) without it; srun's --kill-on-bad-exit does not stop them). Skipped with
# ARC_HOST_CHECK=0, without a run root, and without a ledger there. ARC_TEST_HOSTNAME stands for the host's name
# in tests only.
arc_host_check() {
  [ "${ARC_HOST_CHECK:-1}" = "0" ] && return 0
  [ -n "${ARC_RUN_DIR:-}" ] || return 0
  [ -f "$ARC_RUN_DIR/devices.jsonl" ] || [ -f "$(dirname "$ARC_RUN_DIR")/devices.jsonl" ] || return 0
  local host="${ARC_TEST_HOSTNAME:-$(hostname)}" why status=0
  why=$("$PYTHON" -m arc_engine.cli hosts "$ARC_RUN_DIR" --check "$host" 2>/dev/null) || status=$?
  if [ "$status" = "1" ]; then
    echo "[launch] not joining: ${why}" >&2
    exit "${ARC_EXCLUDED_EXIT:-0}"
  fi
  return 0
}

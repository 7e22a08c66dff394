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
  local status=0 errors
  errors=$("$PYTHON" -m arc_engine.cli show-config "${arc_args[@]}" 2>&1 >/dev/null) || status=$?
  if [ "$status" = "2" ]; then
    printf '%s\n' "$errors" >&2
    echo "[launch] not launching: invalid arc_engine config (exit 2; ARC_PREFLIGHT=0 skips this check)" >&2
    exit 2
  elif [ "$status" != "0" ]; then
    echo "[launch] arc_engine config check skipped: '$PYTHON -m arc_engine.cli' failed (exit $status)" >&2
  fi
  return 0
}

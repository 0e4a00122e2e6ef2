# shellcheck shell=bash
# Shared by the launchers in this directory (sourced, not run).
# Provides: parse_staleness_args, run, repo_root; sets DRY_RUN, STALENESS, EXTRA (array).

# shellcheck disable=SC2034  # DRY_RUN / STALENESS / EXTRA are read by the sourcing script
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MEGATRON_DAPO="${MEGATRON_DAPO:-megatron-dapo}"
DRY_RUN=0

# Usage of the model launchers: SCRIPT [STALENESS] [--dry-run] [key.sub=value ...]
# STALENESS (first argument, default 3) becomes algo.staleness; the rest are config overrides.
parse_staleness_args() {
  STALENESS=3
  EXTRA=()
  local first=1 arg
  for arg in "$@"; do
    if [[ "$arg" == "--dry-run" ]]; then
      DRY_RUN=1
    elif [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
      awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
      exit 0
    elif [[ $first -eq 1 && "$arg" != *=* ]]; then
      if ! [[ "$arg" =~ ^[0-9]+$ ]]; then
        echo "$(basename "$0"): STALENESS must be a non-negative integer, got '$arg'" >&2
        exit 2
      fi
      STALENESS="$arg"
      first=0
    else
      EXTRA+=("$arg")
      first=0
    fi
  done
}

# Strip --dry-run from the arguments of the cluster launchers; the rest stay in ARGS.
parse_dry_run() {
  ARGS=()
  local arg
  for arg in "$@"; do
    if [[ "$arg" == "--dry-run" ]]; then DRY_RUN=1; else ARGS+=("$arg"); fi
  done
}

# Print the command (shell-quoted, one line, prefixed with "+ "); run it unless --dry-run.
run() {
  local quoted
  quoted="$(printf '%q ' "$@")"
  echo "+ ${quoted% }"
  if [[ $DRY_RUN -eq 0 ]]; then
    "$@"
  fi
}

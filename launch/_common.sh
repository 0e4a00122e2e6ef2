# shellcheck shell=bash
# Shared by the launchers in this directory (sourced, not run).
# Provides: parse_staleness_args, parse_advanced_args, parse_dry_run, run, run_model_job;
# sets DRY_RUN, STALENESS, EXTRA (array), COST_MODEL.

# shellcheck disable=SC2034  # DRY_RUN / STALENESS / EXTRA are read by the sourcing script
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MEGATRON_DAPO="${MEGATRON_DAPO:-megatron-dapo}"
DRY_RUN=0

# Usage of the model launchers: SCRIPT [STALENESS] [--dry-run] [key.sub=value ...]
# STALENESS (first argument, default DEFAULT_STALENESS or 3) becomes algo.staleness; the rest are config overrides.
parse_staleness_args() {
  STALENESS="${DEFAULT_STALENESS:-3}"
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

# The advanced launchers: as parse_staleness_args, plus the cost model that throughput_optimal routing
# needs, from `--cost-model FILE` or $COST_MODEL (written by `megatron-dapo profile-engine`); required.
parse_advanced_args() {
  local rest=() name
  name="$(basename "$0")"
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --cost-model)
        [[ $# -ge 2 ]] || { echo "$name: --cost-model needs a FILE" >&2; exit 2; }
        COST_MODEL="$2"; shift 2 ;;
      --cost-model=*) COST_MODEL="${1#--cost-model=}"; shift ;;
      *) rest+=("$1"); shift ;;
    esac
  done
  parse_staleness_args ${rest[@]+"${rest[@]}"}
  if [[ -z "${COST_MODEL:-}" ]]; then
    echo "$name: no cost model: pass --cost-model FILE or set COST_MODEL to the JSON written by" \
      "'megatron-dapo profile-engine --server URL --out FILE' (see docs/rollout-coordination.md)" >&2
    exit 2
  fi
  if [[ ! -f "$COST_MODEL" ]]; then
    echo "$name: cost model file '$COST_MODEL' does not exist" >&2
    exit 2
  fi
  # absolute, so that processes started elsewhere (Ray workers) read the same file
  COST_MODEL="$(cd "$(dirname "$COST_MODEL")" && pwd)/$(basename "$COST_MODEL")"
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

# The body of the model launchers: plan, then train, with the staleness / cluster / data overrides.
# Usage: run_model_job CONFIG DEFAULT_NNODES [fixed overrides ...]   (after parse_staleness_args)
# Environment: NNODES, GPUS_PER_NODE (8), GPU_MEM_GIB (80), RAY_ADDRESS, MODEL_PATH, TRAIN_FILE, VAL_FILE.
run_model_job() {
  local config="$1" nnodes="${NNODES:-$2}" gpus="${GPUS_PER_NODE:-8}"
  shift 2
  local overrides=("algo.staleness=$STALENESS" "$@" "trainer.nnodes=$nnodes" "trainer.gpus_per_node=$gpus")
  [[ -n "${RAY_ADDRESS:-}" ]] && overrides+=("trainer.ray_address=$RAY_ADDRESS")
  [[ -n "${MODEL_PATH:-}" ]] && overrides+=("model.hf_path=$MODEL_PATH")
  [[ -n "${TRAIN_FILE:-}" ]] && overrides+=("data.train_files=[$TRAIN_FILE]")
  [[ -n "${VAL_FILE:-}" ]] && overrides+=("data.val_files=[$VAL_FILE]")
  overrides+=("${EXTRA[@]}")
  run "$MEGATRON_DAPO" plan "$config" --nodes "$nnodes" --gpus-per-node "$gpus" \
    --gpu-mem-gib "${GPU_MEM_GIB:-80}" "${overrides[@]}"
  run "$MEGATRON_DAPO" train --config "$config" "${overrides[@]}"
}

#!/usr/bin/env bash
# DAPO on Qwen2.5-3B-Instruct with the FSDP2 backend (4 ranks) and 4 SGLang engines (TP 1) on 1 node x 8 GPUs.
#
# Usage: launch/qwen2.5_3b_fsdp.sh [STALENESS] [--dry-run] [key.sub=value ...]
#   STALENESS  weight versions rollouts may run ahead of training (algo.staleness; default 3, 0 = synchronous)
#   --dry-run  print the commands instead of running them
# Environment: NNODES (1), GPUS_PER_NODE (8), GPU_MEM_GIB (80), MODEL_PATH, TRAIN_FILE, VAL_FILE,
#   RAY_ADDRESS (a running Ray cluster, e.g. from launch/slurm_ray.sbatch; default: the config's trainer.ray_address).
# Runs `megatron-dapo plan` first so that a layout or memory problem fails before anything starts.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
parse_staleness_args "$@"

CONFIG="$REPO_ROOT/configs/qwen3/qwen2.5_3b_fsdp.yaml"
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
OVERRIDES=("algo.staleness=$STALENESS" "trainer.backend=fsdp2" "trainer.nnodes=$NNODES" "trainer.gpus_per_node=$GPUS_PER_NODE")
[[ -n "${RAY_ADDRESS:-}" ]] && OVERRIDES+=("trainer.ray_address=$RAY_ADDRESS")
[[ -n "${MODEL_PATH:-}" ]] && OVERRIDES+=("model.hf_path=$MODEL_PATH")
[[ -n "${TRAIN_FILE:-}" ]] && OVERRIDES+=("data.train_files=[$TRAIN_FILE]")
[[ -n "${VAL_FILE:-}" ]] && OVERRIDES+=("data.val_files=[$VAL_FILE]")
OVERRIDES+=("${EXTRA[@]}")

run "$MEGATRON_DAPO" plan "$CONFIG" --nodes "$NNODES" --gpus-per-node "$GPUS_PER_NODE" \
  --gpu-mem-gib "${GPU_MEM_GIB:-80}" "${OVERRIDES[@]}"
run "$MEGATRON_DAPO" train --config "$CONFIG" "${OVERRIDES[@]}"

#!/usr/bin/env bash
# DAPO on Qwen3-30B-A3B (MoE) with Megatron (TP=2 + SP, EP=8, DP=8) and 4 SGLang engines (TP 4) on 4 nodes x 8 GPUs.
#
# Usage: launch/qwen3_30b_megatron.sh [STALENESS] [--dry-run] [key.sub=value ...]
#   STALENESS  weight versions rollouts may run ahead of training (algo.staleness; default 3, 0 = synchronous)
#   --dry-run  print the commands instead of running them
# Environment: NNODES (4), GPUS_PER_NODE (8), GPU_MEM_GIB (80), MODEL_PATH, TRAIN_FILE, VAL_FILE,
#   RAY_ADDRESS (a running Ray cluster, e.g. from launch/slurm_ray.sbatch; default: the config's trainer.ray_address).
# Runs `megatron-dapo plan` first so that a layout or memory problem fails before anything starts.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
parse_staleness_args "$@"

run_model_job "$REPO_ROOT/configs/qwen3/qwen3_30b_a3b.yaml" 4

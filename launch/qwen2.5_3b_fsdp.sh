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

run_model_job "$REPO_ROOT/configs/qwen3/qwen2.5_3b_fsdp.yaml" 1 "trainer.backend=fsdp2"

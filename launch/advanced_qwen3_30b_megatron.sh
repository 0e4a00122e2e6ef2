#!/usr/bin/env bash
# DAPO on Qwen3-30B-A3B (MoE) with Megatron (TP=2 + SP, EP=8, DP=8), 4 SGLang engines (TP 4) and the
# advanced rollout coordination (throughput_optimal routing, priority queues, greedy sync,
# migration, proactive filtering) on 4 nodes x 8 GPUs. Needs tuning: see docs/rollout-coordination.md.
#
# Usage: launch/advanced_qwen3_30b_megatron.sh [STALENESS] --cost-model FILE [--dry-run] [key.sub=value ...]
#   STALENESS     weight versions rollouts may run ahead of training (algo.staleness; default 3; retry needs >= 1)
#   --cost-model  the engine cost model JSON (rollout.routing.cost_model; or env COST_MODEL), written by
#                 `megatron-dapo profile-engine --server URL --out FILE` on one engine of this model and TP size
#   --dry-run     print the commands instead of running them
# Environment: COST_MODEL, NNODES (4), GPUS_PER_NODE (8), GPU_MEM_GIB (80), MODEL_PATH, TRAIN_FILE, VAL_FILE,
#   RAY_ADDRESS (a running Ray cluster, e.g. from launch/slurm_ray.sbatch; default: the config's trainer.ray_address).
# Runs `megatron-dapo plan` first so that a layout or memory problem fails before anything starts.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
DEFAULT_STALENESS=3
parse_advanced_args "$@"

run_model_job "$REPO_ROOT/configs/qwen3/advanced_qwen3_30b_a3b.yaml" 4 "rollout.routing.cost_model=$COST_MODEL"

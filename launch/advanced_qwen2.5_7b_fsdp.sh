#!/usr/bin/env bash
# DAPO on Qwen2.5-7B with the FSDP2 backend (8 ranks), 8 SGLang engines (TP 1) and the advanced rollout
# coordination (throughput_optimal routing, priority queues, greedy sync, migration, proactive
# filtering) on 2 nodes x 8 GPUs. Needs tuning: see docs/rollout-coordination.md.
#
# Usage: launch/advanced_qwen2.5_7b_fsdp.sh [STALENESS] --cost-model FILE [--dry-run] [key.sub=value ...]
#   STALENESS     weight versions rollouts may run ahead of training (algo.staleness; default 2; retry needs >= 1)
#   --cost-model  the engine cost model JSON (rollout.routing.cost_model; or env COST_MODEL), written by
#                 `megatron-dapo profile-engine --server URL --out FILE` on one engine of this model and TP size
#   --dry-run     print the commands instead of running them
# Environment: COST_MODEL, NNODES (2), GPUS_PER_NODE (8), GPU_MEM_GIB (80), MODEL_PATH, TRAIN_FILE, VAL_FILE,
#   RAY_ADDRESS (a running Ray cluster, e.g. from launch/slurm_ray.sbatch; default: the config's trainer.ray_address).
# Runs `megatron-dapo plan` first so that a layout or memory problem fails before anything starts.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
DEFAULT_STALENESS=2
parse_advanced_args "$@"

run_model_job "$REPO_ROOT/configs/qwen3/advanced_qwen2.5_7b_fsdp.yaml" 2 "trainer.backend=fsdp2" \
  "rollout.routing.cost_model=$COST_MODEL"

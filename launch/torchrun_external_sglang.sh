#!/usr/bin/env bash
# Trainer ranks under torchrun, generating with SGLang servers that already run elsewhere.
#
# Usage (on every trainer node): launch/torchrun_external_sglang.sh [--dry-run] CONFIG [key.sub=value ...]
# Environment: NNODES (1), NODE_RANK (0), NPROC_PER_NODE (8), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500),
#   SGLANG_SERVERS  comma-separated server URLs (http://host:port,...); default: the config's rollout.servers.
# Every rank trains (trainer.launcher=torchrun); the trainer world size is NNODES * NPROC_PER_NODE,
# so the config's tp * pp * cp * dp must equal it. Start the servers first, e.g. with
#   python -m sglang.launch_server --model-path MODEL --tp-size 2 --port 30000 --host 0.0.0.0
# (the weight-sync group needs their TP workers to reach MASTER_ADDR).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
parse_dry_run "$@"
if [[ ${#ARGS[@]} -lt 1 ]]; then
  echo "usage: launch/torchrun_external_sglang.sh [--dry-run] CONFIG [key.sub=value ...]" >&2
  exit 2
fi
CONFIG="${ARGS[0]}"
NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
OVERRIDES=("trainer.launcher=torchrun" "rollout.engine=sglang" "trainer.nnodes=$NNODES"
           "trainer.gpus_per_node=$NPROC_PER_NODE" "trainer.world_size=$((NNODES * NPROC_PER_NODE))")
[[ -n "${SGLANG_SERVERS:-}" ]] && OVERRIDES+=("rollout.servers=[$SGLANG_SERVERS]")
# Trainer rank 0 runs on the master node and hosts the weight-update group there: servers on other
# machines reach it at the master's address, not at the default loopback (a later key=value still wins).
if [[ -n "${MASTER_ADDR:-}" && "$MASTER_ADDR" != 127.* && "$MASTER_ADDR" != localhost ]]; then
  BIND_HOST="$(getent ahostsv4 "$MASTER_ADDR" 2>/dev/null | awk 'NR == 1 { print $1 }' || true)"
  OVERRIDES+=("trainer.bind_host=${BIND_HOST:-$MASTER_ADDR}")
fi
OVERRIDES+=("${ARGS[@]:1}")
# Every node on this machine (a loopback MASTER_ADDR): gloo listens on loopback's interface, not on the address
# the host name resolves to.
if [[ "${MASTER_ADDR:-127.0.0.1}" == 127.* || "${MASTER_ADDR:-}" == localhost ]] && [[ -z "${GLOO_SOCKET_IFNAME:-}" ]]; then
  export GLOO_SOCKET_IFNAME=lo
fi

# Validate (config + layout) once before torchrun starts any rank.
run "$MEGATRON_DAPO" config validate "$CONFIG" "${OVERRIDES[@]}"
run torchrun --nnodes="$NNODES" --node-rank="${NODE_RANK:-0}" --nproc-per-node="$NPROC_PER_NODE" \
  --master-addr="${MASTER_ADDR:-127.0.0.1}" --master-port="${MASTER_PORT:-29500}" \
  -m megatron_dapo.cli train --config "$CONFIG" "${OVERRIDES[@]}"

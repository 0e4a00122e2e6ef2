#!/usr/bin/env bash
# The coordination goal settings (issue 25 item 4) through `megatron-dapo simulate`, and the goal table:
# per setting, sync, the best plain async and the best advanced trained tokens/s, the simulated ceiling
# (async with a free trainer and syncs), advanced over async, and advanced's share of the analytic
# ceiling (megatron_dapo/sim/ceiling.py).
#
#   bash benchmarks/coordination_goal.sh                     # from the repository root; CPU only
#   OUT=/tmp/goal SEEDS=3 STEPS=6 bash benchmarks/coordination_goal.sh
#   COST_MODEL=cost.json bash benchmarks/coordination_goal.sh   # a profile-engine fit instead of PSRL's 7B one
#
# Settings (benchmarks/sim/*.yaml, their comments say where each number comes from):
#   psrl_14b_8x8     R1-Distill-Qwen-14B, 32 trainer H100s + 32 TP-1 engines, 128 x 16, lengths mean 10K with
#                    15 % at the 20K cap (a long-CoT run's shape; assumed, not measured)
#   a3b_2+6, a3b_3+5 Qwen3-30B-A3B, 2 + 6 and 3 + 5 nodes (16 / 24 trainer GPUs, 24 / 20 TP-2 engines), 64 x 16,
#                    40K responses, lengths mean 16K with 10 % at the cap (assumed)
#   qwen2.5_7b_2x8   the issue-15 goal: 8 trainer GPUs + 8 engines, 512 x 16, DAPO-like lengths
# Every engine is timed by one cost model (default: PSRL's 7B fit, QWEN_7B_1GPU), which flatters the
# larger models' engines; give COST_MODEL for a measured one. Several minutes per setting on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/goal_out}
SEEDS=${SEEDS:-1}
STEPS=${STEPS:-4}
STALENESS=${STALENESS:-1,2,3}
PY=${PYTHON:-python}
mkdir -p "$OUT"
common=(--modes sync,async,advanced,ceiling --staleness "$STALENESS" --seeds "$SEEDS" --steps "$STEPS" --warmup-steps 1)
[ -n "${COST_MODEL:-}" ] && common+=(--cost-model "$COST_MODEL")

run() {  # name config flags...
  local name=$1 config=$2
  shift 2
  echo "== $name" >&2
  "$PY" -m megatron_dapo.cli simulate "$config" "$@" "${common[@]}" --json "$OUT/$name.json" | tee "$OUT/$name.txt" >&2
}

run psrl_14b_8x8 benchmarks/sim/psrl_r1_distill_qwen_14b_8x8.yaml --length-mean 10000 --cap-share 0.15 --trainer-gpu h100
run a3b_2+6 benchmarks/sim/qwen3_30b_a3b_2+6_64x16_40k.yaml --length-mean 16000 --cap-share 0.1 --trainer-gpu h100
run a3b_3+5 benchmarks/sim/qwen3_30b_a3b_3+5_64x16_40k.yaml --length-mean 16000 --cap-share 0.1 --trainer-gpu h100
run qwen2.5_7b_2x8 benchmarks/sim/qwen2.5_7b_2x8.yaml --trainer-gpu h100

"$PY" - "$OUT" psrl_14b_8x8 a3b_2+6 a3b_3+5 qwen2.5_7b_2x8 <<'PYTHON'
import json
import sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]


def best(rows, mode):
    mine = [r for r in rows if r["mode"] == mode]
    return max(mine, key=lambda r: r["tokens_per_s"]) if mine else None


print("setting | sync tok/s | async tok/s (stale) | advanced tok/s (stale) | sim. ceiling | adv / async | adv of analytic ceiling")
for name in names:
    rows = json.loads((out / f"{name}.json").read_text())
    sync, plain, adv, ceil = (best(rows, m) for m in ("sync", "async", "advanced", "ceiling"))
    cell = lambda r: f"{r['tokens_per_s']:.0f} ({r['staleness']})" if r else "-"  # noqa: E731
    ratio = f"{adv['tokens_per_s'] / plain['tokens_per_s']:.2f}" if adv and plain else "-"
    share = f"{adv['ceiling_share']:.2f}" if adv else "-"
    tps = lambda r: f"{r['tokens_per_s']:.0f}" if r else "-"  # noqa: E731
    print(f"{name} | {tps(sync)} | {cell(plain)} | {cell(adv)} | {tps(ceil)} | {ratio} | {share}")
PYTHON

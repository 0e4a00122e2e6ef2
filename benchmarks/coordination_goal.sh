#!/usr/bin/env bash
# The coordination goal settings (issue 25 item 4) through `megatron-dapo simulate`, and the goal table:
# per setting, sync, the best plain async and the best advanced produced tokens/s (trained tokens plus the
# change in completed groups held for later steps, per second: what a long run trains), the simulated ceiling
# (async with a free trainer and syncs), advanced over async and over sync, and the rows' trained tokens/s.
#
#   bash benchmarks/coordination_goal.sh                     # from the repository root; CPU only
#   OUT=/tmp/goal SEEDS=3 STEPS=12 STALENESS=2 CHECK_MS=1000 bash benchmarks/coordination_goal.sh   # goal rows
#       # (>= 12 measured steps; the PSRL-like rows of benchmarks/RESULTS.md used 30)
#   COST_MODEL=cost.json bash benchmarks/coordination_goal.sh   # a profile-engine fit instead of PSRL's 7B one
#   SETTINGS="a3b_2+6 qwen2.5_7b_2x8" bash benchmarks/coordination_goal.sh   # only those (two shells at once)
#   TABLE_ONLY=1 bash benchmarks/coordination_goal.sh     # the goal table of the settings' JSONs under OUT
#   CHECK_MS=1000 bash benchmarks/coordination_goal.sh    # the advanced rows at the ablation's intervals (below)
#   SEEDS=3 STEPS=6 bash benchmarks/coordination_goal.sh ablation [VARIANT ...]
#   bash benchmarks/coordination_goal.sh ablation-table   # only the table of the rows under OUT
#       # issue 25 item 5: the PSRL-like setting at staleness 2, plain async, the advanced set and the advanced
#       # set with each switch off in turn (VARIANTs: the names below, default all), then the ablation table;
#       # CHECK_MS (default 1000) sets the advanced rows' sync / migration check and load poll intervals: at
#       # the YAMLs' 100 / 200 ms, reading 32 engines' loads ten times a simulated second costs ~20 s of CPU
#       # per simulated step; a second is still small beside this setting's ~9-minute steps
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
common=(--staleness "$STALENESS" --seeds "$SEEDS" --steps "$STEPS" --warmup-steps 1)
[ -n "${COST_MODEL:-}" ] && common+=(--cost-model "$COST_MODEL")

run() {  # name config flags...
  local name=$1 config=$2
  shift 2
  echo "== $name" >&2
  "$PY" -m megatron_dapo.cli simulate "$config" "$@" "${common[@]}" --json "$OUT/$name.json" | tee "$OUT/$name.txt" >&2
}

PSRL=(benchmarks/sim/psrl_r1_distill_qwen_14b_8x8.yaml --length-mean 10000 --cap-share 0.15 --trainer-gpu h100)

if [ "${1:-}" = ablation ] || [ "${1:-}" = ablation-table ]; then
  [ "$1" = ablation-table ] && names=(none) || names=("${@:2}")
  # name: the overrides on top of the advanced YAML's switches (the simulator applies them last)
  STATUS="rollout.sync.policy=status_based rollout.sync.indicator=kv_cache rollout.sync.check_req_before_sync=false"
  declare -A VARIANTS=(
    [advanced]=""
    [no_routing]="rollout.routing.method=least_outstanding"
    [no_queue]="rollout.queue.policy=fifo"
    [aao_sync]="rollout.sync.policy=all_at_once"
    # PSRL's sync rule (the YAMLs' default until the 2026-12-06 ablation; RESULTS.md "Ablation of the advanced set")
    [status_sync]="$STATUS rollout.sync.threshold=0.99"
    [no_migration]="rollout.migration.enabled=false"
    [no_retry]="rollout.retry.enabled=false"
    [no_redundancy]="rollout.redundancy.extra_prompts=0"
    # scaled to the 128-prompt batch (the YAMLs' values are for 512): 1/16 of it, and retry's 4 / 512
    [redundancy_8]="rollout.redundancy.extra_prompts=8"
    [retry_1]="rollout.retry.threshold=1"
    [scaled]="rollout.redundancy.extra_prompts=8 rollout.retry.threshold=1"
    # PSRL's status_based sync's KV-cache threshold, with least_outstanding routing and with throughput_optimal
    [lo_kv_0.5]="rollout.routing.method=least_outstanding $STATUS rollout.sync.threshold=0.5"
    [lo_kv_0.7]="rollout.routing.method=least_outstanding $STATUS rollout.sync.threshold=0.7"
    [lo_kv_0.9]="rollout.routing.method=least_outstanding $STATUS rollout.sync.threshold=0.9"
    [lo_kv_0.99]="rollout.routing.method=least_outstanding $STATUS rollout.sync.threshold=0.99"
    [to_kv_0.7]="rollout.routing.method=throughput_optimal $STATUS rollout.sync.threshold=0.7"
    [to_kv_0.99]="rollout.routing.method=throughput_optimal $STATUS rollout.sync.threshold=0.99"
  )
  [ ${#names[@]} -eq 0 ] && names=(async advanced no_routing no_queue aao_sync status_sync no_migration no_retry no_redundancy)
  common=(--staleness "${STALENESS%%,*}" --seeds "$SEEDS" --steps "$STEPS" --warmup-steps 1)
  checks=("rollout.sync.check_interval_ms=${CHECK_MS:-1000}" "rollout.loads.interval_ms=${CHECK_MS:-1000}")
  [ -n "${COST_MODEL:-}" ] && common+=(--cost-model "$COST_MODEL")
  for name in "${names[@]}"; do
    if [ "$name" = none ]; then
      continue
    elif [ "$name" = async ]; then
      run "ablation_$name" "${PSRL[@]}" --modes async
    else
      # shellcheck disable=SC2086  # the overrides are words
      run "ablation_$name" "${PSRL[@]}" --modes advanced "${checks[@]}" ${VARIANTS[$name]?unknown variant $name}
    fi
  done
  exec "$PY" - "$OUT" <<'PYTHON'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = {p.stem.removeprefix("ablation_"): json.loads(p.read_text())[0] for p in sorted(out.glob("ablation_*.json"))}


RATE = "produced_per_s"  # as in the goal table below; older JSONs: their trained rate


def spread(row, key, fmt):
    values = [s.get(key, s["tokens_per_s"] if key == RATE else None) for s in row.get("seeds", [row])]
    return f"{sum(values) / len(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def ratio(row, base):
    rate = lambda r: r.get(RATE, r["tokens_per_s"])  # noqa: E731
    return f"{rate(row) / rate(rows[base]):.2f}" if base in rows else "-"


print("variant | produced tok/s [seed range] | x advanced | x async | trained tok/s | trainer busy | rollout busy | step s | migrations | aborted tok | decode batch | refusals")
for name, r in rows.items():
    cells = [spread(r, RATE, ".0f"), ratio(r, "advanced"), ratio(r, "async"), spread(r, "tokens_per_s", ".0f")]
    cells += [spread(r, k, f) for k, f in (("trainer_busy", ".2f"), ("rollout_busy", ".2f"), ("step_s", ".0f"))]
    cells += [f"{r[k]:.0f}" for k in ("migrations", "aborted_tokens")] + [f"{r['mean_decode_batch']:.1f}", f"{r['refusals']:.0f}"]
    print(" | ".join([name, *cells]))
PYTHON
fi

declare -A SETTING_ARGS=(
  [psrl_14b_8x8]="${PSRL[*]}"
  [a3b_2+6]="benchmarks/sim/qwen3_30b_a3b_2+6_64x16_40k.yaml --length-mean 16000 --cap-share 0.1 --trainer-gpu h100"
  [a3b_3+5]="benchmarks/sim/qwen3_30b_a3b_3+5_64x16_40k.yaml --length-mean 16000 --cap-share 0.1 --trainer-gpu h100"
  [qwen2.5_7b_2x8]="benchmarks/sim/qwen2.5_7b_2x8.yaml --trainer-gpu h100"
)
all_settings=(psrl_14b_8x8 a3b_2+6 a3b_3+5 qwen2.5_7b_2x8)
# SETTINGS="a b" runs only those (e.g. two at once in separate shells); TABLE_ONLY=1 prints the table of
# the JSONs already under OUT
read -r -a settings <<<"${SETTINGS:-${all_settings[*]}}"
if [ -z "${TABLE_ONLY:-}" ]; then
  for name in "${settings[@]}"; do
    read -r -a args <<<"${SETTING_ARGS[$name]?unknown setting $name}"
    if [ -z "${CHECK_MS:-}" ]; then
      run "$name" "${args[@]}" --modes sync,async,advanced,ceiling
    else  # the advanced rows with the ablation's check / poll interval, in a run of their own; then one JSON
      run "$name.plain" "${args[@]}" --modes sync,async,ceiling
      run "$name.advanced" "${args[@]}" --modes advanced "rollout.sync.check_interval_ms=$CHECK_MS" \
        "rollout.loads.interval_ms=$CHECK_MS"
      "$PY" -c 'import json, sys; json.dump([r for p in sys.argv[2:] for r in json.load(open(p))], open(sys.argv[1], "w"))' \
        "$OUT/$name.json" "$OUT/$name.plain.json" "$OUT/$name.advanced.json"
    fi
  done
fi
done_settings=()
for name in "${all_settings[@]}"; do [ -f "$OUT/$name.json" ] && done_settings+=("$name"); done

"$PY" - "$OUT" "${done_settings[@]}" <<'PYTHON'
import json
import sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]


# Rates are produced tokens/s (trained + the change in completed groups held for later steps, per second of
# the window): over a few steps a run that fills or drains its staleness buffers trains up to ~25 % more or
# less than it produces (RESULTS.md, "The goal table"). Older JSONs have no
# produced_per_s: their trained rate stands in.
RATE = "produced_per_s"


def rate(r):
    return r.get(RATE, r["tokens_per_s"])


def best(rows, mode):
    mine = [r for r in rows if r["mode"] == mode]
    return max(mine, key=rate) if mine else None


def spread(r, key, fmt):
    values = [s.get(key, s["tokens_per_s"] if key == RATE else None) for s in r.get("seeds", [r])]
    return f"{sum(values) / len(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


print(
    "setting | sync tok/s | async produced tok/s [seeds] (stale) | advanced produced tok/s [seeds] (stale) | sim. ceiling"
    " | adv / async | adv / sync | async, adv trained tok/s | async, adv rollout busy"
)
for name in names:
    rows = json.loads((out / f"{name}.json").read_text())
    sync, plain, adv, ceil = (best(rows, m) for m in ("sync", "async", "advanced", "ceiling"))
    cell = lambda r: f"{spread(r, RATE, '.0f')} ({r['staleness']})" if r else "-"  # noqa: E731
    ratio = lambda a, b: f"{rate(a) / rate(b):.2f}" if a and b else "-"  # noqa: E731
    both = lambda key, fmt: " / ".join(spread(r, key, fmt) if r else "-" for r in (plain, adv))  # noqa: E731
    tps = lambda r: f"{rate(r):.0f}" if r else "-"  # noqa: E731
    cells = [tps(sync), cell(plain), cell(adv), tps(ceil), ratio(adv, plain), ratio(adv, sync)]
    print(" | ".join([name, *cells, both("tokens_per_s", ".0f"), both("rollout_busy", ".2f")]))
PYTHON

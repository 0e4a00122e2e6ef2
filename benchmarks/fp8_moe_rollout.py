"""FP8 rollout on the tiny MoE CPU config: the rollout / trainer mismatch with fp8_block vs bf16 weights on the servers.

Trains `--steps` steps of configs/qwen3/tiny_qwen3_moe_cpu.yaml (EP=2 trainer on gloo, one embedded server; the
model, task and short responses of benchmarks/routing_replay.py; routing replay on, its MoE default) per seed,
with `rollout.weight_format=bf16` and `fp8_block`, both with the default correction (token_tis) and staleness 0:
every sample of step s comes from the weights the trainer synced after step s - 1 (step 0: the servers' start
weights), so `actor/mismatch_k3_lag0` is the engine's own mismatch after each sync. bf16 keeps
`rollout.sync.verify` (the servers' logprobs checked against the trainer's after each sync); fp8_block
cannot (validation refuses it: the servers run the FP8-rounded weights by design).

    python benchmarks/fp8_moe_rollout.py [--steps 4] [--seeds 0 1 2] [--workdir /tmp/fp8_moe_rollout]

Prints per format and seed: k3 over all tokens (mean over steps), k3 at lag 0 after a sync (mean over steps
1..), at step 0 (the start weights: the FP8 conversion for fp8_block), the mean |train - rollout logprob|,
the mean token-TIS weight, the routing agreement (the trainer's own routers vs the replayed rollout routing),
the bytes per sync, whether every logged scalar of every step is finite, and wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMATS = {"bf16": [], "fp8_block": ["rollout.sync.verify=false"]}


def overrides(model: Path, train: Path, run_dir: Path, fmt: str, seed: int, steps: int) -> list[str]:
    """The tiny MoE run of benchmarks/routing_replay.py with `fmt` on the servers, staleness 0, seed `seed`
    (also the end-to-end test's run, tests/trainer/test_fp8_moe_rollout.py)."""
    from benchmarks.routing_replay import run_overrides

    extra = ["checkpoint.save_every=0", "algo.staleness=0", f"rollout.weight_format={fmt}", *FORMATS[fmt]]
    return run_overrides(model, train, run_dir, steps, *extra, f"trainer.seed={seed}", f"data.seed={seed}")


def train(model: Path, train_file: Path, run_dir: Path, fmt: str, seed: int, steps: int) -> tuple[list[dict], float]:
    """metrics.jsonl rows of one run and its wall time; raises with the log's tail when it fails. A run whose
    bench.json says it finished is read, not run again (a sweep can be resumed or re-tabulated)."""
    from benchmarks.routing_replay import CONFIG

    done = run_dir / "bench.json"
    if done.exists():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return rows, json.loads(done.read_text())["wall_s"]
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "train", "--config", str(CONFIG)]
    cmd += overrides(model, train_file, run_dir, fmt, seed, steps)
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{fmt} seed {seed} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    done.write_text(json.dumps({"wall_s": time.time() - t0, "cmd": cmd}))
    return rows, time.time() - t0


def all_finite(rows: list[dict]) -> bool:
    return all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, (int, float)))


def summary(rows: list[dict]) -> dict:
    def mean(key, rs=rows):
        vals = [r[key] for r in rs if key in r]
        return statistics.fmean(vals) if vals else float("nan")

    return {
        "k3": mean("actor/mismatch_k3"),
        "k3_lag0_synced": mean("actor/mismatch_k3_lag0", rows[1:]),
        "k3_lag0_start": rows[0].get("actor/mismatch_k3_lag0", float("nan")),
        "abs_diff": mean("actor/train_rollout_logprob_abs_diff"),
        "tis_weight": mean("actor/rollout_corr_weight_mean"),
        "routing_agreement": mean("actor/routing_agreement"),
        "sync_bytes": mean("sync/bytes"),
        "finite": all_finite(rows),
        "steps": len(rows),
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks.routing_replay import prepare

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workdir", default="/tmp/fp8_moe_rollout")
    p.add_argument("--json", help="also write the summaries here")
    args = p.parse_args(argv)
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model, train_file = prepare(work)
    results = []
    for seed in args.seeds:  # seed by seed, both formats: the machine's load drifts alike for both
        for fmt in FORMATS:
            rows, wall = train(model, train_file, work / f"{fmt}_seed{seed}", fmt, seed, args.steps)
            results.append({"format": fmt, "seed": seed, "wall_s": wall, **summary(rows)})
            print(json.dumps(results[-1]), flush=True)
    cols = {
        "format": "{format}",
        "seed": "{seed}",
        "k3": "{k3:.2e}",
        "k3 lag 0, after a sync": "{k3_lag0_synced:.2e}",
        "k3 lag 0, step 0": "{k3_lag0_start:.2e}",
        "abs logprob diff": "{abs_diff:.2e}",
        "TIS weight": "{tis_weight:.4f}",
        "routing agreement": "{routing_agreement:.3f}",
        "bytes per sync": "{sync_bytes:.0f}",
        "finite": "{finite}",
        "wall s": "{wall_s:.0f}",
    }
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(fmt.format(**r) for fmt in cols.values()) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

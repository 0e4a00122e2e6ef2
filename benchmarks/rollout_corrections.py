"""Rollout corrections and policy losses under a perturbed rollout engine, on the CPU demo (issue 38).

Each run is `megatron-dapo demo` (the tiny Qwen3, the arithmetic task, 2 embedded servers, TP=2
trainer on gloo) with `algo.staleness=3`, every run sharing one prepared warm start
(`demo --prepared-dir`). The rollout engine is perturbed: `rollout.extra_args=[--dtype,bfloat16]`
makes the embedded servers compute in bf16 while the trainer stays fp32, so the rollout logprobs
differ from the trainer's old-policy logprobs even at lag 0 (the `fp32` baseline shows the mismatch
from staleness alone). Variants:

    token_tis   DAPO loss, token-level truncated IS (upper 2)
    token_mis   DAPO loss, token-level masked IS (weights zeroed above 2)
    geo_reject  DAPO loss, token TIS + geometric rejection (verl's seq_mean_k1 bounds 0.999 / 1.001)
    icepop      DAPO loss, IcePop mask [0.5, 5] (Ring-1T's alpha, beta)
    gspo        GSPO loss (seq-mean-token-mean) + token TIS
    cispo       CISPO loss + token TIS
    seq_tis     DAPO loss, sequence-level truncated IS (upper 2: verl's decoupled_seq_is preset)
    seq_mis     DAPO loss, sequence-level masked IS in [0.5, 2] (the bounds of verl's decoupled_seq_is_rs)
    geo_wide    token TIS + geometric rejection at 0.99 / 1.01 (10x verl's preset width; see GEO_WIDE)
    bypass_tis  token TIS with bypass: rollout logprobs as the old policy, no old-logprob forward
    fp32        token_tis with fp32 servers (the unperturbed engine), with --baseline

The first six are the issue's; `run` does them by default, `--variants` picks others.

Each run's metrics.jsonl (and a `bench.json` with its wall time and exit status) stays under
`--root/<variant>/seed<k>`; `table` reads them, so a partial sweep can be tabulated (step-averaged
columns, then some of them over each third of the steps). Runs are done seed by seed (all variants of
seed 0 first), and a run whose bench.json says it finished is skipped.

    python benchmarks/rollout_corrections.py run --root runs/rc --steps 12 --seeds 0 1 2 [--baseline]
    python benchmarks/rollout_corrections.py table --root runs/rc
    python benchmarks/rollout_corrections.py moe --root runs/rc --steps 4

`moe` trains the tiny MoE CPU config (configs/qwen3/tiny_qwen3_moe_cpu.yaml, EP=2; the model, task and
short-response settings of benchmarks/routing_replay.py) with GSPO + rollout routing replay and staleness
3, and prints per step the loss, GSPO's clip fraction, the routing agreement, the mismatch metrics and
whether every logged scalar is finite.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

BF16 = ["rollout.extra_args=[--dtype,bfloat16]", "rollout.sync.verify=false"]  # verify expects fp32 equality
GSPO = ["algo.policy_loss=gspo", "algo.loss_agg_mode=seq-mean-token-mean", "algo.rollout_correction.mode=token_tis"]
VARIANTS: dict[str, list[str]] = {
    "token_tis": [*BF16, "algo.rollout_correction.mode=token_tis"],
    "token_mis": [*BF16, "algo.rollout_correction.mode=token_mis"],
    "geo_reject": [*BF16, "algo.rollout_correction.mode=token_tis", "algo.rollout_correction.geo_reject.enable=true"],
    "icepop": [
        *BF16,
        "algo.rollout_correction.mode=icepop",
        "algo.rollout_correction.lower=0.5",
        "algo.rollout_correction.upper=5.0",
    ],
    "gspo": [*BF16, *GSPO],
    "cispo": [*BF16, "algo.policy_loss=cispo", "algo.rollout_correction.mode=token_tis"],
}
# verl's geometric presets (decoupled_geo_rs and the rest, verl 0.9.1) all use 0.999 / 1.001, which rejected
# 93 % of the responses at staleness 3 here; +-1 % (0.99_1.01 in verl's rollout_rs_threshold syntax) is the
# next decade out. Symmetric, so verl's inverted ratio (docs/algorithm.md) gives the same bounds within 1e-4.
GEO_WIDE = ["algo.rollout_correction.geo_reject.lower=0.99", "algo.rollout_correction.geo_reject.upper=1.01"]
EXTRA_VARIANTS: dict[str, list[str]] = {
    "seq_tis": [*BF16, "algo.rollout_correction.mode=seq_tis"],
    "seq_mis": [*BF16, "algo.rollout_correction.mode=seq_mis", "algo.rollout_correction.lower=0.5"],
    "geo_wide": [
        *BF16,
        "algo.rollout_correction.mode=token_tis",
        "algo.rollout_correction.geo_reject.enable=true",
        *GEO_WIDE,
    ],
    "bypass_tis": [*BF16, "algo.rollout_correction.mode=token_tis", "algo.rollout_correction.bypass=true"],
}
BASELINE = {"fp32": ["algo.rollout_correction.mode=token_tis"]}
ALL_VARIANTS = {**VARIANTS, **EXTRA_VARIANTS, **BASELINE}
VAL = "val/math_dapo/acc/mean@4"
# (column, metrics.jsonl key): averaged over the training steps of a run, then over seeds
MISMATCH = [
    ("k3", "actor/mismatch_k3"),
    ("k3 lag0", "actor/mismatch_k3_lag0"),
    ("chi2 tok", "actor/mismatch_chi2_token"),
    ("tok rej", "actor/mismatch_token_rejected_frac"),
    ("seq rej", "actor/mismatch_seq_rejected_frac"),
    ("w mean", "actor/rollout_corr_weight_mean"),
    ("train acc", "reward/accuracy"),
]
WINDOWS = 3  # the second table: these columns averaged over each third of the steps, then over seeds
OVER_STEPS = ["k3", "chi2 tok", "seq rej", "train acc"]


def run_overrides(name: str, seed: int, steps: int, staleness: int) -> list[str]:
    """The config overrides one run passes to `megatron-dapo demo`, after the demo's own."""
    return [
        f"algo.staleness={staleness}",
        f"trainer.seed={seed}",
        f"data.seed={seed}",
        f"trainer.val_every={max(1, steps // 2)}",  # held-out at the start, mid-way and the end
        *ALL_VARIANTS[name],
    ]


def run_one(root: Path, prepared: Path, name: str, seed: int, steps: int, staleness: int):
    out = root / name / f"seed{seed}"
    done = out / "bench.json"
    if done.exists() and json.loads(done.read_text())["rc"] == 0:
        print(f"{name} seed {seed}: done, skipped", flush=True)
        return
    cmd = [
        sys.executable,
        "-m",
        "megatron_dapo.cli",
        "demo",
        "--run-dir",
        str(out),
        "--prepared-dir",
        str(prepared),
        "--steps",
        str(steps),
        *run_overrides(name, seed, steps, staleness),
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)  # a failed earlier attempt: start over
    t0 = time.time()
    with open(out / "demo.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    tmp = out / "bench.json.tmp"
    tmp.write_text(json.dumps({"rc": rc, "wall_s": wall, "cmd": cmd}))
    tmp.rename(done)
    print(f"{name} seed {seed}: rc {rc}, {wall:.0f}s", flush=True)


def read_run(path: Path) -> dict | None:
    """Held-out mean@4 per validation step, training-step means of the mismatch columns, wall time."""
    if not (path / "metrics.jsonl").exists():
        return None
    rows = [json.loads(line) for line in open(path / "metrics.jsonl") if line.strip()]
    val = {r["step"]: r[VAL] for r in rows if VAL in r}
    train = [r for r in rows if "actor/pg_loss" in r]
    out = {"val": val, "steps": len(train)}
    for col, key in MISMATCH:
        vals = [r[key] for r in train if key in r]
        out[col] = statistics.fmean(vals) if vals else None
    out["windows"] = {col: _window_means(train, dict(MISMATCH)[col]) for col in OVER_STEPS}
    bench = path / "bench.json"
    if bench.exists():
        out.update({k: json.loads(bench.read_text())[k] for k in ("rc", "wall_s")})
    else:  # the sweep was stopped while this run went on: the demo prints its wall time when it completes
        log = path / "demo.log"
        walls = re.findall(r"^wall time (\d+)s", log.read_text(), re.M) if log.exists() else []
        out.update({"rc": 0 if walls else None, "wall_s": float(walls[-1]) if walls else None})
    return out


def _window_means(train: list[dict], key: str) -> list[float | None]:
    """The mean of `key` over each of WINDOWS consecutive, equal shares of the training steps."""
    windows: list[list[float]] = [[] for _ in range(WINDOWS)]
    for i, r in enumerate(train):
        if key in r:
            windows[i * WINDOWS // len(train)].append(r[key])
    return [statistics.fmean(w) if w else None for w in windows]


def _ms(xs: list[float], fmt: str) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(statistics.fmean(xs), fmt)}±{format(statistics.stdev(xs), fmt)}"


def table(root: Path, seeds: list[int] | None = None) -> str:
    """One row per variant over its completed runs (of `seeds`, default all), then end mean@4 per seed."""
    names = [n for n in ALL_VARIANTS if (root / n).is_dir()]
    head = ["variant", "seeds", "steps", "mean@4 start", "mid", "end", *[c for c, _ in MISMATCH], "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    per_seed = []
    over_steps = {}
    for name in names:
        runs = {}
        for d in sorted((root / name).glob("seed*")):
            if seeds is not None and int(d.name.removeprefix("seed")) not in seeds:
                continue
            r = read_run(d)
            if r is not None and r["rc"] == 0:
                runs[d.name] = r
        if not runs:
            continue
        steps = sorted({r["steps"] for r in runs.values()})
        last = max(steps)
        mid = last // 2
        cols = [
            name,
            str(len(runs)),
            "/".join(map(str, steps)),
            _ms([r["val"][0] for r in runs.values() if 0 in r["val"]], ".3f"),
            _ms([r["val"][mid] for r in runs.values() if mid in r["val"]], ".3f"),
            _ms([r["val"][last] for r in runs.values() if last in r["val"]], ".3f"),
        ]
        for col, _ in MISMATCH:
            xs = [r[col] for r in runs.values() if r[col] is not None]
            cols.append(_ms(xs, ".3f" if col in ("tok rej", "seq rej", "w mean", "train acc") else ".2e"))
        cols.append(_ms([r["wall_s"] for r in runs.values()], ".0f"))
        lines.append("| " + " | ".join(cols) + " |")
        over_steps[name] = [
            _ms([r["windows"][col][w] for r in runs.values() if r["windows"][col][w] is not None], ".3g")
            for col in OVER_STEPS
            for w in range(WINDOWS)
        ]
        per_seed.append(
            f"{name}: end mean@4 per seed "
            + ", ".join(f"{s}={r['val'].get(last, float('nan')):.3f}" for s, r in sorted(runs.items()))
        )
    head = ["variant", *[f"{col} {w + 1}/{WINDOWS}" for col in OVER_STEPS for w in range(WINDOWS)]]
    windows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    windows += ["| " + " | ".join([name, *cells]) + " |" for name, cells in over_steps.items()]
    return "\n".join([*lines, "", *per_seed, "", "Over the steps (each third of a run's steps):", "", *windows])


MOE_COLUMNS = [
    "actor/pg_loss",
    "actor/pg_clipfrac_upper",
    "actor/pg_clipfrac_lower",
    "actor/grad_norm",
    "actor/routing_agreement",
    "actor/train_rollout_logprob_abs_diff",
    "actor/mismatch_k3",
    "reward/score_mean",
]


def moe(root: Path, steps: int) -> str:
    from benchmarks.routing_replay import CONFIG, prepare, run_overrides

    work = root / "moe"
    work.mkdir(parents=True, exist_ok=True)
    model, train = prepare(work)
    run_dir = work / "run"
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    extra = ["checkpoint.save_every=0", "algo.routing_replay=rollout", "algo.staleness=3", *GSPO]
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "train", "--config", str(CONFIG)]
    cmd += run_overrides(model, train, run_dir, steps, *extra)
    t0 = time.time()
    with open(work / "train.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc:
        raise SystemExit(f"moe run failed (rc {rc}): see {work / 'train.log'}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    short = [c.split("/", 1)[1] for c in MOE_COLUMNS]
    lines = [
        f"tiny Qwen3-MoE (EP=2), GSPO + routing replay, staleness 3: {len(rows)} steps in {time.time() - t0:.0f}s",
        "| step | " + " | ".join(short) + " | all finite |",
        "|" + "---|" * (len(short) + 2),
    ]
    for r in rows:
        scalars = [v for v in r.values() if isinstance(v, (int, float))]
        finite = all(math.isfinite(v) for v in scalars)
        cells = [format(r[c], ".4g") if c in r else "-" for c in MOE_COLUMNS]
        lines.append(f"| {r['step']} | " + " | ".join(cells) + f" | {finite} ({len(scalars)} scalars) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", default="runs/rollout_corrections")
    r.add_argument("--steps", type=int, default=12)
    r.add_argument("--staleness", type=int, default=3)
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(ALL_VARIANTS))
    r.add_argument("--baseline", action="store_true", help="also the fp32-engine token_tis run, after each seed")
    r.add_argument("--warm-steps", type=int, default=1000)
    t = sub.add_parser("table")
    t.add_argument("--root", default="runs/rollout_corrections")
    t.add_argument("--seeds", type=int, nargs="+", default=None, help="only these seeds (default: every seed run)")
    m = sub.add_parser("moe")
    m.add_argument("--root", default="runs/rollout_corrections")
    m.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    root = Path(args.root).resolve()
    if args.cmd == "moe":
        print(moe(root, args.steps))
        return 0
    if args.cmd == "table":
        print(table(root, args.seeds))
        return 0
    prepared = root / "prepared"
    if not (prepared / "model" / "config.json").exists():  # the shared warm start, once
        import torch

        from megatron_dapo.apps.demo import prepare

        # One thread, as `megatron-dapo demo` sets for its own warm start: on a shared small machine torch's
        # spinning intra-op threads slowed this warm start from ~23 to ~1 step/s.
        torch.set_num_threads(1)
        prepare(prepared, args.warm_steps)
    for seed in args.seeds:
        names = list(args.variants) + (list(BASELINE) if args.baseline else [])
        for name in names:
            run_one(root, prepared, name, seed, args.steps, args.staleness)
    print(table(root))
    return 0


if __name__ == "__main__":
    sys.exit(main())

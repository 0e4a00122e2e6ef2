"""`megatron-dapo simulate CONFIG [--nodes N --gpus-per-node G --engines E --step-time S --lengths dapo|FILE ...]`

Predicts cluster-scale throughput by running the project's own rollout coordinator (producer,
staleness reservation, router, sync policies) in virtual time against simulated engines timed by
a cost model and a simulated trainer (megatron_dapo.sim.world). Prints, for synchronous training
(staleness 0), plain async (all_at_once sync) and advanced (an advanced YAML's rollout-coordination
switches), at each staleness asked for: trained tokens/s, rollout and trainer busy fractions, mean staleness,
migrations, aborted tokens.

`--modes ceiling` adds the rollout ceiling: plain async at the largest staleness asked, with a trainer
that takes no time and weight syncs that cost nothing. What is left is the engines (their KV pools,
the length distribution) and dynamic sampling's filtered groups; a coordinator that neither makes
engines decode faster than at a full KV pool nor filters fewer groups cannot train faster than this.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from megatron_dapo.config import derived
from megatron_dapo.config.cost_model import QWEN_7B_1GPU, CostModel
from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.load import load_config
from megatron_dapo.planner.cluster_args import MAX_COUNT, add_cluster_args, cluster_overrides
from megatron_dapo.planner.colocation import colocated_phases, cpu_optimizer_step_s
from megatron_dapo.planner.lengths import lengths_by_mean, load_lengths, mean_length
from megatron_dapo.planner.memory import GiB, rollout_memory, training_memory
from megatron_dapo.planner.speed import (
    DEFAULT_LINK_GB_S,
    peak_tflops,
    trainer_speed,
    weight_sync_s,
)
from megatron_dapo.runtime.cli_args import number
from megatron_dapo.sim.cluster import kv_tokens_per_engine, model_shape
from megatron_dapo.sim.slowdown import RandomSlowdowns, Slowdown

# The rollout-coordination switches `advanced` takes from an advanced YAML (sections of `rollout`, or
# `section.field` for single fields); everything else (model, cluster, batch, staleness) stays the
# simulated config's. One definition of "advanced": the advanced launchers' own config.
ADVANCED_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "qwen3" / "advanced_qwen3_8b.yaml"
ADVANCED_KEYS = (
    "concurrency",
    "partial_rollout",
    "sync.policy",
    "sync.indicator",
    "sync.threshold",
    "sync.check_req_before_sync",
    "routing",
    "queue",
    "migration",
    "retry",
    "redundancy",
    "loads",
)
PLAIN = ["rollout.sync.policy=all_at_once"]


def advanced_overrides(path: str | Path = ADVANCED_CONFIG, batch: int | None = None) -> list[str]:
    """`key=value` overrides that set ADVANCED_KEYS of `rollout` to the advanced YAML's values; with
    `batch` (the simulated train_batch_size), its group counts scaled to that batch (batch_scaled)."""

    if not Path(path).is_file():
        raise ValueError(f"--advanced-config: {path} not found")
    yaml_cfg = load_config(str(path), [], validate=False)
    rollout = yaml_cfg.rollout
    out = []
    for key in ADVANCED_KEYS:
        value = rollout
        for part in key.split("."):
            value = getattr(value, part)
        items = dataclasses.asdict(value).items() if dataclasses.is_dataclass(value) else [(None, value)]
        for name, v in items:
            if key == "routing" and name == "cost_model":
                continue  # the simulated engines' cost model (--cost-model) is the router's
            dotted = f"rollout.{key}" + (f".{name}" if name else "")
            out.append(f"{dotted}={v if isinstance(v, str) else json.dumps(v)}")  # a str field keeps the text
    return out if batch is None else out + batch_scaled(yaml_cfg, batch)


def batch_scaled(yaml_cfg, batch: int) -> list[str]:
    """`rollout.redundancy.extra_prompts` and `rollout.retry.threshold` count groups, sized for the YAML's
    own batch (32 and 4 of 512): the same shares of `batch`, rounded (a threshold rounding to 0 turns
    retry off). Unscaled, 32 spare prompts at 128 abort a quarter of the work
    (docs/design/advanced-coordination.md)."""
    share = batch / yaml_cfg.algo.train_batch_size
    rollout = yaml_cfg.rollout
    out = [f"rollout.redundancy.extra_prompts={round(rollout.redundancy.extra_prompts * share)}"]
    if rollout.retry.enabled:
        threshold = round(rollout.retry.threshold * share)
        out.append(f"rollout.retry.threshold={threshold}" if threshold >= 1 else "rollout.retry.enabled=false")
    return out


MODES = ("sync", "async", "advanced", "ceiling")


def mode_overrides(mode: str, advanced_config: str | Path = ADVANCED_CONFIG, batch: int | None = None) -> list[str]:
    """What a mode changes in the config: sync / async / ceiling = all_at_once sync; advanced = the
    advanced YAML's (scaled to `batch`, the simulated train_batch_size, when given)."""
    if mode not in MODES:
        raise ValueError(f"--modes: unknown {mode!r} (one of {', '.join(MODES)})")
    return advanced_overrides(advanced_config, batch) if mode == "advanced" else list(PLAIN)


# Upper bounds of the numeric flags: the simulated coordinator polls in virtual time, so real time grows
# with the simulated seconds (1e5 s steps: ~30 s of real time a mode; 1e300 s: never ends).
MAX_SECONDS = 1e4


def _staleness_list(text: str) -> list[int]:
    one = number(int, 0, MAX_COUNT)
    try:
        values = [one(s.strip()) for s in text.split(",") if s.strip()]
    except argparse.ArgumentTypeError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers in [0, {MAX_COUNT}], got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-dapo simulate", description=__doc__.split("\n\n")[0])
    add_cluster_args(p)
    p.add_argument("--engines", type=number(int, 1, MAX_COUNT), help="rollout engines (sets rollout.num_servers)")
    p.add_argument("--cost-model", help="engine cost model JSON (profile-engine); default PSRL's 7B fit")
    p.add_argument("--max-running", type=number(int, 1), default=1024, help="max running requests per engine (1024)")
    p.add_argument(
        "--engine-admission",
        choices=["sglang", "greedy"],
        default="sglang",
        help="engines' KV budget for admitting: SGLang's (input + a decaying share of every "
        "running request's remaining output) or greedy (the input only)",
    )
    p.add_argument(
        "--engine-speed",
        help="comma list, one per engine: its speed as a multiple of the cost model's (1,1,0.5,...; default all 1)",
    )
    p.add_argument(
        "--engine-kv",
        help="comma list, one per engine: its KV pool in tokens, or a multiple of plan's pool with x (200000,0.5x,...)",
    )
    p.add_argument(
        "--slowdown",
        action="append",
        default=[],
        metavar="ENGINE:FACTOR:START:DURATION[:EVERY]",
        help="engine ENGINE at FACTOR of its speed from START for DURATION s (again every EVERY s); repeatable",
    )
    p.add_argument(
        "--random-slowdowns",
        metavar="EVERY:FACTOR:DURATION",
        help="each engine slowed to FACTOR for DURATION s at random gaps of mean EVERY s (drawn from the seed)",
    )
    p.add_argument(
        "--step-time",
        type=number(float, 0, MAX_SECONDS, low_open=True),
        help="trainer seconds per step; default: plan's FLOPs estimate",
    )
    p.add_argument(
        "--gpu-tflops",
        type=number(float, 0, low_open=True),
        help="peak bf16 TFLOP/s per trainer GPU (instead of --trainer-gpu)",
    )
    p.add_argument(
        "--sync-s",
        type=number(float, 0, MAX_SECONDS),
        help="seconds of one weight sync (default: the model's bytes over --link-gb-s)",
    )
    p.add_argument(
        "--link-gb-s",
        type=number(float, 0, low_open=True),
        help=f"GB/s a weight sync moves the model's bytes at ({DEFAULT_LINK_GB_S:g})",
    )
    p.add_argument("--lengths", help="dapo (default) | a run's metrics.jsonl | JSON with `lengths`")
    p.add_argument(
        "--length-mean",
        type=number(float, 0, low_open=True),
        help="lognormal response lengths of this mean (tokens, after the cap)",
    )
    p.add_argument(
        "--cap-share",
        type=number(float, 0, 1),
        help="with --length-mean: the share of responses cut at max_response_length (0)",
    )
    p.add_argument("--prompt-len", type=number(int, 1), default=256, help="prompt tokens (256)")
    p.add_argument(
        "--keep-prob",
        type=number(float, 0, 1, low_open=True),
        default=0.5,
        help="dynamic sampling: share of groups kept (0.5)",
    )
    p.add_argument("--staleness", type=_staleness_list, default=[0, 1, 2, 3], help="comma list (0,1,2,3)")
    p.add_argument(
        "--modes",
        help="comma list of sync, async, advanced, ceiling (async with a free trainer and syncs); default "
        "sync,async,advanced (trainer.placement=colocated: sync, the only one it can run)",
    )
    p.add_argument(
        "--advanced-config",
        default=str(ADVANCED_CONFIG),
        help="YAML whose rollout-coordination switches `advanced` uses (configs/qwen3/advanced_qwen3_8b.yaml)",
    )
    p.add_argument("--steps", type=number(int, 1, MAX_COUNT), default=6, help="measured steps (6)")
    p.add_argument("--warmup-steps", type=number(int, 0, MAX_COUNT), default=2, help="steps before measuring (2)")
    p.add_argument(
        "--token-unit", type=number(int, 0), default=0, help="tokens per simulated id (0: max_response_length / 1024)"
    )
    p.add_argument("--seed", type=number(int, 0), default=0)
    p.add_argument(
        "--seeds",
        type=number(int, 1, MAX_COUNT),
        default=1,
        help="run each row over seeds seed .. seed+K-1: mean [min-max] (1)",
    )
    p.add_argument("--json", help="also write the rows to this JSON file")
    return p


def _lengths(args, max_len: int, seed: int):
    if args.length_mean is None:
        if args.cap_share is not None:
            raise ValueError("--cap-share needs --length-mean")
        return load_lengths(args.lengths or "dapo", max_len, seed)
    if args.lengths is not None:
        raise ValueError("--lengths and --length-mean: give one of them")
    return lengths_by_mean(args.length_mean, args.cap_share or 0.0, max_len, seed)


def _sync_s(cfg, args) -> float:
    if args.sync_s is not None:
        if args.link_gb_s is not None:
            raise ValueError("--sync-s and --link-gb-s: give one of them")
        if not args.sync_s >= 0:
            raise ValueError(f"--sync-s={args.sync_s} must be >= 0")
        return args.sync_s
    return weight_sync_s(cfg, model_shape(cfg), DEFAULT_LINK_GB_S if args.link_gb_s is None else args.link_gb_s)


def _per_engine(flag: str, text: str | None, parse) -> tuple | None:
    if text is None:
        return None
    try:
        values = tuple(parse(v.strip()) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected a comma list of numbers, one per engine") from None
    if not all(0 < v < float("inf") for v in values):
        raise ValueError(f"{flag} {text!r}: every value must be a finite number > 0")
    return values


def _engine_kvs(text: str | None, pool: int) -> tuple[int, ...] | None:
    """--engine-kv: tokens, or `Fx` for F times plan's pool."""
    kvs = _per_engine("--engine-kv", text, lambda v: pool * float(v[:-1]) if v.endswith("x") else float(v))
    return None if kvs is None else tuple(max(1, int(k)) for k in kvs)


def build_world(cfg, args, seed: int | None = None):
    """The World of `cfg` and the command line's options (`seed`: instead of --seed), and the trainer's
    speed (None with --step-time)."""
    from megatron_dapo.sim.engine import KVAdmission
    from megatron_dapo.sim.world import World

    seed = args.seed if seed is None else seed
    max_len = cfg.data.max_response_length
    lengths = _lengths(args, max_len, seed)
    cost = CostModel.load(args.cost_model) if args.cost_model else QWEN_7B_1GPU
    peak = peak_tflops(args.trainer_gpu, args.gpu_tflops)
    if args.step_time is not None:
        if args.trainer_gpu is not None or args.gpu_tflops is not None:
            raise ValueError("--step-time and --trainer-gpu / --gpu-tflops: give one of them")
        train_s, speed = (lambda tokens: args.step_time), None
    else:
        mean_seq = args.prompt_len + mean_length(lengths)
        speed = trainer_speed(cfg, model_shape(cfg), mean_seq, peak, args.mfu)
        train_s = speed.step_s
    overhead = trainer_overhead_s(cfg, args.gpu_mem_gib)
    if overhead:
        base_s, train_s = train_s, (lambda tokens: base_s(tokens) + overhead)
    unit = args.token_unit or max(1, max_len // 1024)
    pool = kv_tokens_per_engine(cfg, args.gpu_mem_gib)
    engines = cfg.rollout.num_servers
    world = World(
        cost=cost,
        kv_capacity=pool,
        max_running=args.max_running,
        train_s=train_s,
        sync_s=_sync_s(cfg, args),
        keep_prob=args.keep_prob,
        lengths=lengths,
        prompt_len=args.prompt_len,
        token_unit=unit,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        seed=seed,
        admission=KVAdmission() if args.engine_admission == "sglang" else None,
        engine_speed=_per_engine("--engine-speed", args.engine_speed, float),
        engine_kv=_engine_kvs(args.engine_kv, pool),
        slowdowns=tuple(Slowdown.parse(s, engines) for s in args.slowdown),
        random_slowdowns=RandomSlowdowns.parse(args.random_slowdowns) if args.random_slowdowns else None,
    )
    world.check(engines, max_len)
    return world, speed


def trainer_overhead_s(cfg, gpu_mem_gib: float) -> float:
    """Seconds a step adds to the trainer's compute, by the plan's estimate (planner/colocation.py): with
    trainer.placement=colocated the offload / reload over PCIe, with optimizer.cpu_offload the CPU optimizer."""
    if not (derived.colocated(cfg) or cfg.optimizer.cpu_offload):
        return 0.0
    shape = model_shape(cfg)
    co = colocated_phases(cfg, training_memory(cfg, shape), rollout_memory(cfg, shape, int(gpu_mem_gib * GiB)))
    return (co.transfer_s if derived.colocated(cfg) else 0.0) + cpu_optimizer_step_s(cfg, co)


def modes_of(cfg, text: str | None) -> list[str]:
    """--modes (default by placement); a colocated config runs synchronously only. Its simulation is the
    synchronous one: at staleness 0 the producer has nothing in flight once a step's batch is complete
    (every reservation of the version is in it or was dropped), so the engines are idle while the trainer
    trains, as colocated servers (released then) must be; what differs from a split run is the engines and
    trainer GPUs (all of them each), the KV pool and the per-step offload / reload (trainer_overhead_s)."""
    colocated = derived.colocated(cfg)
    modes = [m.strip() for m in (text or ("sync" if colocated else "sync,async,advanced")).split(",") if m.strip()]
    if colocated and modes != ["sync"]:
        raise ValueError(
            f"--modes {','.join(modes)}: trainer.placement=colocated runs synchronously (trainer and engines take "
            f"turns on the same GPUs): --modes sync; simulate the split config for async / advanced / ceiling"
        )
    return modes


def settings(modes: list[str], staleness: list[int]) -> list[tuple[str, int]]:
    rows = []
    for mode in modes:
        if mode == "sync":
            rows.append((mode, 0))
        elif mode == "ceiling":
            rows.append((mode, max([1, *staleness])))
        else:
            rows.extend((mode, s) for s in staleness if s > 0 or mode == "advanced")
    return rows


def ceiling_world(world):
    """The same engines, lengths and filter with a trainer and weight syncs that take no time."""
    return dataclasses.replace(world, train_s=lambda tokens: 0.0, sync_s=0.0, server_sync_s=None)


HEADER = (
    "mode",
    "stale",
    "tokens/s",
    "produced tok/s",
    "trainer busy",
    "rollout busy",
    "of ceiling",
    "x sync",
    "step s",
    "mean stale",
    "migrations",
    "aborted tok",
    "regen tok",
    "decoded tok/s",
    "decode batch",
    "refusals",
    "retractions",
)


def _spread(values: list[float], fmt: str) -> str:
    """One number, or the mean [min-max] of several (one per seed)."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return format(mean, fmt)
    return f"{mean:{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def _mean_row(runs: list[dict]) -> dict:
    """The seeds' mean of every number (an int stays an int when all agree)."""
    out = {}
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        out[key] = first if all(v == first for v in values) else sum(values) / len(values)
    return out


def _format_row(mode: str, s: int, runs: list[dict], sync_tps: float | None) -> str:
    col = lambda key, fmt: _spread([r[key] for r in runs], fmt)  # noqa: E731
    ratio = _spread([r["tokens_per_s"] / sync_tps for r in runs], ".2f") if sync_tps else "-"
    return " | ".join(
        [
            mode,
            str(s),
            col("tokens_per_s", ".0f"),
            col("produced_per_s", ".0f"),
            col("trainer_busy", ".2f"),
            col("rollout_busy", ".2f"),
            col("ceiling_share", ".2f"),
            ratio,
            col("step_s", ".1f"),
            col("mean_staleness", ".2f"),
            col("migrations", ".0f"),
            col("aborted_tokens", ".0f"),
            col("regenerated_tokens", ".0f"),
            col("generated_per_s", ".0f"),
            col("mean_decode_batch", ".1f"),
            col("refusals", ".0f"),
            col("retractions", ".0f"),
        ]
    )


def _describe(config: str, cfg, world, speed, args) -> str:
    w = world
    kv = f"KV pool {w.kv_capacity} tokens each" if w.engine_kv is None else f"KV pools {list(w.engine_kv)}"
    speeds = "" if w.engine_speed is None else f", speeds {list(w.engine_speed)}"
    slow = f"; {len(w.slowdowns)} scripted slowdowns" if w.slowdowns else ""
    if w.random_slowdowns:
        r = w.random_slowdowns
        slow += f"; random slowdowns to {r.factor} for {r.duration} s every ~{r.every} s per engine"
    gpu = args.trainer_gpu or ("h100" if args.gpu_tflops is None else "GPU")
    trainer = (
        f"{args.step_time} s/step"
        if speed is None
        else f"{speed.gpus} x {gpu} at {args.mfu:.0%} of {speed.peak_tflops:.0f} TFLOP/s"
    )
    keep = f"keep {w.keep_prob}" if cfg.algo.filter_groups.enable else "dynamic-sampling filter off"
    how = (
        f"{args.sync_s} s given"
        if args.sync_s is not None
        else f"model bytes over {DEFAULT_LINK_GB_S if args.link_gb_s is None else args.link_gb_s:g} GB/s"
    )
    placement = ""
    if derived.colocated(cfg) or cfg.optimizer.cpu_offload:
        placement = (
            f"; {'colocated (engines released while training)' if derived.colocated(cfg) else 'split'}, trainer "
            f"+{trainer_overhead_s(cfg, args.gpu_mem_gib):.1f} s per step for "
            + " and ".join(
                (["offload / reload"] if derived.colocated(cfg) else [])
                + (["the CPU optimizer"] if cfg.optimizer.cpu_offload else [])
            )
        )
    return (
        f"simulate {config}: {cfg.rollout.num_servers} engines x tp {cfg.rollout.server_tp}, {kv}{speeds}{slow}; "
        f"{cfg.algo.train_batch_size} prompts x {cfg.rollout.n_resp_per_prompt} per step; {w.lengths.describe()}; "
        f"{keep}; trainer {trainer}{placement}; sync {w.sync_s:.2f} s ({how}); {w.warmup_steps}+{w.steps} steps"
    )


def run_all(config: str, overrides: list[str], args, out=None) -> list[dict]:
    from megatron_dapo.sim.ceiling import ceiling
    from megatron_dapo.sim.world import simulate

    out = out or sys.stdout  # at call time: a default bound at import would keep a replaced stdout

    base = [*overrides, *cluster_overrides(args)]
    if args.engines is not None:
        base.append(f"rollout.num_servers={args.engines}")
    if args.seeds < 1:
        raise ValueError(f"--seeds={args.seeds} must be >= 1")
    staleness = args.staleness
    cfg0 = load_config(config, base, validate=False)
    modes = modes_of(cfg0, args.modes)
    changes = {m: mode_overrides(m, args.advanced_config, cfg0.algo.train_batch_size) for m in modes}
    seeds = [args.seed + k for k in range(args.seeds)]
    worlds = [build_world(cfg0, args, seed) for seed in seeds]
    world, speed = worlds[0]
    print(
        _describe(config, cfg0, world, speed, args) + (f"; seeds {seeds[0]}..{seeds[-1]}" if len(seeds) > 1 else ""),
        file=out,
    )
    print(" | ".join(HEADER), file=out)
    rows, sync_tps = [], None
    for mode, s in settings(modes, staleness):
        # the command line's key=value last: an explicit override wins over the mode's switches
        cfg = load_config(config, [*changes[mode], *base, f"algo.staleness={s}"], validate=False)
        runs = []
        for w, _ in worlds:
            w = ceiling_world(w) if mode == "ceiling" else w
            bound = ceiling(cfg, w)
            r = simulate(cfg, w)
            runs.append(
                {
                    **r.summary(),
                    "ceiling_tokens_per_s": bound.value,
                    "ceiling_rollout": bound.rollout,
                    "ceiling_trainer": bound.trainer if math.isfinite(bound.trainer) else None,  # None: free
                    "ceiling_share": r.tokens_per_s / bound.value,
                }
            )
        if mode == "sync":
            sync_tps = sum(r["tokens_per_s"] for r in runs) / len(runs)
        print(_format_row(mode, s, runs, sync_tps), file=out, flush=True)
        row = {"mode": mode, "staleness": s, **_mean_row(runs)}
        if len(runs) > 1:
            row["seeds"] = [{"seed": seed, **r} for seed, r in zip(seeds, runs)]
        rows.append(row)
    if rows:
        print(
            "analytic ceiling (sim/ceiling.py), tokens/s: "
            + ", ".join(
                f"{r['mode']}@{r['staleness']} {r['ceiling_tokens_per_s']:.0f} (rollout {r['ceiling_rollout']:.0f}, "
                + ("trainer free)" if r["ceiling_trainer"] is None else f"trainer {r['ceiling_trainer']:.0f})")
                for r in rows
            ),
            file=out,
        )
    simulated = next((r["tokens_per_s"] for r in rows if r["mode"] == "ceiling"), None)
    if simulated:
        print(
            "of the ceiling: "
            + ", ".join(
                f"{r['mode']}@{r['staleness']} {r['tokens_per_s'] / simulated:.2f}"
                for r in rows
                if r["mode"] != "ceiling"
            ),
            file=out,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)

    try:
        rows = run_all(args.config, args.overrides, args)
    except (ConfigError, ValueError) as e:
        print(f"simulate error: {e}", file=sys.stderr)
        return 2
    if args.json:
        from pathlib import Path

        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps(rows, indent=2) + "\n")
        tmp.replace(args.json)
    return 0

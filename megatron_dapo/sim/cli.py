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
import sys
from pathlib import Path

from megatron_dapo.config.cost_model import QWEN_7B_1GPU, CostModel
from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.load import load_config
from megatron_dapo.planner.lengths import load_lengths, mean_length
from megatron_dapo.planner.speed import DEFAULT_MFU, H100_BF16_TFLOPS, trainer_speed
from megatron_dapo.runtime.cli_args import number
from megatron_dapo.sim.cluster import kv_tokens_per_engine, model_shape

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


def advanced_overrides(path: str | Path = ADVANCED_CONFIG) -> list[str]:
    """`key=value` overrides that set ADVANCED_KEYS of `rollout` to the advanced YAML's values."""

    if not Path(path).is_file():
        raise ValueError(f"--advanced-config: {path} not found")
    rollout = load_config(str(path), [], validate=False).rollout
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
    return out


MODES = ("sync", "async", "advanced", "ceiling")


def mode_overrides(mode: str, advanced_config: str | Path = ADVANCED_CONFIG) -> list[str]:
    """What a mode changes in the config: sync / async / ceiling = all_at_once sync; advanced = the
    advanced YAML's."""
    if mode not in MODES:
        raise ValueError(f"--modes: unknown {mode!r} (one of {', '.join(MODES)})")
    return advanced_overrides(advanced_config) if mode == "advanced" else list(PLAIN)


# Upper bounds of the numeric flags: the simulated coordinator polls in virtual time, so real time grows
# with the simulated seconds (1e5 s steps: ~30 s of real time a mode; 1e300 s: never ends).
MAX_SECONDS = 1e4
MAX_COUNT = 100_000


def _staleness_list(text: str) -> list[int]:
    one = number(int, 0, MAX_COUNT)
    try:
        values = [one(s.strip()) for s in text.split(",") if s.strip()]
    except argparse.ArgumentTypeError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers in [0, {MAX_COUNT}], got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-dapo simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    p.add_argument("--nodes", type=number(int, 1, MAX_COUNT), help="nodes (sets trainer.nnodes)")
    p.add_argument("--gpus-per-node", type=number(int, 1, MAX_COUNT), help="GPUs per node (sets trainer.gpus_per_node)")
    p.add_argument("--engines", type=number(int, 1, MAX_COUNT), help="rollout engines (sets rollout.num_servers)")
    p.add_argument(
        "--gpu-mem-gib",
        type=number(float, 0, MAX_COUNT, low_open=True),
        default=80.0,
        help="GPU memory for the engines' KV pool (80)",
    )
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
        "--step-time",
        type=number(float, 0, MAX_SECONDS, low_open=True),
        help="trainer seconds per step; default: plan's FLOPs estimate",
    )
    p.add_argument(
        "--gpu-tflops",
        type=number(float, 0, low_open=True),
        default=H100_BF16_TFLOPS,
        help=f"peak bf16 TFLOP/s per trainer GPU ({H100_BF16_TFLOPS:g}, H100)",
    )
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU, help=f"trainer model FLOPs utilisation ({DEFAULT_MFU})")
    p.add_argument("--sync-s", type=number(float, 0, MAX_SECONDS), default=5.0, help="seconds of one weight sync (5)")
    p.add_argument("--lengths", default="dapo", help="dapo | a run's metrics.jsonl | JSON with `lengths`")
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
        default="sync,async,advanced",
        help="comma list of sync, async, advanced, ceiling (async with a free trainer and syncs)",
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
    p.add_argument("--json", help="also write the rows to this JSON file")
    return p


def build_world(cfg, args):
    from megatron_dapo.sim.engine import KVAdmission
    from megatron_dapo.sim.world import World

    max_len = cfg.data.max_response_length
    lengths = load_lengths(args.lengths, max_len, args.seed)
    cost = CostModel.load(args.cost_model) if args.cost_model else QWEN_7B_1GPU
    if args.step_time is not None:
        train_s, speed = (lambda tokens: args.step_time), None
    else:
        mean_seq = args.prompt_len + mean_length(lengths)
        speed = trainer_speed(cfg, model_shape(cfg), mean_seq, args.gpu_tflops, args.mfu)
        train_s = speed.step_s
    unit = args.token_unit or max(1, max_len // 1024)
    world = World(
        cost=cost,
        kv_capacity=kv_tokens_per_engine(cfg, args.gpu_mem_gib),
        max_running=args.max_running,
        train_s=train_s,
        sync_s=args.sync_s,
        keep_prob=args.keep_prob,
        lengths=lengths,
        prompt_len=args.prompt_len,
        token_unit=unit,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        admission=KVAdmission() if args.engine_admission == "sglang" else None,
    )
    return world, speed


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


def run_all(config: str, overrides: list[str], args, out=None) -> list[dict]:
    from megatron_dapo.sim.world import simulate

    out = out or sys.stdout  # at call time: a default bound at import would keep a replaced stdout

    base = list(overrides)
    if args.nodes is not None:
        base.append(f"trainer.nnodes={args.nodes}")
    if args.gpus_per_node is not None:
        base.append(f"trainer.gpus_per_node={args.gpus_per_node}")
    if args.engines is not None:
        base.append(f"rollout.num_servers={args.engines}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    changes = {m: mode_overrides(m, args.advanced_config) for m in modes}
    staleness = args.staleness
    cfg0 = load_config(config, base, validate=False)
    world, speed = build_world(cfg0, args)
    print(
        f"simulate {config}: {cfg0.rollout.num_servers} engines x tp {cfg0.rollout.server_tp}, KV pool "
        f"{world.kv_capacity} tokens each; {cfg0.algo.train_batch_size} prompts x {cfg0.rollout.n_resp_per_prompt} "
        f"per step; {world.lengths.describe()}; keep {world.keep_prob}; trainer "
        + (
            f"{args.step_time} s/step"
            if speed is None
            else f"{speed.gpus} GPUs at {args.mfu:.0%} of {args.gpu_tflops:.0f} TFLOP/s"
        )
        + f"; sync {world.sync_s} s; {world.warmup_steps}+{world.steps} steps",
        file=out,
    )
    header = (
        "mode",
        "stale",
        "tokens/s",
        "x sync",
        "step s",
        "rollout busy",
        "trainer busy",
        "mean stale",
        "migrations",
        "aborted tok",
        "regen tok",
        "decoded tok/s",
        "decode batch",
        "refusals",
        "retractions",
    )
    print(" | ".join(header), file=out)
    rows, sync_tps = [], None
    for mode, s in settings(modes, staleness):
        # the command line's key=value last: an explicit override wins over the mode's switches
        cfg = load_config(config, [*changes[mode], *base, f"algo.staleness={s}"], validate=False)
        r = simulate(cfg, ceiling_world(world) if mode == "ceiling" else world)
        if mode == "sync":
            sync_tps = r.tokens_per_s
        row = {"mode": mode, "staleness": s, **r.summary()}
        rows.append(row)
        ratio = f"{r.tokens_per_s / sync_tps:.2f}" if sync_tps else "-"
        print(
            f"{mode} | {s} | {r.tokens_per_s:.0f} | {ratio} | {r.step_s:.1f} | {r.rollout_busy:.2f} | "
            f"{r.trainer_busy:.2f} | {r.mean_staleness:.2f} | {r.migrations} | {r.aborted_tokens} | "
            f"{r.regenerated_tokens} | {r.generated_per_s:.0f} | {r.mean_decode_batch:.1f} | {r.refusals} | "
            f"{r.retractions}",
            file=out,
            flush=True,
        )
    ceiling = next((r["tokens_per_s"] for r in rows if r["mode"] == "ceiling"), None)
    if ceiling:
        print(
            "of the ceiling: "
            + ", ".join(
                f"{r['mode']}@{r['staleness']} {r['tokens_per_s'] / ceiling:.2f}"
                for r in rows
                if r["mode"] != "ceiling"
            ),
            file=out,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)

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

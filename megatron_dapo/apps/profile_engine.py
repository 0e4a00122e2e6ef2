"""`megatron-dapo profile-engine --server URL [--out cost.json]`: measure a running rollout server
(SGLang 0.5.23 or the embedded one) and fit the decode-step cost model the router and the simulator use.
`--from-trace FILE [FILE ...]` fits it instead from the decode steps an embedded server traced while it
served a real run (`serve --step-trace`): the engines under that run's own load.

For each batch size n and prompt length p of the grid, one batch of n distinct prompts generates exactly
`--new-tokens` tokens each (EOS ignored) on an otherwise idle server. The server's own decode counters
(`decode_moments` of /v1/loads: steps, sum of batch sizes, sum of step microseconds) read before and after
give that run's mean decode step time and batch; its mean resident KV tokens is n * (p + new_tokens / 2).
A server that reports no decode counters is timed from outside instead: the run's wall time minus that of
the same batch generating one token, over the extra steps. The points are fitted by least squares
(coordinator/profile.py); the JSON carries the coefficients, `fit_rel_error` and the points.

From a trace, the decode steps are grouped by batch n and context per sequence (`trace_points`), and the
fit is also checked against the total of every traced step (`total_time_rel_error`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import sys
import time
from pathlib import Path

from megatron_dapo.config.cost_model import CostModel
from megatron_dapo.coordinator.profile import (
    ProfilePoint,
    fit_cost_model,
    format_table,
    prefill_cost,
    read_step_trace,
    total_time_error,
    trace_points,
)
from megatron_dapo.rollout.client import SGLangClient, SGLangError
from megatron_dapo.runtime.cli_args import number


class ProfileError(RuntimeError):
    """The server cannot be profiled as asked (busy, or it did not generate what was asked)."""


# Input bounds: token ids are int32 in every engine; batch, prompt and output sizes past these fit no
# server, and a grid of them would measure only its failures.
MAX_BATCH = 1 << 16
MAX_TOKENS = 1 << 24
MAX_TOKEN_ID = 2**31 - 1


def _ints(high: int):
    one = number(int, 1, high)

    def parse(text: str) -> list[int]:
        try:
            values = [one(v.strip()) for v in text.split(",") if v.strip()]
        except argparse.ArgumentTypeError:
            values = []
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers in [1, {high}], got {text!r}")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-dapo profile-engine", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--server", help="base URL of the running server (http://host:port)")
    src.add_argument(
        "--from-trace",
        nargs="+",
        metavar="FILE",
        help="step-trace files of embedded servers (serve --step-trace): fit their decode steps",
    )
    p.add_argument("--since", type=number(float), help="--from-trace: only steps ending at/after this time")
    p.add_argument("--until", type=number(float), help="--from-trace: only steps ending at/before this time")
    p.add_argument("--out", default="cost_model.json", help="where to write the fitted coefficients (JSON)")
    p.add_argument("--api-key", default=None, help="Bearer key of the server")
    p.add_argument(
        "--batch-sizes",
        type=_ints(MAX_BATCH),
        default=[1, 2, 4, 8, 16, 32, 64],
        help="concurrent requests n of the grid (comma-separated)",
    )
    p.add_argument(
        "--prompt-lens",
        type=_ints(MAX_TOKENS),
        default=[128, 512, 2048],
        help="prompt lengths of the grid; resident KV tokens K grow with them (comma-separated)",
    )
    p.add_argument(
        "--new-tokens",
        type=number(int, 2, MAX_TOKENS),
        default=64,
        help="tokens each request generates (>= 2: the first comes from the prefill)",
    )
    p.add_argument("--repeats", type=number(int, 1, 1000), default=1, help="measurements per grid point")
    p.add_argument(
        "--max-token-id",
        type=number(int, 2, MAX_TOKEN_ID),
        default=200,
        help="prompt token ids are drawn from [1, this); keep it below the model's vocabulary",
    )
    p.add_argument("--seed", type=number(int, 0), default=0, help="seed of the random prompts")
    p.add_argument(
        "--timeout-s",
        type=number(float, 0, 86400, low_open=True),
        default=300.0,
        help="seconds to wait for the server to be healthy, and for each request (300)",
    )
    p.add_argument(
        "--max-fit-error",
        type=number(float, 0, low_open=True),
        default=0.5,
        help="refuse to write a fit whose relative rms error exceeds this (0.5 = 50%%)",
    )
    return p


def _moments_delta(before, after) -> list[float] | None:
    if after.decode_moments is None:
        return None
    base = before.decode_moments or (0.0,) * 6
    return [a - b for a, b in zip(after.decode_moments, base)]


async def _timed_batch(client: SGLangClient, prompts: list[list[int]], new_tokens: int) -> float:
    t0 = time.perf_counter()
    lengths = await client.generate_fixed_length(prompts, new_tokens)
    wall = time.perf_counter() - t0
    if any(n != new_tokens for n in lengths):
        raise ProfileError(
            f"asked {new_tokens} tokens per request, got {sorted(set(lengths))}: does the server "
            "honour ignore_eos, and does prompt + new tokens fit its context?"
        )
    return wall


async def _idle_load(client: SGLangClient):
    """The server's load report; ProfileError if other requests run there (they would be timed too)."""
    load = await client.get_loads()
    if load.running or load.waiting:
        raise ProfileError(
            f"{client.base_url} is busy ({load.running} running, {load.waiting} waiting): profile an idle server"
        )
    return load


async def measure_point(
    client: SGLangClient, n: int, prompt_len: int, new_tokens: int, rng: random.Random, max_token_id: int
) -> ProfilePoint:
    before = await _idle_load(client)
    prompts = [[rng.randrange(1, max_token_id) for _ in range(prompt_len)] for _ in range(n)]
    wall = await _timed_batch(client, prompts, new_tokens)
    delta = _moments_delta(before, await client.get_loads())
    if delta is not None and delta[0] > 0:
        steps, batch_sum, us_sum = delta[0], delta[1], delta[2]
        n_mean = batch_sum / steps
        return ProfilePoint(
            n=n_mean, kv_tokens=n_mean * (prompt_len + new_tokens / 2), step_s=us_sum / steps / 1e6, steps=int(steps)
        )
    # no decode counters: the extra steps' share of the wall time
    wall_one = await _timed_batch(client, prompts, 1)
    return ProfilePoint(
        n=float(n),
        kv_tokens=n * (prompt_len + new_tokens / 2),
        step_s=max(wall - wall_one, 1e-9) / (new_tokens - 1),
        steps=new_tokens - 1,
    )


async def profile(args) -> list[ProfilePoint]:
    rng = random.Random(args.seed)
    points = []
    async with SGLangClient(args.server, api_key=args.api_key, timeout_s=args.timeout_s) as client:
        await client.wait_healthy(timeout_s=args.timeout_s)
        await _idle_load(client)
        await _timed_batch(client, [[1, 2, 3]], 2)  # warm-up: first-call costs stay out of the points
        for n in args.batch_sizes:
            for p in args.prompt_lens:
                for _ in range(args.repeats):
                    point = await measure_point(client, n, p, args.new_tokens, rng, args.max_token_id)
                    print(
                        f"  n={n:<4} prompt={p:<6} -> {point.step_s * 1e3:8.3f} ms/step "
                        f"(mean batch {point.n:.1f}, {point.steps} steps)",
                        flush=True,
                    )
                    points.append(point)
    return points


def fit_trace(paths: list[str], since: float | None = None, until: float | None = None) -> dict:
    """The cost model of traced decode steps, as the JSON `main` writes (coefficients, fit_rel_error,
    total_time_rel_error, steps, points). ValueError if the files hold too few steps to fit."""
    rows = read_step_trace(paths, since, until)
    points = trace_points(rows)
    try:
        model, rel_error = fit_cost_model(points, by_steps=True)
    except ValueError as e:
        raise ValueError(
            f"{len(rows)} decode steps in {', '.join(map(str, paths))} ({len(points)} points): {e}"
        ) from None
    prefills = read_step_trace(paths, since, until, kind="prefill")
    # prefill: its own steps' time per token (decode waits for them, as the simulator's engines do)
    model = dataclasses.replace(model, p_k=prefill_cost(prefills))
    return {
        **model.to_dict(),
        "fit_rel_error": rel_error,
        "total_time_rel_error": total_time_error(model, rows),
        "steps": len(rows),
        "decode_s": sum(r["s"] for r in rows),
        "prefills": len(prefills),
        "prefill_s": sum(r["s"] for r in prefills),
        "points": [p.to_dict() for p in points],
        "traces": [str(p) for p in paths],
        "since": since,
        "until": until,
    }


def _main_trace(args) -> int:
    try:
        fit = fit_trace(args.from_trace, args.since, args.until)
    except (OSError, ValueError) as e:
        print(f"profile-engine: {e}", file=sys.stderr)
        return 1
    model = CostModel.from_dict(fit)
    points = [ProfilePoint(**p) for p in fit["points"]]
    print(
        f"{fit['steps']} decode steps ({fit['decode_s']:.1f} s) from {len(args.from_trace)} trace(s), "
        f"{len(points)} points (steps binned by batch n and context per sequence; fit weighted by steps)"
    )
    print(format_table(model, points))
    print(
        f"fit relative error (rms over points, weighted by steps): {fit['fit_rel_error']:.2%}; "
        f"total decode time fitted vs traced: {fit['total_time_rel_error']:+.2%}; "
        f"prefill: {fit['prefills']} steps, {fit['prefill_s']:.2f} s, p_k = {model.p_k:.3g} s per token"
    )
    print("coefficients (s): " + ", ".join(f"{k}={v:.4g}" for k, v in model.to_dict().items()))
    if not _fit_good_enough(fit["fit_rel_error"], args):
        return 1
    model.save(Path(args.out), **{k: v for k, v in fit.items() if k not in model.to_dict()})
    print(f"wrote {args.out}")
    return 0


def _fit_good_enough(rel_error: float, args) -> bool:
    """False (and why, on stderr) when the fit is too poor to write: a cost model that mispredicts step
    times by more than --max-fit-error would mislead the router and the simulator."""
    if rel_error <= args.max_fit_error:
        return True
    print(
        f"profile-engine: fit relative error {rel_error:.2%} exceeds --max-fit-error {args.max_fit_error:.2%}: "
        f"{args.out} not written (a server busy with other work, too few or too noisy points?)",
        file=sys.stderr,
    )
    return False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.from_trace:
        return _main_trace(args)
    if args.since is not None or args.until is not None:
        parser.error("--since / --until select steps of a trace: they need --from-trace")
    print(
        f"profiling {args.server}: n in {args.batch_sizes}, prompt lengths {args.prompt_lens}, "
        f"{args.new_tokens} new tokens, {args.repeats} repeat(s)",
        flush=True,
    )
    try:
        points = asyncio.run(profile(args))
        model, rel_error = fit_cost_model(points)
    except (SGLangError, ProfileError, ValueError) as e:
        print(f"profile-engine: {e}", file=sys.stderr)
        return 1
    print(format_table(model, points))
    print(f"fit relative error (rms): {rel_error:.2%}")
    print("coefficients (s): " + ", ".join(f"{k}={v:.4g}" for k, v in model.to_dict().items()))
    if not _fit_good_enough(rel_error, args):
        return 1
    model.save(
        Path(args.out),
        fit_rel_error=rel_error,
        points=[p.to_dict() for p in points],
        server=args.server,
        new_tokens=args.new_tokens,
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does the simulator's model of the world match reality? A real CPU run of
benchmarks/async_throughput.py against its simulation, setting by setting.

The real run's `--out` JSON holds, per setting, its resolved algo / rollout / data config, the measured
response lengths, trainer step and sync times. The simulation (megatron_dapo.sim) gets exactly those:
the same config, lengths drawn from the measured ones, the measured mean train and sync seconds, and
a decode cost model of the servers: by default the setting's own `cost_fit` (async_throughput.py
--step-trace: fitted on the decode steps the four servers took in that setting's measured window, with
the trainer and the other servers on the same cores and the machine's load of the moment), else
`--cost-model` (e.g. profile-engine's fit of one idle server: the old way, which left the simulation
1.4-3.5x too fast on a shared machine). The engines batch as the embedded server does (`--batching
static`: a batch runs to its end before waiting requests start). It then runs the same warm-up and
measured steps (`--batching continuous` for a run whose servers batched continuously; the run's JSON
says which). Printed per setting: measured and simulated step time (wall time of the measured steps /
steps) and trained tokens/s, their ratio, whether the step times agree within 25% (the issue-15 check),
and the cost fit's error against the traced steps. A run with slowed servers (`--server-slowdown`): each
engine runs at the pace its own trace shows against the fit (`--speeds measured`, the default when the
traces are on this machine; the fit comes from the unslowed servers), not the nominal factor: a
`--slowdown 0.5` server measured 0.42-0.45 on 2026-12-06, and the nominal 0.5 left the plain-async rounds
0.68-0.77x too fast.

    python benchmarks/sim_validate.py --bench results.json [--cost-model cost.json] [--batching static]
        [--speeds measured|nominal] [--max-running 64 --kv-capacity 0 --tolerance 0.25]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "qwen3" / "tiny_qwen3_cpu.yaml"


def measured(result: dict) -> dict:
    """The real run's numbers over its measured steps (as async_throughput's Result.summary)."""
    w = result["warmup"]
    ends = result["step_end"]
    steps = len(ends) - w
    wall = ends[-1] - ends[w - 1]
    lengths = [x for step in result["response_lengths"] for x in step]
    samples = sum(len(step) for step in result["response_lengths"])
    prompt_len = (sum(result["tokens"]) - sum(lengths)) / samples
    inline = result["config"]["rollout"]["sync"]["policy"] == "all_at_once"
    return {
        "step_s": wall / steps,
        "tokens_per_s": sum(result["tokens"][w:]) / wall,
        "steps": steps,
        "lengths": lengths,
        "prompt_len": prompt_len,
        "train_s": statistics.mean(result["train_s"][w:]),
        # all_at_once: the trainer's inline sync; per-server policies: one server's sync (time/sync_s is
        # then only the weight-store put, a few ms, while each server is out for its own load)
        "sync_s": statistics.mean(result["sync_s"][w:]) if inline else per_server_sync_s(result),
        # a step's wall time beyond waiting, training and the inline sync (batch assembly, metrics, log)
        "other_s": wall / steps
        - statistics.mean(
            g + t + y for g, t, y in zip(result["gen_wait_s"][w:], result["train_s"][w:], result["sync_s"][w:])
        ),
    }


def server_sync_durations(result: dict) -> dict[int, list[float]]:
    """Per server: seconds of each of its syncs that ended in the measured steps (async_throughput's
    server_syncs)."""
    out: dict[int, list[float]] = {}
    for step in result.get("server_syncs", [])[result["warmup"] :]:
        for e in step:
            out.setdefault(e["server"], []).append(e["end"] - e["start"])
    return out


def per_server_sync_s(result: dict) -> float:
    """Mean seconds a server spent in one sync over the measured steps (the registry's per-server counters)."""
    w = result["warmup"]
    syncs = sum(result["syncs"][-1]) - sum(result["syncs"][w - 1])
    secs = sum(result["server_sync_s"][-1]) - sum(result["server_sync_s"][w - 1])
    return secs / syncs if syncs else 0.0


def measured_speeds(traces: list[str], since: float, until: float, cost) -> tuple[float, ...]:
    """Each server's pace against `cost` over [since, until]: the decode seconds the model predicts for its
    traced steps over the seconds they took. A `serve --slowdown 0.5` server measures ~0.44, not 0.5 (it
    stretches each step to twice the step's own time, which on the shared cores is itself ~12 % longer than
    the fit of the unslowed server predicts); in a plain-async run that server is the straggler, so the
    difference moves the whole step."""
    from megatron_dapo.coordinator.profile import read_step_trace

    out = []
    for path in traces:
        dec = read_step_trace([path], since, until, "decode")
        took = sum(r["s"] for r in dec)
        out.append(sum(cost.step_time(r["n"], r["kv"]) for r in dec) / took if took else 1.0)
    return tuple(out)


def trace_usage(traces: list[str], since: float, until: float) -> dict:
    """From the servers' step traces (async_throughput --step-trace), over [since, until]: each server's
    share of the time in decode and in prefill steps, and the mean decode batch (a step's n weighted by
    its seconds: what the batch was while the engine worked)."""
    from megatron_dapo.coordinator.profile import read_step_trace

    per = []
    for path in traces:
        dec = read_step_trace([path], since, until, "decode")
        dec_s = sum(r["s"] for r in dec)
        per.append(
            {
                "decode": dec_s / (until - since),
                "prefill": sum(r["s"] for r in read_step_trace([path], since, until, "prefill")) / (until - since),
                "batch": sum(r["n"] * r["s"] for r in dec) / dec_s if dec_s else 0.0,
            }
        )
    return {
        "per_server": per,
        "decode": statistics.mean(p["decode"] for p in per),
        "prefill": statistics.mean(p["prefill"] for p in per),
    }


def simulate_result(
    result: dict,
    cost,
    max_running: int,
    kv_capacity: int,
    batching: str = "static",
    seed: int = 0,
    engine_speed: tuple[float, ...] | None = None,
):
    from megatron_dapo.config.cost_model import CostModel
    from megatron_dapo.config.load import config_from_dict, config_to_dict, load_config
    from megatron_dapo.planner.lengths import EmpiricalLengths
    from megatron_dapo.sim.world import World, simulate

    m = measured(result)
    base_cfg = load_config(str(CONFIG), validate=False)
    base = config_to_dict(base_cfg)
    sections = json.loads(json.dumps(result["config"]))
    algo = sections["algo"]
    # i14-bench's key (default train_batch_size, i.e. no extra buffer room) until it is on this branch's main
    if "staleness_buffer_groups" in algo and not hasattr(base_cfg.algo, "staleness_buffer_groups"):
        if algo.pop("staleness_buffer_groups") not in (None, algo["train_batch_size"]):
            raise ValueError("algo.staleness_buffer_groups != train_batch_size: this tree cannot simulate it")
    cfg = config_from_dict({**base, **sections})
    cfg.rollout.servers = []  # the simulated engines stand in for them
    cfg.rollout.num_servers = len(result["config"]["rollout"]["servers"]) or cfg.rollout.num_servers
    max_len = cfg.data.max_response_length
    world = World(
        cost=cost,
        kv_capacity=kv_capacity or max_running * (max_len + cfg.data.max_prompt_length),
        max_running=max_running,
        train_s=lambda tokens: m["train_s"],
        sync_s=m["sync_s"],
        keep_prob=1.0,
        lengths=EmpiricalLengths(m["lengths"], max_len, source="the real run", seed=seed),
        prompt_len=round(m["prompt_len"]),
        token_unit=1,
        steps=m["steps"],
        warmup_steps=result["warmup"],
        batching=batching,
        server_sync_s=_sampler(server_sync_durations(result), seed),
        seed=seed,
        # the real router's model (throughput_optimal): the file the run loaded, not the engines' fit
        router_cost=CostModel.load(cfg.rollout.routing.cost_model) if cfg.rollout.routing.cost_model else None,
        admission=None,
        engine_speed=engine_speed,  # the run's serve --slowdown per server
    )  # the embedded server admits up to --max-batch, with no KV budget
    return m, simulate(cfg, world)


def _sampler(per_server: dict[int, list[float]], seed: int = 0):
    """Server i -> a draw from server i's measured values (all servers' when it has none); None if none."""
    pooled = [v for vs in per_server.values() for v in vs]
    if not pooled:
        return None
    rng = random.Random(seed)
    return lambda i: rng.choice(per_server.get(i) or pooled)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", type=Path, required=True, help="benchmarks/async_throughput.py --out JSON")
    ap.add_argument(
        "--cost-model",
        type=Path,
        default=None,
        help="profile-engine JSON for every setting (default: each setting's own `cost_fit`)",
    )
    ap.add_argument(
        "--batching",
        choices=("static", "static_split", "continuous"),
        default=None,
        help="static: the embedded server's default, a burst reaching an idle server joins one batch; "
        "static_split: only its first request starts the batch; continuous: SGLang's, and the "
        "embedded server's --batching continuous (default: as the run's servers batched)",
    )
    ap.add_argument("--max-running", type=int, default=64, help="the servers' --max-batch (64)")
    ap.add_argument(
        "--kv-capacity",
        type=int,
        default=0,
        help="KV tokens per server (default: the run's --server-kv-tokens, else max-running full sequences)",
    )
    ap.add_argument(
        "--speeds",
        choices=("measured", "nominal"),
        default="measured",
        help="each server's pace in the simulation: measured from its step trace against the cost fit "
        "(default, when the traces are on this machine), or the run's --server-slowdown values",
    )
    ap.add_argument("--tolerance", type=float, default=0.25)
    ap.add_argument(
        "--seeds",
        type=int,
        default=5,
        help="simulations per setting (seeds of the length draws and sync durations); the mean is compared",
    )
    args = ap.parse_args(argv)
    from megatron_dapo.config.cost_model import CostModel

    shared = CostModel.load(args.cost_model) if args.cost_model else None
    data = json.loads(args.bench.read_text())
    results = data["results"] if isinstance(data, dict) else data
    saved = data.get("settings", {}) if isinstance(data, dict) else {}
    traces = saved.get("traces")
    batching = args.batching or saved.get("server_batching", "static")  # runs before the flag batched statically
    kv_capacity = args.kv_capacity or saved.get("server_kv_tokens") or 0
    speeds = tuple(saved["server_slowdown"]) if saved.get("server_slowdown") else None
    if traces and not all(Path(t).is_file() for t in traces):
        traces = None  # the run's step traces are not on this machine: no decode-share column
    print(
        "setting | real step s | sim step s | sim/real | real tok/s | sim tok/s | within | cost fit: rms error, "
        "total decode time | train s | sync s | other s | real decode / prefill share, sim busy [real per server]"
        " | server pace"
    )
    ok = True
    for result in results:
        label = f"{result['setting']['name']}@s{result['setting']['staleness']}"
        fit = result.get("cost_fit")
        if shared is None and not fit:
            raise SystemExit(
                f"{args.bench}: {label} has no cost_fit (run async_throughput.py with --step-trace) "
                "and no --cost-model was given"
            )
        cost = shared or CostModel.from_dict(fit, source=f"{label} cost_fit")
        pace = speeds
        if args.speeds == "measured" and traces and result.get("step_end_wall"):
            w = result["warmup"]
            pace = measured_speeds(traces, result["step_end_wall"][w - 1], result["step_end_wall"][-1], cost)
        runs, failed = [], []
        for seed in range(args.seeds):
            try:
                runs.append(simulate_result(result, cost, args.max_running, kv_capacity, batching, seed, pace))
            except RuntimeError as e:  # e.g. the coordinator's stall guard: a sample aborted again and again
                failed.append(f"seed {seed}: {e}")
        if not runs:
            raise SystemExit(f"{label}: every simulation failed: {failed}")
        for f in failed:
            print(f"  {label}: simulation failed, left out ({f})", file=sys.stderr)
        m = runs[0][0]
        sim_steps = [x.step_s for _, x in runs]
        sim_step = statistics.mean(sim_steps)
        ratio = sim_step / m["step_s"]
        within = abs(ratio - 1) <= args.tolerance
        ok &= within
        fit_err = f"{fit['fit_rel_error']:.1%}, {fit['total_time_rel_error']:+.1%}" if fit and not shared else "-"
        busy = "-"
        if traces and result.get("step_end_wall"):
            w = result["warmup"]
            use = trace_usage(traces, result["step_end_wall"][w - 1], result["step_end_wall"][-1])
            each = ", ".join(f"{p['decode']:.2f}" for p in use["per_server"])
            sim_busy = statistics.mean(x.rollout_busy for _, x in runs)
            busy = f"{use['decode']:.2f} / {use['prefill']:.3f} / {sim_busy:.2f} [{each}]"
        spread = f" ({min(sim_steps):.2f}-{max(sim_steps):.2f})" if len(runs) > 1 else ""
        sim_tps = statistics.mean(x.tokens_per_s for _, x in runs)
        print(
            f"{label} | {m['step_s']:.2f} | {sim_step:.2f}{spread} | {ratio:.2f} | {m['tokens_per_s']:.0f} | "
            f"{sim_tps:.0f} | {'yes' if within else 'NO'} | {fit_err} | {m['train_s']:.2f} | "
            f"{m['sync_s']:.3f} | {m['other_s']:.2f} | {busy} | "
            + (", ".join(f"{x:.2f}" for x in pace) if pace else "-"),
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

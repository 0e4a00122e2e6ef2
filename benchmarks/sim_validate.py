"""Does the simulator's model of the world match reality? A real CPU run of
benchmarks/async_throughput.py against its simulation, setting by setting.

The real run's `--out` JSON holds, per setting, its resolved algo / rollout / data config, the measured
response lengths, trainer step and sync times. The simulation (megatron_dapo.sim) gets exactly those:
the same config, lengths drawn from the measured ones, the measured mean train and sync seconds, and
the embedded servers' decode cost model fitted by `megatron-dapo profile-engine` on one of them. It
then runs the same warm-up and measured steps. Printed per setting: measured and simulated step time
(wall time of the measured steps / steps) and trained tokens/s, their ratio, and whether the step
times agree within 25% (the issue-15 check).

    python benchmarks/sim_validate.py --bench results.json --cost-model embedded_cost.json
        [--max-running 64 --kv-capacity 0 --tolerance 0.25]
"""

from __future__ import annotations

import argparse
import json
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
    return {"step_s": wall / steps, "tokens_per_s": sum(result["tokens"][w:]) / wall, "steps": steps,
            "lengths": lengths, "prompt_len": prompt_len,
            "train_s": statistics.mean(result["train_s"][w:]), "sync_s": statistics.mean(result["sync_s"][w:])}


def simulate_result(result: dict, cost, max_running: int, kv_capacity: int):
    from megatron_dapo.config.load import config_from_dict, config_to_dict, load_config
    from megatron_dapo.sim.lengths import EmpiricalLengths
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
    world = World(cost=cost, kv_capacity=kv_capacity or max_running * (max_len + cfg.data.max_prompt_length),
                  max_running=max_running, train_s=lambda tokens: m["train_s"], sync_s=m["sync_s"], keep_prob=1.0,
                  lengths=EmpiricalLengths(m["lengths"], max_len, source="the real run"),
                  prompt_len=round(m["prompt_len"]), token_unit=1, steps=m["steps"], warmup_steps=result["warmup"],
                  admission=None)  # the embedded server admits up to --max-batch, with no KV budget
    return m, simulate(cfg, world)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", type=Path, required=True, help="benchmarks/async_throughput.py --out JSON")
    ap.add_argument("--cost-model", type=Path, required=True, help="profile-engine JSON of one embedded server")
    ap.add_argument("--max-running", type=int, default=64, help="the servers' --max-batch (64)")
    ap.add_argument("--kv-capacity", type=int, default=0, help="KV tokens per server (0: max-running full sequences)")
    ap.add_argument("--tolerance", type=float, default=0.25)
    ap.add_argument("--cpu-share", type=float, default=1.0,
                    help="multiply every cost coefficient by this (e.g. 2.5: 4 servers + a trainer on 2 cores, "
                         "where the profile ran one server alone)")
    args = ap.parse_args(argv)
    from megatron_dapo.coordinator.cost_model import CostModel

    fit = CostModel.load(args.cost_model)
    cost = CostModel(**{k: v * args.cpu_share for k, v in fit.to_dict().items()})
    data = json.loads(args.bench.read_text())
    results = data["results"] if isinstance(data, dict) else data
    print("setting | real step s | sim step s | sim/real | real tok/s | sim tok/s | within")
    ok = True
    for result in results:
        m, r = simulate_result(result, cost, args.max_running, args.kv_capacity)
        ratio = r.step_s / m["step_s"]
        within = abs(ratio - 1) <= args.tolerance
        ok &= within
        label = f"{result['setting']['name']}@s{result['setting']['staleness']}"
        print(f"{label} | {m['step_s']:.2f} | {r.step_s:.2f} | {ratio:.2f} | {m['tokens_per_s']:.0f} | "
              f"{r.tokens_per_s:.0f} | {'yes' if within else 'NO'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

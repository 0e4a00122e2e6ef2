"""Weight-sync throughput: the bridge end to end vs one raw broadcast of the same bytes on the same group.

Starts `--servers` embedded servers holding a Qwen3-shaped model of the requested size, forms the
weight-update group with the bridge, then times
  * bridge (per-tensor / flattened): `BroadcastTransport.sync()` of the trainer's full state, including
    pause/continue, the HTTP calls, every broadcast and the servers' loads into their models;
  * raw: one `broadcast` of a flat uint8 buffer of the same total bytes over the same process group,
    received by the same server processes (an update announcing one tensor the model does not have:
    the server receives the whole buffer into its reused flattened-bucket buffer, as it must to keep
    the group in step, and loads nothing): the pure transfer cost.
ratio = bridge GB/s / raw GB/s (goal >= 0.8 on CPU gloo), from the medians of interleaved repeats. The
bridge's extra costs are the HTTP round trips (pause, one update per bucket, continue), one broadcast
per tensor and, in flattened mode, the trainer's copy into the staging buffer (the servers receive
repeated flattened updates straight into their parameters).
After the syncs the servers' logprobs on a
probe are compared with the trainer's (max abs difference reported).

Sync sources (rollout.sync.sources), in the same run: a megatron-core trainer on two gloo ranks
(benchmarks/weight_sync_trainer.py under torchrun) at PP=2 (the dense model above) and at EP=2 (a Qwen3-MoE
of `--moe-experts` experts) syncs into one embedded server, through rank 0 and from every export source
(per_stage): the bytes through the busiest trainer rank (its export hops beyond TP gathers, from `Traffic`,
plus what it broadcast) and the wall time per sync (median of `--repeats`, the two modes interleaved), each
against the rank0 baseline of the same layout.

    python benchmarks/weight_sync.py [--hidden 1024 --layers 8 --vocab 32000] [--servers 2] [--bucket-mb 512]
                                     [--moe-experts 8] [--parts single sources]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dapo.config.schema import SyncConfig  # noqa: E402
from megatron_dapo.rollout import weight_group as wgroup  # noqa: E402
from megatron_dapo.rollout.launcher import launch_embedded_servers  # noqa: E402
from megatron_dapo.sync.broadcast import BroadcastTransport  # noqa: E402

RAW_NAME = "__raw_broadcast_baseline__"


def model_config(args, family: str = "qwen3"):
    from megatron_dapo.models.tiny import tiny_hf_config

    shape = dict(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        vocab_size=args.vocab,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=args.hidden // 8,
    )
    if family == "qwen3_moe":  # every layer but the first MoE (tiny_hf_config's mlp_only_layers)
        shape.update(num_experts=args.moe_experts, moe_intermediate_size=args.hidden // 2)
    return tiny_hf_config(family, **shape)


def build_models(args, out_dir: Path):
    from transformers import AutoModelForCausalLM

    cfg = model_config(args)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out_dir)
    torch.manual_seed(1)
    trainer = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    return trainer


def raw_broadcast_seconds(bridge: BroadcastTransport, flat: torch.Tensor) -> float:
    nbytes = flat.numel()

    async def announce():
        return await asyncio.gather(
            *(
                c._request(
                    "POST",
                    "/update_weights_from_distributed",
                    {
                        "names": [RAW_NAME],
                        "dtypes": ["uint8"],
                        "shapes": [[nbytes]],
                        "group_name": bridge.group.group_name,
                        "flush_cache": False,
                        "abort_all_requests": False,
                        "load_format": "flattened_bucket",
                    },
                )
                for c in bridge.calls.clients
            ),
            return_exceptions=True,
        )

    bridge.calls.ask_all_and_raise_failed("begin_weight_update")  # untimed: the baseline is the broadcast alone
    t0 = time.perf_counter()
    answers = bridge.calls.submit(announce())
    wgroup.broadcast(flat, bridge.group.pg)
    seconds = time.perf_counter() - t0
    for a in answers.result(600):  # the servers refuse to *load* it, after receiving every byte
        assert RAW_NAME in str(a), f"unexpected answer to the raw baseline: {a!r}"
    bridge.calls.ask_all_and_raise_failed("end_weight_update")
    return seconds


LAYOUTS = (("PP=2 dense", "qwen3", ["--pp", "2"]), ("EP=2 MoE", "qwen3_moe", ["--ep", "2"]))


def compare_sources(args, tmp: Path) -> list[dict]:
    """rank0 vs per_stage at each of LAYOUTS: one row per (layout, mode)."""
    from transformers import AutoModelForCausalLM

    from tests.dist_utils import run_torchrun

    rows = []
    for layout, family, flags in LAYOUTS:
        model = tmp / family
        if not model.exists():
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(model_config(args, family), dtype=torch.float32).save_pretrained(model)
        servers = launch_embedded_servers(str(model), 1, tmp / f"logs_{family}", timeout_s=600)
        try:
            out = tmp / f"{family}.json"
            urls = [s.url for s in servers]
            worker = Path(__file__).with_name("weight_sync_trainer.py")
            run_torchrun(worker, 2, out, model, *urls, *flags, "--repeats", args.repeats, timeout=3600)
            result = json.loads(out.read_text())
        finally:
            for s in servers:
                s.stop()
        base = result["rank0"]
        for mode in ("rank0", "per_stage"):
            r = result[mode]
            rows.append(
                dict(
                    layout=layout,
                    mode=mode,
                    sources=r["sources"],
                    model_bytes=r["model_bytes"],
                    busiest=max(r["bytes_through"]),
                    bytes_through=r["bytes_through"],
                    seconds=statistics.median(r["seconds"]),
                    all_seconds=r["seconds"],
                    bytes_vs_rank0=max(r["bytes_through"]) / max(base["bytes_through"]),
                    time_vs_rank0=statistics.median(r["seconds"]) / statistics.median(base["seconds"]),
                )
            )
    return rows


def print_sources(rows: list[dict], repeats: int) -> None:
    print(
        "| layout | sources | model | busiest rank moves | vs rank0 | s per sync | vs rank0 |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['layout']} | {r['mode']} {r['sources']} | {r['model_bytes'] / 2**20:.1f} MiB | "
            f"{r['busiest'] / 2**20:.1f} MiB | {r['bytes_vs_rank0']:.2f} | {r['seconds']:.3f} | "
            f"{r['time_vs_rank0']:.2f} |"
        )
    print(
        f"(2 gloo trainer ranks, 1 embedded server; s per sync: median of {repeats} interleaved, from a barrier "
        "to the end of the sync on every rank; busiest rank moves = export hops beyond TP gathers + its broadcasts)"
    )


def single_rank(args, tmp: Path) -> dict:
    """The bridge vs one raw broadcast of the same bytes, from a single trainer process."""
    trainer = build_models(args, tmp / "model")
    named = list(trainer.state_dict().items())
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    # the raw baseline sends the weights' own bytes, already flat (its flattening is not timed)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named])
    print(
        f"model: {sum(t.numel() for _, t in named) / 1e6:.1f}M params, {nbytes / 2**20:.0f} MiB fp32; "
        f"{args.servers} embedded servers, gloo, bucket {args.bucket_mb} MiB",
        flush=True,
    )
    servers = launch_embedded_servers(str(tmp / "model"), args.servers, tmp / "logs", timeout_s=600)
    rows = []
    try:
        results = {}
        for mode in ("per_tensor", "flattened"):
            cfg = SyncConfig(bucket_mb=args.bucket_mb, flatten_bucket=mode == "flattened", pause_generation=True)
            bridge = BroadcastTransport([s.url for s in servers], cfg, group_name=f"bench_{mode}")
            bridge.connect()
            try:
                bridge.sync(named, version=f"{mode}-warmup")
                raw_broadcast_seconds(bridge, flat)
                raw, times = [], []
                for i in range(args.repeats):  # interleaved, so both see the same machine load
                    raw.append(raw_broadcast_seconds(bridge, flat))
                    times.append(bridge.sync(named, version=f"{mode}-{i}").seconds)
                probe = list(range(1, 33))
                with torch.no_grad():
                    lp = torch.log_softmax(trainer(torch.tensor([probe])).logits[0, :-1].double(), -1)
                ref = lp.gather(-1, torch.tensor(probe[1:]).unsqueeze(-1)).squeeze(-1)
                diff = bridge.verify(probe, ref.tolist(), tolerance=1e-3)
            finally:
                bridge.close()
            bridge_s, raw_s = statistics.median(times), statistics.median(raw)
            results[mode] = dict(
                bridge_s=bridge_s,
                raw_s=raw_s,
                bridge_gbps=nbytes / bridge_s / 1e9,
                raw_gbps=nbytes / raw_s / 1e9,
                ratio=raw_s / bridge_s,
                best_ratio=min(raw) / min(times),
                max_logprob_diff=diff,
                bridge_all_s=times,
                raw_all_s=raw,
            )
            rows.append((mode, results[mode]))
    finally:
        for s in servers:
            s.stop()

    print(f"\nload average {os.getloadavg()[0]:.2f} (1 min) at the end")
    print(
        "| mode | bytes | bridge s | bridge GB/s | raw broadcast s | raw GB/s | ratio | best-of ratio "
        "| max logprob diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, r in rows:
        print(
            f"| {mode} | {nbytes / 2**20:.0f} MiB | {r['bridge_s']:.3f} | {r['bridge_gbps']:.3f} | {r['raw_s']:.3f} | "
            f"{r['raw_gbps']:.3f} | {r['ratio']:.2f} | {r['best_ratio']:.2f} | {r['max_logprob_diff']:.1e} |"
        )
    print(
        f"(median of {args.repeats} interleaved repeats; ratio = bridge GB/s / raw GB/s; best-of ratio = "
        "fastest raw / fastest bridge; bytes counted once, each of the servers receives them)"
    )
    return {"bytes": nbytes, "servers": args.servers, "bucket_mb": args.bucket_mb, "results": results}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--moe-experts", type=int, default=8, help="experts per MoE layer of the EP=2 model")
    p.add_argument(
        "--parts",
        nargs="+",
        choices=["single", "sources"],
        default=["single", "sources"],
        help="single: bridge vs raw broadcast from one process; sources: rank0 vs per_stage at PP=2 / EP=2",
    )
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "single" in args.parts:
            report["single"] = single_rank(args, tmp)
        if "sources" in args.parts:
            rows = compare_sources(args, tmp)
            print(f"\nload average {os.getloadavg()[0]:.2f} (1 min) at the end")
            print_sources(rows, args.repeats)
            report["sources"] = rows
    if args.json:
        tmp_json = Path(args.json + ".tmp")
        tmp_json.write_text(json.dumps(report, indent=1))
        tmp_json.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

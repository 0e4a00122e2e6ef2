"""torchrun worker of benchmarks/weight_sync.py: a megatron-core trainer (gloo, CPU) timing its weight syncs.

usage (torchrun, tp * pp * ep ranks):
    weight_sync_trainer.py OUT_JSON HF_DIR URL [URL ...] [--tp N] [--pp N] [--ep N]
                           [--sources rank0 per_stage] [--repeats N]
Loads HF_DIR into a GPTModel of that layout, connects a bridge per `--sources` mode (rank0: everything
through trainer rank 0; per_stage: every export source over its own update group), syncs once per mode
untimed (warm-up), then `--repeats` rounds of one sync per mode (interleaved), each timed from a barrier to
the end of `BroadcastTransport.sync` on every rank (the export's TP gathers and hops, every broadcast and the
servers' loads). Each rank
records what went through it: the export's hops beyond TP gathers (`Traffic`) and what it broadcast.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def timed_sync(bridge, chunks, per_stage: bool, version: str):
    """One sync; (seconds on this rank, SyncStats or None, this rank's export Traffic)."""
    from megatron_dapo.bridge.export import EACH_SOURCE, Traffic, export_hf_weights

    traffic = Traffic()
    dist.barrier()
    t0 = time.perf_counter()
    export = export_hf_weights(chunks, dst_rank=EACH_SOURCE if per_stage else 0, traffic=traffic)
    stats = bridge.sync(export, version=version)
    dist.barrier()  # the sync ends when the last rank is done
    return time.perf_counter() - t0, stats, traffic


def measure(chunks, urls, modes: list[str], repeats: int) -> dict:
    """Every mode's bridge connected at once (a server holds each update group by name), then the modes'
    syncs interleaved, so that each mode sees the same machine load."""
    from megatron_dapo.bridge.export import export_sources
    from megatron_dapo.config.schema import SyncConfig
    from megatron_dapo.sync.broadcast import BroadcastTransport

    bridges = {}
    try:
        for mode in modes:
            sources = export_sources(chunks) if mode == "per_stage" else [0]
            cfg = SyncConfig(flatten_bucket=False)
            bridges[mode] = BroadcastTransport(urls, cfg, group_name=f"bench_{mode}", sources=sources)
            bridges[mode].connect()
        results = {m: {"sources": b.sources, "seconds": []} for m, b in bridges.items()}
        for i in range(-1, repeats):  # -1: the warm-up, untimed
            for mode, bridge in bridges.items():
                s, stats, traffic = timed_sync(bridge, chunks, mode == "per_stage", f"{mode}-{i}")
                if i < 0:
                    continue
                results[mode]["seconds"].append(s)
                if i == 0:  # the same every repeat: the export plan is fixed
                    results[mode]["bytes_through"] = _bytes_through_each_rank(stats, traffic)
                    results[mode]["model_bytes"] = stats.nbytes if stats is not None else None
    finally:
        for bridge in bridges.values():
            bridge.close()
    return results


def _bytes_through_each_rank(stats, traffic) -> list[int]:
    """Per trainer rank: export bytes sent + received (beyond TP gathers) + bytes it broadcast to the servers."""
    broadcast = None
    if dist.get_rank() == 0:
        broadcast = stats.source_bytes or {0: stats.nbytes}
    box = [broadcast]
    dist.broadcast_object_list(box, src=0)
    mine = traffic.sent + traffic.received + box[0].get(dist.get_rank(), 0)
    each = [None] * dist.get_world_size()
    dist.all_gather_object(each, mine)
    return each


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("hf_dir")
    ap.add_argument("urls", nargs="+")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--sources", nargs="+", choices=["rank0", "per_stage"], default=["rank0", "per_stage"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from megatron_dapo.bridge.load import load_hf_into_megatron
    from megatron_dapo.models.provider import ModelParallel, build_gpt_model
    from megatron_dapo.runtime.distributed import init_distributed, init_model_parallel

    info = init_distributed("gloo")
    init_model_parallel(tp=args.tp, pp=args.pp, ep=args.ep)
    chunks = build_gpt_model(args.hf_dir, ModelParallel(tp=args.tp, pp=args.pp, ep=args.ep))
    load_hf_into_megatron(chunks, args.hf_dir)
    with torch.no_grad():  # weights unlike the servers' (as after a training step)
        for chunk in chunks:
            for p in chunk.parameters():
                p.mul_(1.01)
    results = measure(chunks, args.urls, args.sources, args.repeats)
    if info.rank == 0:
        with open(args.out + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(args.out + ".tmp", args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

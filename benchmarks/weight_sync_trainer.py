"""torchrun worker of benchmarks/weight_sync.py: a megatron-core trainer (gloo, CPU) timing its weight syncs.

usage (torchrun, tp * pp * ep ranks):
    weight_sync_trainer.py OUT_JSON HF_DIR URL [URL ...] [--tp N] [--pp N] [--ep N]
                           [--sources rank0 per_stage] [--repeats N]
Loads HF_DIR into a GPTModel of that layout and, for each `--sources` mode in turn, connects a bridge
(rank0: everything through trainer rank 0; per_stage: every export source over its own update group),
syncs once untimed (warm-up), then `--repeats` times, each timed on rank 0 from a barrier to the end of
`WeightSyncBridge.sync` (the export's TP gathers and hops, every broadcast and the servers' loads). Each rank
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


def measure(chunks, urls, mode: str, repeats: int) -> dict:
    from megatron_dapo.bridge.export import export_sources
    from megatron_dapo.config.schema import SyncConfig
    from megatron_dapo.sync.bridge import WeightSyncBridge

    per_stage = mode == "per_stage"
    sources = export_sources(chunks) if per_stage else [0]
    bridge = WeightSyncBridge(urls, SyncConfig(flatten_bucket=False), group_name=f"bench_{mode}", sources=sources)
    bridge.connect()
    try:
        timed_sync(bridge, chunks, per_stage, f"{mode}-warmup")
        seconds, through, nbytes = [], None, None
        for i in range(repeats):
            s, stats, traffic = timed_sync(bridge, chunks, per_stage, f"{mode}-{i}")
            seconds.append(s)
            if through is None:  # the same every repeat: the export plan is fixed
                through = _bytes_through_each_rank(stats, traffic)
                nbytes = stats.nbytes if stats is not None else None
    finally:
        bridge.close()
    return {"sources": sources, "seconds": seconds, "bytes_through": through, "model_bytes": nbytes}


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
    results = {mode: measure(chunks, args.urls, mode, args.repeats) for mode in args.sources}
    if info.rank == 0:
        with open(args.out + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(args.out + ".tmp", args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

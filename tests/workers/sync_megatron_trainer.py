"""A megatron-core trainer (gloo, CPU) that syncs its weights into embedded servers.

usage (torchrun, tp * pp * ep ranks):
    sync_megatron_trainer.py OUT_JSON HF_DIR API_KEY URL [URL ...] [--tp N] [--pp N] [--ep N] [--etp N]
                             [--sources rank0|per_stage]
Loads HF_DIR into a GPTModel of that layout, changes every weight (as a training step would), streams
`export_hf_weights` through the bridge -- all through rank 0, or from every export source over its own
update group (per_stage) -- twice (versions 1, 2). Rank 0 records each server's probe logprobs and checks
them against an independent reference: HF transformers' own model loaded from HF_DIR with the same changes
(and, with tp only, the Megatron model's own logits gathered over TP). It also records the bytes each rank
moved: the export's hops beyond TP gathers (Traffic) and what each source broadcast, and the names of the
tensors the export yielded on each rank.
"""

import argparse
import faulthandler
import json
import os
import signal

import torch
import torch.distributed as dist

ROUNDS = (("1", 1.1), ("2", 0.95))


def megatron_logprobs(chunks, probe, vocab):
    from megatron.core import parallel_state as ps

    model = chunks[0]
    ids = torch.tensor([probe])
    pos = torch.arange(len(probe)).unsqueeze(0)
    mask = torch.triu(torch.ones(len(probe), len(probe), dtype=torch.bool), diagonal=1).view(1, 1, len(probe), -1)
    with torch.no_grad():
        shard = model(ids, pos, mask)  # [1, S, V_padded / tp], vocab-parallel
    parts = [torch.empty_like(shard) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, shard.contiguous(), group=ps.get_tensor_model_parallel_group())
    logits = torch.cat(parts, dim=-1)[0, :, :vocab].double()
    return _token_logprobs(logits, probe)


def _token_logprobs(logits, probe):
    lp = torch.log_softmax(logits[:-1].double(), -1)
    return lp.gather(-1, torch.tensor(probe[1:]).unsqueeze(-1)).squeeze(-1)


def hf_logprobs(hf_model, probe):
    with torch.no_grad():
        logits = hf_model(torch.tensor([probe])).logits[0]
    return _token_logprobs(logits, probe)


def recording(export, names: list):
    """`export`, appending to `names` the name of every tensor it yields on this rank (what this rank sends)."""
    for name, tensor in export:
        if tensor is not None:
            names.append(name)
        yield name, tensor


def killing_after(export, n: int, pgid: int):
    """`export`, SIGKILLing process group `pgid` (a server) once this rank has yielded `n` tensors."""
    yielded = 0
    for name, tensor in export:
        if tensor is not None:
            if yielded == n:
                os.killpg(pgid, signal.SIGKILL)
            yielded += 1
        yield name, tensor


def losing_a_server(bridge, export, version, info) -> dict:
    """A sync in which a server is lost: the ServersLost each rank raised, what the bridge left in, and
    (rank 0) whether the others were left out of their session, at their old version, right after it."""
    from megatron_dapo.sync.errors import ServersLost

    try:
        bridge.sync(export, version=version)
        seen = None
    except ServersLost as e:
        seen = {"message": str(e), "urls": e.urls, "live": bridge.live}
    each = [None] * info.world_size
    dist.all_gather_object(each, seen)
    out = {"lost": each}
    if info.rank == 0:
        out["versions_after_loss"] = [v["weight_version"] for v in bridge.calls.ask_all("get_model_info")]
        opened = bridge.calls.ask_all("begin_weight_update", return_exceptions=True)  # refused if one was left open
        out["sessions_after_loss"] = [repr(a) if isinstance(a, BaseException) else "opened" for a in opened]
        bridge.calls.ask_all("end_weight_update")
    return out


def expect_failure(bridge, export, version, info, out):
    from megatron_dapo.sync.errors import WeightSyncError

    try:
        bridge.sync(export, version=version)
        error = None
    except WeightSyncError as e:
        error = str(e)
    errors = [None] * info.world_size
    dist.all_gather_object(errors, error)
    bridge.close()
    if info.rank == 0:
        with open(out, "w") as f:
            json.dump({"errors": errors}, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    faulthandler.dump_traceback_later(200)  # a hung rank shows where, before the test's timeout kills it
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("hf_dir")
    ap.add_argument("api_key")
    ap.add_argument("urls", nargs="+")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None)
    ap.add_argument("--sources", choices=["rank0", "per_stage"], default="rank0")
    # the servers cannot take every tensor: record each rank's WeightSyncError of the first sync, then stop
    ap.add_argument("--expect-failure", action="store_true")
    # in round 2, the last source SIGKILLs this process group (a server) halfway through its tensors, expects
    # ServersLost on every rank, records it, then syncs again with a fresh export (as the trainer does)
    ap.add_argument("--kill-pgid", type=int, default=None)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from megatron_dapo.bridge.export import EACH_SOURCE, Traffic, export_hf_weights, export_sources
    from megatron_dapo.bridge.load import load_hf_into_megatron
    from megatron_dapo.config.schema import SyncConfig
    from megatron_dapo.models.provider import ModelParallel, build_gpt_model
    from megatron_dapo.runtime.distributed import init_distributed, init_model_parallel
    from megatron_dapo.runtime.net import LOOPBACK
    from megatron_dapo.sync.addresses import source_store_addresses
    from megatron_dapo.sync.broadcast import BroadcastTransport

    info = init_distributed("gloo")
    init_model_parallel(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    chunks = build_gpt_model(args.hf_dir, ModelParallel(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp))
    load_hf_into_megatron(chunks, args.hf_dir)
    vocab = chunks[0].arch.vocab_size
    probe = [int(x) for x in torch.randint(0, vocab, (20,), generator=torch.Generator().manual_seed(3))]
    hf_model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32) if info.rank == 0 else None
    own_reference = args.pp == 1 and args.ep == 1

    per_stage = args.sources == "per_stage"
    sources = export_sources(chunks) if per_stage else [0]
    cfg = SyncConfig(bucket_mb=0.1, flatten_bucket=False)
    # as the trainer does: rank 0 hosts at its bind host (loopback here), each other source at its node's
    # address (MEGATRON_DAPO_NODE_ADDRESS when set, else its route to the servers)
    address = source_store_addresses(sources, LOOPBACK, args.urls).get(info.rank, LOOPBACK)  # collective
    bridge = BroadcastTransport(args.urls, cfg, api_key=args.api_key, sources=sources, master_address=address)
    bridge.connect()
    stores = [None] * info.world_size
    dist.all_gather_object(stores, bridge.master_address)
    report = {"sources": sources, "bucket_bytes": int(cfg.bucket_mb * 1024 * 1024), "rounds": [], "stores": stores}
    last_sent: list[str] = []  # what the export yielded on this rank in the previous round
    for version, scale in ROUNDS:
        with torch.no_grad():
            for chunk in chunks:
                for p in chunk.parameters():
                    p.mul_(scale)  # the same on every rank, so replicated parameters stay identical
            if hf_model is not None:
                for p in hf_model.parameters():
                    p.mul_(scale)
        ref = megatron_logprobs(chunks, probe, vocab) if own_reference else None
        traffic = Traffic()
        sent: list[str] = []
        export = export_hf_weights(chunks, dst_rank=EACH_SOURCE if per_stage else 0, traffic=traffic)
        export = recording(export, sent)
        if args.expect_failure:
            expect_failure(bridge, export, version, info, args.out)
            return
        degraded = {}
        if args.kill_pgid is not None and version == "2":
            if info.rank == sources[-1]:
                export = killing_after(export, len(last_sent) // 2, args.kill_pgid)
            degraded = losing_a_server(bridge, export, version, info)
            sent, traffic = [], Traffic()
            export = recording(export_hf_weights(chunks, dst_rank=EACH_SOURCE, traffic=traffic), sent)
        stats = bridge.sync(export, version=version)
        last_sent = list(sent)
        moved = [None] * info.world_size
        dist.all_gather_object(moved, (traffic.sent, traffic.received))
        yielded = [None] * info.world_size
        dist.all_gather_object(yielded, sent)
        if info.rank == 0:
            served = bridge.server_logprobs(probe)
            hf_ref = hf_logprobs(hf_model, probe)
            versions = bridge.calls.ask_all("get_model_info")
            report["rounds"].append(
                {
                    "version": version,
                    "max_diff": bridge.verify(probe, ref.tolist(), tolerance=1e-4) if own_reference else None,
                    "max_diff_hf": max(
                        float((torch.tensor(s, dtype=torch.float64) - hf_ref).abs().max()) for s in served
                    ),
                    "server_logprobs": served,
                    "tensors": stats.num_tensors,
                    "model_bytes": stats.nbytes,
                    "source_bytes": {str(k): v for k, v in (stats.source_bytes or {0: stats.nbytes}).items()},
                    "export_traffic": moved,
                    "yielded": yielded,  # per rank: the names the export yielded there
                    "server_versions": [v["weight_version"] for v in versions],
                    **degraded,
                }
            )
        dist.barrier()
    bridge.close()
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f)
        print("megatron sync worker done", report)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

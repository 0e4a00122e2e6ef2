"""A TP=2 megatron-core trainer (gloo, CPU) that syncs its weights into embedded servers.

usage (torchrun, 2 ranks): sync_megatron_trainer.py OUT_JSON HF_DIR API_KEY URL [URL ...]
Loads HF_DIR into a TP=2 GPTModel, changes every weight (as a training step would), streams
`export_hf_weights` through the bridge, and checks on rank 0 that the servers' logprobs on a probe
equal the Megatron model's own (logits gathered over TP, float64 log-softmax), twice (versions 1, 2).
"""

import json
import sys

import torch
import torch.distributed as dist


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
    lp = torch.log_softmax(logits[:-1], -1)
    return lp.gather(-1, torch.tensor(probe[1:]).unsqueeze(-1)).squeeze(-1)


def main():
    out, hf_dir, api_key, *urls = sys.argv[1:]
    from megatron_dapo.bridge.export import export_hf_weights
    from megatron_dapo.bridge.load import load_hf_into_megatron
    from megatron_dapo.config.schema import SyncConfig
    from megatron_dapo.models.provider import ModelParallel, build_gpt_model
    from megatron_dapo.runtime.distributed import init_distributed, init_model_parallel
    from megatron_dapo.sync.bridge import WeightSyncBridge

    info = init_distributed("gloo")
    init_model_parallel(tp=2)
    chunks = build_gpt_model(hf_dir, ModelParallel(tp=2))
    load_hf_into_megatron(chunks, hf_dir)
    vocab = chunks[0].arch.vocab_size
    probe = [int(x) for x in torch.randint(0, vocab, (20,), generator=torch.Generator().manual_seed(3))]

    bridge = WeightSyncBridge(urls, SyncConfig(bucket_mb=0.1, flatten_bucket=False), api_key=api_key)
    bridge.connect()
    report = {"rounds": []}
    for version, scale in (("1", 1.1), ("2", 0.95)):
        with torch.no_grad():
            for p in chunks[0].parameters():
                p.mul_(scale)  # the same on every rank, so replicated parameters stay identical
        ref = megatron_logprobs(chunks, probe, vocab)
        stats = bridge.sync(export_hf_weights(chunks), version=version)
        if info.rank == 0:
            diff = bridge.verify(probe, ref.tolist(), tolerance=1e-4)

            versions = bridge._all("get_model_info")
            report["rounds"].append(
                {
                    "version": version,
                    "max_diff": diff,
                    "tensors": stats.num_tensors,
                    "server_versions": [v["weight_version"] for v in versions],
                }
            )
        dist.barrier()
    if info.rank == 0:
        bridge.close()
        with open(out, "w") as f:
            json.dump(report, f)
        print("megatron sync worker done", report)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

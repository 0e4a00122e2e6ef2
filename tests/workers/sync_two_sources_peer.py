"""Two trainer ranks sync `tests.sync.test_sglang_peer._weights()` into a server, each source its own part.

usage (torchrun, 2 ranks): sync_two_sources_peer.py URL API_KEY VERSION SPLIT [--flatten]
Rank 0 holds the tensors before index SPLIT, rank 1 the rest; each iterates the whole list with None in
place of the other's tensors (as `export_hf_weights(dst_rank=EACH_SOURCE)` yields them) and the bridge
broadcasts from both (sources [0, 1]), pausing with retract.
"""

import sys

import torch.distributed as dist


def main():
    url, api_key, version, split, *flags = sys.argv[1:]
    from megatron_dapo.config.schema import SyncConfig
    from megatron_dapo.sync.broadcast import BroadcastTransport
    from tests.sync.test_sglang_peer import _weights

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stream = [(n, t if (i < int(split)) == (rank == 0) else None) for i, (n, t) in enumerate(_weights())]
    cfg = SyncConfig(bucket_mb=0.004, flatten_bucket="--flatten" in flags, pause_mode="retract")
    bridge = BroadcastTransport(
        [url], cfg, api_key=api_key, group_name=f"peer_{version}", backend="gloo", sources=[0, 1]
    )
    bridge.connect()
    try:
        stats = bridge.sync(stream, version=version)
        if rank == 0:
            print("two-source sync done", stats.source_bytes, flush=True)
    finally:
        bridge.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Weight transports side by side: ipc vs broadcast vs per_server_store, bytes and time per sync, one run.

Starts `--servers` embedded servers (CPU, on this host) holding a Qwen3-shaped model, then syncs the
trainer's weights (another seed) into all of them with each transport in turn, interleaved, `--repeats` times:
  * broadcast: `BroadcastTransport.sync()` over one gloo weight-update group with every server;
  * per_server_store: what `PerServerStoreTransport` does per version without its policy thread:
    `WeightStore.put` (the host copy on trainer rank 0), then each server's own `BroadcastTransport` syncs
    from the snapshot (one group per server, as `PerServerSync`), the servers in parallel;
  * ipc: `IpcTransport.sync()`: each bucket copied into one shared-memory buffer, its handles posted to
    `/update_weights_from_tensor` (flattened_bucket).
Every sync is whole (pause, session, every update, continue; the servers' loads into their models). Bytes
per sync are exact: what the trainer copies on its host and what it sends to servers (weights over gloo,
or the HTTP bodies that carry the IPC handles). After each mode's syncs the servers' probe logprobs are
compared with the trainer's (max abs difference). Times: median of the repeats; ratio vs broadcast.

    python benchmarks/weight_transports.py [--hidden 256 --layers 4 --vocab 16000] [--servers 2]
                                           [--bucket-mb 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.weight_sync import model_config  # noqa: E402
from megatron_dapo.config.schema import SyncConfig  # noqa: E402
from megatron_dapo.rollout.launcher import launch_embedded_servers  # noqa: E402
from megatron_dapo.sync.broadcast import BroadcastTransport  # noqa: E402
from megatron_dapo.sync.ipc import IpcTransport  # noqa: E402
from megatron_dapo.sync.per_server import WeightStore  # noqa: E402

PROBE = [(7 * i) % 900 + 3 for i in range(24)]


def build(args, out_dir: Path):
    from transformers import AutoModelForCausalLM

    cfg = model_config(args)  # the weight-sync benchmark's Qwen3 shape
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out_dir)
    torch.manual_seed(1)
    trainer = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(trainer(torch.tensor([PROBE])).logits[0].double(), -1)
    ref = [float(lp[t - 1, PROBE[t]]) for t in range(1, len(PROBE))]
    return [(n, p.detach()) for n, p in trainer.state_dict().items()], ref


class PerServerStore:
    """The store path of one version: the host copy, then every server from it over its own group."""

    def __init__(self, urls, cfg):
        self.store = WeightStore()
        self.transports = [
            BroadcastTransport([u], cfg, group_name=f"bench_store_{i}", min_live=0) for i, u in enumerate(urls)
        ]
        self.pool = concurrent.futures.ThreadPoolExecutor(len(urls))

    def connect(self):
        for t in self.transports:
            t.connect()

    def sync(self, named, version):
        self.store.put(version, named)
        snaps = [self.store.acquire() for _ in self.transports]
        try:
            pairs = zip(self.transports, snaps)
            list(self.pool.map(lambda ts: ts[0].sync(iter(ts[1].tensors), version=version), pairs))
        finally:
            for s in snaps:
                self.store.release(s)

    def verify(self, probe, ref):
        return max(t.verify(probe, ref) for t in self.transports)

    def close(self):
        self.pool.shutdown()
        for t in self.transports:
            t.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-transports-") as tmp:
        tmp = Path(tmp)
        named, ref = build(args, tmp / "model")
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        servers = launch_embedded_servers(str(tmp / "model"), args.servers, tmp / "logs", timeout_s=600)
        urls = [s.url for s in servers]
        cfg = SyncConfig(bucket_mb=args.bucket_mb, pause_mode="retract", verify_tolerance=1e-4)
        ipc_cfg = SyncConfig(bucket_mb=args.bucket_mb, pause_mode="retract", flatten_bucket=True, verify_tolerance=1e-4)
        modes = {
            "broadcast": BroadcastTransport(urls, cfg, group_name="bench_broadcast"),
            "per_server_store": PerServerStore(urls, cfg),
            "ipc": IpcTransport(urls, ipc_cfg),
        }
        times = {m: [] for m in modes}
        payload = 0
        diffs = {}
        try:
            for t in modes.values():
                t.connect()
            for r in range(args.repeats + 1):  # the first round warms every path up, untimed
                for i, (mode, t) in enumerate(modes.items()):
                    t0 = time.perf_counter()
                    stats = t.sync(iter(named), version=10 * r + i)  # an int: the store's versions are
                    if r:
                        times[mode].append(time.perf_counter() - t0)
                    if mode == "ipc":
                        payload = stats.payload_bytes
                    diffs[mode] = t.verify(PROBE, ref)
        finally:
            for t in modes.values():
                t.close()
            for s in servers:
                s.stop()
    n = args.servers
    # exact bytes the trainer moves per sync: host copies + what it sends to the servers
    moved = {
        "broadcast": (0, nbytes * n, "weights over gloo"),
        "per_server_store": (nbytes, nbytes * n, "weights over gloo"),
        "ipc": (nbytes, payload, "HTTP bodies (handles)"),
    }
    base = statistics.median(times["broadcast"])
    mib = 1024 * 1024
    print(
        f"\n{len(named)} tensors, {nbytes / mib:.1f} MiB fp32, {n} servers, bucket {args.bucket_mb} MiB, "
        f"median of {args.repeats}, load average {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| transport | host copy MiB | sent to servers MiB | sent as | s per sync | vs broadcast | max logprob diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        copied, sent, how = moved[mode]
        med = statistics.median(times[mode])
        print(
            f"| {mode} | {copied / mib:.1f} | {sent / mib:.3f} | {how} | {med:.3f} | {med / base:.2f} | "
            f"{diffs[mode]:.1e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

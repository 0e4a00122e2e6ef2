"""FP8 block rollout on CPU: what the quantization costs per GB, and bytes and time per weight sync, bf16 vs fp8_block.

1. Quantization (trainer side, `bridge.fp8.quantize_block`) and dequantization (the embedded server's load) of
   Qwen3-8B's linear weight shapes in bf16: seconds per GB of bf16 input, median of `--repeats`.
2. A weight sync of a Qwen3-shaped bf16 model (`--hidden`, `--layers`, `--vocab`) into `--servers` embedded
   servers (bf16) on this host, through each of `--transports`: `BroadcastTransport` (gloo on loopback) and
   `IpcTransport` (shared-memory handles through /update_weights_from_tensor, colocated placement's transport),
   per-tensor buckets (`rollout.sync.flatten_bucket` false, the default; `--flatten` for flattened), of the
   trainer's tensors as they are (bf16) and through `quantize_stream` (fp8_block, the stage the weight sync puts in
   front of the transport): bytes, buckets, wall time per sync (median of `--repeats`, transports and formats
   interleaved so all see the same machine load), each against bf16 over broadcast measured in the same run. The
   fp8 time includes its quantization and the servers' dequantization; on a GPU the quantization is a
   memory-bound kernel (benchmarks/gpu_check.sh times it when a GPU is lent), on CPU it is a large share.

    python benchmarks/fp8_sync.py [--hidden 1024 --layers 4 --vocab 32000] [--servers 1] [--repeats 3]
                                  [--transports broadcast ipc] [--flatten]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.weight_sync import model_config  # noqa: E402
from megatron_dapo.bridge import fp8  # noqa: E402
from megatron_dapo.config.schema import SyncConfig  # noqa: E402
from megatron_dapo.rollout.launcher import launch_embedded_servers  # noqa: E402
from megatron_dapo.sync.broadcast import BroadcastTransport  # noqa: E402
from megatron_dapo.sync.ipc import IpcTransport  # noqa: E402

QWEN3_8B_LINEARS = {"q/o 4096x4096": (4096, 4096), "k/v 1024x4096": (1024, 4096), "gate/up 12288x4096": (12288, 4096)}


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _synced(device: str, fn, *args):
    out = fn(*args)
    if device.startswith("cuda"):  # the kernels' time, not their launch
        torch.cuda.synchronize()
    return out


def quantization_cost(repeats: int, device: str) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for label, shape in QWEN3_8B_LINEARS.items():
        w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16).to(device)
        gb = w.numel() * 2 / 1e9
        q, s = fp8.quantize_block(w)
        qs = _median_s(lambda w=w: _synced(device, fp8.quantize_block, w), repeats)
        ds = _median_s(lambda q=q, s=s: _synced(device, fp8.dequantize_block, q, s, torch.bfloat16), repeats)
        rows.append({"shape": label, "bf16_gb": gb, "quantize_s_per_gb": qs / gb, "dequantize_s_per_gb": ds / gb})
    return rows


def model_dir(args, out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    cfg = model_config(args)  # the weight-sync benchmark's Qwen3 shape
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    return out


def sync_cost(args, tmp: Path) -> dict:
    from transformers import AutoModelForCausalLM

    path = model_dir(args, tmp / "model")
    torch.manual_seed(1)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    named = [(n, p.detach()) for n, p in trainer.state_dict().items()]
    servers = launch_embedded_servers(
        str(path), args.servers, tmp / "logs", timeout_s=600, extra_args=["--dtype", "bfloat16"]
    )
    streams = {"bf16": lambda: iter(named), "fp8_block": lambda: fp8.quantize_stream(named)}
    rows = {(t, f): {"seconds": []} for t in args.transports for f in streams}
    try:
        urls = [s.url for s in servers]
        cfg = SyncConfig(bucket_mb=int(args.bucket_mb), pause_generation=True, flatten_bucket=args.flatten)
        makers = {
            "broadcast": lambda: BroadcastTransport(urls, cfg, group_name="bench_fp8"),
            "ipc": lambda: IpcTransport(urls, cfg),
        }
        bridges = {t: makers[t]() for t in args.transports}
        try:
            for bridge in bridges.values():
                bridge.connect()
            for i in range(-1, args.repeats):  # round -1 warms every path up, untimed; then interleaved
                for (t, f), row in rows.items():
                    st = bridges[t].sync(streams[f](), version=f"{t}-{f}-{i}")
                    if i >= 0:
                        row["seconds"].append(st.seconds)
                    row.update(bytes=st.nbytes, tensors=st.num_tensors, buckets=st.num_buckets)
                    row["sent"] = st.payload_bytes if st.payload_bytes is not None else st.nbytes * len(urls)
        finally:
            for bridge in bridges.values():
                bridge.close()
    finally:
        for s in servers:
            s.stop()
    for row in rows.values():
        row["median_s"] = statistics.median(row["seconds"])
    return {
        "rows": [{"transport": t, "format": f, **row} for (t, f), row in rows.items()],
        "quantize_s": _median_s(lambda: list(fp8.quantize_stream(named)), args.repeats),
        "params": sum(t.numel() for _, t in named),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--flatten", action="store_true", help="flattened buckets (rollout.sync.flatten_bucket)")
    p.add_argument("--transports", nargs="+", default=["broadcast", "ipc"], choices=["broadcast", "ipc"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", help="device of the quantization-cost part (cuda on a GPU)")
    p.add_argument("--parts", nargs="+", default=["quantize", "sync"], choices=["quantize", "sync"])
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    result: dict = {"torch_threads": torch.get_num_threads(), "device": args.device}
    if "quantize" in args.parts:
        rows = quantization_cost(args.repeats, args.device)
        result["quantization"] = rows
        print(f"block quantization on {args.device} ({torch.get_num_threads()} torch threads), Qwen3-8B linear shapes:")
        print("| weight | bf16 | quantize s/GB | GB/s | dequantize s/GB | GB/s |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            q, d = r["quantize_s_per_gb"], r["dequantize_s_per_gb"]
            print(f"| {r['shape']} | {r['bf16_gb'] * 1e3:.0f} MB | {q:.2f} | {1 / q:.2f} | {d:.2f} | {1 / d:.2f} |")
    if "sync" in args.parts:
        with tempfile.TemporaryDirectory(prefix="fp8-sync-") as tmp:
            res = sync_cost(args, Path(tmp))
        result["sync"] = res
        rows = res["rows"]
        base = next(r for r in rows if r["format"] == "bf16" and r["transport"] == args.transports[0])
        print(
            f"\nweight sync: Qwen3-shaped {res['params'] / 1e6:.0f}M params (hidden {args.hidden}, "
            f"{args.layers} layers, vocab {args.vocab}), bf16 trainer -> {args.servers} embedded bf16 server(s) "
            f"on this host, {'flattened' if args.flatten else 'per-tensor'} buckets of {args.bucket_mb} MiB; "
            f"median of {args.repeats}, interleaved; vs bf16 over {base['transport']}:"
        )
        print("| transport | format | bytes | sent | tensors | buckets | s per sync | bytes vs bf16 | time vs bf16 |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['transport']} | {r['format']} | {r['bytes'] / 2**20:.1f} MiB | {r['sent'] / 2**20:.3f} MiB | "
                f"{r['tensors']} | {r['buckets']} | {r['median_s']:.3f} | {r['bytes'] / base['bytes']:.3f} | "
                f"{r['median_s'] / base['median_s']:.2f} |"
            )
        print(f"fp8_block's quantization alone (the stage, no transport): {res['quantize_s']:.3f} s per sync")
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) at the end")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

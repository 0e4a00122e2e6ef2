"""FP8 block rollout on CPU: what the quantization costs per GB, and bytes and time per weight sync, bf16 vs fp8_block.

1. Quantization (trainer side, `bridge.fp8.quantize_block`) and dequantization (the embedded server's load) of
   Qwen3-8B's linear weight shapes in bf16: seconds per GB of bf16 input, median of `--repeats`.
2. A weight sync of a Qwen3-shaped bf16 model (`--hidden`, `--layers`, `--vocab`) into `--servers` embedded
   servers (bf16) over gloo on loopback, through `BroadcastTransport` (flattened buckets, the default), of the
   trainer's tensors as they are (bf16) and through `quantize_stream` (fp8_block, the stage the weight sync puts in
   front of the transport): bytes sent, buckets, wall time per sync (median of `--repeats`, the formats
   interleaved so both see the same machine load), each against bf16 measured in the same run. The fp8 time
   includes its quantization and the servers' dequantization; on a GPU the quantization is a memory-bound kernel
   (benchmarks/gpu_check.sh times it when a GPU is lent), on CPU it is a large share.

    python benchmarks/fp8_sync.py [--hidden 1024 --layers 4 --vocab 32000] [--servers 1] [--repeats 3]
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
    out = {f: {"seconds": []} for f in streams}
    try:
        cfg = SyncConfig(bucket_mb=args.bucket_mb, pause_generation=True)
        bridge = BroadcastTransport([s.url for s in servers], cfg, group_name="bench_fp8")
        bridge.connect()
        try:
            for f, stream in streams.items():
                bridge.sync(stream(), version=f"{f}-warmup")
            for i in range(args.repeats):  # interleaved: both formats see the same machine load
                for f, stream in streams.items():
                    st = bridge.sync(stream(), version=f"{f}-{i}")
                    out[f]["seconds"].append(st.seconds)
                    out[f].update(bytes=st.nbytes, tensors=st.num_tensors, buckets=st.num_buckets)
        finally:
            bridge.close()
    finally:
        for s in servers:
            s.stop()
    quant_s = _median_s(lambda: list(fp8.quantize_stream(named)), args.repeats)
    for f in out:
        out[f]["median_s"] = statistics.median(out[f]["seconds"])
    out["fp8_block"]["quantize_s"] = quant_s
    out["params"] = sum(t.numel() for _, t in named)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=64)
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
        b, f = res["bf16"], res["fp8_block"]
        print(
            f"\nweight sync: Qwen3-shaped {res['params'] / 1e6:.0f}M params (hidden {args.hidden}, "
            f"{args.layers} layers, vocab {args.vocab}), "
            f"bf16 trainer -> {args.servers} embedded bf16 server(s), gloo loopback, "
            f"flattened buckets of {args.bucket_mb:g} MiB; median of {args.repeats}, interleaved:"
        )
        print("| format | bytes | tensors | buckets | s per sync | bytes vs bf16 | time vs bf16 |")
        print("|---|---|---|---|---|---|---|")
        for name, r in (("bf16", b), ("fp8_block", f)):
            print(
                f"| {name} | {r['bytes'] / 2**20:.1f} MiB | {r['tensors']} | {r['buckets']} | {r['median_s']:.3f} | "
                f"{r['bytes'] / b['bytes']:.3f} | {r['median_s'] / b['median_s']:.2f} |"
            )
        print(
            f"fp8_block's quantization alone (the stage, no transport): {f['quantize_s']:.3f} s per sync "
            f"({f['quantize_s'] / f['median_s']:.0%} of its sync on this CPU)"
        )
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) at the end")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

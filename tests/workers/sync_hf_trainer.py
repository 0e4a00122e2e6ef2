"""A plain torch trainer process holding an HF model; syncs its weights into embedded servers.

usage: sync_hf_trainer.py OUT_JSON CKPT_DIR URL [URL ...] [--flatten] [--bucket-mb X] [--versions V,...]
       [--first-ckpt DIR] [--api-key K] [--no-pause]
--first-ckpt syncs that checkpoint first (version "first"), so the later syncs overwrite other weights.
--bad-name-first first tries a sync with one extra tensor no server has; its error goes to OUT_JSON.
--fp8 sends the FP8 block layout (bridge.fp8.quantize_stream in front of the transport); the reference model then
holds the checkpoint's weights as the quantization rounds them (each block dequantized, in float64 first).
--transport ipc syncs with IpcTransport (shared-memory handles through /update_weights_from_tensor) instead of
the broadcast transport's gloo group; OUT_JSON's "after_first" holds the servers' logprobs after --first-ckpt.
Reads the checkpoint's tensors (HF on-disk names, per-expert for MoE) as the named-tensor stream,
syncs them, then writes its own logprobs of a probe (from transformers' model of the same checkpoint,
the independent reference) and the servers' to OUT_JSON.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch
from safetensors import safe_open

from megatron_dapo.config.schema import SyncConfig
from megatron_dapo.sync.broadcast import BroadcastTransport
from megatron_dapo.sync.errors import WeightSyncError


def rounded_copy(ckpt: str, out: str, keep=lambda name: False) -> str:
    """`ckpt` with every FP8-quantized weight (`bridge.fp8.is_quantized`, except those `keep` names) replaced by
    its blocks rounded to e4m3 (dequantized in float64 first), under the checkpoint's own names (per expert for
    MoE, before transformers fuses them), written to `out` with its config."""
    from safetensors.torch import save_file

    from megatron_dapo.bridge import fp8

    tensors = {}
    for f in sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors")):
        with safe_open(os.path.join(ckpt, f), "pt") as s:
            for n in s.keys():
                w = s.get_tensor(n)
                if fp8.is_quantized(n) and not keep(n):
                    w = fp8.dequantize_block(*fp8.quantize_block(w), torch.float64).to(w.dtype)
                tensors[n] = w
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(ckpt, "config.json"), out)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("ckpt")
    p.add_argument("urls", nargs="+")
    p.add_argument("--flatten", action="store_true")
    p.add_argument("--bucket-mb", type=float, default=0.05)
    p.add_argument("--versions", default="1")
    p.add_argument("--first-ckpt")
    p.add_argument("--bad-name-first", action="store_true")
    p.add_argument("--api-key")
    p.add_argument("--no-pause", action="store_true")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--transport", choices=["broadcast", "ipc"], default="broadcast")
    p.add_argument("--ready-file", help="touched once the group is formed")
    p.add_argument("--go-file", help="sync only once this file exists")
    a = p.parse_args()

    from transformers import AutoModelForCausalLM

    from megatron_dapo.bridge import fp8

    with tempfile.TemporaryDirectory(prefix="fp8_reference_") as out:
        # with --fp8 the reference holds what the servers should: each linear weight's blocks, rounded to e4m3
        reference = rounded_copy(a.ckpt, out) if a.fp8 else a.ckpt
        model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    probe = [
        int(x) for x in torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(7))
    ]
    with torch.no_grad():
        logits = model(torch.tensor([probe])).logits[0].double()
    ref = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(probe[1:]).unsqueeze(-1)).squeeze(-1)

    def read(ckpt):
        files = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
        for f in files:
            with safe_open(os.path.join(ckpt, f), "pt") as s:
                for k in s.keys():
                    yield k, s.get_tensor(k)

    def named(ckpt=a.ckpt):
        return fp8.quantize_stream(read(ckpt)) if a.fp8 else read(ckpt)

    cfg = SyncConfig(bucket_mb=a.bucket_mb, flatten_bucket=a.flatten, pause_generation=not a.no_pause)
    if a.transport == "ipc":
        from megatron_dapo.sync.ipc import IpcTransport

        bridge = IpcTransport(a.urls, cfg, api_key=a.api_key)
    else:
        bridge = BroadcastTransport(a.urls, cfg, api_key=a.api_key)
    bridge.connect()
    if a.ready_file:
        open(a.ready_file, "w").close()
    if a.go_file:
        deadline = time.time() + 120
        while not os.path.exists(a.go_file):
            if time.time() > deadline:
                raise TimeoutError(f"{a.go_file} never appeared")
            time.sleep(0.01)
    stats, bad_name_error = [], None
    if a.bad_name_first:
        bogus = ("model.layers.0.mlp.bogus_proj.weight", torch.ones(8, 8))
        try:
            bridge.sync([*named(), bogus], version="bogus")
        except WeightSyncError as e:
            bad_name_error = str(e)
    after_first = None
    if a.first_ckpt:
        bridge.sync(named(a.first_ckpt), version="first")
        after_first = served(bridge, probe)
    for v in a.versions.split(","):
        s = bridge.sync(named(), version=v)
        stats.append(
            {
                "version": s.version,
                "tensors": s.num_tensors,
                "bytes": s.nbytes,
                "buckets": s.num_buckets,
                "gbps": s.gbps,
            }
        )
    diff = bridge.verify(probe, ref.tolist(), tolerance=1e-4)
    server_lps = served(bridge, probe)
    bridge.close()
    with open(a.out, "w") as f:
        json.dump(
            {
                "stats": stats,
                "bad_name_error": bad_name_error,
                "max_diff": diff,
                "probe": probe,
                "trainer": ref.tolist(),
                "servers": server_lps,
                "after_first": after_first,
            },
            f,
        )
    print("sync worker done", stats, diff)
    return 0


def served(bridge, probe):
    """Each live server's logprobs of the probe (either transport)."""
    return bridge.calls.ask_all("prompt_logprobs", list(probe))


if __name__ == "__main__":
    sys.exit(main())

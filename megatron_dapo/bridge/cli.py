"""`megatron-dapo convert {hf-to-megatron,megatron-to-hf,hf-to-fp8}`: HF <-> megatron-core checkpoint conversion,
and FP8 block-quantized HF checkpoints (the first start of servers run with rollout.weight_format=fp8_block)."""

from __future__ import annotations

import argparse
import math
import sys


def _positive_gb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value * 1024**3 >= 1):
        raise argparse.ArgumentTypeError(f"expected a positive size in GB, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-dapo convert", description=__doc__)
    sub = p.add_subparsers(dest="direction", required=True)

    def layout(sp, what):
        sp.add_argument("--tp", type=int, default=1, help=f"tensor parallel size {what}")
        sp.add_argument("--pp", type=int, default=1, help=f"pipeline parallel size {what}")
        sp.add_argument("--ep", type=int, default=1, help=f"expert parallel size {what} (MoE)")
        sp.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: tp)")
        sp.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the HF config's dtype)")

    a = sub.add_parser("hf-to-megatron", help="HF safetensors -> megatron-core dist_checkpointing (torch_dist)")
    a.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="output checkpoint directory (must not exist)")
    layout(a, "of the saved checkpoint (it loads at any other layout)")

    b = sub.add_parser("megatron-to-hf", help="megatron-core dist_checkpointing -> HF safetensors")
    b.add_argument("--ckpt", required=True, help="checkpoint directory (written by hf-to-megatron or training)")
    b.add_argument(
        "--hf-config", default=None, help="HF directory with config.json / tokenizer (default: CKPT/hf_config)"
    )
    b.add_argument("--out", required=True, help="output HF directory (must not exist)")
    b.add_argument("--max-shard-size-gb", type=_positive_gb, default=5.0, help="safetensors shard size")
    b.add_argument(
        "--weight-format",
        choices=("bf16", "fp8_block"),
        default="bf16",
        help="fp8_block: linear weights float8_e4m3fn + weight_scale_inv per 128x128 block (Qwen3-FP8 layout)",
    )
    layout(b, "used to read the checkpoint")

    c = sub.add_parser("hf-to-fp8", help="HF bf16 safetensors -> FP8 block-quantized HF safetensors (Qwen3-FP8 layout)")
    c.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    c.add_argument("--out", required=True, help="output HF directory (must not exist)")
    c.add_argument("--max-shard-size-gb", type=_positive_gb, default=5.0, help="safetensors shard size")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_dapo.bridge.convert import hf_to_fp8, hf_to_megatron, megatron_to_hf

    try:
        if args.direction == "hf-to-fp8":
            out = hf_to_fp8(args.hf, args.out, max_shard_bytes=int(args.max_shard_size_gb * 1024**3))
        elif args.direction == "hf-to-megatron":
            out = hf_to_megatron(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, dtype=args.dtype)
        else:
            out = megatron_to_hf(
                args.ckpt,
                args.out,
                hf_config_dir=args.hf_config,
                tp=args.tp,
                pp=args.pp,
                ep=args.ep,
                etp=args.etp,
                dtype=args.dtype,
                max_shard_bytes=int(args.max_shard_size_gb * 1024**3),
                weight_format=args.weight_format,
            )
    except (ValueError, OSError, RuntimeError) as e:
        print(f"megatron-dapo convert: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`megatron-dapo plan CONFIG --nodes N --gpus-per-node G [--gpu-mem-gib M] [key=value ...]`: the
process layout, per-GPU memory and step time of a config on a cluster (megatron_dapo.planner.plan);
exit 1 naming what does not fit, 2 on a bad config or option."""

from __future__ import annotations

import argparse
import sys

from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.load import load_config
from megatron_dapo.config.validate import validate_config
from megatron_dapo.planner.cluster_args import add_cluster_args, cluster_overrides
from megatron_dapo.planner.plan import fit_errors, format_plan, make_plan
from megatron_dapo.planner.refit import IB_400G_GBPS, NVLINK_GBPS
from megatron_dapo.planner.speed import H100_BF16_TFLOPS, peak_tflops


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-dapo plan", description=__doc__.split("\n\n")[0])
    add_cluster_args(parser, nodes_required=True)
    parser.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="fraction of GPU memory kept free for the CUDA context, NCCL and fragmentation (0.1)",
    )
    parser.add_argument(
        "--gpu-tflops",
        type=float,
        help=f"peak bf16 TFLOP/s per trainer GPU, instead of --trainer-gpu ({H100_BF16_TFLOPS:g}, H100)",
    )
    parser.add_argument(
        "--link-gbps",
        type=float,
        help=f"Gbit/s of the trainer -> rollout server link, for the refit time (default: {NVLINK_GBPS:g}, "
        f"NVLink, when the trainer and the servers share one node, else {IB_400G_GBPS:g}, 400G InfiniBand)",
    )
    parser.add_argument("--prompt-len", type=float, default=256, help="mean prompt tokens, for the step time (256)")
    parser.add_argument(
        "--response-len",
        type=float,
        help="mean response tokens, for the step time (default: the simulator's DAPO-like "
        "lengths for data.max_response_length)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)

    try:
        cfg = load_config(args.config, [*args.overrides, *cluster_overrides(args)], validate=False)
        for note in validate_config(cfg):
            print(f"note: {note}", file=sys.stderr)
        peak = peak_tflops(args.trainer_gpu, args.gpu_tflops)
        plan = make_plan(
            cfg, args.gpu_mem_gib, args.headroom, args.prompt_len, args.response_len, peak, args.mfu, args.link_gbps
        )
    except (ConfigError, ValueError) as e:
        print(f"plan error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    errors = fit_errors(plan)
    for err in errors:
        print(f"does not fit: {err}", file=sys.stderr)
    if errors:
        return 1
    print("fits: yes")
    return 0

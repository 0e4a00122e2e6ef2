"""The command-line flags that describe a cluster and its trainer GPUs, defined once for `plan` and
`simulate` (`profile-engine` measures one server and takes none of them).

The step-time flags keep a plain `float` type on purpose: their range is checked where the estimate is
made (`planner.speed`), which names the flag in the command's own error line.
"""

from __future__ import annotations

import argparse

from megatron_dapo.planner.speed import DEFAULT_MFU, GPU_BF16_TFLOPS
from megatron_dapo.runtime.cli_args import number

MAX_COUNT = 100_000  # nodes, GPUs, engines, steps: past this no cluster (and no simulation) is meant
DEFAULT_GPU_MEM_GIB = 80.0

# the flags add_cluster_args defines, by argparse dest (the sharing test reads it)
CLUSTER_FLAGS = ("config", "overrides", "nodes", "gpus_per_node", "gpu_mem_gib", "trainer_gpu", "mfu")


def add_cluster_args(parser: argparse.ArgumentParser, nodes_required: bool = False) -> None:
    """The config with its overrides, the cluster's shape (`--nodes`, `--gpus-per-node`, `--gpu-mem-gib`)
    and the trainer GPUs' speed (`--trainer-gpu`, `--mfu`). Unset node / GPU counts keep the config's."""
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    count = number(int, 1, MAX_COUNT)
    parser.add_argument("--nodes", type=count, required=nodes_required, help="nodes (sets trainer.nnodes)")
    parser.add_argument(
        "--gpus-per-node", type=count, required=nodes_required, help="GPUs per node (sets trainer.gpus_per_node)"
    )
    parser.add_argument(
        "--gpu-mem-gib",
        type=number(float, 0, MAX_COUNT, low_open=True),
        default=DEFAULT_GPU_MEM_GIB,
        help=f"memory of one GPU in GiB, for the memory estimate and the engines' KV pool ({DEFAULT_GPU_MEM_GIB:g})",
    )
    parser.add_argument(
        "--trainer-gpu",
        choices=sorted(GPU_BF16_TFLOPS),
        help="the trainer GPUs, for their peak bf16 TFLOP/s in the step time (default h100)",
    )
    parser.add_argument(
        "--mfu",
        type=float,
        default=DEFAULT_MFU,
        help=f"trainer model FLOPs utilisation, for the step time ({DEFAULT_MFU})",
    )


def cluster_overrides(args: argparse.Namespace) -> list[str]:
    """`key=value` overrides for the node and GPU counts given on the command line."""
    out = []
    if args.nodes is not None:
        out.append(f"trainer.nnodes={args.nodes}")
    if args.gpus_per_node is not None:
        out.append(f"trainer.gpus_per_node={args.gpus_per_node}")
    return out

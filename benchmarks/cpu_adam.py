"""The speed cost of optimizer.cpu_offload (megatron-core's HybridDeviceOptimizer): its CPU part steps torch
AdamW on fp32 master weights in host memory, and each step copies the offloaded share's gradients out and
its parameters back over PCIe.

Measured here (CPU): torch AdamW's step rate on one core and on all cores, in parameters per second, for
the kernels HybridDeviceOptimizer can use (fused=True, what megatron-core 0.16.1 asks for; foreach; the
per-tensor loop), each against the per-tensor loop of the same run; and the trainer engine's offload /
reload (trainer/offload.py) of a state of the same size in host memory, in GB/s, the copy a GPU run does
over PCIe. Then the plan's estimate of the cost per training step for the colocated Qwen3 configs
(planner/colocation.py: CPU_ADAM_PARAMS_S_PER_CORE per core x CORES_PER_GPU, PCIE_GB_S) beside their
trainer step time, since the GPU-side overlap needs CUDA to measure.

    python benchmarks/cpu_adam.py [--params 20000000] [--tensors 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def adam_rate(n: int, tensors: int, repeats: int, **kwargs) -> float:
    """Parameters per second of torch AdamW steps on `n` fp32 parameters in `tensors` tensors."""
    params = [torch.zeros(n // tensors, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.1, **kwargs)
    opt.step()  # the moments are allocated on the first step
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return n / statistics.median(times)


def offload_rate(n: int, repeats: int) -> float:
    """GB/s of DeviceOffload's offload + reload of `n` fp32 parameters (host to host here)."""
    from megatron_dapo.trainer.offload import DeviceOffload

    params = [torch.randn(n // 8) for _ in range(8)]
    off = DeviceOffload(torch.device("cpu"), {"params": lambda: params, "grads": list, "optimizer": list})
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        off.offload("params")
        off.reload("params")
        times.append(time.perf_counter() - t)
    return 2 * 4 * n / statistics.median(times) / 1e9


def plan_rows() -> list[str]:
    from megatron_dapo.config import load_config
    from megatron_dapo.planner.colocation import optimizer_steps_per_step
    from megatron_dapo.planner.plan import make_plan

    rows = []
    for name in ("qwen3_8b_colocated.yaml", "qwen3_30b_a3b_colocated.yaml"):
        cfg = load_config(str(ROOT / "configs" / "qwen3" / name), [])
        plan = make_plan(cfg)
        co, step = plan.colocated, plan.step
        train_s = step.speed.step_s(step.tokens(cfg))
        cpu_s = co.cpu_optimizer_s * optimizer_steps_per_step(cfg)
        rows.append(
            f"| {name} | {co.cpu_optimizer_params / 1e9:.2f} B | {optimizer_steps_per_step(cfg)} | {cpu_s:.1f} s | "
            f"{co.transfer_s:.1f} s | {train_s:.0f} s | {(cpu_s + co.transfer_s) / train_s:.1%} |"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=20_000_000)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    cores = torch.get_num_threads()
    print(
        f"torch AdamW step on {args.params / 1e6:.0f} M fp32 parameters ({args.tensors} tensors), "
        f"median of {args.repeats}"
    )
    print("| kernel | threads | params/s | vs per-tensor loop |")
    print("|---|---|---|---|")
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        base = adam_rate(args.params, args.tensors, args.repeats, foreach=False)
        for kernel, kwargs in (
            ("per-tensor loop", {"foreach": False}),
            ("foreach", {"foreach": True}),
            ("fused", {"fused": True}),
        ):
            rate = base if kernel == "per-tensor loop" else adam_rate(args.params, args.tensors, args.repeats, **kwargs)
            print(f"| {kernel} | {threads} | {rate:.3g} | {rate / base:.2f}x |")
    torch.set_num_threads(cores)
    print(
        f"\nengine offload + reload of {args.params / 1e6:.0f} M fp32 parameters (host to host): "
        f"{offload_rate(args.params, args.repeats):.1f} GB/s"
    )
    print("\nplan's estimate per training step (planner/colocation.py), H100 node:")
    print(
        "| config | params on CPU per GPU | optimizer steps | CPU optimizer | offload + reload | trainer step "
        "| overhead |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in plan_rows():
        print(row)


if __name__ == "__main__":
    main()

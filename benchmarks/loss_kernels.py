"""Benchmark: target log-probs over a Qwen3-sized vocabulary, forward + backward.

Variants, all from the same bf16 logits [T, V] and measured in the same run:
  naive     full fp32 log_softmax + gather (what a plain PyTorch loss does)
  project   megatron_dapo.kernels.vocab_parallel_logprobs (Triton on CUDA, chunked torch on CPU)
  megatron  megatron.core.tensor_parallel.vocab_parallel_cross_entropy (TP group of 1)

CPU: every (variant, T) runs in its own subprocess, so peak RSS belongs to that variant alone;
"extra" is the peak (VmHWM, reset after the inputs are built) above the RSS right before the first
forward: inputs and the torch runtime excluded, the bf16 grad of the logits (the same for every
variant) included. CUDA: torch.cuda.max_memory_allocated above the inputs (grad included) and CUDA-event times,
plus the achieved bandwidth against the bytes that must move (logits read twice, grad written once).

    python benchmarks/loss_kernels.py                 # T in {2048, 8192}, V = 151936
    python benchmarks/loss_kernels.py --quick         # T in {256, 1024}: small CPU machines
    python benchmarks/loss_kernels.py --json out.json # also write the rows as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VARIANTS = ("naive", "project", "megatron")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """Peak RSS since the last reset_peak_rss() (VmHWM), else since the process started."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS, so input creation is not counted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def make_variant(name: str):
    """A function logits, target -> per-token logprobs [T] (differentiable)."""
    if name == "naive":
        return lambda x, t: torch.log_softmax(x.float(), dim=-1).gather(-1, t[:, None]).squeeze(-1)
    if name == "project":
        from megatron_dapo.kernels import vocab_parallel_logprobs

        return lambda x, t: vocab_parallel_logprobs(x, t)
    if name == "megatron":
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        from megatron_dapo.runtime.distributed import init_distributed, init_model_parallel

        init_distributed()
        init_model_parallel(tp=1)
        # megatron-core wants [s, b, V]; it returns the loss -logprob
        return lambda x, t: -vocab_parallel_cross_entropy(x[:, None], t[:, None]).squeeze(1)
    raise ValueError(f"unknown variant {name!r}, expected one of {VARIANTS}")


def inputs(tokens: int, vocab: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=g, device=device, dtype=dtype).mul_(2)  # no fp32 temporary
    target = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    grad_out = torch.randn(tokens, generator=g, device=device)
    return logits.requires_grad_(), target, grad_out


def step(fn, logits, target, grad_out):
    logits.grad = None
    lp = fn(logits, target)
    lp.backward(grad_out)
    return lp


def run_cpu_worker(name: str, tokens: int, vocab: int, dtype: str, repeats: int) -> dict:
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
    fn = make_variant(name)
    logits, target, grad_out = inputs(tokens, vocab, DTYPES[dtype], torch.device("cpu"))
    before = rss_mib()
    reset_peak_rss()
    times = []
    for i in range(repeats + 1):  # first run is warm-up
        t0 = time.perf_counter()
        lp = step(fn, logits, target, grad_out)
        if i:
            times.append(time.perf_counter() - t0)
    return dict(
        variant=name,
        tokens=tokens,
        vocab=vocab,
        dtype=dtype,
        device="cpu",
        time_ms=statistics.median(times) * 1e3,
        peak_mib=peak_rss_mib(),
        extra_mib=peak_rss_mib() - before,
        checksum=float(lp.detach().double().sum()),
        grad_checksum=float(logits.grad.double().abs().sum()),
    )


def run_cuda(name: str, tokens: int, vocab: int, dtype: str, repeats: int) -> dict:
    dev = torch.device("cuda")
    fn = make_variant(name)
    logits, target, grad_out = inputs(tokens, vocab, DTYPES[dtype], dev)
    step(fn, logits, target, grad_out)  # warm-up / compile
    logits.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        lp = step(fn, logits, target, grad_out)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    t_ms = statistics.median(times)
    moved = 3 * logits.numel() * logits.element_size()  # read fwd, read bwd, write grad
    return dict(
        variant=name,
        tokens=tokens,
        vocab=vocab,
        dtype=dtype,
        device="cuda",
        time_ms=t_ms,
        peak_mib=torch.cuda.max_memory_allocated() / 2**20,
        extra_mib=(torch.cuda.max_memory_allocated() - base) / 2**20,
        gbps=moved / (t_ms * 1e-3) / 1e9,
        checksum=float(lp.double().sum()),
        grad_checksum=float(logits.grad.double().abs().sum()),
    )


def run_cpu(name, tokens, vocab, dtype, repeats, timeout) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        name,
        "--tokens",
        str(tokens),
        "--vocab",
        str(vocab),
        "--dtype",
        dtype,
        "--repeats",
        str(repeats),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(variant=name, tokens=tokens, vocab=vocab, dtype=dtype, device="cpu", error=f"timeout {timeout}s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(
            variant=name, tokens=tokens, vocab=vocab, dtype=dtype, device="cpu", error=f"rc={proc.returncode}: {err}"
        )
    return json.loads(lines[-1])


def table(rows: list[dict]) -> str:
    head = ["T", "V", "variant", "time ms", "x naive", "peak MiB", "extra MiB", "x naive mem", "GB/s", "check"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['tokens']} | {r['vocab']} | {r['variant']} | {r['error']} |" + " |" * 6)
            continue
        naive = next(
            (n for n in rows if n["variant"] == "naive" and n["tokens"] == r["tokens"] and "error" not in n), None
        )
        speed = f"{naive['time_ms'] / r['time_ms']:.2f}" if naive else "-"
        mem = f"{r['extra_mib'] / naive['extra_mib']:.2f}" if naive and naive["extra_mib"] > 0 else "-"
        check = (
            "ok" if naive is None or abs(r["checksum"] - naive["checksum"]) <= 1e-3 * abs(naive["checksum"]) else "DIFF"
        )
        gbps = f"{r['gbps']:.0f}" if "gbps" in r else "-"
        out.append(
            f"| {r['tokens']} | {r['vocab']} | {r['variant']} | {r['time_ms']:.1f} | {speed} | "
            f"{r['peak_mib']:.0f} | {r['extra_mib']:.0f} | {mem} | {gbps} | {check} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--repeats", type=int, default=None, help="timed runs after one warm-up (median)")
    ap.add_argument("--quick", action="store_true", help="T in {256, 1024}, 1 timed run (small CPU machines)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per CPU subprocess")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    tokens = args.tokens or ([256, 1024] if args.quick else [2048, 8192])
    cuda = torch.cuda.is_available()
    repeats = args.repeats or (1 if args.quick else (10 if cuda else 3))
    if args.worker:
        print(json.dumps(run_cpu_worker(args.worker, tokens[0], args.vocab, args.dtype, repeats)), flush=True)
        return 0
    rows = []
    for t in tokens:
        for name in args.variants:
            print(f"[loss_kernels] T={t} V={args.vocab} {name} ...", file=sys.stderr, flush=True)
            if cuda:
                rows.append(run_cuda(name, t, args.vocab, args.dtype, repeats))
                torch.cuda.empty_cache()
            else:
                rows.append(run_cpu(name, t, args.vocab, args.dtype, repeats, args.timeout))
    where = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores), subprocess per variant"
    print(f"# loss_kernels: logprobs fwd+bwd, {args.dtype} logits, {where}, median of {repeats} run(s)")
    print(
        "# peak = max RSS (CPU) / max_memory_allocated (CUDA); extra = peak above the inputs; "
        "x naive = naive time / time and extra / naive extra"
    )
    print(table(rows))
    if args.json:
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(json.dumps(rows, indent=2))
        tmp.rename(args.json)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: target log-probs over a Qwen3-sized vocabulary, forward + backward.

Two modes. `--mode logits` (the default) starts from logits; `--mode lm-head` starts from the final
hidden state and the output weight (see LM_HEAD_DOC below).

--mode logits: variants, all from the same bf16 logits [T, V] and measured in the same run:
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
    nice python benchmarks/loss_kernels.py --mode lm-head --hidden 128 --tokens 2048 8192 32768
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
LM_HEAD_VARIANTS = ("naive", "today", "megatron", "fused", "fused-triton")
LM_HEAD_DOC = """--mode lm-head: hidden [T, H] and weight [V, H] (bf16, TP=1) to per-token logprob + entropy,
forward + backward of (logprob * a).sum() + (entropy * b).sum() into dH and dW:
  naive     logits = hidden @ weight.T, fp32 log_softmax, gather, entropy -(p log p).sum
  today     the actor with algo.fused_lm_head=false: the output layer's bf16 logits,
            mask_padded_vocab_logits, then the project's vocab_parallel_logprobs(with_entropy=True)
  megatron  the same logits into megatron-core's vocab_parallel_cross_entropy, plus an fp32 entropy
  fused     megatron_dapo.kernels.fused_linear_logprobs (token chunks sized from its workspace),
            backend="torch": the per-chunk softmax work in torch ops
  fused-triton  the same op with backend="triton": that work in its Triton kernels (CUDA only; the
            default variant list includes it when a GPU is present)
"extra" = peak (CPU: VmHWM reset after the inputs and a small warm-up; CUDA: max_memory_allocated)
above the memory before the step, minus the dH and dW outputs themselves (bf16, the same for every
variant). Rows whose estimate (extra per token of the same variant's smallest-T row, times T) exceeds
the available memory are not run and say what they would need."""
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
        grad_checksum=chunked_abs_sum(logits.grad),  # no float64 [T, V] copy
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
        grad_checksum=chunked_abs_sum(logits.grad),  # no float64 [T, V] copy
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


# ---------------------------------------------------------------- --mode lm-head
LM_TEMPERATURE = 1.0  # megatron-core's cross entropy takes no temperature: keep every variant comparable


def fp32_entropy(logits: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    return torch.logsumexp(x, dim=-1) - (torch.softmax(x, dim=-1) * x).sum(dim=-1)


def make_lm_head_variant(name: str):
    """A function hidden, weight, target -> (logprobs [T], entropy [T]), differentiable."""
    if name == "naive":

        def naive(h, w, t):
            logp = torch.log_softmax((h @ w.t()).float(), dim=-1)
            return logp.gather(1, t[:, None]).squeeze(1), -(logp.exp() * logp).sum(dim=-1)

        return naive
    if name == "today":
        from megatron_dapo.kernels import vocab_parallel_logprobs
        from megatron_dapo.models.provider import mask_padded_vocab_logits

        def today(h, w, t):
            logits = mask_padded_vocab_logits(h @ w.t(), w.shape[0], vocab_start=0)  # the output layer at TP=1
            return vocab_parallel_logprobs(logits, t, None, temperature=LM_TEMPERATURE, with_entropy=True)

        return today
    if name == "megatron":
        ce = make_variant("megatron")
        return lambda h, w, t: (lambda x: (ce(x, t), fp32_entropy(x)))(h @ w.t())
    if name in ("fused", "fused-triton"):
        from megatron_dapo.kernels import fused_linear_logprobs

        backend = "triton" if name == "fused-triton" else "torch"
        return lambda h, w, t: fused_linear_logprobs(h, w, t, temperature=LM_TEMPERATURE, backend=backend)
    raise ValueError(f"unknown lm-head variant {name!r}, expected one of {LM_HEAD_VARIANTS}")


def lm_head_inputs(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g, device=device, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=g, device=device, dtype=dtype).mul_(2 * hidden**-0.5)
    target = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    a, b = torch.randn(tokens, generator=g, device=device), torch.randn(tokens, generator=g, device=device)
    return h.requires_grad_(), w.requires_grad_(), target, a, b


def lm_head_step(fn, h, w, target, a, b):
    h.grad = w.grad = None
    lp, ent = fn(h, w, target)
    ((lp * a).sum() + (ent * b).sum()).backward()
    return lp.detach(), ent.detach()


def chunked_abs_sum(x: torch.Tensor, rows: int = 4096) -> float:
    """sum |x| in float64 without a float64 copy of x (a [T, V] or [V, H] tensor can be GiBs)."""
    return float(sum(x[i : i + rows].double().abs().sum() for i in range(0, x.shape[0], rows)))


def run_lm_head_worker(name: str, tokens: int, hidden: int, vocab: int, dtype: str) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
    fn = make_lm_head_variant(name)
    lm_head_step(fn, *lm_head_inputs(min(tokens, 256), hidden, vocab, DTYPES[dtype], dev))  # warm-up
    h, w, target, a, b = lm_head_inputs(tokens, hidden, vocab, DTYPES[dtype], dev)
    outputs_mib = (h.numel() * h.element_size() + w.numel() * w.element_size()) / 2**20  # dH + dW
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        lp, ent = lm_head_step(fn, h, w, target, a, b)
        torch.cuda.synchronize()
        t_ms, peak = (time.perf_counter() - t0) * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        before = rss_mib()
        reset_peak_rss()
        t0 = time.perf_counter()
        lp, ent = lm_head_step(fn, h, w, target, a, b)
        t_ms, peak = (time.perf_counter() - t0) * 1e3, peak_rss_mib() - before
    return dict(
        variant=name,
        tokens=tokens,
        vocab=vocab,
        hidden=hidden,
        dtype=dtype,
        device=dev.type,
        time_ms=t_ms,
        extra_mib=peak - outputs_mib,
        lp_sum=float(lp.double().sum()),
        ent_sum=float(ent.double().sum()),
        dh_sum=chunked_abs_sum(h.grad),
        dw_sum=chunked_abs_sum(w.grad),
    )


def available_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0] / 2**20
    with open("/proc/meminfo") as f:
        return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("MemAvailable:"))


def estimated_mib(rows: list[dict], name: str, tokens: int) -> float | None:
    """The variant's extra memory at `tokens`, scaled linearly from its smallest measured T."""
    done = sorted((r for r in rows if r["variant"] == name and "error" not in r), key=lambda r: r["tokens"])
    return done[0]["extra_mib"] * tokens / done[0]["tokens"] if done else None


def run_lm_head_row(name: str, tokens: int, args, rows: list[dict]) -> dict:
    row = dict(variant=name, tokens=tokens, vocab=args.vocab, hidden=args.hidden, dtype=args.dtype)
    need, avail = estimated_mib(rows, name, tokens), available_mib()
    if need is not None and need > 0.8 * avail:
        return dict(row, error=f"not run: needs ~{need:.0f} MiB extra (scaled from T), {avail:.0f} MiB available")
    cmd = [sys.executable, __file__, "--mode", "lm-head", "--worker", name, "--tokens", str(tokens)]
    cmd += ["--vocab", str(args.vocab), "--hidden", str(args.hidden), "--dtype", args.dtype]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(row, error=f"timeout {args.timeout}s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output (killed: out of memory?)"])[-1]
        est = f"; needs ~{need:.0f} MiB extra (scaled from T)" if need else ""
        return dict(row, error=f"rc={proc.returncode}: {err[-200:]}{est}")
    return json.loads(lines[-1])


def lm_head_table(rows: list[dict]) -> str:
    head = ["T", "variant", "time ms", "x today", "extra MiB", "x today mem", "check vs naive"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['tokens']} | {r['variant']} | {r['error']} |" + " |" * 4)
            continue
        same = {x["variant"]: x for x in rows if x["tokens"] == r["tokens"] and "error" not in x}
        today, naive = same.get("today"), same.get("naive")
        speed = f"{r['time_ms'] / today['time_ms']:.2f}" if today else "-"
        mem = f"{r['extra_mib'] / today['extra_mib']:.3f}" if today and today["extra_mib"] > 0 else "-"
        out.append(
            f"| {r['tokens']} | {r['variant']} | {r['time_ms']:.0f} | {speed} | {r['extra_mib']:.0f} | {mem} "
            f"| {lm_head_check(r, naive)} |"
        )
    return "\n".join(out)


def lm_head_check(r: dict, naive: dict | None) -> str:
    """Max relative difference of the checksums (logprob, entropy, |dH|, |dW| sums) against naive."""
    if naive is None:
        return "-"
    keys = ("lp_sum", "ent_sum", "dh_sum", "dw_sum")
    return f"{max(abs(r[k] - naive[k]) / max(abs(naive[k]), 1e-30) for k in keys):.1e}"


def lm_head_main(args) -> int:
    tokens = args.tokens or [2048, 8192, 32768]
    if args.worker:
        print(json.dumps(run_lm_head_worker(args.worker, tokens[0], args.hidden, args.vocab, args.dtype)), flush=True)
        return 0
    cuda_only = () if torch.cuda.is_available() else ("fused-triton",)
    variants = args.variants or [v for v in LM_HEAD_VARIANTS if v not in cuda_only]
    rows: list[dict] = []
    for t in tokens:
        for name in variants:
            print(
                f"[loss_kernels lm-head] T={t} V={args.vocab} H={args.hidden} {name} ...", file=sys.stderr, flush=True
            )
            rows.append(run_lm_head_row(name, t, args, rows))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(
        f"# loss_kernels --mode lm-head: H={args.hidden} V={args.vocab} {args.dtype} TP=1, {where}, subprocess per row"
    )
    print("# extra = peak memory of the step beyond the inputs and the dH / dW outputs; x today = vs today's path")
    print(lm_head_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all("error" not in r or r["error"].startswith("not run") for r in rows) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=LM_HEAD_DOC)
    ap.add_argument("--mode", choices=("logits", "lm-head"), default="logits")
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--hidden", type=int, default=4096, help="--mode lm-head: H (Qwen3-8B: 4096)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--variants", nargs="+", choices=sorted({*VARIANTS, *LM_HEAD_VARIANTS}), default=None)
    ap.add_argument("--repeats", type=int, default=None, help="timed runs after one warm-up (median)")
    ap.add_argument("--quick", action="store_true", help="T in {256, 1024}, 1 timed run (small CPU machines)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per CPU subprocess")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--worker", choices=sorted({*VARIANTS, *LM_HEAD_VARIANTS}), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mode == "lm-head":
        return lm_head_main(args)
    args.variants = args.variants or list(VARIANTS)
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

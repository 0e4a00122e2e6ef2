"""Benchmark: LM head + target log-probs + entropy, forward + backward, naive vs fused.

Variants, from the same hidden [T, H] and weight [V, H] (fp32), measured in the same run:
  naive  logits = hidden @ weight.T / temperature, log_softmax, gather, entropy = -(p * log p).sum
  fused  megatron_dapo.kernels.fused_linear_logprobs (token chunks; the [T, V] logits never exist)
Both backpropagate (logprobs * a).sum() + (entropy * b).sum() into hidden and weight.

CPU: every (variant, T) runs in its own subprocess, so the peak RSS belongs to that variant alone;
"extra" is the peak (VmHWM, reset after the inputs are built and a small warm-up) above the RSS right
before the timed step: the inputs are excluded, dH and dW (the same for both variants) included.
CUDA: torch.cuda.max_memory_allocated above the inputs, and CUDA-event times.

    python benchmarks/fused_linear.py                          # T in {2048, 8192}, H = 1024, V = 32768
    python benchmarks/fused_linear.py --tokens 512 1024 --vocab 8192
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VARIANTS = ("naive", "fused")
TEMPERATURE = 0.7


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmHWM:"))


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # Linux: VmHWM := the current RSS
        f.write("5")


def naive(hidden, weight, target):
    logp = torch.log_softmax((hidden @ weight.t()) / TEMPERATURE, dim=-1)
    return logp.gather(1, target[:, None]).squeeze(1), -(logp.exp() * logp).sum(dim=-1)


def fused(hidden, weight, target, chunk):
    from megatron_dapo.kernels import fused_linear_logprobs

    return fused_linear_logprobs(hidden, weight, target, temperature=TEMPERATURE, chunk_tokens=chunk)


def inputs(tokens, hidden_size, vocab, device):
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g, device=device)
    weight = torch.randn(vocab, hidden_size, generator=g, device=device).mul_(hidden_size**-0.5)
    target = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    a, b = torch.randn(tokens, generator=g, device=device), torch.randn(tokens, generator=g, device=device)
    return hidden.requires_grad_(), weight.requires_grad_(), target, a, b


def step(fn, hidden, weight, target, a, b):
    hidden.grad = weight.grad = None
    lp, ent = fn(hidden, weight, target)
    ((lp * a).sum() + (ent * b).sum()).backward()
    return lp


def run_worker(name, tokens, hidden_size, vocab, chunk, device) -> dict:
    fn = naive if name == "naive" else (lambda h, w, t: fused(h, w, t, chunk))
    dev = torch.device(device)
    step(fn, *inputs(min(tokens, 256), hidden_size, vocab, dev))  # warm-up: thread pool, kernels, allocator
    hidden, weight, target, a, b = inputs(tokens, hidden_size, vocab, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        lp = step(fn, hidden, weight, target, a, b)
        end.record()
        torch.cuda.synchronize()
        t_ms, extra = start.elapsed_time(end), (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        before = rss_mib()
        reset_peak_rss()
        t0 = time.perf_counter()
        lp = step(fn, hidden, weight, target, a, b)
        t_ms, extra = (time.perf_counter() - t0) * 1e3, peak_rss_mib() - before
    return dict(
        variant=name,
        tokens=tokens,
        time_ms=t_ms,
        extra_mib=extra,
        logits_mib=tokens * vocab * 4 / 2**20,
        lp_sum=float(lp.detach().double().sum()),
        dh_sum=float(hidden.grad.double().abs().sum()),
    )


def run_sub(name, args, tokens) -> dict:
    cmd = [sys.executable, __file__, "--worker", name, "--tokens", str(tokens), "--hidden", str(args.hidden)]
    cmd += ["--vocab", str(args.vocab), "--chunk", str(args.chunk), "--device", args.device]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name} T={tokens} failed rc={proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def table(rows, args) -> str:
    out = [
        f"H={args.hidden} V={args.vocab} fp32 {args.device} chunk={args.chunk} (logits block = T x V x 4 B)",
        "| T | variant | time ms | x naive | extra MiB | x naive mem | [T,V] fp32 MiB | |lp sum diff| |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = next(x for x in rows if x["variant"] == "naive" and x["tokens"] == r["tokens"])
        out.append(
            f"| {r['tokens']} | {r['variant']} | {r['time_ms']:.0f} | {r['time_ms'] / n['time_ms']:.2f} "
            f"| {r['extra_mib']:.0f} | {r['extra_mib'] / n['extra_mib']:.2f} | {r['logits_mib']:.0f} "
            f"| {abs(r['lp_sum'] - n['lp_sum']):.1e} |"
        )
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=1024, help="chunk_tokens of the fused op")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.tokens[0], args.hidden, args.vocab, args.chunk, args.device)))
        return
    rows = [run_sub(name, args, t) for t in args.tokens for name in VARIANTS]
    print(table(rows, args))


if __name__ == "__main__":
    main()

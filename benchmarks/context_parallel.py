"""Benchmark: one rank's peak memory in a Megatron actor train step on one long sequence, cp=1 vs cp=2.

The same tiny Qwen3 (local spec, fp32, CPU/gloo), the same one-sequence batch of T tokens, one train step
(old-logprob forward, then forward + backward of the DAPO loss, optimizer step), measured in the same run:
cp=1 on one process, cp=2 on two (torchrun). Per rank, "extra" is the peak resident memory (VmHWM, reset
right before the step) above the RSS before it, after a warm-up step on a short sequence. The local
spec's core attention (torch SDPA, a flash kernel on the CPU, the same class at cp=1 and cp=2) keeps no
scores; its [T/cp, T] mask remains and shrinks with cp like the rest of the activations (Transformer
Engine's THD attention has no mask).

    python benchmarks/context_parallel.py                    # T = 4096
    python benchmarks/context_parallel.py --tokens 8192 16384
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.fused_linear import peak_rss_mib, reset_peak_rss, rss_mib  # noqa: E402

PROMPT = 16


def make_config(hf_dir: str, cp: int, tokens: int):
    from megatron_dapo.config.schema import DapoConfig

    cfg = DapoConfig()
    cfg.model.hf_path, cfg.model.dtype, cfg.model.transformer_impl = hf_dir, "fp32", "local"
    cfg.parallel.tp, cfg.parallel.cp = 1, cp
    cfg.data.max_prompt_length, cfg.data.max_response_length = PROMPT, tokens - PROMPT
    cfg.algo.train_batch_size = cfg.algo.ppo_mini_batch_size = 1
    cfg.algo.max_tokens_per_micro_batch = tokens
    cfg.optimizer.lr_warmup_steps = 0
    return cfg


def one_sequence(tokens: int, seed: int = 0):
    from megatron_dapo.types import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    r = tokens - PROMPT
    return RolloutBatch(
        input_ids=[torch.randint(0, 256, (tokens,), generator=g).tolist()],
        prompt_lengths=[PROMPT],
        response_lengths=[r],
        advantages=torch.ones(1),
        rollout_logprobs=[[-5.5] * r],
        response_loss_mask=[1],
        token_versions=[[0] * r],
        group_index=torch.zeros(1, dtype=torch.long),
        temperature=1.0,
        step=0,
        prompt_indices=[0],
    )


def run_worker(args) -> None:
    import torch.distributed as dist

    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.runtime.distributed import init_distributed, init_model_parallel
    from megatron_dapo.trainer.actor import build_actor

    init_distributed()
    cp = dist.get_world_size()
    init_model_parallel(cp=cp, seed=1)
    hf_dir = Path(args.workdir) / "tiny_qwen3"
    if dist.get_rank() == 0 and not hf_dir.exists():
        save_tiny_hf_model("qwen3", hf_dir, seed=0, max_position_embeddings=max(512, args.tokens[0]))
    dist.barrier()
    tokens = args.tokens[0]
    actor = build_actor(make_config(str(hf_dir), cp, tokens))
    actor.train_step(one_sequence(256, seed=1))  # warm-up: thread pools, optimizer state, allocator
    batch = one_sequence(tokens)
    dist.barrier()
    before = rss_mib()
    reset_peak_rss()
    t0 = time.perf_counter()
    metrics = actor.train_step(batch)
    seconds = time.perf_counter() - t0
    extra = torch.tensor([peak_rss_mib() - before])
    dist.all_reduce(extra, op=dist.ReduceOp.MAX)  # the worst rank
    if dist.get_rank() == 0:
        row = dict(cp=cp, tokens=tokens, extra_mib=float(extra), seconds=seconds, loss=metrics["actor/pg_loss"])
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


def run_sub(cp: int, tokens: int, workdir: str, timeout: float) -> dict:
    from megatron_dapo.runtime.net import LOOPBACK, free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cp}", "--nnodes=1"]
    cmd += [f"--master-addr={LOOPBACK}", f"--master-port={free_port()}", __file__, "--worker"]
    cmd += ["--tokens", str(tokens), "--workdir", workdir]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"cp={cp} T={tokens} failed rc={proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1])


def table(rows) -> str:
    out = [
        "tiny Qwen3 (4 layers, hidden 64, 4 heads), fp32, local spec, CPU/gloo; one train step of one sequence",
        "| T | cp | extra MiB (worst rank) | x cp=1 | step s | loss |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = next(x for x in rows if x["cp"] == 1 and x["tokens"] == r["tokens"])
        out.append(
            f"| {r['tokens']} | {r['cp']} | {r['extra_mib']:.0f} | {r['extra_mib'] / base['extra_mib']:.2f} "
            f"| {r['seconds']:.1f} | {r['loss']:.6f} |"
        )
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_worker(args)
        return
    with tempfile.TemporaryDirectory() as workdir:
        rows = [run_sub(cp, t, workdir, args.timeout) for t in args.tokens for cp in args.cp]
    print(table(rows))


if __name__ == "__main__":
    main()

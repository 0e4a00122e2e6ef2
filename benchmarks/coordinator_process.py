"""What the coordinator process buys: reward scoring off the GIL, and each trainer rank receiving its shard only.

1. Rewards: a CPU-bound pure-Python reward (it holds the GIL, as a symbolic math check does) scored by
   `RewardRunner` on threads of one process (reward.num_workers=0) vs in worker processes
   (num_workers=W); seconds per batch of items, median of repeats, ratio = threads / pool (the
   results are checked equal). Also the lag of a 5 ms heartbeat thread of the same process while
   scoring (p99 and max over the repeats): what the coordinator's router loop suffers meanwhile.
2. Bytes each trainer rank receives per step: the whole pickled batch (the old broadcast) vs its DP
   shard (the largest one), for a batch of B groups x n samples with long-tailed response lengths,
   at several DP sizes; ratio = whole / shard.

    python benchmarks/coordinator_process.py [--items 32 --workers 2 --work 300000 --repeats 3]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dapo.rewards import RewardRunner  # noqa: E402
from megatron_dapo.rewards.registry import RewardCall  # noqa: E402
from megatron_dapo.shards import shard_batch  # noqa: E402
from megatron_dapo.types import RolloutBatch  # noqa: E402


def busy_reward(response: str, ground_truth: str, work: int = 300_000, **_) -> float:
    """Pure-Python work holding the GIL, then a deterministic score."""
    acc = 0
    for i in range(work):
        acc = (acc * 31 + i + len(response)) % 1_000_003
    return float(acc % 3 - 1)


class Heartbeat:
    """A thread that sleeps `period_s` again and again and records how late it wakes (GIL waits)."""

    def __init__(self, period_s: float = 0.005):
        import threading

        self.period_s, self.lags, self._stop = period_s, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(self.period_s)
            self.lags.append(time.perf_counter() - t0 - self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def p99_ms(self) -> float:
        lags = sorted(self.lags)
        return 1000 * lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else 0.0

    def max_ms(self) -> float:
        return 1000 * max(self.lags, default=0.0)


def time_rewards(items: int, workers: int, work: int, repeats: int) -> dict:
    batch = [(f"response {i}", "1", "src", {}) for i in range(items)]
    call = RewardCall(busy_reward, (("work", work),))
    threads = RewardRunner(default=call, timeout_s=600)
    pool = RewardRunner(default=call, timeout_s=600, num_workers=workers)
    t_threads, t_pool = [], []
    beat_threads, beat_pool = Heartbeat(), Heartbeat()
    try:
        pool.score_many(batch[:workers])  # workers started and warm
        for _ in range(repeats):  # interleaved, so that load changes hit both alike
            with beat_threads:
                t0 = time.perf_counter()
                want = threads.score_many(batch)
                t_threads.append(time.perf_counter() - t0)
            beat_threads = _continue(beat_threads)
            with beat_pool:
                t0 = time.perf_counter()
                got = pool.score_many(batch)
                t_pool.append(time.perf_counter() - t0)
            beat_pool = _continue(beat_pool)
            assert got == want, "the pool scored differently"
    finally:
        pool.close()
    a, b = statistics.median(t_threads), statistics.median(t_pool)
    return {"threads_s": a, "pool_s": b, "ratio": a / b, "threads_lag": beat_threads, "pool_lag": beat_pool}


def _continue(beat: Heartbeat) -> Heartbeat:
    """A fresh heartbeat thread that keeps the lags recorded so far."""
    fresh = Heartbeat(beat.period_s)
    fresh.lags = beat.lags
    return fresh


def long_tailed_batch(groups: int, n: int, prompt: int, max_response: int, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    # response lengths: most short, a few near the limit (Pareto-like tail)
    u = torch.rand(groups * n, generator=g)
    lengths = [max(1, min(max_response, int(64 / (1 - float(x)) ** 0.8))) for x in u]
    ids = [torch.randint(0, 150_000, (prompt + r,), generator=g).tolist() for r in lengths]
    rows = len(ids)
    return RolloutBatch(
        input_ids=ids,
        prompt_lengths=[prompt] * rows,
        response_lengths=lengths,
        advantages=torch.randn(rows, generator=g),
        rollout_logprobs=[[-0.5] * r for r in lengths],
        response_loss_mask=[1] * rows,
        token_versions=[[0] * r for r in lengths],
        group_index=torch.arange(groups).repeat_interleave(n),
        temperature=1.0,
        step=0,
        prompt_indices=list(range(groups)),
    )


def shard_bytes(batch: RolloutBatch, dp_sizes: list[int], mini: int) -> list[dict]:
    whole = len(pickle.dumps(batch))
    out = []
    for dp in dp_sizes:
        shards = shard_batch(batch, dp, mini)
        sizes = [len(pickle.dumps(s)) for s in shards]
        out.append(
            {
                "dp": dp,
                "whole_mb": whole / 2**20,
                "shard_mb": max(sizes) / 2**20,
                "mean_mb": statistics.mean(sizes) / 2**20,
                "ratio": whole / max(sizes),
            }
        )
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--items", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--work", type=int, default=300_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--max-response", type=int, default=4096)
    args = p.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    r = time_rewards(args.items, args.workers, args.work, args.repeats)
    print(f"\nrewards: {args.items} items of a GIL-holding reward ({args.work} loop steps each)")
    print("| scoring | s per batch (median) | heartbeat lag p99 / max (ms) |")
    print("|---|---|---|")
    for name, s_key, lag in (
        ("threads of one process (num_workers=0)", "threads_s", r["threads_lag"]),
        (f"{args.workers} worker processes", "pool_s", r["pool_lag"]),
    ):
        print(f"| {name} | {r[s_key]:.2f} | {lag.p99_ms():.1f} / {lag.max_ms():.1f} |")
    print(f"ratio threads / pool: {r['ratio']:.2f}x")
    batch = long_tailed_batch(args.groups, args.n, args.prompt, args.max_response)
    tokens = sum(len(x) for x in batch.input_ids)
    print(
        f"\nbytes per trainer rank: {args.groups} groups x {args.n} samples, {tokens} tokens "
        f"(responses {min(batch.response_lengths)}-{max(batch.response_lengths)})"
    )
    print("| DP | whole batch (MiB) | largest shard (MiB) | mean shard (MiB) | whole / largest |")
    print("|---|---|---|---|---|")
    for row in shard_bytes(batch, [1, 2, 4, 8], mini=max(1, args.groups // 4)):
        print(
            f"| {row['dp']} | {row['whole_mb']:.2f} | {row['shard_mb']:.2f} | {row['mean_mb']:.2f} | "
            f"{row['ratio']:.2f}x |"
        )


if __name__ == "__main__":
    main()

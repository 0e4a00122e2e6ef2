"""The rollout metrics of one step's batch: responses, rewards, advantages, prompt lengths, staleness.

Pure functions of the judged groups and the built batch; the coordinator computes them with the
batch and trainer rank 0 logs them (megatron_dapo.trainer.metrics).
"""

from __future__ import annotations

import math
from collections import Counter


def staleness_metrics(hist: Counter, staleness_bound: int) -> dict[str, float]:
    total = sum(hist.values()) or 1
    out = {f"staleness/frac_{k}": hist.get(k, 0) / total for k in range(staleness_bound + 1)}
    out["staleness/mean"] = sum(k * v for k, v in hist.items()) / total
    out["staleness/max"] = float(max(hist, default=0))
    return out


def response_metrics(groups) -> dict[str, float]:
    lengths = [len(s.output_ids) for g in groups for s in g.samples]
    scores = [x for g in groups for x in g.scores]
    accs = [float(a) for g in groups for a in g.accs]
    truncated = [float(s.finish_reason == "length") for g in groups for s in g.samples]
    penalties = [p for g in groups for p in g.overlong]
    n = max(1, len(lengths))
    return {
        # DAPO's soft overlong punishment (verl's DAPO reward manager logs overlong / overlong_reward)
        "reward/overlong_frac": sum(float(p < 0) for p in penalties) / n,
        "reward/overlong_penalty_mean": sum(penalties) / n,
        "reward/score_mean": sum(scores) / n,
        "reward/seq_reward_mean": sum(r for g in groups for r in g.seq_rewards) / n,
        "reward/accuracy": sum(accs) / n,
        "response/length_mean": sum(lengths) / n,
        "response/length_max": float(max(lengths, default=0)),
        "response/truncated_frac": sum(truncated) / n,
    }


def batch_metrics(batch) -> dict[str, float]:
    """Advantage statistics over the loss tokens (each token carries its response's advantage, as in
    verl's critic/advantages/*) and prompt-length statistics over the samples of a RolloutBatch."""
    tokens = [n * m for n, m in zip(batch.response_lengths, batch.response_loss_mask)]
    adv = [float(a) for a in batch.advantages.tolist()]
    weight = sum(tokens)
    seen = [a for a, n in zip(adv, tokens) if n > 0]
    mean = sum(a * n for a, n in zip(adv, tokens)) / weight if weight else 0.0
    var = sum(n * (a - mean) ** 2 for a, n in zip(adv, tokens)) / weight if weight else 0.0
    prompts = batch.prompt_lengths
    routing = {} if batch.routed_experts is None else {"rollout/routing_bytes": float(routing_bytes(batch))}
    return {
        **routing,
        "advantages/mean": mean,
        "advantages/std": math.sqrt(var),
        "advantages/max": max(seen, default=0.0),
        "advantages/min": min(seen, default=0.0),
        "prompt/length_mean": sum(prompts) / max(1, len(prompts)),
        "prompt/length_max": float(max(prompts, default=0)),
        "prompt/length_min": float(min(prompts, default=0)),
    }


def routing_bytes(batch) -> int:
    """Bytes of the routed experts (routing replay) the batch carries to the trainer."""
    return sum(t.numel() * t.element_size() for t in batch.routed_experts or [])

"""Per-step metrics: TensorBoard scalars (and the staleness histogram) plus `metrics.jsonl`.

The jsonl copy (one JSON object per step) is what tests and scripts read; TensorBoard is what
people look at; `megatron-dapo plot RUN_DIR` turns the TensorBoard scalars into PNG curves.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path


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
    return {
        "advantages/mean": mean,
        "advantages/std": math.sqrt(var),
        "advantages/max": max(seen, default=0.0),
        "advantages/min": min(seen, default=0.0),
        "prompt/length_mean": sum(prompts) / max(1, len(prompts)),
        "prompt/length_max": float(max(prompts, default=0)),
        "prompt/length_min": float(min(prompts, default=0)),
    }


CONSOLE_KEYS = ("reward/accuracy", "reward/score_mean", "response/length_mean", "groups/kept", "actor/pg_loss",
                "actor/grad_norm", "time/step_s")


def console_line(metrics: dict[str, float]) -> str:
    """The few step metrics worth a console line (every `logging.log_every` steps)."""
    return ", ".join(f"{k.split('/', 1)[1]} {metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics)


class MetricsWriter:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float], staleness: Counter | None = None, extra: dict | None = None):
        clean = {k: float(v) for k, v in scalars.items() if v is not None and math.isfinite(float(v))}
        record = {"step": step, **clean, **(extra or {})}
        if staleness is not None:
            record["staleness_hist"] = {str(k): v for k, v in sorted(staleness.items())}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, step)
            if staleness:
                import numpy as np

                values = np.repeat(np.array(list(staleness.keys()), dtype=np.float64), list(staleness.values()))
                self.tb.add_histogram("staleness/versions_behind", values, step)
            self.tb.flush()

    def close(self):
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

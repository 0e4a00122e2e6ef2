"""Per-step metrics: TensorBoard scalars (and the staleness histogram) plus `metrics.jsonl`.

The jsonl copy (one JSON object per step) is what tests and scripts read; TensorBoard is what
people look at; `megatron-dapo plot RUN_DIR` turns the TensorBoard scalars into PNG curves.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

CONSOLE_KEYS = (
    "reward/accuracy",
    "reward/score_mean",
    "response/length_mean",
    "groups/kept",
    "actor/pg_loss",
    "actor/grad_norm",
    "time/step_s",
)


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

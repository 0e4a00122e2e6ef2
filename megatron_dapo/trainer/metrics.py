"""Per-step metrics: `metrics.jsonl`, and the same scalars (and the staleness histogram) to TensorBoard
and Weights & Biases (trainer/metric_sinks.py).

The jsonl copy (one JSON object per step) is what tests and scripts read; TensorBoard / W&B are what
people look at; `megatron-dapo plot RUN_DIR` turns the TensorBoard scalars into PNG curves.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from megatron_dapo.runtime.files import write_text_atomic
from megatron_dapo.trainer.metric_sinks import TensorBoardSink, WandbSink

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


def row_version(row: dict) -> int:
    """The weight version a row describes: a training row names it (`weight_version`, the version its
    step produced); a validation row at step s evaluated version s."""
    return int(row.get("weight_version", row["step"]))


def truncate_after_version(path: Path, version: int) -> None:
    """Drop the rows of `path` about weights newer than `version` (written after the checkpoint a run
    resumes from, so the resumed run writes them again); temp file + rename, so a crash keeps one copy."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if row_version(json.loads(line)) <= version]
    if len(kept) == len(lines):
        return
    write_text_atomic(path, "".join(line + "\n" for line in kept))


class MetricsWriter:
    """`resume_version`: the weight version of the checkpoint this run resumed from (None: not resumed);
    the rows the interrupted run wrote after it are dropped, so each step's row appears once.
    `wandb`: a `logging.wandb` section (mode, project, name); `config`: the resolved config W&B records."""

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        resume_version: int | None = None,
        wandb=None,
        config: dict | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_version is not None:
            truncate_after_version(self.run_dir / "metrics.jsonl", resume_version)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self.sinks: list = []
        if tensorboard:
            self.sinks.append(TensorBoardSink(self.run_dir))
        if wandb is not None and wandb.mode != "disabled":
            self.sinks.append(WandbSink(self.run_dir, wandb.mode, wandb.project, wandb.name, config or {}))

    def log(self, step: int, scalars: dict[str, float], staleness: Counter | None = None, extra: dict | None = None):
        clean = {k: float(v) for k, v in scalars.items() if v is not None and math.isfinite(float(v))}
        record = {"step": step, **clean, **(extra or {})}
        if staleness is not None:
            record["staleness_hist"] = {str(k): v for k, v in sorted(staleness.items())}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for sink in self.sinks:
            sink.log(step, clean, staleness)

    def table(self, step: int, name: str, first_column: str, rows: dict[str, dict[str, float]]) -> None:
        """A table (e.g. validation accuracy per data source) to the sinks that show tables (W&B)."""
        for sink in self.sinks:
            if hasattr(sink, "table"):
                sink.table(step, name, first_column, rows)

    def close(self):
        self.jsonl.close()
        for sink in self.sinks:
            sink.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

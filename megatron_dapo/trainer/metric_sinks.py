"""Where each step's metrics go besides `metrics.jsonl`: TensorBoard and Weights & Biases.

`MetricsWriter` hands every step to each sink: scalars (the same finite values to all), the staleness
histogram, and after a validation its per-data-source table. W&B is imported only when
`logging.wandb.mode` is not `disabled` (`pip install megatron-dapo[wandb]`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float], staleness: Counter | None) -> None:
        for k, v in scalars.items():
            self.tb.add_scalar(k, v, step)
        if staleness:
            import numpy as np

            values = np.repeat(np.array(list(staleness.keys()), dtype=np.float64), list(staleness.values()))
            self.tb.add_histogram("staleness/versions_behind", values, step)
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()


class WandbSink:
    """A W&B run under `<run_dir>/wandb` holding the resolved config; each step's scalars at that step
    (W&B's own step = the training step), the staleness histogram, and a validation table per validation."""

    def __init__(self, run_dir: Path, mode: str, project: str, name: str | None, config: dict):
        try:
            import wandb
        except ImportError:
            raise ImportError(f"logging.wandb.mode={mode} needs wandb: pip install 'megatron-dapo[wandb]'") from None
        self.wandb = wandb
        self.run = wandb.init(
            mode=mode,
            project=project,
            name=name or run_dir.resolve().name,
            dir=str(run_dir),
            config=config,
            reinit="create_new",  # a second run in one process (tests, demo) gets a run of its own
        )

    def log(self, step: int, scalars: dict[str, float], staleness: Counter | None) -> None:
        entry: dict = dict(scalars)
        if staleness:
            values = [k for k, n in sorted(staleness.items()) for _ in range(n)]
            entry["staleness/versions_behind"] = self.wandb.Histogram(values)
        self._log(step, entry)

    def table(self, step: int, name: str, first_column: str, rows: dict[str, dict[str, float]]) -> None:
        columns = list(dict.fromkeys(c for r in rows.values() for c in r))
        data = [[label, *(r.get(c) for c in columns)] for label, r in rows.items()]
        self._log(step, {name: self.wandb.Table(columns=[first_column, *columns], data=data)})

    def _log(self, step: int, entry: dict) -> None:
        # W&B drops a row whose step is below its last one (it warns); a validation logs at the step the
        # next training step also logs at, which W&B merges into one row
        self.run.log(entry, step=step)

    def close(self) -> None:
        self.run.finish()
        # wandb 0.31's service completes an offline run file only when it shuts down (after `finish` the
        # file may still hold only its header): shut it down now, not at interpreter exit
        self.wandb.teardown()

"""Metrics files and `megatron-dapo plot`: scalars written per step come back from TensorBoard."""

from collections import Counter

from megatron_dapo.apps.plot import main as plot_main
from megatron_dapo.apps.plot import read_scalars
from megatron_dapo.coordinator.metrics import staleness_metrics
from megatron_dapo.trainer.metrics import MetricsWriter, read_metrics


def test_metrics_jsonl_tensorboard_and_plot(tmp_path):
    w = MetricsWriter(tmp_path)
    for step in range(3):
        hist = Counter({0: 3 - step, 1: step})
        w.log(
            step,
            {
                "reward/accuracy": 0.1 * step,
                "actor/grad_norm": 1.0 + step,
                "bad": float("nan"),
                **staleness_metrics(hist, 1),
            },
            staleness=hist,
        )
    w.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "bad" not in rows[0] and rows[2]["staleness_hist"] == {"0": 1, "1": 2}
    assert rows[2]["staleness/frac_1"] == 2 / 3 and rows[2]["staleness/max"] == 1.0
    scalars = read_scalars(tmp_path / "tensorboard")
    assert [round(v, 6) for _, v in scalars["reward/accuracy"]] == [0.0, 0.1, 0.2]
    assert plot_main([str(tmp_path)]) == 0
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["actor.png", "reward.png", "staleness.png"]
    assert (tmp_path / "plots" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _log_run(w, steps, val_every=2):
    """Rows as the loop writes them: a training row per step (its weight version step + 1) and, after
    every `val_every` steps, a validation row of the new version logged at step + 1."""
    for step in steps:
        w.log(step, {"actor/pg_loss": float(step)}, extra={"weight_version": step + 1})
        if (step + 1) % val_every == 0:
            w.log(step + 1, {"val/acc": float(step + 1)})


def test_resume_drops_the_rows_written_after_the_checkpoint(tmp_path):
    """A run killed after step 4, resumed from its checkpoint of step 2 (version 3): steps 3 and 4 and
    the validation of version 4 were written twice before; now each appears once."""
    w = MetricsWriter(tmp_path, tensorboard=False)
    _log_run(w, range(5))
    w.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 2, 3, 4, 4]
    w = MetricsWriter(tmp_path, tensorboard=False, resume_version=3)
    _log_run(w, range(3, 6))
    w.close()
    rows = read_metrics(tmp_path)
    train = [r["step"] for r in rows if "actor/pg_loss" in r]
    val = [r["step"] for r in rows if "val/acc" in r]
    assert train == [0, 1, 2, 3, 4, 5] and val == [2, 4, 6]
    assert not list(tmp_path.glob("*.tmp"))


def test_resume_without_checkpoint_starts_the_rows_over(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    _log_run(w, range(2))
    w.close()
    MetricsWriter(tmp_path, tensorboard=False, resume_version=-1).close()
    assert read_metrics(tmp_path) == []

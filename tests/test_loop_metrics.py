"""Metrics files and `megatron-dapo plot`: scalars written per step come back from TensorBoard."""

from collections import Counter

from megatron_dapo.coordinator.metrics import staleness_metrics
from megatron_dapo.trainer.metrics import MetricsWriter, read_metrics
from megatron_dapo.trainer.plot import main as plot_main
from megatron_dapo.trainer.plot import read_scalars


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

"""logging.wandb in offline mode: the W&B run holds the resolved config, every TensorBoard scalar at its
step with TensorBoard's value, the staleness histogram and the validation table (read back from the
run's own files with wandb's protobuf classes)."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest

from megatron_dapo.apps.plot import read_scalars
from megatron_dapo.config import ConfigError, DapoConfig, config_from_dict, config_to_dict
from megatron_dapo.config.schema import WandbConfig
from megatron_dapo.trainer.metrics import MetricsWriter
from tests.wandb_records import read_run

pytest.importorskip("wandb")  # the `test` extra installs it: CI runs this


def _steps():
    """Four steps of scalars: a NaN (dropped everywhere) and a validation merged into step 2's row."""
    rng = np.random.default_rng(0)
    for step in range(4):
        scalars = {
            "reward/accuracy": float(rng.random()),
            "actor/pg_loss": float(rng.normal()),
            "time/step_s": 1.5 + step,
        }
        if step == 1:
            scalars["actor/grad_norm"] = math.nan
        yield step, scalars, Counter({0: 3, 1: step + 1})


def test_offline_run_mirrors_tensorboard_config_and_validation_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = DapoConfig()
    cfg.logging.wandb = WandbConfig(mode="offline", project="dapo-test", name="mirror")
    writer = MetricsWriter(tmp_path, tensorboard=True, wandb=cfg.logging.wandb, config=config_to_dict(cfg))
    val = {"val/math/acc/mean@4": 0.25, "val/math/acc/greedy": 0.5, "val/code/acc/mean@4": 0.75}
    for step, scalars, staleness in _steps():
        writer.log(step, scalars, staleness=staleness)
        if step == 2:
            writer.log(step, val)
            writer.table(
                step,
                "val/by_source",
                "data source",
                {"math": {"mean@4": 0.25, "greedy": 0.5}, "code": {"mean@4": 0.75}},
            )
    writer.close()

    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    config, history = read_run(run_file)
    assert "algo" in config, sorted(config)
    assert config["algo"] == json.loads(json.dumps(config_to_dict(cfg)["algo"]))
    assert config["logging"]["wandb"] == {"mode": "offline", "project": "dapo-test", "name": "mirror"}

    tb = read_scalars(tmp_path / "tensorboard")
    assert set(tb) == {"reward/accuracy", "actor/pg_loss", "time/step_s", *val}
    for key, points in tb.items():
        # TensorBoard stores float32; W&B the float64 logged: equal once rounded the same way
        mirrored = [(s, np.float32(row[key])) for s, row in sorted(history.items()) if key in row]
        assert mirrored == [(s, np.float32(v)) for s, v in points], key
    assert not any("actor/grad_norm" in row for row in history.values())  # NaN: left out of both

    assert history[3]["staleness/versions_behind/_type"] == "histogram"
    assert sum(history[3]["staleness/versions_behind/values"]) == 3 + 4
    table_row = history[2]
    assert table_row["val/by_source/_type"] == "table-file"
    table = json.loads((run_file.parent / "files" / table_row["val/by_source/path"]).read_text())
    assert table["columns"] == ["data source", "mean@4", "greedy"]
    assert table["data"] == [["math", 0.25, 0.5], ["code", 0.75, None]]


def test_disabled_wandb_writes_nothing_and_a_bad_mode_is_named(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False, wandb=WandbConfig())
    writer.log(0, {"a": 1.0})
    writer.close()
    assert not (tmp_path / "wandb").exists() and writer.sinks == []
    with pytest.raises(ConfigError, match=r"logging\.wandb\.mode.*'offline'"):
        config_from_dict({}, ["logging.wandb.mode=ofline"])

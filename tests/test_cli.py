"""Argument handling of the `megatron-dapo` sub-commands, through the top-level entry point."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.cli import main

TINY = Path(__file__).resolve().parent.parent / "configs" / "qwen3" / "tiny_qwen3_cpu.yaml"


@pytest.fixture
def launched(monkeypatch):
    """The config each `train` invocation would launch (the launcher itself is not under test)."""
    import megatron_dapo.trainer.cli as train_cli

    calls = []
    record = lambda cfg, resume: calls.append((cfg, resume))
    monkeypatch.setattr(train_cli, "run_with_ray", record)
    monkeypatch.setattr(train_cli, "run_with_torchrun", record)
    return calls


@pytest.mark.parametrize(
    "order",
    [
        ["--config", str(TINY), "trainer.total_steps=3", "--resume", "algo.staleness=1"],
        ["trainer.total_steps=3", "--config", str(TINY), "algo.staleness=1", "--resume"],
        ["--resume", "trainer.total_steps=3", "algo.staleness=1", "--config", str(TINY)],
    ],
)
def test_train_takes_overrides_and_resume_in_any_order(launched, order, tmp_path):
    assert main(["train", *order, f"logging.run_dir={tmp_path}"]) == 0
    [(cfg, resume)] = launched
    assert resume is True and cfg.checkpoint.resume is True
    assert cfg.trainer.total_steps == 3 and cfg.algo.staleness == 1 and cfg.logging.run_dir == str(tmp_path)


def test_train_without_resume_and_with_a_bad_override(launched, capsys):
    assert main(["train", "--config", str(TINY), "trainer.total_steps=2"]) == 0
    assert launched[0][1] is False
    assert main(["train", "trainer.total_stepz=2", "--config", str(TINY), "--resume"]) == 2
    assert "trainer.total_stepz" in capsys.readouterr().err and len(launched) == 1

"""Argument handling of the `megatron-dapo` sub-commands, through the top-level entry point."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.cli import main

TINY = Path(__file__).resolve().parents[2] / "configs" / "qwen3" / "tiny_qwen3_cpu.yaml"


@pytest.fixture
def launched(monkeypatch):
    """The config each `train` invocation would launch (the launcher itself is not under test)."""
    import megatron_dapo.apps.train as train_cli

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


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--step-time", "nan", "a finite number in (0, 10000]"),  # used to hang
        ("--step-time", "inf", "a finite number in (0, 10000]"),
        ("--step-time", "0", "a finite number in (0, 10000]"),
        ("--step-time", "1e300", "a finite number in (0, 10000]"),  # the virtual clock would never reach it
        ("--sync-s", "-1", "a finite number in [0, 10000]"),
        ("--sync-s", "nan", "a finite number in [0, 10000]"),
        ("--steps", "0", "an integer in [1, 100000]"),
        ("--steps", "-3", "an integer in [1, 100000]"),
        ("--warmup-steps", "-1", "an integer in [0, 100000]"),
        ("--token-unit", "-1", "an integer >= 0"),
        ("--engines", "0", "an integer in [1, 100000]"),
        ("--engines", "2.5", "an integer in [1, 100000]"),
        ("--nodes", "-1", "an integer in [1, 100000]"),
        ("--gpus-per-node", "0", "an integer in [1, 100000]"),
        ("--gpu-mem-gib", "-80", "a finite number in (0, 100000]"),
        ("--max-running", "0", "an integer >= 1"),
        ("--gpu-tflops", "inf", "a finite number > 0"),
        ("--prompt-len", "0", "an integer >= 1"),
        ("--keep-prob", "0", "a finite number in (0, 1]"),
        ("--keep-prob", "1.5", "a finite number in (0, 1]"),
        ("--seed", "-1", "an integer >= 0"),
        ("--staleness", "0,-1", "a comma list of integers in [0, 100000]"),
        ("--staleness", ",", "a comma list of integers in [0, 100000]"),
    ],
)
def test_simulate_refuses_numbers_out_of_range_naming_the_flag(flag, value, expected, capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate", str(TINY), "--step-time", "1", flag, value])
    assert e.value.code == 2
    assert f"argument {flag}: expected {expected}, got '{value}'" in capsys.readouterr().err


def test_simulate_takes_the_edges_of_the_ranges(tmp_path, capsys):
    """Zero sync time, automatic token unit and staleness 0 are meaningful and run."""
    out = tmp_path / "rows.json"
    argv = [
        *("simulate", str(TINY), "algo.train_batch_size=4", "rollout.n_resp_per_prompt=4"),
        *("data.max_response_length=256", "algo.overlong_buffer.len=64", "--step-time", "0.5", "--sync-s", "0"),
        *("--token-unit", "0", "--steps", "1", "--warmup-steps", "0", "--staleness", "0", "--modes", "sync"),
        *("--keep-prob", "1", "--json", str(out)),
    ]
    assert main(argv) == 0
    import json

    rows = json.loads(out.read_text())
    assert [(r["mode"], r["staleness"]) for r in rows] == [("sync", 0)] and rows[0]["tokens_per_s"] > 0

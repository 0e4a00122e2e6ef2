"""Checkpoint publication: an interrupted save never replaces the last good checkpoint."""

import random

import pytest
import torch

from megatron_dapo.trainer import checkpoint as ck


def _save(save_dir, step, keep_last=0, payload=None):
    tmp = ck.begin_save(save_dir, step)
    (tmp / "model").mkdir()
    (tmp / "model" / "weights.bin").write_bytes(bytes([step % 256]) * 16)
    ck.save_rng(tmp, rank=0)
    ck.write_trainer_state(tmp, {"step": step, "version": step, "world_size": 1, **(payload or {})})
    return ck.commit_save(save_dir, step, keep_last)


def test_latest_points_at_complete_checkpoints_and_prunes(tmp_path):
    assert ck.latest_checkpoint(tmp_path) is None
    for step in (2, 4, 6):
        _save(tmp_path, step, keep_last=2)
    assert ck.latest_checkpoint(tmp_path).name == "step_000006"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000004", "step_000006"]
    assert ck.read_trainer_state(ck.latest_checkpoint(tmp_path))["step"] == 6


def test_interrupted_save_keeps_previous_checkpoint(tmp_path):
    _save(tmp_path, 3, payload={"version": 4})
    # a save of step 5 dies half-way: model written, trainer.json never
    tmp = ck.begin_save(tmp_path, 5)
    (tmp / "model").mkdir()
    (tmp / "model" / "weights.bin").write_bytes(b"partial")
    assert ck.latest_checkpoint(tmp_path).name == "step_000003"
    with pytest.raises(ck.CheckpointError, match="trainer.json missing"):
        ck.commit_save(tmp_path, 5)
    assert ck.latest_checkpoint(tmp_path).name == "step_000003"
    assert ck.read_trainer_state(ck.latest_checkpoint(tmp_path)) == {"step": 3, "version": 4, "world_size": 1}
    # the retry of step 5 starts from a clean temporary directory
    _save(tmp_path, 5)
    assert not (tmp_path / "step_000005.tmp").exists()
    assert ck.latest_checkpoint(tmp_path).name == "step_000005"
    # a crash while writing the pointer leaves the old pointer (latest.tmp is never read)
    (tmp_path / "latest.tmp").write_text("step_000009\n")
    assert ck.latest_checkpoint(tmp_path).name == "step_000005"


def test_dangling_pointer_is_a_clear_error(tmp_path):
    (tmp_path / "latest").write_text("step_000042\n")
    with pytest.raises(ck.CheckpointError, match="names step_000042, which is not a complete checkpoint"):
        ck.latest_checkpoint(tmp_path)


def test_rng_round_trip(tmp_path):
    import numpy as np

    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    ck.save_rng(tmp_path, rank=1)
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    ck.load_rng(tmp_path, rank=1)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]
    with pytest.raises(ck.CheckpointError, match="rank_00002.json missing"):
        ck.load_rng(tmp_path, rank=2)

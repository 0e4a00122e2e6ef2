"""Checkpoint saves onto a real, small file system (a tmpfs the test mounts in a mount namespace of its
own): a full disk and a read-only one. Every failed save is one CheckpointError whose message names the
OS error (No space left on device (ENOSPC), Read-only file system (EROFS)), also where torch's own file
writer hides it ("unexpected pos ..."); the partial save is gone and `latest` still names the previous,
verified checkpoint; once there is room again the same step saves. The bridge's Megatron-LM checkpoint
save names the OS error the same way.

Usage (inside the namespace, the tmpfs mounted on FS): checkpoint_small_fs.py FS
Prints `CASE <name>: <message>` for each failed save and `small fs OK` at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

SHARD = 200_000  # floats: 800 KB, written by megatron-core's writer process through torch's file writer
COMMON = 1_000  # floats of the common state (common.pt)


def megatron_writer(shard: int = SHARD):
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_dapo.trainer import checkpoint as ckpt

    def write(tmp: Path) -> None:
        (tmp / "model").mkdir()
        state = {
            "w": ShardedTensor.from_rank_offsets("w", torch.arange(float(shard)), (0, 0, 1)),
            "c": torch.arange(float(COMMON)),
        }
        ckpt.megatron_save(state, tmp / "model")

    return write


def trainer_json(step: int, fill_first: Path | None = None):
    """trainer.json of `step`; with `fill_first`, after filling the file system up (no byte left) there."""
    from megatron_dapo.trainer import checkpoint as ckpt

    def write(tmp: Path) -> None:
        if fill_first is not None:
            fill(fill_first, 0)
        ckpt.write_trainer_state(tmp, {"step": step, "version": step, "world_size": 1})

    return write


def free_bytes(fs: Path) -> int:
    st = os.statvfs(fs)
    return st.f_bavail * st.f_frsize


def fill(fs: Path, leave: int) -> None:
    """Fill the file system at `fs` until at most `leave` bytes are free (a filler file, appended to)."""
    with open(fs / "filler", "ab") as f:
        try:
            f.write(bytes(max(0, free_bytes(fs) - leave)))
            f.flush()
            os.fsync(f.fileno())
        except OSError:  # leave = 0: the last block does not fit, the file system is full
            pass


def expect_failure(case: str, save_dir: Path, step: int, write_model, write_state, *expected: str) -> None:
    from megatron_dapo.bridge.manifest import verify_manifest
    from megatron_dapo.errors import CheckpointError
    from megatron_dapo.trainer import checkpoint as ckpt

    try:
        ckpt.save_collective(save_dir, step, write_model, write_state)
    except CheckpointError as e:
        message = str(e)
    else:
        raise AssertionError(f"{case}: the save onto a {case} file system did not fail")
    print(f"CASE {case}: {message}", flush=True)
    for text in (f"checkpoint save into {ckpt.tmp_dir(save_dir, step)} failed (rank 0: ", *expected):
        assert text in message, (case, text, message)
    assert not ckpt.tmp_dir(save_dir, step).exists(), f"{case}: the partial save was left behind"
    assert ckpt.latest_checkpoint(save_dir).name == ckpt.step_name(1), case
    verify_manifest(save_dir / ckpt.step_name(1))  # every byte of the previous checkpoint intact


def bridge_save_fails(fs: Path) -> None:
    """The bridge's save (megatron_dapo convert) onto the full file system: the error names ENOSPC."""
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_dapo.bridge.checkpoint import save_megatron_checkpoint
    from megatron_dapo.errors import CheckpointError

    class Chunk:  # what save_megatron_checkpoint asks of a model chunk
        def sharded_state_dict(self):
            return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(float(SHARD)), (0, 0, 1))}

    fill(fs, SHARD)  # room for a quarter of the shard
    try:
        save_megatron_checkpoint([Chunk()], fs / "megatron_lm")
    except CheckpointError as e:
        message = str(e)
    else:
        raise AssertionError("the bridge's save onto a full file system did not fail")
    print(f"CASE bridge: {message}", flush=True)
    assert f"saving the megatron-core checkpoint into {fs / 'megatron_lm' / 'release'} failed (" in message, message
    assert "No space left on device (ENOSPC)" in message, message


def main(fs: str) -> None:
    from megatron_dapo.bridge.manifest import verify_manifest
    from megatron_dapo.runtime.distributed import destroy_distributed, init_distributed, init_model_parallel
    from megatron_dapo.trainer import checkpoint as ckpt

    fs = Path(fs)
    init_distributed()
    init_model_parallel()
    save_dir = fs / "checkpoints"
    assert ckpt.save_collective(save_dir, 1, megatron_writer(), trainer_json(1)).name == ckpt.step_name(1)

    # the shard's file runs out of room a quarter of the way: torch's writer (in megatron-core's writer
    # process) says only "unexpected pos ..."; the test write into the .tmp names the OS error
    fill(fs, SHARD)
    expect_failure(
        "full-shard",
        save_dir,
        2,
        megatron_writer(),
        trainer_json(2),
        "torch could not write the file (",
        "No space left on device (ENOSPC)",
    )
    (fs / "filler").unlink()
    # the model fits; the disk is full by the time rank 0 writes trainer.json: an OSError, named
    expect_failure(
        "full-trainer-json",
        save_dir,
        2,
        megatron_writer(),
        trainer_json(2, fill_first=fs),
        "OSError: [Errno 28] No space left on device",
        "(ENOSPC)",
    )
    (fs / "filler").unlink()
    # a read-only file system (a read-only bind remount: what a user namespace may do): the .tmp cannot be made
    subprocess.run(["mount", "-o", "remount,bind,ro", str(fs)], check=True)
    expect_failure("read-only", save_dir, 2, megatron_writer(), trainer_json(2), "Read-only file system", "(EROFS)")
    subprocess.run(["mount", "-o", "remount,bind,rw", str(fs)], check=True)

    # room again: the same step saves, and is the one `latest` names
    final = ckpt.save_collective(save_dir, 2, megatron_writer(), trainer_json(2))
    assert final.name == ckpt.step_name(2) and ckpt.latest_checkpoint(save_dir) == final
    verify_manifest(final)

    bridge_save_fails(fs)
    print("small fs OK", flush=True)
    destroy_distributed()


if __name__ == "__main__":  # megatron-core's writer processes import this file again: nothing may run then
    main(sys.argv[1])

"""A full disk during a 2-rank megatron-core checkpoint save: every rank gets the same CheckpointError
naming the `.tmp` and the cause, the partial save is gone, `latest` still names the previous checkpoint.

A file is made unwritable by pointing it at /dev/full (writes fail with ENOSPC) before megatron-core's
dist_checkpointing writes it. Usage (torchrun, 2 ranks): checkpoint_full_disk.py SAVE_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.bridge.manifest import verify_manifest
from megatron_dapo.errors import CheckpointError
from megatron_dapo.runtime.distributed import destroy_distributed, init_distributed, init_model_parallel
from megatron_dapo.runtime.megatron_compat import common_state_in_dcp
from megatron_dapo.trainer import checkpoint as ckpt


def model_writer(full_file_of_rank: dict[int, str]):
    """Writes a sharded tensor with megatron-core; the named file of this rank is /dev/full."""
    from megatron.core.dist_checkpointing import ShardedTensor

    def write(tmp: Path) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = tmp / "model"
        if rank == 0:
            model.mkdir()
        dist.barrier()
        if rank in full_file_of_rank:
            os.symlink("/dev/full", model / full_file_of_rank[rank])
        dist.barrier()
        shard = torch.arange(200_000.0) + rank  # big enough that torch's writer hits the device
        ckpt.megatron_save({"w": ShardedTensor.from_rank_offsets("w", shard, (0, rank, world))}, model)

    return write


def trainer_json(step: int, full: bool = False):
    """Writes trainer.json (rank 0 alone), through /dev/full when `full`."""

    def write(tmp: Path) -> None:
        if full:
            os.symlink("/dev/full", tmp / "trainer.json.tmp")
        ckpt.write_trainer_state(tmp, {"step": step, "version": step + 1, "world_size": 2})

    return write


def expect_failure(save_dir: Path, step: int, full_file_of_rank: dict[int, str], cause: str) -> None:
    tmp = ckpt.tmp_dir(save_dir, step)
    shards = {r: f for r, f in full_file_of_rank.items() if f != "trainer.json"}
    try:
        ckpt.save_collective(
            save_dir, step, model_writer(shards), trainer_json(step, "trainer.json" in full_file_of_rank.values())
        )
    except CheckpointError as e:
        message = str(e)
    else:
        raise AssertionError(f"rank {dist.get_rank()}: a save into /dev/full did not fail")
    failing_rank = next(iter(full_file_of_rank))
    assert str(tmp) in message and f"failed (rank {failing_rank}: " in message and cause in message, message
    dist.barrier()
    assert not tmp.exists(), f"{tmp} left behind"
    assert ckpt.latest_checkpoint(save_dir).name == ckpt.step_name(1)
    verify_manifest(save_dir / ckpt.step_name(1))
    print(f"rank {dist.get_rank()} step {step}: {message}", flush=True)


def main(save_dir: str) -> None:
    init_distributed()
    init_model_parallel()
    save_dir = Path(save_dir)
    final = ckpt.save_collective(save_dir, 1, model_writer({}), trainer_json(1))
    assert (final is not None) == (dist.get_rank() == 0)
    # rank 1's shard file: megatron-core's writer process fails, the coordinator rank holds the details
    expect_failure(save_dir, 2, {1: "__1_0.distcp"}, "No space left on device")
    if common_state_in_dcp():
        # megatron-core 0.19 writes the common state into rank 0's shard file, in the collective save
        expect_failure(save_dir, 3, {0: "__0_0.distcp"}, "No space left on device")
    else:
        # rank 0's common.pt, which megatron-core 0.16.1 writes alone before its collectives (megatron_save
        # defers the error past them): torch.save fails with a C++ message and no errno
        expect_failure(save_dir, 3, {0: "common.pt"}, "torch could not write the file")
    # rank 0's own trainer.json, after every rank wrote its shards
    expect_failure(save_dir, 4, {0: "trainer.json"}, "No space left on device")
    # rank 0's metadata.json, which megatron-core writes alone right before its closing barrier (megatron_save
    # defers the error past it): without that every other rank would wait in the barrier for good
    expect_failure(save_dir, 5, {0: "metadata.json"}, "No space left on device")
    # after the disk has room again the same step saves
    final = ckpt.save_collective(save_dir, 5, model_writer({}), trainer_json(5))
    if dist.get_rank() == 0:
        assert final.name == ckpt.step_name(5) and ckpt.latest_checkpoint(save_dir) == final
    print(f"rank {dist.get_rank()} OK", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])

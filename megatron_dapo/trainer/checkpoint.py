"""Training checkpoints that an interrupted save can never break, and that load only data.

Layout of `save_dir`:

    step_000010/            a complete checkpoint
        model/              the actor's model + optimizer (megatron-core dist_checkpointing, torch_dist)
        rng/rank_00000.json python / numpy / torch / megatron RNG states of each trainer rank
        rollout.json        rollout state (data position, buffered groups, the next batch)
        trainer.json        step, weight version, world size
        manifest.json       size + SHA-256 of every file above, written last
    step_000020.tmp/        a save in progress (or one that was interrupted): never read
    latest                  the name of the newest complete checkpoint, replaced atomically

A save writes everything into `<name>.tmp/`, hashes it into the manifest, renames it to `<name>/`
and only then points `latest` at it (write `latest.tmp`, fsync, `os.replace`). A crash at any
moment leaves `latest` naming the previous complete checkpoint. On resume the manifest is checked
before anything is read, and nothing but JSON and megatron-core's files is deserialized; the one
pickle among those (torch_dist's `.metadata`) is first read with an allow-list (`bridge.dcp_metadata`).
`latest` may only name a `step_*` directory directly inside save_dir.

`save_collective` runs a save on every trainer rank: a write that fails on any rank removes the
partial `.tmp` and raises one CheckpointError, naming the `.tmp` and the cause, on every rank. The
cause names the OS error (No space left on device (ENOSPC), Disk quota exceeded (EDQUOT), Read-only
file system (EROFS)), also where torch's own file writer hid it ("unexpected pos 704 vs 598"): a test
write into the `.tmp`, before it is removed, says how the file system refuses writes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from megatron_dapo.bridge.dcp_metadata import check_dcp_metadata
from megatron_dapo.bridge.manifest import MANIFEST, ManifestError, verify_manifest, write_manifest
from megatron_dapo.errors import CheckpointError
from megatron_dapo.runtime.files import save_failure_text, write_text_atomic

LATEST = "latest"
TRAINER_STATE_KEYS = ("step", "version", "world_size")
_NAME = re.compile(r"step_(\d{6,})")
log = logging.getLogger(__name__)


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def tmp_dir(save_dir: str | Path, step: int) -> Path:
    return Path(save_dir) / (step_name(step) + ".tmp")


def begin_save(save_dir: str | Path, step: int) -> Path:
    """A fresh temporary directory for checkpoint `step` (a leftover from an interrupted save is removed)."""
    tmp = tmp_dir(save_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def complete_checkpoints(save_dir: str | Path) -> list[Path]:
    """Checkpoints whose save finished (a manifest is written last), oldest first."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in save_dir.iterdir()
        if (m := _NAME.fullmatch(p.name)) and p.is_dir() and (p / MANIFEST).is_file()
    ]
    return [p for _, p in sorted(found)]


def commit_save(save_dir: str | Path, step: int, keep_last: int = 0) -> Path:
    """Publish the temporary directory of `step` as complete; prune older ones; return the final path."""
    save_dir = Path(save_dir)
    tmp, final = tmp_dir(save_dir, step), save_dir / step_name(step)
    if not (tmp / "trainer.json").exists():
        raise CheckpointError(f"{tmp}: trainer.json missing, refusing to publish an incomplete checkpoint")
    t0 = time.perf_counter()
    files = write_manifest(tmp)["files"]
    log.info(
        "checkpoint manifest: %d files, %.1f MB hashed in %.2f s",
        len(files),
        sum(f["size"] for f in files.values()) / 2**20,
        time.perf_counter() - t0,
    )
    if final.exists():  # a re-save of the same step (e.g. after resume): replace only once complete
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_text_atomic(save_dir / LATEST, final.name + "\n")
    if keep_last > 0:
        for old in complete_checkpoints(save_dir)[:-keep_last]:
            if old.name != final.name:
                shutil.rmtree(old, ignore_errors=True)
    return final


def save_collective(
    save_dir: str | Path,
    step: int,
    write_rank_files: Callable[[Path], None],
    write_rank0_files: Callable[[Path], None],
    keep_last: int = 0,
) -> Path | None:
    """A checkpoint of `step`, collectively over the default process group (or this process alone when
    none is initialised): rank 0 starts the `.tmp`, every rank runs `write_rank_files(tmp)` (model
    shards: itself collective) and saves its RNG state, then rank 0 runs `write_rank0_files(tmp)`
    (trainer.json, ...) and publishes. Returns the final path on rank 0, None elsewhere.

    After each phase the ranks compare outcomes: if any rank failed, rank 0 removes the `.tmp` and
    every rank raises the same CheckpointError (naming the `.tmp`, the failing rank and its cause),
    so no rank waits forever for one that gave up and no partial save is left to fill the disk."""
    save_dir, rank, tmp = Path(save_dir), _rank(), tmp_dir(save_dir, step)
    _agree(tmp, _attempt(lambda: begin_save(save_dir, step)) if rank == 0 else None)
    _agree(tmp, _attempt(lambda: (write_rank_files(tmp), save_rng(tmp, rank))))
    final: list[Path] = []
    error = None
    if rank == 0:
        error = _attempt(lambda: (write_rank0_files(tmp), final.append(commit_save(save_dir, step, keep_last))))
    _agree(tmp, error)
    return final[0] if final else None


def megatron_save(sharded_state_dict: dict, path: str | Path) -> None:
    """megatron-core's `dist_checkpointing.save`, except that a failure of a file rank 0 writes alone, outside
    the save's collectives, is raised only after the collectives that follow it, so the other ranks never
    wait for it in one: `metadata.json` (written by rank 0 just before the closing barrier) and, on
    megatron-core 0.16.1, `common.pt` (written before the sharded save's collectives; 0.19 saves the common
    state inside the collective DCP save). Both are written as megatron-core writes them; only their errors
    are held back (runtime.megatron_compat.deferred_rank0_writes). A failed shard write keeps its message
    (megatron_compat.writer_errors_kept)."""
    from megatron.core import dist_checkpointing

    from megatron_dapo.runtime.megatron_compat import deferred_rank0_writes, writer_errors_kept

    with deferred_rank0_writes() as errors, writer_errors_kept():
        dist_checkpointing.save(sharded_state_dict, str(path))
    if errors:
        raise errors[0]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _attempt(write: Callable[[], object]) -> BaseException | None:
    """Run one save phase; the exception it raised, if any. torch's CheckpointException is a
    BaseException (megatron-core raises it on every rank when a writer process failed)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        write()
    except (Exception, CheckpointException) as e:
        return e
    return None


def _agree(tmp: Path, error: BaseException | None) -> None:
    """Collective: raise the first failure of any rank, the same CheckpointError everywhere, after rank 0
    removed the partial save."""
    import torch.distributed as dist

    mine = None if error is None else save_failure_text(error, tmp, _rank()) or f"rank {_rank()}: failed"
    causes: list = [mine]
    if dist.is_available() and dist.is_initialized():
        causes = [None] * dist.get_world_size()
        dist.all_gather_object(causes, mine)
    failed = [c for c in causes if c is not None]
    if not failed:
        return
    cause = next((c for c in failed if not c.endswith(": failed")), failed[0])
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):  # a read-only file system refuses even this (EROFS, not ENOENT)
            (tmp.parent / (LATEST + ".tmp")).unlink(missing_ok=True)
    free = shutil.disk_usage(tmp.parent).free / 2**20 if tmp.parent.exists() else float("nan")
    raise CheckpointError(
        f"checkpoint save into {tmp} failed ({cause}). The partial save was removed "
        f"({free:.0f} MiB free on that file system); `latest` still names the previous checkpoint"
    ) from error


def _pointed(save_dir: Path) -> Path:
    """The checkpoint directory `latest` names; CheckpointError unless it is a step_* child of save_dir."""
    pointer = save_dir / LATEST
    with open(pointer, "rb") as f:
        raw = f.read(257)
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        name = None
    if name is None or not _NAME.fullmatch(name):
        raise CheckpointError(
            f"{pointer} does not hold a checkpoint name (step_NNNNNN inside {save_dir}): {raw[:60]!r}"
        )
    path = save_dir / name
    if path.is_symlink():
        raise CheckpointError(
            f"{pointer} names {name}, a symbolic link: a checkpoint must be a directory of {save_dir}"
        )
    if not (path / "trainer.json").is_file() or not (path / MANIFEST).is_file():
        raise CheckpointError(
            f"{pointer} names {name}, which is not a complete checkpoint "
            f"(no {'trainer.json' if not (path / 'trainer.json').is_file() else MANIFEST})"
        )
    return path


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names, or None when there is no pointer (files not yet verified)."""
    save_dir = Path(save_dir)
    if not (save_dir / LATEST).exists():
        return None
    return _pointed(save_dir)


def find_resume_checkpoint(save_dir: str | Path) -> Path | None:
    """The verified checkpoint a resumed run continues from; None when save_dir holds no checkpoint.

    With complete checkpoints present and no valid `latest`, refuses (CheckpointError naming the
    newest complete one and how to resume from it): starting over would overwrite them.
    """
    save_dir = Path(save_dir)
    try:
        found = latest_checkpoint(save_dir)
        why = f"no {LATEST} pointer"
    except CheckpointError as e:
        found, why = None, str(e)
    if found is None:
        complete = complete_checkpoints(save_dir)
        if complete:
            newest = complete[-1]
            raise CheckpointError(
                f"resume: {save_dir} holds checkpoints but {why}; refusing to start over (it would overwrite "
                f"them). The newest complete checkpoint is {newest}: resume from it with "
                f"`echo {newest.name} > {save_dir / LATEST}`, or set checkpoint.save_dir to an empty directory"
            )
        if why != f"no {LATEST} pointer":
            raise CheckpointError(why)
        return None
    try:
        verify_manifest(found)
        check_dcp_metadata(found)
    except ManifestError as e:
        raise CheckpointError(str(e)) from None
    return found


def _read_json(path: Path):
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path} missing") from None
    except (ValueError, RecursionError) as e:  # truncated, not UTF-8, not JSON, absurdly nested
        raise CheckpointError(f"{path} is not valid JSON ({type(e).__name__}: {str(e)[:80]})") from None


def write_trainer_state(ckpt_dir: Path, state: dict) -> None:
    write_text_atomic(Path(ckpt_dir) / "trainer.json", json.dumps(state))


def read_trainer_state(ckpt_dir: Path) -> dict:
    path = Path(ckpt_dir) / "trainer.json"
    state = _read_json(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(state).__name__}")
    for key in TRAINER_STATE_KEYS:
        if not isinstance(state.get(key), int) or isinstance(state[key], bool) or state[key] < 0:
            raise CheckpointError(f"{path}: key {key!r} missing or not a non-negative integer")
    return state


def write_rollout_state(ckpt_dir: Path, state: dict) -> None:
    """The rollout side's plain-data state (JSON: floats round-trip exactly)."""
    write_text_atomic(Path(ckpt_dir) / "rollout.json", json.dumps(state))


def read_rollout_state(ckpt_dir: Path) -> dict:
    path = Path(ckpt_dir) / "rollout.json"
    state = _read_json(path)
    if not isinstance(state, dict) or "next_batch" not in state:
        raise CheckpointError(f"{path}: expected a JSON object with 'next_batch'")
    return state


# --------------------------------------------------------------------------------------- RNG states


def rng_state() -> dict:
    """Every RNG state of this process as plain JSON data (exact: ints and float reprs)."""
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    try:  # megatron-core's model-parallel RNG tracker (dropout streams), when initialised
        from megatron.core import tensor_parallel

        state["megatron"] = {k: v.tolist() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    except Exception:
        pass
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "megatron" in state:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(
            {k: torch.tensor(v, dtype=torch.uint8) for k, v in state["megatron"].items()}
        )


def rng_path(ckpt_dir: Path, rank: int) -> Path:
    return Path(ckpt_dir) / "rng" / f"rank_{rank:05d}.json"


def save_rng(ckpt_dir: Path, rank: int) -> None:
    path = rng_path(ckpt_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(rng_state()))


def read_rng(ckpt_dir: Path, rank: int) -> dict:
    path = rng_path(ckpt_dir, rank)
    if not path.exists():
        raise CheckpointError(f"{path} missing: the checkpoint was saved with fewer trainer ranks")
    state = _read_json(path)
    shape_ok = (
        isinstance(state, dict)
        and all(isinstance(state.get(k), list) for k in ("python", "numpy", "torch"))
        and len(state["python"]) == 3
        and len(state["numpy"]) == 5
    )
    if not shape_ok:
        raise CheckpointError(f"{path}: expected RNG states 'python' [3], 'numpy' [5], 'torch' lists")
    return state


def load_rng(ckpt_dir: Path, rank: int) -> None:
    path = rng_path(ckpt_dir, rank)
    try:
        set_rng_state(read_rng(ckpt_dir, rank))
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a valid RNG state ({type(e).__name__}: {str(e)[:80]})") from None

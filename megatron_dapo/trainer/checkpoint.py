"""Training checkpoints that an interrupted save can never break.

Layout of `save_dir`:

    step_000010/            a complete checkpoint
        model/              the actor's model + optimizer (megatron-core dist_checkpointing, torch_dist)
        rng/rank_00000.pt   python / numpy / torch RNG states of each trainer rank
        trainer.json        step, weight version, rollout state (data position, buffered groups)
    step_000020.tmp/        a save in progress (or one that was interrupted): never read
    latest                  the name of the newest complete checkpoint, replaced atomically

A save writes everything into `<name>.tmp/`, then renames it to `<name>/` and only then points
`latest` at it (write `latest.tmp`, fsync, `os.replace`). A crash at any moment leaves `latest`
naming the previous complete checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

LATEST = "latest"


class CheckpointError(RuntimeError):
    pass


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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit_save(save_dir: str | Path, step: int, keep_last: int = 0) -> Path:
    """Publish the temporary directory of `step` as complete; prune older ones; return the final path."""
    save_dir = Path(save_dir)
    tmp, final = tmp_dir(save_dir, step), save_dir / step_name(step)
    if not (tmp / "trainer.json").exists():
        raise CheckpointError(f"{tmp}: trainer.json missing, refusing to publish an incomplete checkpoint")
    if final.exists():  # a re-save of the same step (e.g. after resume): replace only once complete
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(save_dir / LATEST, final.name + "\n")
    if keep_last > 0:
        complete = sorted(p for p in save_dir.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in complete[:-keep_last]:
            if old.name != final.name:
                shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None when there is none."""
    save_dir = Path(save_dir)
    pointer = save_dir / LATEST
    if not pointer.exists():
        return None
    path = save_dir / pointer.read_text().strip()
    if not (path / "trainer.json").exists():
        raise CheckpointError(f"{pointer} names {path.name}, which is not a complete checkpoint (no trainer.json)")
    return path


def write_trainer_state(ckpt_dir: Path, state: dict) -> None:
    _write_atomic(Path(ckpt_dir) / "trainer.json", json.dumps(state))


def read_trainer_state(ckpt_dir: Path) -> dict:
    return json.loads((Path(ckpt_dir) / "trainer.json").read_text())


def rng_state() -> dict:
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    try:  # megatron-core's model-parallel RNG tracker (dropout streams), when initialised
        from megatron.core import tensor_parallel

        state["megatron"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception:
        pass
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "megatron" in state:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])


def save_rng(ckpt_dir: Path, rank: int) -> None:
    import torch

    path = Path(ckpt_dir) / "rng" / f"rank_{rank:05d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), path)


def load_rng(ckpt_dir: Path, rank: int) -> None:
    import torch

    path = Path(ckpt_dir) / "rng" / f"rank_{rank:05d}.pt"
    if not path.exists():
        raise CheckpointError(f"{path} missing: the checkpoint was saved with fewer trainer ranks")
    set_rng_state(torch.load(path, weights_only=False))

"""megatron-core dist_checkpointing (torch_dist) checkpoints of GPTModel chunks, in Megatron-LM's layout.

    CKPT/latest_checkpointed_iteration.txt   "release" (or an iteration number)
    CKPT/release/                            dist_checkpointing files: {"model": GPTModel.sharded_state_dict()}
    CKPT/hf_config/                          config.json (+ tokenizer files) of the source HF model

Keys are megatron-core's own GPTModel sharded-state-dict keys, so the checkpoint loads at any
TP / PP / EP layout, by this package or by any megatron-core user (Megatron-LM `--load`), into a model
of either layer spec (local or Transformer Engine: `spec_keys`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_dapo.errors import CheckpointError
from megatron_dapo.runtime.files import save_failure_text
from megatron_dapo.runtime.megatron_compat import writer_errors_kept

TRACKER = "latest_checkpointed_iteration.txt"
HF_CONFIG_DIR = "hf_config"


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def checkpoint_dir(ckpt: str | Path) -> Path:
    """The dist_checkpointing directory of `ckpt` (a Megatron-LM checkpoint root or the directory itself)."""
    ckpt = Path(ckpt)
    tracker = ckpt / TRACKER
    if tracker.is_file():
        it = tracker.read_bytes()[:64].decode("utf-8", "replace").strip()
        if it != "release" and not it.isdigit():
            raise ValueError(f"{tracker} holds {it!r}, not 'release' or an iteration number")
        d = ckpt / ("release" if it == "release" else f"iter_{int(it):07d}")
    else:
        d = ckpt
    if not (d / "metadata.json").is_file():
        raise FileNotFoundError(f"{d} is not a megatron-core dist_checkpointing checkpoint (no metadata.json)")
    return d


def save_megatron_checkpoint(model_chunks, out_dir: str | Path, iteration: int | str = "release") -> Path:
    """Collective: save the chunks' weights to `out_dir` (its tracker file is written by rank 0). A write
    that fails is a CheckpointError naming the directory and the OS error (a full disk: No space left on
    device (ENOSPC)), also where torch's own file writer hid it."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    out_dir = Path(out_dir)
    sub = out_dir / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")
    if dist.get_rank() == 0:
        sub.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    n = len(model_chunks)
    state = {_model_key(i, n): c.sharded_state_dict() for i, c in enumerate(model_chunks)}
    state["checkpoint_version"] = 3.0
    state["iteration"] = 0 if iteration == "release" else int(iteration)
    try:
        with writer_errors_kept():  # megatron-core 0.19 would report a failed write by its type alone
            dist_checkpointing.save(state, str(sub))
        if dist.get_rank() == 0:
            (out_dir / TRACKER).write_text(f"{iteration}\n")
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        raise CheckpointError(
            f"saving the megatron-core checkpoint into {sub} failed ({save_failure_text(e, sub)})"
        ) from e
    dist.barrier()
    return sub


@torch.no_grad()
def load_megatron_checkpoint(model_chunks, ckpt: str | Path) -> None:
    """Collective: load a dist_checkpointing checkpoint (any saved TP/PP/EP layout, stacked or per-layer
    decoder layers) into this rank's chunks."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megatron_dapo.bridge.layer_layout import sharded_state_dict_metadata
    from megatron_dapo.bridge.spec_keys import load_model_state, read_keys_as_saved

    d = checkpoint_dir(ckpt)
    n = len(model_chunks)
    meta = sharded_state_dict_metadata(model_chunks, d)  # stacked or per-layer decoder, as saved
    sharded = {_model_key(i, n): c.sharded_state_dict(metadata=meta) for i, c in enumerate(model_chunks)}
    # Training checkpoints (this package's or Megatron-LM's) also hold optimizer and RNG state: skip those,
    # but refuse model tensors missing from the checkpoint or present in it only (another model).
    saved = {sh.key for sh in load_sharded_metadata(str(d)).values()}
    read_keys_as_saved(sharded, saved)  # saved by the other layer spec (local / Transformer Engine)
    absent = sorted({sh.key for sh in nested_values(sharded) if hasattr(sh, "key")} - saved)
    if absent:  # checked before loading: megatron-core fails obscurely on a partial load of merged tensors
        raise ValueError(f"checkpoint {d} lacks model tensors {absent[:4]}: it is a checkpoint of another model")
    state, not_requested, _ = dist_checkpointing.load(sharded, str(d), strict=StrictHandling.RETURN_ALL)
    model_roots = {name for c in model_chunks for name, _ in c.named_children()}
    extra = sorted(k for k in not_requested if k.split(".")[0] in model_roots)
    if extra:
        raise ValueError(
            f"checkpoint {d} holds tensors the model lacks {extra[:4]}: it is a checkpoint of another model"
        )
    for i, c in enumerate(model_chunks):
        load_model_state(c, state[_model_key(i, n)])

"""HF safetensors -> megatron-core GPTModel chunks, each rank reading only the slices it owns."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_dapo.bridge.hf_io import CheckpointError, HFCheckpointReader
from megatron_dapo.bridge.mapping import hf_names, hf_shape, shard_from_hf
from megatron_dapo.bridge.parallel import local_units, model_arch
from megatron_dapo.runtime.layout import ParallelLayout


def check_hf_checkpoint(arch, hf_dir: str | Path) -> HFCheckpointReader:
    """Open `hf_dir` and check its tensor names and shapes against `arch` (errors name the tensor)."""
    reader = HFCheckpointReader(hf_dir)
    expected = {n: hf_shape(arch, n) for n in hf_names(arch)}
    # Some tied-embedding checkpoints also store lm_head.weight; it is the embedding, so ignore it.
    optional = ["lm_head.weight"] if arch.tie_word_embeddings else []
    reader.check(expected, optional=optional)
    return reader


@torch.no_grad()
def load_hf_into_megatron(model_chunks, hf_dir: str | Path, progress: bool = False) -> None:
    """Copy the HF checkpoint in `hf_dir` into this rank's GPTModel chunks (built by build_gpt_model).

    Every rank calls it for its own chunks; there are no collectives. Raises CheckpointError naming a
    missing / unexpected / wrongly shaped tensor, MappingError naming an unmapped megatron parameter.
    Padded vocabulary rows are set to zero. Values are cast to the parameters' dtype.
    `progress`: show a tqdm bar (pass it on one rank).
    """
    arch = model_arch(model_chunks)
    reader = check_hf_checkpoint(arch, hf_dir)
    layout = ParallelLayout.from_megatron()

    def read(name, dim, start, stop):
        return reader.read(name, dim, start, stop)

    units = local_units(model_chunks, arch, layout)
    if progress:
        from tqdm import tqdm

        units = tqdm(units, desc="load HF tensors", unit="param")
    for unit, param in units:
        rank, size = layout.tp_split(unit.rule.expert)
        shard = shard_from_hf(unit, arch, read, rank, size, param.shape)
        if tuple(shard.shape) != tuple(param.shape):
            raise CheckpointError(
                f"megatron parameter {unit.param_name!r} (from {', '.join(unit.hf_names)}): "
                f"expected shape {tuple(param.shape)}, got {tuple(shard.shape)}"
            )
        param.data.copy_(shard.to(param.dtype))

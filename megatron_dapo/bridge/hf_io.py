"""Reading and writing HF safetensors checkpoints (single file or sharded with an index json)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    pass


def _safe_open(path: Path):
    """safe_open, with an unreadable file (truncated, not safetensors) as a CheckpointError naming it."""
    from safetensors import SafetensorError

    try:
        return safe_open(str(path), "pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


class HFCheckpointReader:
    """Lazy, slice-wise access to the tensors of an HF checkpoint directory.

    Only the requested slice of a tensor is read from disk (safetensors `get_slice`), so a rank of a
    tensor-parallel model touches only the bytes it owns.
    """

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_bytes()).get("weight_map")
            except (ValueError, AttributeError, RecursionError) as e:
                raise CheckpointError(f"{index} is not a valid index ({type(e).__name__})") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no 'weight_map'")
            self.files = {name: self.dir / f for name, f in weight_map.items()}
            for f in set(self.files.values()):
                if not f.is_file():
                    raise CheckpointError(f"{index} names {f.name}, which does not exist")
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"no *.safetensors files (and no {INDEX_NAME}) in {self.dir}")
            self.files = {}
            for f in shards:
                with _safe_open(f) as s:
                    for name in s.keys():
                        if name in self.files:
                            raise CheckpointError(f"tensor {name!r} is in both {self.files[name].name} and {f.name}")
                        self.files[name] = f
        self._handles: dict[Path, object] = {}

    def _open(self, name: str):
        if name not in self.files:
            raise CheckpointError(f"tensor {name!r} is missing from the HF checkpoint in {self.dir}")
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = _safe_open(f)
        return self._handles[f]

    def names(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """Tensor `name`, or its slice [start, stop) along `dim` (0 or 1)."""
        sl = self._open(name).get_slice(name)
        if dim is None:
            return sl[:]
        if dim == 0:
            return sl[start:stop]
        if dim == 1:
            return sl[:, start:stop]
        raise ValueError(f"slicing along dim {dim} is not supported")

    def check(self, expected: dict[str, tuple[int, ...]], optional: Iterable[str] = ()) -> None:
        """Raise CheckpointError naming a missing, unexpected or wrongly shaped tensor."""
        have = self.names()
        missing = [n for n in expected if n not in have]
        if missing:
            raise CheckpointError(
                f"HF checkpoint {self.dir} is missing tensor {missing[0]!r} ({len(missing)} missing in all)"
            )
        extra = sorted(have - set(expected) - set(optional))
        if extra:
            raise CheckpointError(
                f"HF checkpoint {self.dir} has unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all) "
                "for the architecture its config.json describes"
            )
        for name, shape in expected.items():
            got = self.shape(name)
            if got != tuple(shape):
                raise CheckpointError(
                    f"tensor {name!r}: expected shape {tuple(shape)}, got {got} in {self.files[name].name}"
                )


class ShardedSafetensorsWriter:
    """Writes tensors in order into `model-0000i-of-0000N.safetensors` files of at most ~`max_shard_bytes`,
    plus `model.safetensors.index.json`. Memory held: one shard."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 5 * 1024**3):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous().cpu()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        i = len(self._shards)
        save_file(self._pending, str(self.dir / f".shard-{i}.safetensors"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Finish the files; returns the shard file names."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        weight_map, files = {}, []
        for i, names in enumerate(self._shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / f".shard-{i}.safetensors", self.dir / fname)
            files.append(fname)
            weight_map.update({name: fname for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return files

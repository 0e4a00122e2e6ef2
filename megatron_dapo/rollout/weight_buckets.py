"""Group a stream of named tensors into size-bounded buckets, and the flat byte layout of a bucket.

The flat layout is SGLang 0.5.23's `FlattenedTensorBucket` (srt/weight_sync/tensor_bucket.py): the
tensors' bytes back to back in order, as one uint8 buffer, each tensor starting at a byte offset that
is a multiple of its dtype's itemsize. The receiver derives the offsets from names/dtypes/shapes alone,
so the sender never pads: a tensor that would start misaligned opens a new bucket instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class FlatLayout:
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]
    offsets: list[int]
    nbytes: int

    def unflatten(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, dt, shape, off in zip(self.names, self.dtypes, self.shapes, self.offsets):
            size = math.prod(shape) * dt.itemsize
            out.append((name, flat[off : off + size].view(dt).reshape(shape)))
        return out


def bucket_layout(names, dtypes, shapes) -> FlatLayout:
    offsets, off = [], 0
    for name, dt, shape in zip(names, dtypes, shapes, strict=True):
        if any(d < 0 for d in shape):
            raise ValueError(f"{name}: negative dimension in shape {shape}")
        if off % dt.itemsize:
            raise ValueError(f"{name}: byte offset {off} is not aligned to {dt} ({dt.itemsize} bytes)")
        offsets.append(off)
        off += math.prod(shape) * dt.itemsize
    return FlatLayout(list(names), list(dtypes), [list(s) for s in shapes], offsets, off)


@dataclass
class Bucket:
    tensors: list[tuple[str, torch.Tensor]]
    last: bool = False  # no tensor follows this bucket in its stream

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.tensors]

    @property
    def dtypes(self) -> list[str]:
        return [dtype_name(t.dtype) for _, t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(t.shape) for _, t in self.tensors]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    def flatten(self, staging: torch.Tensor | None = None) -> torch.Tensor:
        """One uint8 buffer in SGLang's flattened-bucket layout (written into `staging[:nbytes]` if given)."""
        parts = [t.contiguous().reshape(-1).view(torch.uint8) for _, t in self.tensors]
        if staging is None:
            return torch.cat(parts)
        out = staging[: self.nbytes]
        torch.cat(parts, out=out)
        return out


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, aligned: bool = False
) -> Iterator[Bucket]:
    """Consecutive tensors, at most `bucket_bytes` per bucket (a bigger tensor gets a bucket alone).

    aligned=True also closes a bucket before a tensor whose flat offset would be misaligned.
    A bucket is yielded as soon as the first tensor of the next one arrives (or the stream ends, and
    then it is marked `last`), so a consumer holds at most one bucket plus one tensor.
    """
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        nbytes = t.numel() * t.element_size()
        misaligned = aligned and size % t.element_size() != 0
        if cur and (size + nbytes > bucket_bytes or misaligned):
            yield Bucket(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes
    if cur:
        yield Bucket(cur, last=True)

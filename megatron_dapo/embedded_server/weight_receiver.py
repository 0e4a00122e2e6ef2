"""Receive named tensors broadcast by the trainer over the weight-update group (server side).

Mirrors SGLang 0.5.23 (`weight_updater.receive_weights_from_distributed`): one broadcast per tensor
in the listed order, or, with load_format="flattened_bucket", one broadcast of a uint8 buffer that
holds the tensors back to back. Everything announced is received even when a name is unknown, so a
bad name fails this update with a message instead of leaving the trainer blocked in a broadcast.
"""

from __future__ import annotations

import math

import torch

from megatron_dapo.bridge import fp8
from megatron_dapo.rollout import weight_group as wgroup
from megatron_dapo.rollout.weight_buckets import bucket_layout


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"dtypes: {name!r} is not a torch dtype")
    return dt


def announcement_problem(names, dtypes, shapes, max_bytes: int) -> str | None:
    """Why an announced update cannot be received at all, or None.

    The receiver must post exactly the broadcasts the sender makes, with the same sizes; if it cannot
    (no dtype, no size, more bytes than it could hold), the group is out of step with the sender and
    the next update would receive this one's bytes.
    """
    if not names or not len(names) == len(dtypes) == len(shapes):
        return (
            f"names/dtypes/shapes: must be non-empty lists of equal length, got "
            f"{len(names)}/{len(dtypes)}/{len(shapes)}"
        )
    total = 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        try:
            dt = torch_dtype(dtype)
        except ValueError as e:
            return f"{name}: {e}"
        if any(d < 0 for d in shape):
            return f"{name}: shape {list(shape)} has a negative size"
        total += math.prod(shape) * dt.itemsize
    if total > max_bytes:
        return f"the update announces {total} bytes, more than this server receives at once ({max_bytes})"
    return None


def receive(
    pg, names, dtypes, shapes, device, flattened: bool, into=None, flat_buffer=None
) -> list[tuple[str, torch.Tensor]]:
    """Receive the announced tensors; returns those still to be loaded.

    `into(name, dtype, shape)` may return the model's own tensor to receive straight into (same dtype,
    contiguous): such tensors are loaded by the broadcast itself and not returned.
    `flat_buffer(layout)` may supply the uint8 receive buffer of a flattened bucket.
    """
    dts = [torch_dtype(d) for d in dtypes]
    if flattened:
        layout = bucket_layout(names, dts, shapes)
        if flat_buffer is not None:
            flat = flat_buffer(layout)
        else:
            flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        wgroup.broadcast(flat, pg)
        return layout.unflatten(flat)
    out, works = [], []
    for name, dt, shape in zip(names, dts, shapes):
        t = into(name, dt, shape) if into is not None else None
        if t is None:
            t = torch.empty(shape, dtype=dt, device=device)
            out.append((name, t))
        works.append(wgroup.broadcast(t, pg, async_op=True))
    for w in works:
        w.wait()
    return out


class FlatBucketHomes:
    """Zero-copy flattened updates: parameters re-homed into the receive buffer of the bucket carrying them.

    SGLang receives a flattened bucket into a fresh buffer and copies every tensor into the model. Here
    the first update with a given layout does the same, and then every parameter the bucket covers
    whole (same dtype, device and shape; not one expert's slice of a fused tensor) is pointed at its
    slice of that buffer, so later updates with the same layout (every sync of a run) are received
    straight into the parameters. Steady-state memory is unchanged: the buffer is those parameters'
    storage. Only touch it with generation stopped (paused, or drained by the update gate).
    """

    def __init__(self, loader):
        self.loader = loader  # megatron_dapo.bridge.hf_loader.HFWeightLoader
        self._homes: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def _key(layout) -> tuple:
        return tuple(zip(layout.names, map(str, layout.dtypes), map(tuple, layout.shapes)))

    def buffer(self, layout, device) -> torch.Tensor:
        """The bucket's home if it has one (receiving into it loads the parameters), else a new buffer."""
        flat = self._homes.get(self._key(layout))
        if flat is None or flat.device != torch.device(device):
            flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        return flat

    def forget(self) -> None:
        """Drop every home (the weights are being released: their buffers must go with them)."""
        self._homes.clear()

    def adopt(self, layout, flat: torch.Tensor, named) -> None:
        """Make `flat` (just received, `named` its views) the home of the parameters it covers whole."""
        key = self._key(layout)
        if self._homes.get(key) is flat:
            return
        names = set(layout.names)
        for old in [k for k in self._homes if any(n in names for n, _, _ in k)]:
            del self._homes[old]  # its parameters move here; the old buffer goes with its last view
        for name, view in named:
            if fp8.scale_base(name) is not None:  # FP8 scales have no home: they are dequantized away
                continue
            dst, mem_name = self.loader.target(name)
            param = self.loader.params[mem_name]
            if dst is param and (param.dtype, param.device, param.shape) == (view.dtype, view.device, view.shape):
                param.data = view
        self._homes[key] = flat

"""Receive named tensors broadcast by the trainer over the weight-update group (server side).

Mirrors SGLang 0.5.23 (`weight_updater.receive_weights_from_distributed`): one broadcast per tensor
in the listed order, or, with load_format="flattened_bucket", one broadcast of a uint8 buffer that
holds the tensors back to back. Everything announced is received even when a name is unknown, so a
bad name fails this update with a message instead of leaving the trainer blocked in a broadcast.
"""

from __future__ import annotations

import torch

from megatron_dapo.sync import group as wgroup
from megatron_dapo.sync.buckets import bucket_layout


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"dtypes: {name!r} is not a torch dtype")
    return dt


def receive(pg, names, dtypes, shapes, device, flattened: bool, into=None,
            flat_buffer=None) -> list[tuple[str, torch.Tensor]]:
    """Receive the announced tensors; returns those still to be loaded.

    `into(name, dtype, shape)` may return the model's own tensor to receive straight into (same dtype,
    contiguous): such tensors are loaded by the broadcast itself and not returned.
    `flat_buffer(nbytes)` may supply the uint8 receive buffer of a flattened bucket.
    """
    dts = [torch_dtype(d) for d in dtypes]
    if flattened:
        layout = bucket_layout(names, dts, shapes)
        if flat_buffer is not None:
            flat = flat_buffer(layout.nbytes)
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

"""The interface every weight transport implements, and what a sync reports.

A transport moves the trainer's HF-named tensors of one weight version to the rollout servers. It takes
them as an iterator of `(hf_name, tensor or None)` (`megatron_dapo.bridge.export_hf_weights` on every trainer
rank), so a stage in front of any transport (e.g. quantizing) is one more iterator. Implementations:
`sync.broadcast.BroadcastTransport` (an NCCL/gloo update group with every server, now),
`sync.ipc.IpcTransport` (CUDA IPC / shared-memory handles to servers on the trainer's host, now) and
`sync.per_server.PerServerStoreTransport` (a host-memory store each server takes the weights from when its
policy says). docs/rollout-and-weight-sync.md tells which policy uses which.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class SyncStats:
    version: str
    num_tensors: int
    nbytes: int
    num_buckets: int
    seconds: float
    max_logprob_diff: float | None = None
    source_bytes: dict[int, int] | None = None  # bytes each source rank broadcast (several sources)
    payload_bytes: int | None = None  # HTTP bytes of the updates that carried handles, not tensors (ipc)

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9

    def as_metrics(self, prefix: str = "sync/") -> dict[str, float]:
        m = {
            f"{prefix}seconds": self.seconds,
            f"{prefix}gbps": self.gbps,
            f"{prefix}bytes": float(self.nbytes),
            f"{prefix}buckets": float(self.num_buckets),
        }
        if self.source_bytes:
            m[f"{prefix}sources"] = float(len(self.source_bytes))
            m[f"{prefix}source_bytes_max"] = float(max(self.source_bytes.values()))
        if self.payload_bytes is not None:
            m[f"{prefix}payload_bytes"] = float(self.payload_bytes)
        if self.max_logprob_diff is not None:
            m[f"{prefix}max_logprob_diff"] = self.max_logprob_diff
        return m


class WeightTransport(Protocol):
    """Every method is called on every trainer rank (the export is collective)."""

    def connect(self) -> None:
        """Ready to sync: whatever channel to the servers the transport needs, formed."""

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor | None]], version) -> SyncStats | None:
        """Hand one full set of weights of `version` to the servers; the iterator is drained on every rank.
        Stats on trainer rank 0, None elsewhere."""

    def close(self) -> None:
        """Leave the servers as another transport may find them (their groups left, no session open)."""

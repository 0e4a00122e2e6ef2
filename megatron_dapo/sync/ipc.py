"""The IPC transport (`rollout.sync.transport: ipc`): weights handed to servers on the trainer's own host
through `/update_weights_from_tensor`, as SGLang's colocated senders do (verl, slime).

Each bucket (about `rollout.sync.bucket_mb`) is pickled with torch's multiprocessing reductions, as
SGLang's `MultiprocessingSerializer`: a CUDA tensor travels as a CUDA IPC handle, a CPU tensor as the name
of the shared-memory file its storage moves to. The HTTP body carries handles, not the bytes; the server
maps them and copies into its model. So every server must run on this host (checked at construction), and
the bucket's tensors are kept alive (held by the bucket) until every server has answered its update. The
body lists one entry per server TP rank (SGLang's rank r deserializes entry r only); each entry is pickled
on its own, so each consumer of a CUDA IPC handle has its own producer-side reference count. With
`flatten_bucket`, a bucket is one uint8 buffer plus SGLang's `FlattenedTensorMetadata` list
(`load_format="flattened_bucket"`). On the CPU every bucket is first copied into one shared-memory buffer,
allocated once and reused (pickling a CPU storage moves it into shared memory: the trainer's own
parameters must not move), so the handles name slices of it. The FP8 block stream (`rollout.weight_format:
fp8_block`) travels like any other: float8 weights and float32 scales in one bucket, each tensor aligned to its
dtype in the flat bytes (SGLang's multi-dtype FlattenedTensorBucket); a receiver that holds one half of a pair
past its bucket must copy it (the next bucket overwrites the staging buffer: bridge.fp8.DequantizingStream).

Trainer rank 0 talks to the servers (the export gathers every tensor there; the other ranks drain the
iterator for its collectives). The session (pause, begin ... end, continue), the membership (lost,
re-admitted servers) and the check after a sync (`verify`) are those of the broadcast transport; there is
no group, so a lost server costs nothing to leave out and a returning one only needs the next sync.

    transport = IpcTransport(urls, cfg.rollout.sync)        # on every trainer rank
    transport.connect()
    stats = transport.sync(export_hf_weights(model), version=step)
    transport.verify(probe_ids, trainer_logprobs)            # rank 0, with rollout.sync.verify
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_dapo.config.schema import SyncConfig
from megatron_dapo.embedded_server.tensor_payload import (
    flattened_metadata,
    serialize_flattened_bucket,
    serialize_named_tensors,
)
from megatron_dapo.rollout.weight_buckets import Bucket, iter_buckets
from megatron_dapo.runtime.net import is_this_host
from megatron_dapo.sync.addresses import server_host
from megatron_dapo.sync.errors import ServersLost, WeightSyncError
from megatron_dapo.sync.membership import Membership
from megatron_dapo.sync.probe_check import probe_max_diff
from megatron_dapo.sync.server_calls import DEFAULT_TIMEOUT_S, ServerCalls, readmit_answering
from megatron_dapo.sync.session import UpdateSession
from megatron_dapo.sync.transport import SyncStats

log = logging.getLogger(__name__)

FLATTENED_BUCKET = "flattened_bucket"


def remote_servers(server_urls: Sequence[str]) -> list[str]:
    """Those of `server_urls` not on this host: IPC handles (shared memory, CUDA IPC) do not cross hosts."""
    return [u for u in server_urls if not is_this_host(server_host(u))]


class IpcTransport:
    def __init__(
        self,
        server_urls: Sequence[str],
        sync_cfg=None,  # megatron_dapo.config.schema.SyncConfig (bucket_mb, flatten_bucket, pause_*, verify_*)
        api_key: str | None = None,
        server_tp_sizes: Sequence[int] | None = None,
        pause_mode: str | None = None,  # default: sync_cfg.pause_mode
        timeout_s: float | None = None,  # each HTTP call; default sync_cfg.timeout_s, else 600 s
        min_live: int = 1,  # fewer live servers than this after a loss: the sync fails (rollout.min_healthy_servers)
        on_lost=None,  # (url, reason) -> None, for each server left out (the coordinator's registry.mark_down)
    ):
        remote = remote_servers(server_urls)
        if remote:
            raise ValueError(
                f"rollout.sync.transport=ipc: servers {remote} are not on this host; IPC handles (CUDA IPC, "
                "shared memory) reach only servers on the trainer's own host (use transport broadcast)"
            )
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.cfg = cfg = sync_cfg or SyncConfig()
        self.members = Membership(server_urls, server_tp_sizes, min_live, on_lost)
        self.calls = ServerCalls(self.members, api_key, timeout_s or cfg.timeout_s or DEFAULT_TIMEOUT_S)
        self.session = UpdateSession(self.calls, cfg.pause_generation, pause_mode or cfg.pause_mode)
        self.bucket_bytes = int(cfg.bucket_mb * 1024 * 1024)
        self.flatten_bucket = bool(cfg.flatten_bucket)
        self._shared_staging: torch.Tensor | None = None  # CPU flat buffer in shared memory, reused

    # ---- what callers read ---------------------------------------------------------------------
    @property
    def live(self) -> list[str]:
        return self.members.live

    @property
    def lost(self) -> dict[str, str]:
        return self.members.lost

    @property
    def lost_causes(self) -> dict[str, BaseException]:
        return self.members.lost_causes

    # ---- lifecycle -----------------------------------------------------------------------------
    def connect(self) -> None:
        """No group to form: rank 0 opens its HTTP clients."""
        if self.rank == 0:
            self.calls.start()

    def close(self) -> None:
        self.calls.close()
        self._shared_staging = None

    # ---- sync ----------------------------------------------------------------------------------
    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor | None]], version) -> SyncStats | None:
        """Hand one full set of weights to every live server; stats on rank 0, None elsewhere. A server lost
        meanwhile is left out and ServersLost raised (the others ended and continued): sync again with a
        fresh export. Below `min_live` servers a WeightSyncError names every lost server."""
        version = str(version)
        items = iter(named_tensors)
        if self.rank != 0:
            for _ in items:  # take part in the export's collectives
                pass
            return None
        if not self.calls.started:
            raise WeightSyncError("sync() before connect()")
        t0 = time.perf_counter()
        error, sent = None, (0, 0, 0, 0)
        try:
            if not self.members.live:
                raise WeightSyncError(f"no live server to sync; lost: {self.members.describe_lost()}")
            self.session.open()
            sent = self._send(items, version)
            if not sent[2]:
                raise WeightSyncError("the weight iterator yielded no tensors on trainer rank 0")
        except Exception as e:
            error = e
        for _ in items:  # the rest of the export: the other ranks wait on its gathers
            pass
        try:
            if isinstance(error, ServersLost):
                self.members.leave_out(error)
        finally:
            self.session.close(failed=error is not None)
        if error is not None:
            raise error
        self.members.synced(version)
        tensors, nbytes, buckets, payload = sent
        stats = SyncStats(version, tensors, nbytes, buckets, time.perf_counter() - t0, payload_bytes=payload)
        log.info(
            "synced %d tensors (%.1f MB, %d buckets, %.1f kB of handles) by IPC to %d servers in %.2fs, version %s",
            tensors,
            nbytes / 1e6,
            buckets,
            payload / 1e3,
            len(self.members.live),
            stats.seconds,
            version,
        )
        return stats

    def _send(self, items, version: str) -> tuple[int, int, int, int]:
        """Every bucket to every live server, one after the other (each answered before the next is sent, so
        its tensors stay alive until loaded). Returns (tensors, bytes, buckets, HTTP payload bytes)."""
        tensors = nbytes = buckets = payload = 0
        # aligned: each tensor starts at a multiple of its itemsize in the flat bytes, so it can be viewed there
        for bucket in iter_buckets(items, self.bucket_bytes, aligned=True):
            payload += self._update(bucket, version if bucket.last else None, bucket.last and self.session.flush_cache)
            tensors, nbytes, buckets = tensors + len(bucket.tensors), nbytes + bucket.nbytes, buckets + 1
        return tensors, nbytes, buckets, payload

    def _update(self, bucket: Bucket, version: str | None, flush: bool) -> int:
        held, serialize = self._stage(bucket)  # `held`: what the handles point at, alive until answered
        entries = [[serialize() for _ in range(tp)] for tp in self._live_tp_sizes()]
        load_format = FLATTENED_BUCKET if self.flatten_bucket else None

        async def post():
            return await asyncio.gather(
                *(
                    c.update_weights_from_tensor(e, load_format, flush_cache=flush, weight_version=version)
                    for c, e in zip(self.calls.clients, entries)
                ),
                return_exceptions=True,
            )

        answers = self.calls.run(post())
        names = bucket.names
        what = (
            f"update_weights_from_tensor of tensor {names[0]!r}"
            if len(names) == 1
            else f"update_weights_from_tensor of the bucket from tensor {names[0]!r} to {names[-1]!r} "
            f"({len(names)} tensors)"
        )
        self.calls.raise_failed(what, answers)
        del held
        return sum(len(b) for e in entries for b in e)

    def _live_tp_sizes(self) -> list[int]:
        tps = dict(zip(self.members.urls, self.members.tp_sizes))
        return [tps[u] for u in self.members.live]

    def _stage(self, bucket: Bucket):
        """(what must stay alive, a function pickling one TP rank's entry). CUDA tensors travel from where they
        are; CPU tensors are first copied into a reused shared-memory buffer (pickling a CPU storage would
        otherwise move it, the trainer's own parameter maybe, into shared memory)."""
        named = [(n, t.detach().contiguous()) for n, t in bucket.tensors]
        meta = flattened_metadata(named)
        on_cpu = named[0][1].device.type == "cpu"
        if not self.flatten_bucket and not on_cpu:
            return named, lambda: serialize_named_tensors(named)
        flat = self._flat(named, meta[-1].end_idx) if on_cpu else torch.cat([_bytes(t) for _, t in named])
        if self.flatten_bucket:
            return flat, lambda: serialize_flattened_bucket(flat, meta)
        views = [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in meta]
        return flat, lambda: serialize_named_tensors(views)

    def _flat(self, named, nbytes: int) -> torch.Tensor:
        """The bucket's bytes back to back in the shared-memory staging buffer (its first `nbytes`): allocated
        once, reused by every bucket (the previous one is answered, hence loaded, before this one is written)."""
        buf = self._shared_staging
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, self.bucket_bytes), dtype=torch.uint8).share_memory_()
            self._shared_staging = buf
        out = buf[:nbytes]
        torch.cat([_bytes(t) for _, t in named], out=out)
        return out

    # ---- re-admission and verification ---------------------------------------------------------
    def readmit(self) -> list[str]:
        """Lost servers answering /health again (and live ones found restarted, first left out) go back into
        `live`: the next sync gives them the current weights. Rank 0; returns those re-admitted."""
        if self.rank != 0 or not self.calls.started:
            return []
        return readmit_answering(self.members, self.calls)

    def verify(self, probe_ids: Sequence[int], trainer_logprobs, tolerance: float | None = None) -> float:
        """Max |server - trainer| logprob over the probe, worst server, rank 0 only; raises past the tolerance
        (default rollout.sync.verify_tolerance). A server lost meanwhile is left out and ServersLost raised
        after the others were checked."""
        tol = self.cfg.verify_tolerance if tolerance is None else tolerance
        worst, lost = probe_max_diff(self.calls, probe_ids, trainer_logprobs, tol)
        if lost is not None:
            self.members.leave_out(lost)
            raise lost
        return worst


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)

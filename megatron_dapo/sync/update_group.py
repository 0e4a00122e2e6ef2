"""One source's weight-update process group with the live servers, and the buckets it broadcasts over it.

The group: this rank at rank 0, live server i at rank offset 1 + the TP ranks of the live servers before it
(rollout/weight_group.py forms it the way SGLang does). `stream` groups `(name, tensor)` pairs into buckets
of about `bucket_mb`; for each, `/update_weights_from_distributed` is posted to every live server at once,
then the bucket's tensors are broadcast (one broadcast each, or with `flatten_bucket` one flat uint8 buffer
in SGLang's `flattened_bucket` layout), then the answers are awaited; meanwhile the next bucket is produced
and staged. The last bucket carries the weight version (and the cache flush).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megatron_dapo.rollout import weight_group as wgroup
from megatron_dapo.rollout.protocol import FLATTENED_BUCKET
from megatron_dapo.rollout.weight_buckets import Bucket, iter_buckets
from megatron_dapo.runtime.net import free_port
from megatron_dapo.sync.errors import WeightSyncError, is_lost
from megatron_dapo.sync.membership import Membership
from megatron_dapo.sync.server_calls import GRACE_S, ServerCalls

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamCounts:
    tensors: int = 0
    nbytes: int = 0
    buckets: int = 0

    def __add__(self, other: StreamCounts) -> StreamCounts:
        return StreamCounts(self.tensors + other.tensors, self.nbytes + other.nbytes, self.buckets + other.buckets)


@dataclass
class _InFlight:
    """One bucket on its way: the servers' pending HTTP answers and the running broadcasts."""

    answers: list[concurrent.futures.Future]  # of the HTTP loop thread: one per live server, its answer
    works: list
    payload: list[torch.Tensor]  # kept alive until the broadcasts complete
    names: list[str]


def _outcome(answer: concurrent.futures.Future, timeout_s: float):
    """A server's answer, or the exception it raised, or a TimeoutError if it has none yet."""
    if not answer.done():
        return TimeoutError(f"no answer in {timeout_s}s")
    return answer.exception() or answer.result()


def _result_or_error(fut) -> str:
    try:
        return str(fut.result(5))
    except Exception as e:
        return repr(e)


class UpdateGroup:
    def __init__(
        self,
        members: Membership,
        calls: ServerCalls,
        group_name: str,
        backend: str,
        master_address: str,
        master_port: int | None,
        bucket_mb: float,
        flatten_bucket: bool,
    ):
        self.members, self.calls = members, calls
        self.group_name, self.backend = group_name, backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.master_address, self.master_port = master_address, master_port
        self.bucket_bytes, self.flatten_bucket = int(bucket_mb * 1024 * 1024), flatten_bucket
        self.pg = None
        self._staging: list[torch.Tensor | None] = [None, None]

    @property
    def timeout_s(self) -> float:
        return self.calls.timeout_s

    # ---- forming and leaving -------------------------------------------------------------------
    def form(self) -> None:
        """Form the group with the live servers (every one joins at once; this rank hosts its store)."""
        self.calls.start()
        port = self.master_port or free_port(self.master_address)
        world_size, name, backend = self.members.world_size, self.group_name, self.backend

        async def ask_all():
            return await asyncio.gather(
                *(
                    c.init_weights_update_group(self.master_address, port, off, world_size, name, backend)
                    for c, off in zip(self.calls.clients, self.members.rank_offsets())
                )
            )

        answers = self.calls.submit(ask_all())
        try:
            self.pg = wgroup.init_weight_update_group(
                self.master_address, port, 0, world_size, name, backend, self.timeout_s
            )
        except Exception as e:
            raise WeightSyncError(
                f"weight-update group at {self.master_address}:{port} did not form: {e}; "
                f"servers: {_result_or_error(answers)}"
            ) from e
        answers.result(self.timeout_s + GRACE_S)
        self.members.group_formed()
        log.info("weight-update group %s formed: %d servers, world size %d", name, len(self.members.live), world_size)

    def leave(self) -> None:
        """Both sides leave the group (servers first, so the group name may be reused)."""
        if not self.calls.started:  # never formed
            return
        self.calls.ask_all_and_raise_failed("destroy_weights_update_group", self.group_name, quiet=True)
        if self.pg is not None:  # else torn down already (`_abort`)
            wgroup.destroy_weight_update_group(self.pg)
            self.pg = None
        self.members.group_left()

    def reform(self) -> None:
        """A new group for the live servers (none: only leave the old one, which had the lost ones in it)."""
        self.leave()
        if self.members.live:
            self.form()

    def close(self) -> None:
        self.leave()
        self._staging = [None, None]

    # ---- streaming -----------------------------------------------------------------------------
    def stream(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str | None, flush: bool
    ) -> StreamCounts:
        """Broadcast `(name, tensor)` pairs bucket by bucket; the last bucket carries `version` and `flush`.
        No pair: nothing is sent (zero buckets counted; the caller says why that is wrong)."""
        counts = StreamCounts()
        inflight: _InFlight | None = None
        try:
            # Pipelined: while bucket i is on the wire, bucket i+1 is produced (the export's gathers)
            # and staged (device copy, flattening); its update is posted only once bucket i is answered,
            # so every server sees the updates in order.
            for i, bucket in enumerate(iter_buckets(named_tensors, self.bucket_bytes, aligned=self.flatten_bucket)):
                payload = self._stage(bucket, slot=i % 2)
                if inflight is not None:
                    self._finish(inflight)
                # the last bucket carries the version: a server reports it only once all of it is loaded
                last = bucket.last and version is not None
                inflight = self._start(bucket, payload, version if last else None, flush and bucket.last)
                counts += StreamCounts(len(bucket.tensors), bucket.nbytes, 1)
            if inflight is not None:
                self._finish(inflight)
                inflight = None
        finally:
            if inflight is not None and not all(f.done() for f in inflight.answers):  # failed mid-bucket
                self._abandon(inflight)
        return counts

    def _stage(self, bucket: Bucket, slot: int) -> list[torch.Tensor]:
        """What goes on the wire for `bucket`: its tensors on the broadcast device, or one flat buffer."""
        if not self.flatten_bucket:
            return [t.to(self.device).contiguous() for _, t in bucket.tensors]
        if any(t.device != self.device for _, t in bucket.tensors):
            bucket.tensors = [(n, t.to(self.device)) for n, t in bucket.tensors]
        return [bucket.flatten(self._staging_for(bucket.nbytes, slot))]

    def _staging_for(self, nbytes: int, slot: int) -> torch.Tensor:
        """Reused flat buffers on the broadcast device (two, so bucket i+1 is flattened while bucket i is
        on the wire): no fresh allocation, and no page faults, per bucket."""
        buf = self._staging[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, self.bucket_bytes), dtype=torch.uint8, device=self.device)
            self._staging[slot] = buf
        return buf

    def _start(self, bucket: Bucket, payload: list[torch.Tensor], version: str | None, flush_cache: bool) -> _InFlight:
        answers = [
            self.calls.submit(
                c.update_weights_from_distributed(
                    bucket.names,
                    bucket.dtypes,
                    bucket.shapes,
                    group_name=self.group_name,
                    flush_cache=flush_cache,
                    weight_version=version,
                    load_format=FLATTENED_BUCKET if self.flatten_bucket else None,
                )
            )
            for c in self.calls.clients
        ]
        works = [wgroup.broadcast(t, self.pg, async_op=True) for t in payload]
        return _InFlight(answers, works, payload, list(bucket.names))

    def _finish(self, inflight: _InFlight) -> None:
        # A server answers only once it has received (and loaded) the whole bucket, so waiting for the
        # answers waits for the broadcasts without polling them; and a server that refused the update,
        # and so never joins the broadcast, surfaces here instead of leaving us blocked in it.
        what = (
            f"update_weights_from_distributed of tensor {inflight.names[0]!r}"
            if len(inflight.names) == 1
            else f"update_weights_from_distributed of the bucket from tensor {inflight.names[0]!r} to "
            f"{inflight.names[-1]!r} ({len(inflight.names)} tensors)"
        )
        bound = self.timeout_s + GRACE_S
        done, waiting = concurrent.futures.wait(inflight.answers, bound, concurrent.futures.FIRST_EXCEPTION)
        if any(f.exception() is not None and is_lost(f.exception()) for f in done):
            # A server is gone mid-broadcast. The others wait in a receive that cannot complete (until their
            # own group timeout): tearing down our end of the group ends it now, so they answer and go on.
            inflight.works.clear()  # they hold the group's connections open
            self._abort()
        concurrent.futures.wait(waiting, bound)
        self.calls.raise_failed(what, [_outcome(f, self.timeout_s) for f in inflight.answers])
        for w in inflight.works:
            w.wait()

    def _abort(self) -> None:
        """Our end of the group, torn down now: its connections close only once nothing refers to it (the
        caller dropped the broadcasts' works), and their closing ends the other servers' receives."""
        pg, self.pg = self.pg, None
        if pg is not None:
            wgroup.destroy_weight_update_group(pg)
            del pg
            gc.collect()

    @staticmethod
    def _abandon(inflight: _InFlight) -> None:
        concurrent.futures.wait(inflight.answers, 5)
        for f in inflight.answers:
            if f.done() and f.exception() is not None:
                log.warning("weight update abandoned after an error: %s", f.exception())

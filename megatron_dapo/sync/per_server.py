"""Per-server weight sync (`rollout.sync.policy: greedy | status_based`): each server takes the
trainer's newest weights when its policy says so, while training goes on.

`WeightStore` keeps the newest exported weights (HF names) in host memory of trainer rank 0: the
trainer has moved on by the time a lagging server syncs, so the live model no longer holds that
version. A snapshot is immutable: `put` builds the next one while servers may still be reading the
current one, but first waits until none reads an older one, so the store never holds more than two
copies of the model (the wait happens only when one sync outlasts a whole training step).

`PerServerSync` runs on a thread of trainer rank 0. Every `check_interval_ms` (or at once when a new
version is stored, or a sync ends) it asks the policy (megatron_dapo.coordinator.sync_policy) which
lagging servers sync now, and syncs each on its own thread through its own `BroadcastTransport`
(one update group per server, the same session / bucket protocol): stop routing to the server
(`ServerRegistry.begin_sync`), pause it (its requests, aborted or paused per `sync.pause_mode`,
come back through partial rollout or go on with the new weights), load, verify against the
snapshot's probe logprobs if `sync.verify`, publish its version, route to it again.

A failure on any of these threads (a sync, the policy loop, a registry call) is never lost with a
thread nobody joins: it is logged, kept as `error` (the policy loop then stops), reported through
`on_error` (the coordinator's `fail`: the producer's take_batch raises it), and `check()`, which the
trainer calls every step, raises it as a WeightSyncError naming it.

`PerServerStoreTransport` is the two as a `WeightTransport` (sync/transport.py): its `sync` puts the weights
into the store; the first one also brings every server to them, then starts the policy loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo.coordinator.load_poller import LOAD_TIMEOUT_S
from megatron_dapo.coordinator.servers import ServerRegistry
from megatron_dapo.coordinator.sync_policy import make_sync_policy
from megatron_dapo.runtime.net import LOOPBACK
from megatron_dapo.sync.broadcast import BroadcastTransport
from megatron_dapo.sync.errors import ServersLost, WeightSyncError
from megatron_dapo.sync.server_calls import LoopThread
from megatron_dapo.sync.transport import SyncStats

log = logging.getLogger(__name__)

READMIT_EVERY_S = 1.0  # how often a lost server is asked whether it answers again


@dataclass(frozen=True)
class WeightSnapshot:
    version: int
    tensors: tuple[tuple[str, torch.Tensor], ...]
    probe_logprobs: tuple[float, ...] | None = None  # the trainer's, for sync.verify

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


class WeightStore:
    def __init__(self):
        self._cv = threading.Condition()
        self._snap: WeightSnapshot | None = None
        self._readers: dict[int, int] = {}  # version -> syncs reading that snapshot

    def put(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor | None]],
        probe_logprobs: Sequence[float] | None = None,
    ) -> None:
        """Every trainer rank calls this (the export's gathers are collective); rank 0 keeps a host copy."""
        keep = not dist.is_initialized() or dist.get_rank() == 0
        if keep:
            with self._cv:  # at most two copies: the current snapshot (maybe being read) and the new one
                self._cv.wait_for(
                    lambda: self._snap is None or not any(n for v, n in self._readers.items() if v < self._snap.version)
                )
        tensors = []
        for name, t in named_tensors:
            if keep and t is not None:
                tensors.append((name, t.detach().to("cpu", copy=True)))
        if keep:
            if not tensors:
                raise RuntimeError("WeightStore.put: the weight iterator yielded no tensors")
            snap = WeightSnapshot(
                int(version),
                tuple(tensors),
                None if probe_logprobs is None else tuple(float(x) for x in probe_logprobs),
            )
            with self._cv:
                self._snap = snap

    def snapshot(self) -> WeightSnapshot | None:
        with self._cv:
            return self._snap

    def acquire(self) -> WeightSnapshot:
        """The current snapshot, for one server's sync; `release` it when the sync is over."""
        with self._cv:
            snap = self._snap
            self._readers[snap.version] = self._readers.get(snap.version, 0) + 1
            return snap

    def release(self, snap: WeightSnapshot) -> None:
        with self._cv:
            self._readers[snap.version] -= 1
            if not self._readers[snap.version]:
                del self._readers[snap.version]
            self._cv.notify_all()


class PerServerSync:
    def __init__(
        self,
        urls: Sequence[str],
        sync_cfg,
        registry: ServerRegistry,
        store: WeightStore,
        api_key: str | None = None,
        server_tp_sizes: Sequence[int] | None = None,
        master_address: str = LOOPBACK,  # where trainer rank 0 hosts each weight-update group's store
        timeout_s: float | None = None,  # each call of a sync (rollout.sync.timeout_s); default the transport's
        min_live: int = 1,  # fewer servers in service than this after a loss: the run stops (min_healthy_servers)
        probe: Sequence[int] | None = None,
        on_publish: Callable[[str, int], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        clock=time.monotonic,
    ):
        self.cfg, self.registry, self.store = sync_cfg, registry, store
        self.policy = make_sync_policy(sync_cfg, clock)
        tps = list(server_tp_sizes or [1] * len(urls))
        self.transports = {
            u.rstrip("/"): BroadcastTransport(
                [u],
                sync_cfg,
                api_key=api_key,
                server_tp_sizes=[tp],
                group_name=f"megatron_dapo_weight_sync_{i}",
                master_address=master_address,
                timeout_s=timeout_s,
                min_live=0,  # one server each: whether the run goes on is decided here, over all of them
            )
            for i, (u, tp) in enumerate(zip(urls, tps))
        }
        self.api_key, self.probe = api_key, list(probe) if probe is not None else None
        self.min_live = min_live
        self.on_publish, self.on_error = on_publish, on_error
        self.error: BaseException | None = None  # the first failure of any of the syncer's threads
        self._error_lock = threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, len(self.transports)), "server-sync")
        self._http: LoopThread | None = None
        self._clients = {}
        self._readmitting: set[str] = set()  # lost servers being asked (or re-admitted) now
        self._next_readmit: dict[str, float] = {}  # url -> monotonic time it may be asked again

    # ---- lifecycle -----------------------------------------------------------------------------
    def connect(self) -> None:
        for t in self.transports.values():
            t.connect()
        if self.cfg.policy == "status_based":
            self._open_load_clients()

    def _open_load_clients(self) -> None:
        from megatron_dapo.rollout.client import SGLangClient

        self._http = LoopThread()
        # the poller's timeout, no retries: a hung server must not hold the other servers' syncs
        self._clients = {
            u: SGLangClient(u, api_key=self.api_key, timeout_s=LOAD_TIMEOUT_S, retries=0) for u in self.transports
        }

    def sync_all(self) -> None:
        """Bring every server to the store's version now (before rollout starts), in parallel."""
        for url in self.transports:
            self.registry.begin_sync(url)
        snaps = {u: self.store.acquire() for u in self.transports}
        list(self._pool.map(lambda u: self._sync_one(u, snaps[u], raise_errors=True), list(self.transports)))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="per-server-sync", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """A new version is in the store."""
        self._wake.set()

    def check(self) -> None:
        """Raise the first failure of the syncer's threads, if any (the trainer calls this every step)."""
        if self.error is not None:
            raise WeightSyncError(f"per-server weight sync failed: {self.error!r}") from self.error

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self._pool.shutdown(wait=True)
        if self._http is not None:

            async def close_clients():
                for c in self._clients.values():
                    await c.aclose()

            self._http.run(close_clients(), 10)
            self._http.close()
        for t in self.transports.values():
            t.close()

    # ---- the policy loop -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a registry call or the policy failed: a failed run, not a silent stall
            self._fail(e)

    def _loop(self) -> None:
        interval = self.cfg.check_interval_ms / 1000.0
        while not self._stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            if self._stop.is_set() or self.error is not None:
                break
            snap = self.store.snapshot()
            if snap is None:
                continue
            statuses = self.registry.statuses()  # the servers in service
            self._readmit_down(set(self.transports) - {s.url for s in statuses})
            statuses = self._with_loads(statuses, snap.version)
            for url in self.policy.choose(statuses, snap.version):
                self.registry.begin_sync(url)
                self._pool.submit(self._sync_guarded, url, self.store.acquire())

    def _with_loads(self, statuses, latest: int):
        """status_based: each lagging server's own load (running, waiting, throughput, KV use)."""
        if self._http is None:
            return statuses
        lagging = [s for s in statuses if s.version < latest and not s.syncing]

        async def loads():
            return await asyncio.gather(*(self._clients[s.url].get_loads() for s in lagging), return_exceptions=True)

        unknown = set()
        for s, row in zip(lagging, self._http.run(loads(), 6 * LOAD_TIMEOUT_S) if lagging else []):
            if isinstance(row, BaseException):  # down or restarting: not chosen until it reports again
                log.warning("%s: no load report (%s); not syncing it this round", s.url, row)
                unknown.add(s.url)
                continue
            s.running, s.waiting, s.throughput, s.kv_cache = row.running, row.waiting, row.throughput, row.token_usage
        return [s for s in statuses if s.url not in unknown]

    def _readmit_down(self, down: set[str]) -> None:
        """Each server out of service (lost by its sync, or found restarted by the router), at most every
        READMIT_EVERY_S, on a pool thread: re-admitted if it answers."""
        now = time.monotonic()
        for url in down:
            if url not in self._readmitting and now >= self._next_readmit.get(url, 0.0):
                self._readmitting.add(url)
                self._next_readmit[url] = now + READMIT_EVERY_S
                self._pool.submit(self._readmit_guarded, url)

    def _readmit_guarded(self, url: str) -> None:
        """A server out of service that answers again: its group re-formed, the current weights, the logprob
        check (with sync.verify), then routing (`mark_up`); a failure is reported like a failed sync."""
        try:
            transport = self.transports[url]
            transport.readmit()
            if transport.live:  # answering (a lost one that does not stays out, asked again later)
                self.registry.begin_sync(url)
                self._sync_one(url, self.store.acquire(), readmitting=True)
        except BaseException as e:
            self._fail(e)
        finally:
            self._readmitting.discard(url)

    def _sync_guarded(self, url: str, snap) -> None:
        """`_sync_one` on a pool thread nobody joins: whatever it raises (the registry's end_sync,
        on_publish) is kept and reported like a failed sync."""
        try:
            self._sync_one(url, snap)
        except BaseException as e:
            self._fail(e)

    def _sync_one(self, url: str, snap, raise_errors: bool = False, readmitting: bool = False) -> None:
        transport = self.transports[url]
        version = None
        try:
            transport.readmit()  # restarted since its last sync (it holds no group): a new group first
            if not transport.live:
                lost = transport.lost
                raise ServersLost(f"{url}: {lost[url]}", dict(lost)) from transport.lost_causes.get(url)
            transport.sync(iter(snap.tensors), version=snap.version)
            if self.cfg.verify and self.probe is not None and snap.probe_logprobs is not None:
                transport.verify(self.probe, list(snap.probe_logprobs))
            version = snap.version
        except ServersLost as e:
            if raise_errors:
                raise
            self._lose(url, e)
        except BaseException as e:
            if raise_errors:
                raise
            self._fail(e)
        finally:
            self.store.release(snap)
            self.registry.end_sync(url, version)
            if readmitting and version is not None:  # checked: routed to again
                self.registry.mark_up(url, version)
                log.warning("rollout server %s re-admitted at weight version %d", url, version)
            self._wake.set()  # a server freed: the policy may choose again
        if self.on_publish is not None and version is not None:
            self.on_publish(url, version)

    def _lose(self, url: str, lost: ServersLost) -> None:
        """`url` failed its sync (gone or stalled): out of routing and of later syncs, the run goes on with
        the others while at least `min_live` are in service."""
        self.registry.mark_down(url, lost.reasons[url])
        live = [u for u, t in self.transports.items() if t.live]
        if len(live) < self.min_live:
            gone = "; ".join(f"{u}: {why}" for t in self.transports.values() for u, why in t.lost.items())
            error = WeightSyncError(
                f"{len(live)} rollout server(s) in service, fewer than rollout.min_healthy_servers="
                f"{self.min_live}; lost: {gone}"
            )
            error.__cause__ = lost
            self._fail(error)

    def _fail(self, e: BaseException) -> None:
        log.error("per-server weight sync failed: %r", e)
        with self._error_lock:
            first, self.error = self.error is None, self.error or e
        if first and self.on_error is not None:
            try:
                self.on_error(e)
            except Exception as report:  # check() still raises it on the trainer's next step
                log.error("per-server weight sync: reporting the failure failed: %r", report)


class PerServerStoreTransport:
    """The store and its syncer as one WeightTransport; `syncer` on trainer rank 0, None elsewhere."""

    def __init__(self, store: WeightStore, syncer: PerServerSync | None):
        self.store, self.syncer = store, syncer
        self._started = False

    def connect(self) -> None:
        if self.syncer is not None:
            self.syncer.connect()

    def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor | None]],
        version: int,
        probe_logprobs: Sequence[float] | None = None,  # the trainer's, for each server's check (sync.verify)
    ) -> SyncStats | None:
        """Store the weights of `version`; the first sync also brings every server to them (in parallel) and
        starts the policy loop. Raises a failure of the syncer's threads first (the trainer's next step)."""
        if self.syncer is not None:
            self.syncer.check()
        t0 = time.perf_counter()
        self.store.put(version, named_tensors, probe_logprobs)
        if self.syncer is None:
            return None
        snap = self.store.snapshot()
        stats = SyncStats(str(version), len(snap.tensors), snap.nbytes, 0, time.perf_counter() - t0)
        self.syncer.notify()
        if not self._started:  # every server starts from the trainer's weights, then follows its policy
            self._started = True
            self.syncer.sync_all()
            self.syncer.start()
        return stats

    def close(self) -> None:
        if self.syncer is not None:
            self.syncer.close()

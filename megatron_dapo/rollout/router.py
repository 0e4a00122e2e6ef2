"""Spread generation over N servers: least outstanding requests, sticky per prompt group, failover.

A prompt group (the n samples of one prompt) is pinned to one server, so the group shares that
server's prefix cache; a new group goes to the healthy server with the fewest requests in flight.
A request that fails on a server for a server-side reason (connection refused or lost, 5xx) counts
as a failure there and is sent again to another healthy server; after `max_failures` consecutive
failures a server is marked unhealthy and receives nothing until a background `/health` check passes
`recover_after` times in a row. A 4xx answer is our bug, not the server's: it is raised at once.

With a `registry` (megatron_dapo.coordinator.servers, per-server weight sync), a request of
trajectory version `min_version` goes only to a server that is not syncing and holds a version
>= min_version; when none does, it waits until the syncer publishes one.

The router knows which requests (given a `rid`) run where, so the coordinator can abort a group's
requests (`abort_group`: redundant or given-up groups) or every request of one server
(`migrate_from`: the groups pinned there are unpinned, so their continuations go elsewhere).

    router = Router(["http://127.0.0.1:30000", "http://127.0.0.1:30001"])
    async with router:
        async for sample in router.generate_group(prompt_ids, SamplingParams(n=8), group_id="p17"):
            ...  # samples arrive as they finish
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

from megatron_dapo.rollout.client import SGLangClient, SGLangConnectionError, SGLangHTTPError
from megatron_dapo.rollout.types import Sample, SamplingParams

log = logging.getLogger(__name__)


class NoHealthyServer(RuntimeError):
    pass


@dataclass
class ServerState:
    url: str
    client: SGLangClient
    outstanding: int = 0
    failures: int = 0
    healthy: bool = True
    health_passes: int = 0
    completed: int = 0
    stats: dict = field(default_factory=lambda: {"failovers_from": 0})
    slots: asyncio.Semaphore | None = None  # caps this server's in-flight /generate requests


@dataclass
class RunningRequest:
    server: ServerState
    group_id: str | None
    rids: list[str]  # what the server calls the request (a batch: one rid per entry)


def server_rids(rid: str | None, sampling) -> list[str]:
    """The rids a /generate carries (see payloads.generate_body); [] when it carries none."""
    if rid is None:
        return []
    if isinstance(sampling, SamplingParams):
        return [rid] if sampling.n == 1 else []
    return [f"{rid}-{i}" for i in range(len(sampling))]


class Router:
    def __init__(
        self,
        urls: Sequence[str],
        api_key: str | None = None,
        max_failures: int = 1,
        recover_after: int = 2,
        health_interval_s: float = 1.0,
        max_attempts: int | None = None,
        wait_for_healthy_s: float = 60.0,
        sticky_groups: int = 100_000,
        client_kwargs: dict | None = None,
        max_in_flight_per_server: int | None = None,
        registry=None,  # megatron_dapo.coordinator.servers.ServerRegistry
    ):
        if not urls:
            raise ValueError("Router needs at least one server URL")
        kw = dict(client_kwargs or {})
        kw.setdefault("retries", 1)  # the router fails over instead of hammering a dead server
        self.servers = [ServerState(u.rstrip("/"), SGLangClient(u, api_key=api_key, **kw)) for u in urls]
        if max_in_flight_per_server is not None:  # rollout.concurrency
            for s in self.servers:
                s.slots = asyncio.Semaphore(max_in_flight_per_server)
        self.max_failures, self.recover_after = max_failures, recover_after
        self.health_interval_s = health_interval_s
        self.max_attempts = max_attempts or 2 * len(self.servers) + 1
        self.wait_for_healthy_s = wait_for_healthy_s
        self._sticky: OrderedDict[str, ServerState] = OrderedDict()
        self._sticky_cap = sticky_groups
        self._health_task: asyncio.Task | None = None
        self._healthy_event: asyncio.Event | None = None
        self.registry = registry
        self._routable_event: asyncio.Event | None = None
        self._listener = None
        self._running: dict[int, RunningRequest] = {}  # in-flight /generate requests, by a serial number
        self._serial = 0

    # ---- lifecycle -----------------------------------------------------------------------------
    async def __aenter__(self) -> "Router":
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def start(self) -> None:
        if self._health_task is None:
            self._healthy_event = asyncio.Event()
            self._healthy_event.set()
            self._health_task = asyncio.create_task(self._health_loop())
        if self.registry is not None and self._listener is None:
            loop, self._routable_event = asyncio.get_running_loop(), asyncio.Event()
            self._listener = lambda: loop.call_soon_threadsafe(self._routable_event.set)
            self.registry.add_listener(self._listener)

    async def aclose(self) -> None:
        if self._listener is not None:
            self.registry.remove_listener(self._listener)
            self._listener = None
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
            self._health_task = None
        await asyncio.gather(*(s.client.aclose() for s in self.servers))

    # ---- choosing a server ---------------------------------------------------------------------
    def healthy(self) -> list[ServerState]:
        return [s for s in self.servers if s.healthy]

    def _routable(self, s: ServerState, min_version: int | None) -> bool:
        return self.registry is None or self.registry.routable(s.url, min_version)

    def _pick(self, group_id: str | None, exclude: set[str], min_version: int | None = None) -> ServerState | None:
        if group_id is not None:
            s = self._sticky.get(group_id)
            if s is not None and s.healthy and s.url not in exclude and self._routable(s, min_version):
                self._sticky.move_to_end(group_id)
                return s
        usable = [s for s in self.healthy() if self._routable(s, min_version)]
        candidates = [s for s in usable if s.url not in exclude] or usable
        if not candidates:
            return None
        s = min(candidates, key=lambda x: (x.outstanding, x.completed))
        if group_id is not None:
            self._sticky[group_id] = s
            self._sticky.move_to_end(group_id)
            while len(self._sticky) > self._sticky_cap:
                self._sticky.popitem(last=False)
        return s

    def _mark_failure(self, s: ServerState, err: Exception) -> None:
        s.failures += 1
        s.stats["failovers_from"] += 1
        if s.healthy and s.failures >= self.max_failures:
            s.healthy, s.health_passes = False, 0
            log.warning("server %s marked unhealthy after %d failure(s): %s", s.url, s.failures, err)
            if not self.healthy() and self._healthy_event is not None:
                self._healthy_event.clear()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            for s in [s for s in self.servers if not s.healthy]:
                if await s.client.health(timeout_s=max(1.0, self.health_interval_s)):
                    s.health_passes += 1
                    if s.health_passes >= self.recover_after:
                        s.healthy, s.failures = True, 0
                        log.warning("server %s healthy again", s.url)
                        self._healthy_event.set()
                else:
                    s.health_passes = 0

    async def _wait_any_healthy(self) -> None:
        if self.healthy():
            return
        try:
            await asyncio.wait_for(self._healthy_event.wait(), self.wait_for_healthy_s)
        except asyncio.TimeoutError:
            raise NoHealthyServer(f"no healthy server among {[s.url for s in self.servers]} "
                                  f"after {self.wait_for_healthy_s}s") from None

    # ---- generation ----------------------------------------------------------------------------
    async def _wait_routable(self, min_version: int | None) -> None:
        """Until the syncer publishes a change (a server routable again, or holding a newer version)."""
        self.registry.waiting(min_version, +1)
        try:
            await self._routable_event.wait()
        finally:
            self.registry.waiting(min_version, -1)

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams | None = None,
                       group_id: str | None = None, rid: str | None = None,
                       min_version: int | None = None) -> list[Sample]:
        """One /generate (n samples in one request), with failover; returns when all n are done.
        `min_version`: the request's V_traj (with a registry: only servers holding at least it)."""
        sampling = sampling or SamplingParams()
        tried: set[str] = set()
        last_err: Exception | None = None
        attempt = 0
        while attempt < self.max_attempts:
            await self._wait_any_healthy()
            if self._routable_event is not None:
                self._routable_event.clear()
            s = self._pick(group_id, tried, min_version)
            if s is None:
                if self.registry is not None and self.healthy():
                    await self._wait_routable(min_version)
                else:
                    attempt += 1
                continue
            n, attempt = attempt, attempt + 1
            s.outstanding += 1
            if self.registry is not None:
                self.registry.request_started(s.url)
            # A fresh rid per attempt: the failed server may still hold the old one.
            sent_rid = f"{rid or uuid.uuid4().hex}-a{n}" if n else rid
            self._serial += 1
            serial = self._serial
            try:
                async with s.slots or contextlib.nullcontext():
                    # tracked once it goes to the server (not while it waits for a concurrency slot here)
                    self._running[serial] = RunningRequest(s, group_id, server_rids(sent_rid, sampling))
                    samples = await s.client.generate(input_ids, sampling, rid=sent_rid)
            except (SGLangConnectionError, SGLangHTTPError) as e:
                if isinstance(e, SGLangHTTPError) and e.status is not None and e.status < 500:
                    raise
                last_err = e
                tried.add(s.url)
                self._mark_failure(s, e)
                continue
            finally:
                self._running.pop(serial, None)
                s.outstanding -= 1
                if self.registry is not None:
                    self.registry.request_ended(s.url)
            s.failures = 0
            s.completed += 1
            for smp in samples:
                smp.group_id = group_id
            return samples
        raise NoHealthyServer(f"request failed on every server tried ({sorted(tried)}): {last_err}")

    async def generate_group(self, input_ids: Sequence[int], sampling: SamplingParams,
                             group_id: str | None = None) -> AsyncIterator[Sample]:
        """The n samples of one prompt as n single requests on one server, yielded as each finishes."""
        group_id = group_id or uuid.uuid4().hex
        one = replace(sampling, n=1)

        async def one_sample(i: int) -> Sample:
            (smp,) = await self.generate(input_ids, one, group_id=group_id, rid=f"{group_id}-{i}")
            smp.index = i
            return smp

        tasks = [asyncio.ensure_future(one_sample(i)) for i in range(sampling.n)]
        try:
            for fut in asyncio.as_completed(tasks):
                yield await fut
        finally:
            for t in tasks:
                t.cancel()

    async def generate_groups(self, prompts: dict[str, Sequence[int]], sampling: SamplingParams
                              ) -> AsyncIterator[list[Sample]]:
        """Many groups at once; yields each group's n samples (sorted by index) when its last one finishes."""

        async def collect(gid, ids):
            return sorted([s async for s in self.generate_group(ids, sampling, gid)], key=lambda s: s.index)

        tasks = [asyncio.ensure_future(collect(g, ids)) for g, ids in prompts.items()]
        try:
            for fut in asyncio.as_completed(tasks):
                yield await fut
        finally:
            for t in tasks:
                t.cancel()

    # ---- aborting running requests ---------------------------------------------------------------
    def running_on(self, url: str) -> int:
        return sum(r.server.url == url for r in self._running.values())

    async def _abort(self, requests: list[RunningRequest]) -> int:
        """Abort the requests on their servers; they answer with finish_reason abort. A server that
        cannot be reached has lost them anyway."""
        calls = [(r.server, rid) for r in requests for rid in r.rids]
        answers = await asyncio.gather(*(s.client.abort_request(rid) for s, rid in calls), return_exceptions=True)
        for (s, rid), a in zip(calls, answers):
            if isinstance(a, BaseException):
                log.warning("abort of %s on %s failed: %s", rid, s.url, a)
        return len(calls)

    async def abort_group(self, group_id: str) -> int:
        """Abort every running request of the group; returns how many rids were aborted."""
        return await self._abort([r for r in self._running.values() if r.group_id == group_id])

    async def migrate_from(self, url: str) -> int:
        """Abort every running request on `url`, unpinning their groups (their continuations are
        placed anew); returns how many rids were aborted."""
        url = url.rstrip("/")
        for gid in [g for g, s in self._sticky.items() if s.url == url]:
            del self._sticky[gid]
        return await self._abort([r for r in self._running.values() if r.server.url == url])

    # ---- fan-out control -----------------------------------------------------------------------
    async def call_all(self, method: str, *args, healthy_only: bool = True, **kwargs) -> list:
        """Call client method `method` on every (healthy) server concurrently; returns the answers."""
        targets = self.healthy() if healthy_only else self.servers
        return await asyncio.gather(*(getattr(s.client, method)(*args, **kwargs) for s in targets))

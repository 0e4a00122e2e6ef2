"""Spread generation over N servers: least outstanding requests, sticky per prompt group, failover.

A prompt group (the n samples of one prompt) is pinned to one server, so the group shares that
server's prefix cache; a new group goes to the healthy server with the fewest requests in flight.
A request that fails on a server for a server-side reason (connection refused or lost, 5xx) counts
as a failure there and is sent again to another healthy server; after `max_failures` consecutive
failures a server is marked unhealthy and receives nothing until a background `/health` check passes
`recover_after` times in a row. A 4xx answer is our bug, not the server's: it is raised at once.

With a `registry` (megatron_dapo.coordinator.servers, per-server weight sync), a request of
trajectory version `min_version` goes only to a server that is not syncing and holds a version
>= min_version; when none does, it waits until the syncer publishes one. A continuation (partial
rollout) also needs the newest version among its tokens (`newest_version`): a trajectory never goes
back to older weights, so its tokens' versions never decrease.

Every request enters a queue (megatron_dapo.coordinator.queues: `fifo`, or `priority` by
trajectory version) and a dispatcher offers waiting requests to the routing policy
(megatron_dapo.coordinator.routing: `least_outstanding`, `request_num_balance`,
`throughput_optimal[_with_budget]`) over a view of the servers: version, health, requests in flight,
and load (the registry's last load report plus what the router admitted since,
coordinator/load_estimate.py). A request the policy refuses (admission control) waits; the
dispatcher runs again when a request arrives or ends, a server's version, syncing or load report
changes, or a server comes back. With the defaults (least_outstanding, fifo) every request is placed
at once, as before.

The router knows which requests (given a `rid`) run where, so the coordinator can abort a group's
requests (`abort_group`: redundant or given-up groups) or every request of one server
(`migrate_from`: the groups pinned there are unpinned, so their continuations are placed anew).
A continuation placed after a migration aborted its sample is not aborted by a migration again
before it ends: on a server that batches statically it may wait behind a whole batch without
producing a token, and partial rollout gives a sample up after a few aborts without progress.

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
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

from megatron_dapo.config.coordination import QueueConfig, RoutingConfig
from megatron_dapo.coordinator.groups import version_number
from megatron_dapo.coordinator.router_core import Dispatcher
from megatron_dapo.coordinator.routing import RouteRequest, ServerView, make_routing_policy
from megatron_dapo.rollout.client import SGLangClient, SGLangConnectionError, SGLangHTTPError
from megatron_dapo.rollout.types import Sample, SamplingParams
from megatron_dapo.types import RoutingShape

log = logging.getLogger(__name__)


class NoHealthyServer(RuntimeError):
    pass


@dataclass
class ServerState:
    url: str
    client: SGLangClient  # or anything with its generate / health / aclose (megatron_dapo.sim's engines)
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
    migrated: bool = False  # continues a sample a migration aborted: never migrated again


def server_rids(rid: str | None, sampling) -> list[str]:
    """The rids a /generate carries (see payloads.generate_body); [] when it carries none."""
    if rid is None:
        return []
    if isinstance(sampling, SamplingParams):
        return [rid] if sampling.n == 1 else []
    return [f"{rid}-{i}" for i in range(len(sampling))]


@dataclass(eq=False)
class _Ticket:
    """One attempt of a request, from the queue until the server answers (its key in the dispatcher)."""

    future: asyncio.Future  # -> the ServerState it was placed on, or None: no healthy server at all
    server: ServerState | None = None


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
        routing: RoutingConfig | None = None,
        queue: QueueConfig | None = None,
        cost_model=None,  # a CostModel instead of routing.cost_model's file (a simulator's)
        client_factory=SGLangClient,  # (url, api_key=..., **client_kwargs) -> client; the simulator's engines
        routed_experts: RoutingShape | None = None,  # routing replay: training samples carry their experts
    ):
        if not urls:
            raise ValueError("Router needs at least one server URL")
        kw = dict(client_kwargs or {})
        kw.setdefault("retries", 1)  # the router fails over instead of hammering a dead server
        self.servers = [ServerState(u.rstrip("/"), client_factory(u, api_key=api_key, **kw)) for u in urls]
        self.routed_experts = routed_experts
        if max_in_flight_per_server is not None:  # rollout.concurrency
            for s in self.servers:
                s.slots = asyncio.Semaphore(max_in_flight_per_server)
        self.max_failures, self.recover_after = max_failures, recover_after
        self.health_interval_s = health_interval_s
        self.max_attempts = max_attempts or 2 * len(self.servers) + 1
        self.wait_for_healthy_s = wait_for_healthy_s
        self._by_url = {s.url: s for s in self.servers}
        self._health_task: asyncio.Task | None = None
        self._healthy_event: asyncio.Event | None = None
        self.registry = registry
        self.policy = make_routing_policy(routing, max_in_flight_per_server, cost_model)
        self.dispatcher = Dispatcher(self.policy, queue, sticky_groups=sticky_groups)
        self._listener = None
        self._running: dict[int, RunningRequest] = {}  # requests sent to a server, by a serial number
        self._migrated: Counter = Counter()  # group -> its samples a migration aborted, not yet continued
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
            loop = asyncio.get_running_loop()
            self._listener = lambda: loop.call_soon_threadsafe(self._dispatch)
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

    @property
    def refusals(self) -> int:
        """Times the policy kept a request waiting (admission control)."""
        return self.dispatcher.refusals

    def _views(self) -> list[ServerView]:
        """Each server as the policy sees it: health and the router's counts, plus the registry's
        version, syncing and last load report when there is a registry."""
        known = {v.url: v for v in self.registry.route_views()} if self.registry is not None else {}
        views = []
        for s in self.servers:
            v = known.get(s.url) or ServerView(s.url)  # fresh objects: filled in place
            # healthy here and not marked down by the weight sync (the registry's view)
            v.healthy, v.outstanding, v.completed = s.healthy and v.healthy, s.outstanding, s.completed
            views.append(v)
        return views

    def _dispatch(self) -> None:
        """Place what the dispatcher can place now (no healthy server: the callers wait for one)."""
        if not len(self.dispatcher):
            return
        out = self.dispatcher.dispatch(self._views(), fail_unroutable=self.registry is None or not self.healthy())
        for t, url in out.placed:
            if t.future.done():  # its caller was cancelled before its _place could withdraw it
                self.dispatcher.finished(t)
                continue
            s = t.server = self._by_url[url]
            s.outstanding += 1
            if self.registry is not None:
                self.registry.request_started(url)
            t.future.set_result(s)
        for t in out.failed:
            t.future.set_result(None)

    def _release(self, t: _Ticket, generated: int) -> None:
        s = t.server
        s.outstanding -= 1
        report = None
        if self.registry is not None:
            report = self.registry.route_view(s.url)
            self.registry.request_ended(s.url)
        self.dispatcher.finished(t, generated, report)
        asyncio.get_running_loop().call_soon(self._dispatch)  # after the caller's own bookkeeping

    async def _place(
        self,
        input_ids: Sequence[int],
        sequences: int,
        group_id: str | None,
        min_version: int | None,
        newest_version: int | None,
        generated: int | None,
        validation: bool,
        tried: set[str],
    ) -> _Ticket | None:
        """Queue one attempt and wait until the dispatcher places it; None = no healthy server."""
        floor = max((v for v in (min_version, newest_version) if v is not None), default=None)
        req = RouteRequest(
            prompt_tokens=len(input_ids) - (generated or 0),
            generated_tokens=generated or 0,
            sequences=sequences,
            min_version=floor if self.registry is not None else None,
            resumed=generated is not None,
            exclude=frozenset(tried),
        )
        t = _Ticket(asyncio.get_running_loop().create_future())
        # priority queues order by V_traj (the staleness deadline), not by the version it may run at
        self.dispatcher.submit(t, req, group_id, v_traj=min_version or 0, validation=validation)
        if self.registry is not None:
            self.registry.waiting(floor, +1)  # what status_based sync asks: work held for a server
        placed = False
        try:
            self._dispatch()
            placed = await t.future is not None
            return t if placed else None
        finally:
            if self.registry is not None:
                self.registry.waiting(floor, -1)
            if not placed:
                if t.future.done() and not t.future.cancelled() and t.future.result() is not None:
                    self._release(t, 0)  # placed just as the caller was cancelled
                else:
                    self.dispatcher.cancel(t)

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
                        await self._check_restarted(s)
                        self._healthy_event.set()
                        self._dispatch()
                else:
                    s.health_passes = 0

    async def _check_restarted(self, s: ServerState) -> None:
        """A server back after failures may have been restarted (relaunched): then it holds the weights it
        started with, not the registry's version, and no update group. Out of routing (`mark_down`) until the
        trainer's weight sync re-admits it with the current weights (docs/operations.md)."""
        view = None if self.registry is None else self.registry.route_view(s.url)
        if view is None or not view.healthy or view.syncing:  # a sync under way changes its version anyway
            return
        try:
            held = (await s.client.get_model_info()).get("weight_version")
        except Exception:  # failing again: the next requests tell
            return
        expected = self.registry.version(s.url)
        if held is not None and version_number(held) != expected:
            self.registry.mark_down(s.url, f"restarted: holds weight version {held}, not {expected}")
            log.warning(
                "server %s was restarted (weight version %s, not %s): out of routing until re-admitted",
                s.url,
                held,
                expected,
            )

    async def _wait_any_healthy(self) -> None:
        if self.healthy():
            return
        try:
            await asyncio.wait_for(self._healthy_event.wait(), self.wait_for_healthy_s)
        except asyncio.TimeoutError:
            raise NoHealthyServer(
                f"no healthy server among {[s.url for s in self.servers]} after {self.wait_for_healthy_s}s"
            ) from None

    # ---- generation ----------------------------------------------------------------------------
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        group_id: str | None = None,
        rid: str | None = None,
        min_version: int | None = None,
        generated: int | None = None,
        newest_version: int | None = None,
        validation: bool = False,
    ) -> list[Sample]:
        """One /generate (n samples in one request), with failover; returns when all n are done.
        `min_version`: the request's V_traj (with a registry: only servers holding at least it).
        `generated`: set for a request that continues a trajectory (partial rollout): how many of
        `input_ids` it generated so far (the rest is the prompt); `newest_version`: the newest weight
        version among those tokens (with a registry: only servers holding at least it)."""
        sampling = sampling or SamplingParams()
        sequences = sampling.n if isinstance(sampling, SamplingParams) else len(sampling)
        tried: set[str] = set()
        last_err: Exception | None = None
        attempt = 0
        while attempt < self.max_attempts:
            await self._wait_any_healthy()
            t = await self._place(
                input_ids, sequences, group_id, min_version, newest_version, generated, validation, tried
            )
            if t is None:
                attempt += 1
                continue
            s, n, attempt = t.server, attempt, attempt + 1
            produced = 0
            # A fresh rid per attempt: the failed server may still hold the old one.
            sent_rid = f"{rid or uuid.uuid4().hex}-a{n}" if n else rid
            self._serial += 1
            serial = self._serial
            try:
                async with s.slots or contextlib.nullcontext():
                    # tracked once it goes to the server (not while it waits for a concurrency slot here)
                    self._running[serial] = RunningRequest(
                        s,
                        group_id,
                        server_rids(sent_rid, sampling),
                        migrated=generated is not None and self._continues_migrated(group_id),
                    )
                    samples = await s.client.generate(
                        input_ids, sampling, rid=sent_rid, **self._routing_request(input_ids, generated, validation)
                    )
                produced = sum(len(smp.output_ids) for smp in samples)
            except (SGLangConnectionError, SGLangHTTPError) as e:
                if isinstance(e, SGLangHTTPError) and e.status is not None and e.status < 500:
                    raise
                last_err = e
                tried.add(s.url)
                self._mark_failure(s, e)
                continue
            finally:
                self._running.pop(serial, None)
                self._release(t, produced)
            s.failures = 0
            s.completed += 1
            for smp in samples:
                smp.group_id = group_id
            return samples
        raise NoHealthyServer(f"request failed on every server tried ({sorted(tried)}): {last_err}")

    def _routing_request(self, input_ids: Sequence[int], generated: int | None, validation: bool) -> dict:
        """The routed-experts arguments of a training request: a continuation (partial rollout) asks from
        the last position its earlier pieces did not cover, so the pieces join in token order (one that
        continues no token asks for all: its earlier piece may never have been fed to the model)."""
        if self.routed_experts is None or validation:
            return {}
        start = len(input_ids) - 1 if generated else 0
        return {"routing": self.routed_experts, "routed_experts_start_len": start}

    async def generate_group(
        self, input_ids: Sequence[int], sampling: SamplingParams, group_id: str | None = None
    ) -> AsyncIterator[Sample]:
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

    async def generate_groups(
        self, prompts: dict[str, Sequence[int]], sampling: SamplingParams
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

    def protected_on(self, url: str) -> int:
        """Sequences on `url` that `migrate_from` would not abort (continuations of earlier migrations)."""
        return sum(len(r.rids) for r in self._running.values() if r.migrated and r.server.url == url)

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
        self._migrated.pop(group_id, None)  # given up: no continuations will come
        return await self._abort([r for r in self._running.values() if r.group_id == group_id])

    def _continues_migrated(self, group_id: str | None) -> bool:
        """A continuation of `group_id` is being sent: is it one of a sample a migration aborted?"""
        if group_id is None or not self._migrated.get(group_id):
            return False
        self._migrated[group_id] -= 1
        if not self._migrated[group_id]:
            del self._migrated[group_id]
        return True

    async def migrate_from(self, url: str) -> int:
        """Abort every running request on `url` except continuations of earlier migrations (they
        run until they end), unpinning the groups pinned there (their continuations are placed
        anew); returns how many rids were aborted."""
        url = url.rstrip("/")
        self.dispatcher.unpin(url)
        chosen = [r for r in self._running.values() if r.server.url == url and not r.migrated]
        for r in chosen:
            if r.group_id is not None:
                self._migrated[r.group_id] += len(r.rids)
        return await self._abort(chosen)

    # ---- fan-out control -----------------------------------------------------------------------

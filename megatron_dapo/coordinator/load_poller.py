"""Keeps each rollout server's own load in the ServerRegistry: polls `/v1/loads` every interval.

Runs in a thread of its own with its own event loop, so that neither the router's loop nor the
trainer waits on a slow server; each server is polled on its own cadence (the next poll one interval
after the previous one started, or as soon as a slow answer came), its answer or failure written to
the registry at once. A server that does not answer keeps its last report, marked with `load_error`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from megatron_dapo.coordinator.servers import ServerRegistry
from megatron_dapo.rollout.client import SGLangClient, SGLangError

log = logging.getLogger(__name__)

# Poll period when rollout.loads.interval_ms is 0 but the routing policy needs the servers' loads.
DEFAULT_INTERVAL_S = 0.2
LOAD_ROUTING = ("request_num_balance", "throughput_optimal", "throughput_optimal_with_budget")


def poll_interval_s(rollout_cfg) -> float | None:
    """Seconds between polls for this rollout config, or None when nothing needs the loads."""
    if rollout_cfg.loads.interval_ms > 0:
        return rollout_cfg.loads.interval_ms / 1000.0
    routing = getattr(rollout_cfg, "routing", None)
    if getattr(routing, "method", None) in LOAD_ROUTING:
        return DEFAULT_INTERVAL_S
    return None


# a load report is a small JSON read: a server that takes longer is treated as not reporting this round
LOAD_TIMEOUT_S = 5.0


class LoadPoller:
    def __init__(
        self,
        registry: ServerRegistry,
        interval_s: float,
        api_key: str | None = None,
        timeout_s: float = LOAD_TIMEOUT_S,
        client_factory: Callable[..., SGLangClient] = SGLangClient,
    ):
        if interval_s <= 0:
            raise ValueError(f"load poller: interval_s must be > 0, got {interval_s}")
        self.registry, self.interval_s = registry, interval_s
        self._client_kwargs = {"api_key": api_key, "timeout_s": timeout_s, "retries": 0}
        self._client_factory = client_factory
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="load-poller", daemon=True)
        self.polls = {url: 0 for url in registry.urls}  # polls made per server (answered or not)

    def start(self) -> "LoadPoller":
        self._thread.start()
        self._ready.wait()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def __enter__(self) -> "LoadPoller":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _main(self) -> None:
        asyncio.run(self.run())

    async def run(self) -> None:
        """The polling loops until `stop()`. `start()` runs them on their own thread; a caller owning
        an event loop (the simulator, on virtual time) may run this as a task there instead."""
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        clients = {url: self._client_factory(url, **self._client_kwargs) for url in self.registry.urls}
        try:  # one loop per server: a slow one never delays the others' reports
            await asyncio.gather(*(self._poll_loop(url, c) for url, c in clients.items()))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients.values()), return_exceptions=True)

    async def _poll_loop(self, url: str, client: SGLangClient) -> None:
        while not self._stop.is_set():
            started = self._loop.time()  # the loop's clock: monotonic, or the simulator's virtual time
            await self._poll_one(url, client)
            self.polls[url] += 1
            wait = self.interval_s - (self._loop.time() - started)
            if wait > 0:
                try:
                    await asyncio.wait_for(self._stop.wait(), wait)
                except asyncio.TimeoutError:
                    pass

    async def _poll_one(self, url: str, client: SGLangClient) -> None:
        try:
            load = await client.get_loads()
        except (SGLangError, asyncio.TimeoutError) as e:
            if self.registry.records[url].load_error is None:
                log.warning("%s: no load report (%s); keeping its last one", url, e)
            self.registry.load_failed(url, str(e))
            return
        self.registry.update_load(url, load)

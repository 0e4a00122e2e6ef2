"""Trainer rank 0's coordinator client that outlives the coordinator: a dead coordinator is started again
from what rank 0 kept of it, and the call that met its death goes on.

    coord = RestartingCoordinator(lambda: start_coordinator(cfg, urls), max_restarts=3,
                                  abort_servers=..., resume_hint=...)

After every `take_step` (and `checkpoint_state`) rank 0 keeps the coordinator's `snapshot`: the data
position, the completed groups not yet trained and the groups in flight with their partial samples,
taken *after* the step's batch left the producer; after every change of the registry it keeps the
registry's `state` (each server's version and out-of-service mark); and it remembers the last version set.
When a call finds the coordinator gone (`CoordinatorGone`, raised by the transport only), the servers'
requests are aborted (the dead coordinator's, still generating), a new coordinator is started, set up
and given the snapshot, the registry state and the version, started if the old one was, and the call is
made again on it. So a sample trained before the death is never trained again (the snapshot was taken
after it left) and none is lost (the groups in flight, and the draws after them, are in the snapshot):
what the dead one generated after its last snapshot is generated again. At most `max_restarts` restarts
in a run; then `CoordinatorLost` names what died and where the run can resume from.

Thread-safe: the per-server syncer's threads call the registry beside the loop's calls; one restart
serves every thread that met the same death.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from megatron_dapo.coordinator.process import CoordinatorClient, declared
from megatron_dapo.errors import CoordinatorGone, CoordinatorLost

log = logging.getLogger(__name__)

# registry calls that change what a restarted coordinator's registry must hold
REGISTRY_CHANGES = frozenset({"begin_sync", "end_sync", "mark_down", "mark_up", "publish_all", "load_state"})


def abort_every_request(urls: list[str], api_key: str | None = None, timeout_s: float = 30.0) -> None:
    """`/abort_request` with abort_all on every server (what a dead coordinator left generating); a server
    that does not answer is logged and skipped (it may be the one the weight sync lost)."""
    from megatron_dapo.rollout.client import SGLangClient

    async def abort(url):
        async with SGLangClient(url, api_key=api_key, timeout_s=timeout_s, retries=0) as c:
            await c.abort_request(abort_all=True)

    async def every():
        results = await asyncio.gather(*(abort(u) for u in urls), return_exceptions=True)
        for url, r in zip(urls, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("abort of the dead coordinator's requests on %s failed: %r", url, r)

    asyncio.run(every())


class _RestartingRegistry:
    """The coordinator's registry as `RestartingCoordinator.registry`: its declared calls, each through
    the restart logic (a per-server syncer holds this object across restarts)."""

    def __init__(self, owner: RestartingCoordinator):
        self._owner = owner

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        declared("registry", name)
        owner = self._owner

        def call(*args, **kwargs):
            return owner.call("registry", name, *args, **kwargs)

        call.__name__ = name
        return call


class RestartingCoordinator:
    """The coordinator's declared calls (as `CoordinatorClient`), surviving up to `max_restarts` deaths.

    `start_client()` starts a coordinator and returns its client; `abort_servers()` aborts every request
    on the servers; `resume_hint()` says where the run can resume from (for `CoordinatorLost`)."""

    def __init__(
        self,
        start_client: Callable[[], CoordinatorClient],
        max_restarts: int,
        abort_servers: Callable[[], None],
        resume_hint: Callable[[], str],
    ):
        self._start_client, self.max_restarts = start_client, max_restarts
        self._abort_servers, self._resume_hint = abort_servers, resume_hint
        self._client = start_client()
        self._generation = 0  # which client: bumped by each restart
        self._restart_lock = threading.Lock()
        self._kept_lock = threading.Lock()  # a registry change and its state fetch, in one piece
        self.restarts = 0
        self.registry = _RestartingRegistry(self)
        # what a restarted coordinator is given (None: nothing to give yet)
        self._snapshot: tuple[str, dict, int | None] | None = None  # (label, state, next step)
        self._registry_state: dict | None = None
        self._version: int | None = None
        self._started = False

    @property
    def where(self) -> str:
        return self._client.where

    # ---- the calls rank 0 makes ------------------------------------------------------------------
    def setup(self) -> dict:
        return self.call("coordinator", "setup")

    def restore(self, found: str, state: dict, next_step: int) -> None:
        self.call("coordinator", "restore", found, state, next_step)
        self._snapshot = (found, state, next_step)

    def start(self) -> None:
        self.call("coordinator", "start")
        self._started = True

    def take_step(self, step: int, dp_size: int):
        data = self.call("coordinator", "take_step", step, dp_size)
        self._keep_snapshot(step + 1)
        return data

    def checkpoint_state(self, next_step: int | None) -> dict:
        state = self.call("coordinator", "checkpoint_state", next_step)
        self._snapshot = (self._label(next_step), state, next_step)  # holds next_step's batch, taken now
        return state

    def set_version(self, version: int) -> None:
        self.call("coordinator", "set_version", version)
        self._version = version if self._version is None else max(self._version, version)

    def __getattr__(self, name: str):  # the other declared calls (fail, validate, stop, snapshot)
        if name.startswith("_"):
            raise AttributeError(name)
        declared("coordinator", name)

        def call(*args, **kwargs):
            return self.call("coordinator", name, *args, **kwargs)

        call.__name__ = name
        return call

    def close(self) -> None:
        self._client.close()

    # ---- the restart logic -----------------------------------------------------------------------
    def call(self, target: str, name: str, *args, **kwargs):
        """Call `target.name` on the current coordinator; if it is gone, restart it and call again."""
        while True:
            generation, client = self._generation, self._client
            try:
                if target == "registry" and name in REGISTRY_CHANGES:
                    with self._kept_lock:
                        result = getattr(client.registry, name)(*args, **kwargs)
                        self._registry_state = client.registry.state()
                    return result
                proxy = client if target == "coordinator" else client.registry
                return getattr(proxy, name)(*args, **kwargs)
            except CoordinatorGone as e:
                self._restart(generation, e)

    def _keep_snapshot(self, next_step: int) -> None:
        self._snapshot = (self._label(next_step), self.call("coordinator", "snapshot", next_step), next_step)

    @staticmethod
    def _label(next_step: int | None) -> str:
        return f"<the coordinator's state before step {next_step}, kept by trainer rank 0>"

    def _restart(self, generation: int, cause: CoordinatorGone) -> None:
        with self._restart_lock:
            if generation != self._generation:  # another thread restarted it already
                return
            dead = self._client.where
            while True:
                if self.restarts >= self.max_restarts:
                    self._lost(dead, f"{self.restarts} restart(s) did not keep it up: {cause}", cause)
                self.restarts += 1
                log.warning(
                    "rollout coordinator (%s) gone (%s): restart %d of %d",
                    dead,
                    cause,
                    self.restarts,
                    self.max_restarts,
                )
                try:
                    self._client = self._replacement_coordinator()
                except CoordinatorGone as e:  # the new one died too: another restart, within the budget
                    cause = e
                    continue
                except Exception as e:
                    self._lost(dead, f"a new one could not be started: {type(e).__name__}: {e}", e)
                self._generation += 1
                log.warning("rollout coordinator restarted: %s", self._client.where)
                return

    def _lost(self, dead: str, what: str, cause: BaseException):
        raise CoordinatorLost(
            f"the rollout coordinator ({dead}) died and {what} "
            f"(trainer.max_coordinator_restarts={self.max_restarts}); the run can resume from {self._resume_hint()}"
        ) from cause

    def _replacement_coordinator(self) -> CoordinatorClient:
        try:
            self._client.close()  # a process: terminated and reaped (it may be half alive)
        except Exception as e:
            log.warning("closing the dead coordinator: %r", e)
        self._abort_servers()
        client = self._start_client()
        try:
            client.setup()
            if self._snapshot is not None:
                client.restore(*self._snapshot)
            if self._registry_state is not None:
                client.registry.load_state(self._registry_state)
            if self._version is not None:
                client.set_version(self._version)
            if self._started:
                client.start()
        except BaseException:
            client.close()
            raise
        return client

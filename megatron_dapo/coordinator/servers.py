"""Each rollout server's weight version and routing state, shared across threads.

The router (the producer's event loop) asks which servers may take a request of trajectory version
V_traj (`routable`: not syncing, version >= V_traj) and reports requests starting and ending; the
per-server syncer (its own thread) takes a server out of routing while it loads new weights
(`begin_sync`) and publishes the version it holds afterwards (`end_sync`); the trainer reads the
per-server metrics. Listeners are called, from whichever thread made the change, whenever a server
may have become routable, so a request waiting for one can go on.

Each server's own load (running and waiting requests, KV tokens in use and capacity, recent generation
throughput) comes from its /v1/loads report: the load poller (coordinator/load_poller.py, its own
thread) writes it with `update_load`; routing policies read it with `route_views`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from megatron_dapo.coordinator.routing import ServerView
from megatron_dapo.coordinator.sync_policy import ServerStatus
from megatron_dapo.rollout.types import ServerLoad

LOAD_METRICS = ("running", "waiting", "kv_tokens", "kv_capacity", "throughput")


@dataclass
class ServerRecord:
    url: str
    version: int
    outstanding: int = 0  # requests the router has in flight there
    syncing: bool = False
    syncs: int = 0
    sync_s: float = 0.0  # time spent out of routing, loading weights
    idle_s: float = 0.0  # time with nothing in flight and not syncing
    last: float = 0.0  # clock() of the last accounting
    sync_started: float = 0.0
    # the server's last /v1/loads report (load_time is None until the first one)
    running: int = 0  # requests in its running batch
    waiting: int = 0  # requests queued at the server
    kv_tokens: int = 0  # KV tokens in use
    kv_capacity: int = 0  # most KV tokens it can hold (max total tokens)
    throughput: float = 0.0  # generated tokens per second, recent
    load_time: float | None = None  # clock() when the report arrived
    load_error: str | None = None  # why the latest poll got no report (the values above are older)
    down: str | None = None  # why the trainer's weight sync left it out (`mark_down`); None = in service


class ServerRegistry:
    def __init__(self, urls: Sequence[str], version: int = 0, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        now = clock()
        self.records = {u.rstrip("/"): ServerRecord(u.rstrip("/"), version, last=now) for u in urls}
        self.urls = list(self.records)
        self._waiting: Counter = Counter()  # V_traj -> requests at the router waiting for a routable server
        self._listeners: list[Callable[[], None]] = []
        self._events: list[dict] = []  # completed syncs not yet taken by `take_events`

    def add_listener(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    def _notify(self) -> None:
        for fn in list(self._listeners):
            fn()

    def _account(self, r: ServerRecord) -> None:
        now = self.clock()
        if r.outstanding == 0 and not r.syncing:
            r.idle_s += now - r.last
        r.last = now

    # ---- routing (the router) ------------------------------------------------------------------
    def routable(self, url: str, min_version: int | None) -> bool:
        with self._lock:
            r = self.records[url]
            return r.down is None and not r.syncing and (min_version is None or r.version >= min_version)

    def version(self, url: str) -> int:
        with self._lock:
            return self.records[url].version

    def request_started(self, url: str) -> None:
        with self._lock:
            r = self.records[url]
            self._account(r)
            r.outstanding += 1

    def request_ended(self, url: str) -> None:
        with self._lock:
            r = self.records[url]
            self._account(r)
            r.outstanding -= 1

    def waiting(self, v_traj: int | None, delta: int) -> None:
        """A request of version `v_traj` starts (+1) or stops (-1) waiting for a routable server."""
        with self._lock:
            self._waiting[v_traj or 0] += delta

    # ---- loads (the load poller) ----------------------------------------------------------------
    def update_load(self, url: str, load: ServerLoad) -> None:
        with self._lock:
            r = self.records[url]
            r.running, r.waiting, r.kv_tokens = load.running, load.waiting, load.kv_tokens
            r.kv_capacity, r.throughput = load.kv_capacity, load.throughput
            r.load_time, r.load_error = self.clock(), None
        self._notify()  # a server with room again may take a waiting request

    def load_failed(self, url: str, error: str) -> None:
        """The latest poll of `url` got no report; its last values stay, marked by `load_error`."""
        with self._lock:
            self.records[url].load_error = error

    # ---- syncing (the syncer) ------------------------------------------------------------------
    def begin_sync(self, url: str) -> None:
        """Stop routing to `url`: it is about to load new weights."""
        with self._lock:
            r = self.records[url]
            if r.syncing:
                raise RuntimeError(f"{url} is already syncing")
            self._account(r)
            r.syncing, r.sync_started = True, self.clock()

    def end_sync(self, url: str, version: int | None) -> None:
        """`url` loaded `version` (None: the sync failed, it keeps its version); route to it again."""
        with self._lock:
            r = self.records[url]
            self._account(r)
            r.syncing = False
            r.sync_s += self.clock() - r.sync_started
            if version is not None:
                r.version, r.syncs = version, r.syncs + 1
                self._events.append(
                    {"server": self.urls.index(url), "version": version, "start": r.sync_started, "end": self.clock()}
                )
        self._notify()

    def mark_down(self, url: str, reason: str) -> None:
        """The weight sync lost `url` (unreachable, or stalled past rollout.sync.timeout_s): it holds no
        current weights from now on, so it gets no request and no sync."""
        with self._lock:
            r = self.records[url]
            self._account(r)
            r.down, r.syncing = reason, False
        self._notify()  # requests waiting for it may go elsewhere

    def mark_up(self, url: str, version: int) -> None:
        """`url`, marked down before, came back and holds `version` now (the trainer's sync re-admitted it,
        its logprobs checked): it gets requests and syncs again."""
        with self._lock:
            r = self.records[url]
            self._account(r)
            r.down, r.version = None, version
        self._notify()  # requests waiting for a routable server may go there

    def publish_all(self, version: int, seconds: float = 0.0) -> None:
        """Every server in service loaded `version` together (all_at_once)."""
        with self._lock:
            for r in self.records.values():
                if r.down is not None:
                    continue
                self._account(r)
                r.version, r.syncs, r.sync_s = version, r.syncs + 1, r.sync_s + seconds
        self._notify()

    # ---- what a restarted coordinator resumes from ---------------------------------------------------
    def state(self) -> dict:
        """Each server's version, and why it is out of service if it is: what the registry of a restarted
        coordinator needs so that routing and syncs go on as before (loads are polled again)."""
        with self._lock:
            return {r.url: {"version": r.version, "down": r.down} for r in self.records.values()}

    def load_state(self, state: dict) -> None:
        """The versions and out-of-service marks of `state()`; a server it does not name is a ValueError."""
        with self._lock:
            if unknown := set(state) - set(self.records):
                raise ValueError(f"registry state names servers this run does not have: {sorted(unknown)}")
            for url, saved in state.items():
                r = self.records[url]
                r.version, r.down = int(saved["version"]), saved["down"]
        self._notify()

    # ---- views ---------------------------------------------------------------------------------
    def max_version(self) -> int:
        with self._lock:
            return max(r.version for r in self.records.values())

    def records_snapshot(self) -> list[ServerRecord]:
        """A consistent copy of every server's record (version, routing state, last load report)."""
        with self._lock:
            return [replace(r) for r in self.records.values()]

    @staticmethod
    def _view(r: ServerRecord) -> ServerView:
        return ServerView(
            r.url,
            version=r.version,
            healthy=r.down is None,
            syncing=r.syncing,
            running=r.running,
            waiting=r.waiting,
            kv_tokens=r.kv_tokens,
            kv_capacity=r.kv_capacity,
            load_time=r.load_time,
        )

    def route_view(self, url: str) -> ServerView:
        """Server `url` as routing sees it from here (version, syncing, last load report)."""
        with self._lock:
            return self._view(self.records[url])

    def route_views(self) -> list[ServerView]:
        """Every server as routing sees it from here, consistently: version, syncing and last load
        report (the router fills in its own counts). What the router reads on every dispatch, so
        built directly instead of from copied records."""
        with self._lock:
            return [self._view(r) for r in self.records.values()]

    def statuses(self) -> list[ServerStatus]:
        """The router's view of every server in service (one marked down syncs no more): running = the
        router's count in flight there; waiting, throughput and kv_cache from its last load report (a caller
        with fresher reports overwrites them)."""
        with self._lock:
            return [
                ServerStatus(
                    r.url,
                    r.version,
                    running=r.outstanding,
                    syncing=r.syncing,
                    routable=sum(n for v, n in self._waiting.items() if v <= r.version),
                    waiting=r.waiting,
                    throughput=r.throughput,
                    kv_cache=r.kv_tokens / r.kv_capacity if r.kv_capacity else 0.0,
                    kv_tokens=r.kv_tokens,
                )
                for r in self.records.values()
                if r.down is None
            ]

    def take_events(self) -> list[dict]:
        """Per-server syncs completed since the last call: server index, version, start and end times."""
        with self._lock:
            events, self._events = self._events, []
            return events

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = {}
            for i, r in enumerate(self.records.values()):
                self._account(r)
                out.update(
                    {
                        f"server/{i}/version": float(r.version),
                        f"server/{i}/syncs": float(r.syncs),
                        f"server/{i}/sync_s": r.sync_s,
                        f"server/{i}/idle_s": r.idle_s,
                        f"server/{i}/down": float(r.down is not None),
                    }
                )
                if r.load_time is not None:  # its last load report (rollout.loads)
                    out.update({f"server/{i}/{k}": float(getattr(r, k)) for k in LOAD_METRICS})
            return out

"""Relaunch the rollout servers a run launched when their process exits (`rollout.relaunch`).

One watcher thread per server: every `check_interval_s` it asks whether the process is alive; once it
is not, it waits a backoff (doubling per relaunch, capped), restarts it on its own port (same URL, so
the router, the registry and the weight sync know it by the same name) and waits until it is healthy.
A server that exits again after `max_relaunches` relaunches is given up, with a log line naming it:
no crash loop. Re-admission (its update group, the current weights, the logprob check, routing) is
the trainer's weight sync's job at its next sync point (megatron_dapo.sync.broadcast `readmit`).

A watched server is anything with `url`, `alive()` and `restart()`: a `ServerProcess`, or the Ray
launcher's handle on the actor owning one. Stop the supervisor before stopping the servers, or it
relaunches them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

log = logging.getLogger(__name__)


class Relaunchable(Protocol):
    url: str

    def alive(self) -> bool: ...

    def restart(self) -> None: ...  # start it again on its port; return once healthy, else raise


class ServerSupervisor:
    def __init__(
        self,
        servers: Sequence[Relaunchable],
        max_relaunches: int,
        check_interval_s: float = 1.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ):
        if max_relaunches < 1:
            raise ValueError(f"max_relaunches={max_relaunches} must be >= 1")
        self.servers = list(servers)
        self.max_relaunches = max_relaunches
        self.check_interval_s, self.backoff_s, self.max_backoff_s = check_interval_s, backoff_s, max_backoff_s
        self.relaunches = [0] * len(self.servers)  # per server, over the run
        self.given_up: set[int] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> "ServerSupervisor":
        self._threads = [
            threading.Thread(target=self._watch, args=(i,), name=f"server-supervisor-{i}", daemon=True)
            for i in range(len(self.servers))
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Relaunch nothing more (a relaunch under way finishes, within `timeout_s`)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)

    def _watch(self, i: int) -> None:
        server = self.servers[i]
        while not self._stop.wait(self.check_interval_s):
            try:
                if server.alive():
                    continue
            except Exception as e:  # whatever owns the process is gone (a Ray actor's node): nothing to restart
                log.error("rollout server %s given up: cannot tell whether it runs (%r)", server.url, e)
                self.given_up.add(i)
                return
            if self.relaunches[i] >= self.max_relaunches:
                log.error(
                    "rollout server %s given up: it exited again after %d relaunch(es) (rollout.relaunch_max)",
                    server.url,
                    self.relaunches[i],
                )
                self.given_up.add(i)
                return
            self._relaunch(i, server)

    def _relaunch(self, i: int, server: Relaunchable) -> None:
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** self.relaunches[i])
        self.relaunches[i] += 1
        log.warning(
            "rollout server %s exited; relaunching it in %.1f s (relaunch %d of %d)",
            server.url,
            delay,
            self.relaunches[i],
            self.max_relaunches,
        )
        if self._stop.wait(delay):
            return
        try:
            server.restart()
        except Exception as e:  # counted: the next check finds it not alive and tries again, or gives up
            log.error("rollout server %s: relaunch %d failed: %s", server.url, self.relaunches[i], e)
            return
        log.warning("rollout server %s relaunched and healthy; the next weight sync re-admits it", server.url)

"""The router's waiting room: requests wait here until a routing policy places them on a server.

Two policies (`rollout.queue.policy`):

- `fifo`: one queue in arrival order (what the router always did).
- `priority`: PSRL's multi-level queue (psrl/workers/agent_loop/request_queue.py,
  `MultiPriorityRequestQueue`): one queue per trajectory version V_traj for requests that resume a
  trajectory (partial rollout), and brand-new requests in a queue after all of them. Queues drain
  oldest version first, so the trajectories nearest their staleness deadline finish first and the
  staleness buffers do not get stuck waiting for them. Inside a queue, validation requests go first,
  then `order`: `id` (arrival), `short` or `long` (fewest / most tokens: prompt + generated so far).

Draining is strict: when the request at the head of the order cannot be placed, nothing after it
is routed in that pass (a newer request must not take the capacity an older one waits for). The
one exception is `fifo` and a request no server can take at all (no healthy server holds its
version): it waits for a sync without holding up the others, as requests always did.

Plain data structure, no I/O and no clock: the router (and a simulator) call `drain` whenever a
placement may have become possible.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from megatron_dapo.config.coordination import QueueConfig


class Placement(Enum):
    PLACED = "placed"  # the request went to a server: take it off the queue
    REFUSED = "refused"  # servers could take it but the policy says not now (admission control)
    UNROUTABLE = "unroutable"  # no server may take it at all (version, health)
    GONE = "gone"  # the request was cancelled while waiting: drop it


@dataclass
class QueuedRequest:
    v_traj: int  # the trajectory's version
    resumed: bool  # continues a trajectory (partial rollout); False = brand new
    tokens: int  # prompt + generated so far
    validation: bool = False
    item: Any = None  # the caller's handle (the router's ticket)
    id: int = field(default=-1)  # arrival number, set by `put`


def queue_key(req: QueuedRequest) -> tuple:
    """Which queue a request waits in under `priority`: resumed trajectories by version, new ones last."""
    return (0, req.v_traj) if req.resumed else (1, 0)


def order_key(req: QueuedRequest, order: str) -> tuple:
    """Position inside one queue under `priority` (smaller first)."""
    length = {"id": 0, "short": req.tokens, "long": -req.tokens}[order]
    return (not req.validation, length, req.id)


class RequestQueues:
    def __init__(self, cfg: QueueConfig | None = None):
        self.cfg = replace(cfg) if cfg is not None else QueueConfig()  # a checked copy
        self._ids = itertools.count()
        self._queues: dict[tuple, list[tuple[tuple, QueuedRequest]]] = {}

    def put(self, req: QueuedRequest) -> QueuedRequest:
        if req.id < 0:
            req.id = next(self._ids)
        if self.cfg.policy == "fifo":
            qkey, okey = (), (req.id,)
        else:
            qkey, okey = queue_key(req), order_key(req, self.cfg.order)
        heapq.heappush(self._queues.setdefault(qkey, []), (okey, req))
        return req

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[QueuedRequest]:
        """Every waiting request in drain order."""
        for qkey in sorted(self._queues):
            yield from (r for _, r in sorted(self._queues[qkey], key=lambda e: e[0]))

    def drain(self, place: Callable[[QueuedRequest], Placement]) -> int:
        """Offer waiting requests to `place` in priority order until one cannot be placed; returns
        how many were placed."""
        placed = 0
        skipped: list[QueuedRequest] = []
        try:
            for qkey in sorted(self._queues):
                q = self._queues[qkey]
                while q:
                    req = q[0][1]
                    outcome = place(req)
                    if outcome in (Placement.PLACED, Placement.GONE):
                        heapq.heappop(q)
                        placed += outcome is Placement.PLACED
                    elif outcome is Placement.UNROUTABLE and self.cfg.policy == "fifo":
                        skipped.append(heapq.heappop(q)[1])  # waits for a sync, holds nobody up
                    else:
                        return placed
        finally:
            for req in skipped:
                self.put(req)  # keeps its id, hence its place
            for qkey in [k for k, q in self._queues.items() if not q]:
                del self._queues[qkey]
        return placed

"""The router's decisions without its I/O: waiting requests, a routing policy, load estimates and
sticky groups, offered to the policy in queue order whenever a placement may have become possible.

The async router (megatron_dapo.coordinator.router) submits each request attempt under a key, calls
`dispatch` with a view of the servers (version, health, requests in flight, last load report), sends
the placed requests and reports each one's end with `finished`; a simulator does the same against
simulated engines. Within one `dispatch` every placement is counted before the next decision, so a
burst of requests spreads over the servers instead of all taking the one that looked idlest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from megatron_dapo.config.coordination import QueueConfig
from megatron_dapo.coordinator.load_estimate import LoadBook
from megatron_dapo.coordinator.queues import Placement, QueuedRequest, RequestQueues
from megatron_dapo.coordinator.routing import RouteRequest, ServerView, Verdict


def _with(obj, **changes):
    """`dataclasses.replace` for the plain dataclasses here (no init=False fields, no __post_init__),
    a quarter of its cost: a dispatch copies every server's view, and runs on every request end and
    every load report."""
    return type(obj)(**{**vars(obj), **changes})


@dataclass
class _Waiting:
    request: RouteRequest
    group_id: str | None


@dataclass
class Dispatched:
    """The outcome of one `dispatch`: (key, url) placements in order, and the keys given up."""

    placed: list[tuple[Hashable, str]]
    failed: list[Hashable]  # no server may take them and `fail_unroutable` was set


class Dispatcher:
    def __init__(self, policy, queue: QueueConfig | None = None, sticky_groups: int = 100_000):
        self.policy = policy
        self.queue = RequestQueues(queue)
        self.loads = LoadBook()
        self.refusals = 0  # times the policy kept a request waiting (admission control)
        self._waiting: dict[Hashable, _Waiting] = {}
        # group -> (its server, versions its requests were placed at)
        self._sticky: OrderedDict[str, tuple[str, frozenset[int]]] = OrderedDict()
        self._sticky_cap = sticky_groups
        # The last dispatch, when it placed and failed nothing: (its servers' values, fail_unroutable,
        # refusals it counted). Until a request is submitted, cancelled or ends, or a group is unpinned,
        # the same servers give the same outcome: the policy is a pure function of request and views.
        self._idle: tuple[list[tuple], bool, int] | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    def submit(
        self,
        key: Hashable,
        request: RouteRequest,
        group_id: str | None = None,
        v_traj: int | None = None,
        validation: bool = False,
    ) -> None:
        """Queue one request attempt; `v_traj` orders it in priority queues (default: min_version)."""
        v = v_traj if v_traj is not None else request.min_version or 0
        self._idle = None
        self._waiting[key] = _Waiting(request, group_id)
        self.queue.put(QueuedRequest(v, request.resumed, request.tokens, validation, item=key))

    def cancel(self, key: Hashable) -> None:
        """The caller gave up on a waiting request (dropped from the queue at the next dispatch)."""
        self._idle = None
        self._waiting.pop(key, None)

    def sticky(self, group_id: str | None) -> str | None:
        entry = self._sticky.get(group_id) if group_id is not None else None
        return entry[0] if entry else None

    def unpin(self, url: str) -> list[str]:
        """Forget the groups pinned to `url` (its requests are being migrated): their next requests
        are placed anew. Returns those groups."""
        self._idle = None
        groups = [g for g, (u, _) in self._sticky.items() if u == url]
        for g in groups:
            del self._sticky[g]
        return groups

    def dispatch(self, servers: Sequence[ServerView], fail_unroutable: bool = False) -> Dispatched:
        """Place waiting requests in queue order until one has to wait. `servers` carry the last load
        reports (running / waiting / kv_tokens as reported, `load_time` their stamp); the policy sees
        them with the admissions since added. `fail_unroutable`: give up requests no server may take
        (no healthy server at all) instead of keeping them."""
        out = Dispatched([], [])
        if not self._waiting:
            return out
        seen = [tuple(vars(s).values()) for s in servers]  # values, not the caller's (mutable) views
        if self._idle is not None and self._idle[0] == seen and self._idle[1] == fail_unroutable:
            # nothing changed since a dispatch that placed nothing (each load report and request end
            # asks again, often several per event-loop turn): its refusals, without deciding again
            self.refusals += self._idle[2]
            return out
        refusals = self.refusals
        reports = {s.url: s for s in servers}
        views = {url: self._estimate(s) for url, s in reports.items()}

        def place(queued: QueuedRequest) -> Placement:
            key = queued.item
            w = self._waiting.get(key)
            if w is None:
                return Placement.GONE
            stuck = self._sticky.get(w.group_id) if w.group_id is not None else None
            req = _with(
                w.request, sticky=stuck[0] if stuck else None, sibling_versions=stuck[1] if stuck else frozenset()
            )
            route = self.policy.choose(req, list(views.values()))
            if route.verdict is Verdict.PLACED:
                del self._waiting[key]
                self._admit(key, w, views[route.url])
                reports[route.url] = _with(reports[route.url], outstanding=reports[route.url].outstanding + 1)
                views[route.url] = self._estimate(reports[route.url])
                out.placed.append((key, route.url))
                return Placement.PLACED
            if route.verdict is Verdict.UNROUTABLE and fail_unroutable:
                del self._waiting[key]
                out.failed.append(key)
                return Placement.GONE
            if route.verdict is Verdict.REFUSED:
                self.refusals += 1
                return Placement.REFUSED
            return Placement.UNROUTABLE

        self.queue.drain(place)
        nothing = not out.placed and not out.failed
        self._idle = (seen, fail_unroutable, self.refusals - refusals) if nothing else None
        return out

    def finished(self, key: Hashable, generated: int = 0, server: ServerView | None = None) -> None:
        """A placed request ended (answered, aborted or failed) after generating `generated` tokens.
        `server`: its server's latest load report. A report that arrived before this end counts the
        request as running; the book reads reports lazily (at the next dispatch), so it must take it
        before the end, or the end is lost and the server keeps looking as loaded as before."""
        self._idle = None
        if server is not None:
            self._observe(server)
        self.loads.ended(key, generated)

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _observe(self, s: ServerView) -> None:
        self.loads.observe(s.url, s.load_time, s.running, s.waiting, s.kv_tokens)

    def _estimate(self, s: ServerView) -> ServerView:
        self._observe(s)
        running, waiting, kv_tokens = self.loads.load(s.url)
        placed = self.loads.placed_since(s.url)
        return _with(s, running=running, waiting=waiting, kv_tokens=kv_tokens, placed_since=placed)

    def _admit(self, key: Hashable, w: _Waiting, server: ServerView) -> None:
        req = w.request
        self.loads.admitted(key, server.url, req.sequences, req.sequences * self.policy.request_tokens(req))
        if w.group_id is not None:
            old = self._sticky.get(w.group_id)
            self._sticky[w.group_id] = (server.url, (old[1] if old else frozenset()) | {server.version})
            self._sticky.move_to_end(w.group_id)
            while len(self._sticky) > self._sticky_cap:
                self._sticky.popitem(last=False)

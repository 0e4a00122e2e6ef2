"""Each server's load as the router should assume it now: the engine's last report plus its own
admissions and completions since.

A load report (`/v1/loads`, polled into the ServerRegistry) is a snapshot taken some time ago;
requests the router placed after it are not in it. Like PSRL's cost-model router (it adds a routed
request's tokens and one running request at once, subtracts them when the request ends, and takes
the engine's numbers again at the next snapshot), the book adds each admitted request's sequences
and KV tokens to the last snapshot and forgets those deltas when a new snapshot arrives. A request
that was already in the snapshot and ends before the next one is subtracted with the tokens it
grew to. A sequence that ends on an engine whose snapshot showed sequences queued lets one of them
start (the engine admits from its own queue as room frees): the book moves one from waiting to
running instead of dropping one, so a queue the snapshot saw empties as the engine's requests end
rather than only at the next snapshot. Without any snapshot the book is the router's own count of
what it has in flight, and with one the estimate never drops below that count (a report taken just
before a request reached the engine does not make it disappear).

No I/O, no clock: the caller passes each snapshot's stamp (anything that changes per report).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass
class _Server:
    stamp: object = None  # of the snapshot the base numbers come from; None = no snapshot yet
    running: int = 0
    waiting: int = 0
    kv_tokens: float = 0.0
    d_running: int = 0  # admitted - ended since the snapshot
    d_waiting: int = 0  # - queued sequences assumed started since the snapshot (as running ones ended)
    d_kv: float = 0.0
    since: set = field(default_factory=set)  # requests admitted after the snapshot
    own_running: int = 0  # sequences the router has in flight there
    own_kv: float = 0.0  # and the KV tokens it charged them


@dataclass
class _Admitted:
    url: str
    sequences: int
    tokens: float  # KV tokens charged at admission (all sequences)


class LoadBook:
    def __init__(self):
        self._servers: dict[str, _Server] = {}
        self._requests: dict[Hashable, _Admitted] = {}

    def _server(self, url: str) -> _Server:
        return self._servers.setdefault(url, _Server())

    def observe(self, url: str, stamp: object, running: int, waiting: int, kv_tokens: float) -> None:
        """The engine's report `stamp` (a report seen before changes nothing)."""
        s = self._server(url)
        if stamp is None or stamp == s.stamp:
            return
        s.stamp, s.running, s.waiting, s.kv_tokens = stamp, running, waiting, kv_tokens
        s.d_running, s.d_waiting, s.d_kv = 0, 0, 0.0
        s.since.clear()  # the report is taken to include every request admitted so far

    def admitted(self, key: Hashable, url: str, sequences: int, tokens: float) -> None:
        """A request of `sequences` sequences and `tokens` KV tokens in all went to `url`."""
        s = self._server(url)
        self._requests[key] = _Admitted(url, sequences, tokens)
        s.d_running += sequences
        s.d_kv += tokens
        s.since.add(key)
        s.own_running += sequences
        s.own_kv += tokens

    def ended(self, key: Hashable, generated: float = 0.0) -> None:
        """The request finished (or failed) after generating `generated` tokens in all."""
        a = self._requests.pop(key, None)
        if a is None:
            return
        s = self._server(a.url)
        started = min(a.sequences, s.waiting + s.d_waiting)  # queued sequences taking the freed places
        s.d_waiting -= started
        s.d_running -= a.sequences - started
        s.own_running -= a.sequences
        s.own_kv -= a.tokens
        if key in s.since:  # not in the snapshot: take back exactly what was added
            s.since.discard(key)
            s.d_kv -= a.tokens
        else:  # in the snapshot, which saw it hold its prompt and part of its output
            s.d_kv -= a.tokens + generated

    def placed_since(self, url: str) -> int:
        """Sequences admitted to `url` after its last report (the report cannot show them queued yet)."""
        return sum(self._requests[k].sequences for k in self._server(url).since)

    def load(self, url: str) -> tuple[int, int, float]:
        """(running sequences, waiting sequences, resident KV tokens) to assume now."""
        s = self._server(url)
        running = max(s.running + s.d_running, s.own_running - s.waiting, 0)
        return running, s.waiting + s.d_waiting, max(s.kv_tokens + s.d_kv, s.own_kv, 0.0)

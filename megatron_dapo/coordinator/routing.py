"""Which server takes a request, or none for now: routing policies over a snapshot of the servers.

Pure decisions, after PSRL's route strategies (psrl deprecated/workers/agent_loop/route_strategy.py
and router.py `_choose_new_rollout_instance`, Somoku/psrl). `choose(request, servers)` sees one
`ServerView` per server (its version, health, the router's counts and its load: the engine's last
report plus the router's own estimate of what it admitted since, megatron_dapo.coordinator.
load_estimate) and returns a `Route`: a server, or REFUSED (admission control: servers could take
it but should not now; the request waits in the queue) or UNROUTABLE (no healthy, non-syncing
server holds a version >= the request's V_traj).

- `least_outstanding` (default): the group's sticky server if it may take the request, else the
  server with the fewest requests in flight (then fewest completed). Never refuses.
- `request_num_balance`: the server with the fewest sequences queued or running (engine report +
  own admissions); refuses when even that one has `rollout.concurrency` requests in flight.
- `throughput_optimal`: the cost model's marginal throughput. A request of m sequences of r tokens
  each (prompt + generated so far; m = 1 in PSRL, more when a whole group is one /generate) gains
      gain_i = T(n_i + m, K_i + m r) - T(n_i, K_i)
  on server i (T = n / L(n, K), config/cost_model.py; n_i running sequences, K_i resident KV
  tokens). Eligible servers are below the concurrency cap (`rollout.concurrency` requests in
  flight), have an empty waiting queue and KV room (an idle server is always eligible). Servers
  are grouped by `server_order`; in the first group with an eligible server the best gain is taken
  if gain >= delta_throughput_threshold * T(m, m r) (what the request would get on an idle
  server), else the next group is tried, else REFUSED. With a
  threshold <= 1 an idle server always accepts, so waiting requests cannot starve.
  When no server is eligible only because every one is saturated (own queue non-empty or KV
  full; none at the cap), the request is not held: it goes to its group's sticky server, else to
  the one with the fewest sequences queued (reported waiting + placed since that report). Held, it
  only waits while its siblings finish, and a group trains when its last sample ends (issue 25:
  the KV-saturated 512 x 16 setting, docs/design/advanced-coordination.md).
- `throughput_optimal_with_budget`: the same with the generated part rounded up to the next
  multiple of `request_budget` (r = prompt + ceil((generated + 1) / budget) * budget): a request is
  charged for the tokens it will grow into, not only those it has. (PSRL also re-counts the engine's
  K with each running request rounded so; a load report here has no per-request lengths, so K_i is
  the engine's own count plus the rounded charges of what the router placed since.)

Server order (`server_order`), as PSRL's candidate sort indicator:
- `version`: a brand-new request prefers the newest version; a resumed one (partial rollout) the
  oldest version it may use, leaving the newest servers to new work.
- `reserve_capability`: first the servers whose version equals one at which the request's group
  siblings already run (PSRL: the group can use its existing reservation entry, "without a new
  reserve entry"; here a group holds one staleness slot, so what this keeps together is the weight
  version of the group's tokens), then the `version` order. (PSRL's second key, the pending buffer a
  new entry would land in, does not apply: here V_traj and the slot are fixed when the group is
  dispatched, before routing.)
Every policy first offers the request to its group's sticky server (shared prefix cache) when that
server passes the policy's own test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from itertools import groupby

from megatron_dapo.config.coordination import RoutingConfig
from megatron_dapo.config.cost_model import CostModel


@dataclass
class ServerView:
    """What a policy knows of one server when it decides."""

    url: str
    version: int = 0
    healthy: bool = True
    syncing: bool = False
    outstanding: int = 0  # requests the router has in flight there
    completed: int = 0
    running: int = 0  # sequences the engine decodes (report + own admissions since)
    waiting: int = 0  # sequences queued in the engine
    kv_tokens: float = 0.0  # resident KV tokens (report + own admissions since)
    kv_capacity: float = 0.0  # max total tokens; 0 = unknown (no KV check)
    load_time: float | None = None  # when the load numbers were reported; None = never (own counts only)
    placed_since: int = 0  # sequences the router placed here after that report (in `running` above)


@dataclass
class RouteRequest:
    prompt_tokens: int
    generated_tokens: int = 0  # of the trajectory so far (a resumed request)
    sequences: int = 1  # m: samples this one /generate decodes
    min_version: int | None = None  # V_traj: only servers holding at least it
    resumed: bool = False
    sticky: str | None = None  # the server holding the group's siblings
    sibling_versions: frozenset[int] = frozenset()  # versions the group's siblings were routed at
    exclude: frozenset[str] = frozenset()  # servers that failed this request

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens


class Verdict(Enum):
    PLACED = "placed"
    REFUSED = "refused"
    UNROUTABLE = "unroutable"


@dataclass(frozen=True)
class Route:
    verdict: Verdict
    url: str | None = None


REFUSED, UNROUTABLE = Route(Verdict.REFUSED), Route(Verdict.UNROUTABLE)


def candidates(req: RouteRequest, servers: Sequence[ServerView]) -> list[ServerView]:
    """Healthy, not syncing, holding V_traj; servers that failed this request only if none else."""
    usable = [
        s for s in servers if s.healthy and not s.syncing and (req.min_version is None or s.version >= req.min_version)
    ]
    return [s for s in usable if s.url not in req.exclude] or usable


def order_key(req: RouteRequest, s: ServerView, server_order: str) -> tuple:
    """Smaller = preferred group of servers."""
    version = s.version if req.resumed else -s.version
    if server_order == "reserve_capability":
        return (s.version not in req.sibling_versions, version)
    return (version,)


class LeastOutstanding:
    def __init__(self, cfg: RoutingConfig | None = None, concurrency: int | None = None):
        self.cfg = cfg or RoutingConfig()

    def request_tokens(self, req: RouteRequest) -> int:
        """r: the KV tokens one sequence of the request is charged for (the router's load estimate)."""
        return req.tokens

    def choose(self, req: RouteRequest, servers: Sequence[ServerView]) -> Route:
        cands = candidates(req, servers)
        if not cands:
            return UNROUTABLE
        sticky = next((s for s in cands if s.url == req.sticky and s.url not in req.exclude), None)
        best = sticky or min(cands, key=lambda s: (s.outstanding, s.completed))
        return Route(Verdict.PLACED, best.url)


class RequestNumBalance(LeastOutstanding):
    def __init__(self, cfg: RoutingConfig, concurrency: int | None = None):
        super().__init__(cfg)
        self.cap = concurrency

    def load(self, s: ServerView) -> int:
        return s.running + s.waiting

    def has_room(self, s: ServerView) -> bool:
        """Below the concurrency cap (rollout.concurrency: /generate requests in flight per server)."""
        return self.cap is None or s.outstanding < self.cap

    def choose(self, req: RouteRequest, servers: Sequence[ServerView]) -> Route:
        cands = candidates(req, servers)
        if not cands:
            return UNROUTABLE
        sticky = next((s for s in cands if s.url == req.sticky), None)
        if sticky is not None and self.has_room(sticky):
            return Route(Verdict.PLACED, sticky.url)
        best = min(cands, key=lambda s: (self.load(s), s.outstanding, s.completed))
        return Route(Verdict.PLACED, best.url) if self.has_room(best) else REFUSED


class ThroughputOptimal(RequestNumBalance):
    def __init__(self, cfg: RoutingConfig, concurrency: int | None = None, model: CostModel | None = None):
        super().__init__(cfg, concurrency)
        if model is None and not cfg.cost_model:
            raise ValueError(
                f"rollout.routing.method={cfg.method} needs rollout.routing.cost_model "
                f"(the JSON written by `megatron-dapo profile-engine`)"
            )
        self.model = model or CostModel.load(cfg.cost_model)

    def gain(self, req: RouteRequest, s: ServerView) -> float:
        m, r = req.sequences, self.request_tokens(req)
        return self.model.throughput(s.running + m, s.kv_tokens + m * r) - self.model.throughput(s.running, s.kv_tokens)

    def threshold(self, req: RouteRequest) -> float:
        m, r = req.sequences, self.request_tokens(req)
        return self.cfg.delta_throughput_threshold * self.model.throughput(m, m * r)

    def eligible(self, req: RouteRequest, s: ServerView) -> bool:
        if not self.has_room(s):
            return False
        if s.running + s.waiting == 0:
            return True  # an idle server takes even a request larger than its KV estimate allows
        return s.waiting == 0 and (
            s.kv_capacity <= 0 or s.kv_tokens + req.sequences * self.request_tokens(req) <= s.kv_capacity
        )

    def accepts(self, req: RouteRequest, s: ServerView) -> bool:
        return self.eligible(req, s) and self.gain(req, s) >= self.threshold(req)

    def choose(self, req: RouteRequest, servers: Sequence[ServerView]) -> Route:
        cands = candidates(req, servers)
        if not cands:
            return UNROUTABLE
        sticky = next((s for s in cands if s.url == req.sticky), None)
        if sticky is not None and self.accepts(req, sticky):
            return Route(Verdict.PLACED, sticky.url)
        ranked = sorted(cands, key=lambda s: order_key(req, s, self.cfg.server_order))
        for _, group in groupby(ranked, key=lambda s: order_key(req, s, self.cfg.server_order)):
            eligible = [s for s in group if self.eligible(req, s)]
            if not eligible:
                continue
            best = max(eligible, key=lambda s: self.gain(req, s))  # first of equals: stable
            if self.gain(req, best) >= self.threshold(req):
                return Route(Verdict.PLACED, best.url)
        return self.keep_queued(req, cands)

    def queued(self, s: ServerView) -> int:
        """Sequences waiting in the engine's queue to assume now: the report's plus what the router placed
        since (on a saturated engine those queue too, until the next report says otherwise)."""
        return s.waiting + s.placed_since

    def keep_queued(self, req: RouteRequest, cands: Sequence[ServerView]) -> Route:
        """No server is eligible. If that is only because every one is saturated (its queue non-empty or
        its KV full; none at the concurrency cap), holding the request here gains nothing (each engine
        has work queued) and delays its group: a group trains only when its last sample ends. So it
        goes to its group's server (where its siblings run: the group's samples finish together), else
        to the least-queued one. Where a server is eligible but gains too little, or is at the cap, the
        refusal stands."""
        if not all(self.has_room(s) and not self.eligible(req, s) for s in cands):
            return REFUSED
        best = min(cands, key=lambda s: (s.url != req.sticky, self.queued(s), order_key(req, s, self.cfg.server_order)))
        return Route(Verdict.PLACED, best.url)


class ThroughputOptimalWithBudget(ThroughputOptimal):
    def request_tokens(self, req: RouteRequest) -> int:
        budget = self.cfg.request_budget
        return req.prompt_tokens + math.ceil((req.generated_tokens + 1) / budget) * budget


def make_routing_policy(
    cfg: RoutingConfig | None = None, concurrency: int | None = None, model: CostModel | None = None
):
    """The policy `cfg.method` names; `concurrency` = per-server cap on requests in flight
    (rollout.concurrency); `model` overrides the cost model file (a simulator's own). Works on a checked
    copy of `cfg`, as make_sync_policy does."""
    cfg = replace(cfg) if cfg is not None else RoutingConfig()
    if cfg.method == "least_outstanding":
        return LeastOutstanding(cfg)
    if cfg.method == "request_num_balance":
        return RequestNumBalance(cfg, concurrency)
    cls = ThroughputOptimal if cfg.method == "throughput_optimal" else ThroughputOptimalWithBudget
    return cls(cfg, concurrency, model)

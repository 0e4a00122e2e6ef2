"""The rollout-coordination sections of the config: `rollout.sync` (its policy part), `rollout.migration`,
`rollout.queue` and `rollout.routing`.

Each dataclass checks its own values in `__post_init__`, so the coordinator's policies, which run on
a checked copy (`dataclasses.replace`), refuse a bad value even in a config loaded without validation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

SYNC_POLICIES = ("all_at_once", "greedy", "status_based")
SYNC_INDICATORS = ("request_num", "throughput", "kv_cache")
QUEUE_POLICIES = ("fifo", "priority")
QUEUE_ORDERS = ("id", "short", "long")
ROUTING_METHODS = ("least_outstanding", "request_num_balance", "throughput_optimal", "throughput_optimal_with_budget")
SERVER_ORDERS = ("version", "reserve_capability")


@dataclass
class SyncPolicyConfig:
    """When each server takes new weights: the policy part of `rollout.sync` (the schema's SyncConfig
    adds how the weight transport moves the weights)."""

    # all_at_once = every server after each step, inline (the default); greedy = a server as soon as it
    # lags; status_based = a lagging server when idle enough (indicator <= threshold). greedy / status_based
    # serve each server from a host-memory weight store on trainer rank 0 (one update group per server)
    # while training goes on.
    policy: Literal["all_at_once", "greedy", "status_based"] = "all_at_once"
    indicator: Literal["request_num", "throughput", "kv_cache"] = "request_num"  # status_based load measure
    threshold: float = 0.0  # status_based: sync a lagging server when its indicator is <= this
    check_interval_ms: float = 100.0  # greedy / status_based: how often the servers are examined
    check_req_before_sync: bool = True  # status_based: not while the router holds requests it could serve

    def __post_init__(self):
        if self.policy not in SYNC_POLICIES:
            raise ValueError(f"rollout.sync.policy must be one of {', '.join(SYNC_POLICIES)}, got {self.policy!r}")
        if self.indicator not in SYNC_INDICATORS:
            raise ValueError(
                f"rollout.sync.indicator must be one of {', '.join(SYNC_INDICATORS)}, got {self.indicator!r}"
            )
        if not self.check_interval_ms > 0:  # also refuses NaN
            raise ValueError(f"rollout.sync.check_interval_ms={self.check_interval_ms} must be > 0")


@dataclass
class MigrationConfig:
    """`rollout.migration`: when a server is starved, abort every request of the most loaded one; partial
    rollout continues them on the least loaded servers. Checked every rollout.sync.check_interval_ms.
    Needs partial_rollout and at least two servers."""

    enabled: bool = False
    # load measure compared as a ratio busy / starved: request_num (running + waiting), throughput
    # (generated tokens/s) or kv_cache (fraction of KV in use; the last two read /v1/loads)
    indicator: Literal["request_num", "throughput", "kv_cache"] = "request_num"
    threshold: float = 5.0  # migrate when the ratio is above this
    stop_indicator: Literal["request_num", "throughput", "kv_cache"] = "request_num"
    stop_threshold: float = 10.0  # ... and the busy server's stop_indicator is at least this
    # a server counts as starved only after it has been so at every check for this long (0: at once, PSRL);
    # a just-synced or just-drained server is empty for a moment before the producer refills it
    min_starved_ms: float = 0.0

    def __post_init__(self):
        for name in ("indicator", "stop_indicator"):
            if getattr(self, name) not in SYNC_INDICATORS:
                raise ValueError(
                    f"rollout.migration.{name} must be one of {', '.join(SYNC_INDICATORS)}, got {getattr(self, name)!r}"
                )
        if not self.threshold >= 1:
            raise ValueError(f"rollout.migration.threshold={self.threshold} must be >= 1 (a load ratio)")
        if not self.stop_threshold >= 0:
            raise ValueError(f"rollout.migration.stop_threshold={self.stop_threshold} must be >= 0")
        if not self.min_starved_ms >= 0:  # also refuses NaN
            raise ValueError(f"rollout.migration.min_starved_ms={self.min_starved_ms} must be >= 0")

    @property
    def needs_loads(self) -> bool:
        """The servers' own load reports are needed (not only the router's request counts)."""
        return self.indicator != "request_num" or self.stop_indicator != "request_num"


@dataclass
class QueueConfig:
    """`rollout.queue`: the order requests wait in at the router."""

    # fifo: arrival order; priority: resumed trajectories by version (oldest first), new requests last
    policy: Literal["fifo", "priority"] = "fifo"
    order: Literal["id", "short", "long"] = "id"  # priority: inside a queue by arrival / fewest / most tokens

    def __post_init__(self):
        if self.policy not in QUEUE_POLICIES:
            raise ValueError(f"rollout.queue.policy must be one of {', '.join(QUEUE_POLICIES)}, got {self.policy!r}")
        if self.order not in QUEUE_ORDERS:
            raise ValueError(f"rollout.queue.order must be one of {', '.join(QUEUE_ORDERS)}, got {self.order!r}")
        if self.policy == "fifo" and self.order != "id":
            raise ValueError(
                f"rollout.queue.order={self.order!r} needs rollout.queue.policy=priority "
                f"(fifo serves requests in arrival order)"
            )


@dataclass
class RoutingConfig:
    """`rollout.routing`: which server takes each request; see docs/rollout-coordination.md."""

    # least_outstanding: fewest requests in flight; request_num_balance: fewest sequences running +
    # waiting, none above rollout.concurrency; throughput_optimal(_with_budget): largest marginal
    # throughput by the cost model, admitted only if >= delta_throughput_threshold of an idle server's
    method: Literal[
        "least_outstanding", "request_num_balance", "throughput_optimal", "throughput_optimal_with_budget"
    ] = "least_outstanding"
    delta_throughput_threshold: float = 0.5  # throughput_optimal*: in [0, 1]
    # throughput_optimal*: server groups tried in order: version (new requests newest version first,
    # resumed ones oldest allowed first) or reserve_capability (the group's siblings' version first)
    server_order: Literal["version", "reserve_capability"] = "version"
    request_budget: int = 1024  # throughput_optimal_with_budget: generated tokens rounded up to this
    cost_model: Optional[str] = None  # throughput_optimal*: JSON written by `megatron-dapo profile-engine`

    def __post_init__(self):
        if self.method not in ROUTING_METHODS:
            raise ValueError(f"rollout.routing.method must be one of {', '.join(ROUTING_METHODS)}, got {self.method!r}")
        if self.server_order not in SERVER_ORDERS:
            raise ValueError(
                f"rollout.routing.server_order must be one of {', '.join(SERVER_ORDERS)}, got {self.server_order!r}"
            )
        if not 0.0 <= self.delta_throughput_threshold <= 1.0:
            # above 1 even an idle server would refuse: requests would wait forever
            raise ValueError(
                f"rollout.routing.delta_throughput_threshold must be in [0, 1], got {self.delta_throughput_threshold}"
            )
        if self.request_budget < 1:
            raise ValueError(f"rollout.routing.request_budget must be >= 1, got {self.request_budget}")

"""When each rollout server takes the trainer's newest weights: per-server sync policies.

Pure decisions over a snapshot of the servers (`ServerStatus`), with an injectable clock, after
PSRL's sync strategies (psrl/workers/gen/rollout_coordination/sync_and_migrate):

- `all_at_once`: every server syncs together, and only when every one lags (today's behaviour:
  the trainer pushes to all servers after each step);
- `greedy`: a server syncs as soon as it lags behind the trainer;
- `status_based`: checked every `check_interval_ms`; a lagging server syncs only when its waiting
  queue is empty and its load indicator (`request_num` = running + waiting, `throughput` in
  tokens/s, or `kv_cache` fraction in use) is at or below `threshold`, and, with
  `check_req_before_sync`, while the router holds no request it could still serve at its version.

A server already syncing is never chosen again. These are decisions only: all_at_once is applied
inline by the training loop; greedy and status_based by megatron_dapo.sync.per_server, which stops
routing to the chosen server, pauses it, loads the stored weights, publishes its version.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from megatron_dapo.config.coordination import SYNC_INDICATORS, SyncPolicyConfig


@dataclass
class ServerStatus:
    url: str
    version: int  # weight version the server holds
    running: int = 0
    waiting: int = 0
    throughput: float = 0.0  # generated tokens per second, recent
    kv_cache: float = 0.0  # fraction of the KV cache in use
    kv_tokens: int = 0  # KV tokens of its running requests (its load report)
    syncing: bool = False
    routable: int = 0  # requests queued at the router that this server may serve at its version
    protected: int = 0  # of its requests, those a migration may not abort (continuing an earlier migration)

    def indicator(self, name: str) -> float:
        if name == "request_num":
            return float(self.running + self.waiting)
        if name == "throughput":
            return self.throughput
        if name == "kv_cache":
            return self.kv_cache
        raise ValueError(f"unknown sync indicator {name!r} (one of {', '.join(SYNC_INDICATORS)})")


def _lagging(servers: Sequence[ServerStatus], latest: int) -> list[ServerStatus]:
    return [s for s in servers if s.version < latest and not s.syncing]


class AllAtOnce:
    def __init__(self, cfg: SyncPolicyConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.clock = clock

    def choose(self, servers: Sequence[ServerStatus], latest: int) -> list[str]:
        if any(s.syncing for s in servers) or not all(s.version < latest for s in servers):
            return []
        return [s.url for s in servers]


class Greedy(AllAtOnce):
    def choose(self, servers: Sequence[ServerStatus], latest: int) -> list[str]:
        return [s.url for s in _lagging(servers, latest)]


class StatusBased:
    def __init__(self, cfg: SyncPolicyConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self._next_check = float("-inf")

    def choose(self, servers: Sequence[ServerStatus], latest: int) -> list[str]:
        now = self.clock()
        if now < self._next_check:
            return []
        self._next_check = now + self.cfg.check_interval_ms / 1000.0
        return [
            s.url
            for s in _lagging(servers, latest)
            if s.waiting == 0
            and s.indicator(self.cfg.indicator) <= self.cfg.threshold
            and not (self.cfg.check_req_before_sync and s.routable > 0)
        ]


def make_sync_policy(cfg: SyncPolicyConfig, clock: Callable[[], float] = time.monotonic):
    """The policy `cfg` names, on a checked copy (the loader sets fields one by one, so a config loaded
    without validation, as the simulator's, has not run the checks)."""
    cfg = replace(cfg)
    return {"all_at_once": AllAtOnce, "greedy": Greedy, "status_based": StatusBased}[cfg.policy](cfg, clock)

"""Request migration (PSRL's sync_and_migrate `mig`): move work off an overloaded server onto a starved one.

Checked every `rollout.sync.check_interval_ms` (PSRL evaluates sync and migration in one status
loop). A server is starved when it is not syncing, nothing waits in its queue and the router holds
no request it may serve at its version. For each starved server, every other server that is not
syncing and holds no newer version (so its requests, of V_traj <= its version, may run on the
starved one) gets the ratio indicator(it) / indicator(starved) (inf when the starved one's is 0 and
its own is not; 1 when both are 0), with `indicator` request_num (running + waiting), throughput
(generated tokens/s) or kv_cache (fraction of KV in use). The server with the largest ratio above
`threshold` is chosen if its `stop_indicator` is at least `stop_threshold` (too little work left is
not worth the re-prefill). The caller aborts all its requests; partial rollout continues them, the
router re-placing them (sticky pins to the source dropped) on the least loaded servers.
PSRL: `SyncAndMigrateMixin._check_should_migrate` (one source per check).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_dapo.coordinator.sync_policy import INDICATORS, ServerStatus


@dataclass
class MigrationPolicyConfig:
    indicator: str = "request_num"
    threshold: float = 5.0
    stop_indicator: str = "request_num"
    stop_threshold: float = 10.0

    def __post_init__(self):
        for name in ("indicator", "stop_indicator"):
            if getattr(self, name) not in INDICATORS:
                raise ValueError(f"rollout.migration.{name} must be one of {', '.join(INDICATORS)}, "
                                 f"got {getattr(self, name)!r}")
        if self.threshold < 1:
            raise ValueError(f"rollout.migration.threshold={self.threshold} must be >= 1 (a load ratio)")
        if self.stop_threshold < 0:
            raise ValueError(f"rollout.migration.stop_threshold={self.stop_threshold} must be >= 0")

    @property
    def needs_loads(self) -> bool:
        """The servers' own load reports are needed (not only the router's request counts)."""
        return self.indicator != "request_num" or self.stop_indicator != "request_num"


@dataclass
class Migration:
    source: str  # the server whose requests are aborted
    starved: str
    ratio: float
    at: float


def _ratio(src: float, starved: float) -> float:
    if starved == 0:
        return float("inf") if src > 0 else 1.0
    return src / starved


def starved(s: ServerStatus) -> bool:
    return not s.syncing and s.waiting == 0 and s.routable == 0


class MigrationPolicy:
    def __init__(self, cfg: MigrationPolicyConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self.history: list[Migration] = []

    def choose(self, servers: Sequence[ServerStatus]) -> Migration | None:
        """The server to migrate off now, or None."""
        best: Migration | None = None
        for dst in (s for s in servers if starved(s)):
            for src in servers:
                if src.url == dst.url or src.syncing or src.version > dst.version:
                    continue
                r = _ratio(src.indicator(self.cfg.indicator), dst.indicator(self.cfg.indicator))
                if r > self.cfg.threshold and (best is None or r > best.ratio):
                    best = Migration(src.url, dst.url, r, self.clock())
        if best is None:
            return None
        src = next(s for s in servers if s.url == best.source)
        if src.indicator(self.cfg.stop_indicator) < self.cfg.stop_threshold:
            return None
        self.history.append(best)
        return best

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

Where this differs from PSRL, and why (docs/design/advanced-coordination.md, "Migration without cascades";
the runs behind it: docs/history/results-2026-12.md):
- Starvation must last (`min_starved_ms`, on the injectable clock): a server is a destination only
  after it has been starved at every check for that long. Right after a status_based sync, or when its
  last request ends, a server is empty for a moment before the producer refills it, and its throughput
  reads ~0 (an embedded server's decays), so every busy server's ratio to it is infinite; PSRL migrates
  at once (0, the default, keeps that).
- No cascades: the source of a migration is emptied on purpose, so it is not starved (no destination)
  at the next check, nor before it has been starved for `min_starved_ms` again; a server that just
  received migrated work is neither a source nor (its work still on the way) a destination again for
  the next check and `min_starved_ms`. PSRL has neither rule. Simulated (Qwen3-8B 4 x 8, 198
  migrations in three steps) an emptied source at once pulled a third server's work, fed by the
  router's load book, which read a load report taken before the aborted requests ended as if taken
  after, so the source still looked full and every continuation went to the destination (fixed in
  coordinator/router.py `_release`: the continuations now spread over the servers by routing, as PSRL means).
- The router never aborts a migrated request again before it has ended (coordinator/router.py
  `migrate_from`): on a server that batches statically it waits behind the running batch without a
  token, and partial rollout's stall guard would stop the run after a few aborts without progress.
  A server's `protected` count (those requests) is left out of what its migration would move: a server
  running only such requests is no source, and `stop_threshold` applies to the rest.
- Engines of uneven speed (issue 25): a throughput ratio mixes load with speed, so PSRL's rule picks the
  FAST engine as source (it decodes most tokens/s because it is fast) and its requests continue on slow
  ones. Two rules use each server's decode step time, running / throughput from its load report (T = n / L):
  with a cost model (throughput_optimal routing's), a server's speed is the model's step time for its
  running requests and KV tokens over its reported one, and a server is no source for a destination last
  seen at under SLOWER of its own speed (the requests would progress slower there: another GPU, or an
  engine slowed for a while); and among equal ratios (every busy server's ratio to an idle one is
  infinite) the source is the server whose requests progress slowest (longest step), not the first
  listed. Without load reports (request_num alone) neither rule applies; without a cost model only the
  second does (a step time alone mixes speed with batch size and context length).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from megatron_dapo.config.coordination import MigrationConfig
from megatron_dapo.config.cost_model import CostModel
from megatron_dapo.coordinator.sync_policy import ServerStatus


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


def step_time(s: ServerStatus) -> float | None:
    """Seconds per decode step by its load report (throughput T = n / L(n)), None without a report: how
    slowly each of its running requests progresses."""
    return s.running / s.throughput if s.running > 0 and s.throughput > 0 else None


# A destination estimated under this share of the source's speed is the slower engine; above it, speed
# estimates differ by about what a cost-model fit's error does, not by hardware.
SLOWER = 0.8


def speed(s: ServerStatus, model: CostModel) -> float | None:
    """Its decode speed as a multiple of the cost model's engine (its steps take model / speed seconds),
    None without a load report."""
    step = step_time(s)
    return None if step is None else model.step_time(s.running, s.kv_tokens) / step


def movable(s: ServerStatus, stop_indicator: str) -> float:
    """`stop_indicator` of what a migration off `s` would move: with request_num, its requests less those
    continuing an earlier migration (the router keeps them where they are)."""
    if stop_indicator == "request_num":
        return s.indicator(stop_indicator) - s.protected
    return s.indicator(stop_indicator) if s.indicator("request_num") > s.protected else 0.0


class MigrationPolicy:
    """Decides at each check (`choose`), keeping per server when it was first seen starved and when it
    last took part in a migration (as source or destination)."""

    def __init__(
        self, cfg: MigrationConfig, clock: Callable[[], float] = time.monotonic, cost_model: CostModel | None = None
    ):
        self.cfg, self.clock = replace(cfg), clock  # a checked copy, as make_sync_policy's
        self.cost_model = cost_model  # routing's, when it has one (set by the producer once its router exists)
        self.history: list[Migration] = []
        self._checks = 0
        self._starved_since: dict[str, float] = {}  # url -> first check of its current starvation
        self._source_at: dict[str, tuple[int, float]] = {}  # url -> (check, time) it was last migrated off
        self._dest_at: dict[str, tuple[int, float]] = {}  # url -> (check, time) it last received work
        self._speed: dict[str, float] = {}  # url -> its speed when it last reported running requests

    def _observe(self, servers: Sequence[ServerStatus]) -> None:
        if self.cost_model is None:
            return
        for s in servers:
            v = speed(s, self.cost_model)
            if v is not None:
                self._speed[s.url] = v

    def _slower(self, dst: ServerStatus, src: ServerStatus) -> bool:
        """`dst` was last seen decoding at under SLOWER of `src`'s speed now: src's requests would progress
        slower there than where they are."""
        mine, theirs = self._speed.get(src.url), self._speed.get(dst.url)
        return mine is not None and theirs is not None and step_time(src) is not None and theirs < SLOWER * mine

    def _recent(self, at: dict[str, tuple[int, float]], url: str, now: float) -> bool:
        """A migration at this check, the previous one, or within min_starved_ms, involved `url` so."""
        last = at.get(url)
        return last is not None and (self._checks - last[0] <= 1 or now - last[1] < self.cfg.min_starved_ms / 1000.0)

    def _destinations(self, servers: Sequence[ServerStatus], now: float) -> list[ServerStatus]:
        """Servers starved long enough to take work; updates when each one's starvation began."""
        out = []
        for s in servers:
            settling = self._recent(self._source_at, s.url, now) or self._recent(self._dest_at, s.url, now)
            if not starved(s) or settling:
                # an emptied source, or a destination whose work is on its way: starved only after settling
                self._starved_since.pop(s.url, None)
                continue
            since = self._starved_since.setdefault(s.url, now)
            if now - since >= self.cfg.min_starved_ms / 1000.0:
                out.append(s)
        return out

    def choose(self, servers: Sequence[ServerStatus]) -> Migration | None:
        """The server to migrate off now, or None."""
        now = self.clock()
        self._checks += 1
        self._observe(servers)
        best: Migration | None = None
        best_key = (0.0, 0.0)
        for dst in self._destinations(servers, now):
            for src in servers:
                if (
                    src.url == dst.url
                    or src.syncing
                    or src.version > dst.version
                    or self._recent(self._dest_at, src.url, now)
                    or not movable(src, self.cfg.stop_indicator)
                    or self._slower(dst, src)
                ):
                    continue
                r = _ratio(src.indicator(self.cfg.indicator), dst.indicator(self.cfg.indicator))
                key = (r, step_time(src) or 0.0)  # equal ratios: the slowest-progressing source
                if r > self.cfg.threshold and (best is None or key > best_key):
                    best, best_key = Migration(src.url, dst.url, r, now), key
        if best is None:
            return None
        src = next(s for s in servers if s.url == best.source)
        if movable(src, self.cfg.stop_indicator) < self.cfg.stop_threshold:
            return None
        self._source_at[best.source] = self._dest_at[best.starved] = (self._checks, now)
        self._starved_since.pop(best.source, None)
        self._starved_since.pop(best.starved, None)  # it has work coming: starved again only from scratch
        self.history.append(best)
        return best

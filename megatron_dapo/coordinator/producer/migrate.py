"""Migration (on the producer's event loop): every check_interval_s compare the servers' loads and move
the chosen server's requests elsewhere (they continue by partial rollout)."""

from __future__ import annotations

import asyncio
import logging

from megatron_dapo.coordinator.load_poller import LOAD_TIMEOUT_S
from megatron_dapo.coordinator.migration import MigrationPolicy
from megatron_dapo.coordinator.producer.settings import ProducerSettings
from megatron_dapo.coordinator.producer.state import ProducerState, Signals
from megatron_dapo.coordinator.sync_policy import ServerStatus

log = logging.getLogger("megatron_dapo.coordinator.producer")


class Migration:
    def __init__(
        self,
        settings: ProducerSettings,
        state: ProducerState,
        signals: Signals,
        policy: MigrationPolicy,
        load_timeout_s: float = LOAD_TIMEOUT_S,
    ):
        self.settings, self.state, self.signals, self.policy = settings, state, signals, policy
        # the generation clients wait minutes for an answer; a load report that slow is no report
        self.load_timeout_s = load_timeout_s

    async def server_statuses(self, router) -> list[ServerStatus]:
        """Healthy servers' versions and loads: the router's counts (and the registry's last load reports);
        with a throughput / kv_cache indicator, fresh /v1/loads reports overwrite them."""
        if router.registry is not None:
            statuses = router.registry.statuses()
        else:
            statuses = [ServerStatus(s.url, self.state.version, running=s.outstanding) for s in router.servers]
        healthy = {s.url for s in router.healthy()}
        statuses = [s for s in statuses if s.url in healthy]
        for s in statuses:
            s.protected = router.protected_on(s.url)
        if self.policy.cfg.needs_loads:
            statuses = await self._with_loads(router, statuses)
        return statuses

    async def _with_loads(self, router, statuses: list[ServerStatus]) -> list[ServerStatus]:
        by_url = {s.url: s for s in router.servers}
        timeout = self.load_timeout_s
        rows = await asyncio.gather(
            *(asyncio.wait_for(by_url[s.url].client.get_loads(), timeout) for s in statuses), return_exceptions=True
        )
        known = []
        for st, load in zip(statuses, rows):
            if isinstance(load, BaseException):  # no report: not a candidate this round
                continue
            st.running, st.waiting, st.throughput = load.running, load.waiting, load.throughput
            st.kv_cache = load.kv_tokens / load.kv_capacity if load.kv_capacity else 0.0  # unrounded
            st.kv_tokens = load.kv_tokens
            known.append(st)
        return known

    async def run(self, router) -> None:
        try:
            while True:
                await asyncio.sleep(self.settings.check_interval_s)
                await self.once(router)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken migration loop is a failed run, not a silent stop of migrating
            log.exception("migration loop failed")
            with self.state.cv:  # on the loop: take_batch raises it
                self.signals.fail(e)

    async def once(self, router) -> None:
        policy = self.policy
        if policy.cost_model is None:  # routing's engine model (throughput_optimal*), to judge speeds
            policy.cost_model = getattr(router.policy, "model", None)
        m = policy.choose(await self.server_statuses(router))
        if m is None:
            return
        aborted = await router.migrate_from(m.source)
        log.info(
            "migration: %d requests aborted on %s (ratio %.3g to starved %s)", aborted, m.source, m.ratio, m.starved
        )
        if not aborted:  # all it runs continues earlier migrations (the router keeps them): nothing moved
            return
        self.state.counters.coordination["migrations"] += 1  # loop-owned
        self.state.counters.coordination["requests_migrated"] += aborted

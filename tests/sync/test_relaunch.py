"""Heal after a lost rollout server: the supervisor relaunches a SIGKILLed server on its port (bounded: a
server that keeps dying is given up, named); the router and the bridge find a server restarted between two
syncs (its weight version); the bridge re-admits a lost server that answers again (relaunched, or
continued after a stall) in order: its update group re-formed, the current weights, the
logprob check, then routing. Two real embedded servers on loopback, the real bridge over a real gloo group;
the test process is trainer rank 0 (and the driver watching the servers)."""

import asyncio
import logging
import os
import signal
import time

import pytest

from megatron_dapo.coordinator.servers import ServerRegistry
from tests.sync.test_degrade import PROBE, _bounded, _bridge, _info_and_logprobs, _reference_logprobs, _weights, servers  # noqa: F401


def _wait(cond, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_lost_server_is_re_admitted_stalled_or_relaunched_with_the_current_weights_then_given_up(servers, caplog):  # noqa: F811
    from megatron_dapo.rollout.supervisor import ServerSupervisor
    from megatron_dapo.sync.errors import ServersLost

    servers, model = servers
    urls = [s.url for s in servers]
    registry = ServerRegistry(urls, version=0)
    bridge = _bridge(urls, min_live=1, registry=registry, timeout_s=3.0)
    supervisor = ServerSupervisor(servers, max_relaunches=1, check_interval_s=0.1, backoff_s=0.1).start()
    caplog.set_level(logging.WARNING)
    try:
        bridge.sync(_weights(model, 1), version=1)
        # a stall (SIGSTOP) past the sync timeout: left out; not re-admitted while it stays stopped
        os.killpg(servers[1].proc.pid, signal.SIGSTOP)
        assert isinstance(_bounded(lambda: bridge.sync(_weights(model, 2), version=2)).get("error"), ServersLost)
        assert bridge.readmit() == [] and bridge.live == [urls[0]]
        assert supervisor.relaunches == [0, 0]  # stopped is not exited: nothing to relaunch
        # continued, it still holds the old group, paused: replaced by the re-admission and the next sync
        os.killpg(servers[1].proc.pid, signal.SIGCONT)
        assert bridge.readmit() == [urls[1]] and bridge.world_size == 3
        w2 = _weights(model, 2)
        assert _bounded(lambda: bridge.sync(w2, version=2)).get("value") is not None
        assert bridge.verify(PROBE, _reference_logprobs(model, w2, PROBE)) < 1e-4
        assert asyncio.run(_info_and_logprobs(urls[1], PROBE))[0] == "2"
        registry.mark_up(urls[1], 2)
        registry.publish_all(2)
        # SIGKILL between two syncs, relaunched by the supervisor before the next: a new process, same port
        first_pid = servers[1].proc.pid
        servers[1].kill()
        _wait(lambda: servers[1].alive() and servers[1].proc.pid != first_pid, "relaunch")
        _wait(lambda: _healthy(urls[1]), "relaunched server healthy")
        assert f"rollout server {urls[1]} exited; relaunching it" in caplog.text
        # the router, seeing it answer again, finds it restarted (its initial weights): out of routing
        assert asyncio.run(_router_check(urls, registry)) is None
        assert registry.records[urls[1]].down == "restarted: holds weight version default, not 2"
        assert not registry.routable(urls[1], None) and registry.routable(urls[0], 2)
        # the bridge finds it restarted too, and re-admits it at the next sync point: the group re-formed ...
        assert bridge.readmit() == [urls[1]]
        assert bridge.live == urls and bridge.world_size == 3 and not bridge.lost
        assert not registry.routable(urls[1], None)  # ... but no request before it holds and passed the check
        # ... the current weights (a full sync), which its logprobs show ...
        w3 = _weights(model, 3)
        assert _bounded(lambda: bridge.sync(w3, version=3)).get("value") is not None
        ref = _reference_logprobs(model, w3, PROBE)
        assert bridge.verify(PROBE, ref) < 1e-4  # ... the logprob check, both servers ...
        version, lps = asyncio.run(_info_and_logprobs(urls[1], PROBE))
        assert version == "3" and max(abs(a - b) for a, b in zip(lps, ref)) < 1e-4
        registry.mark_up(urls[1], 3)  # ... then routing (what the trainer's weight sync does next)
        assert registry.routable(urls[1], 3) and registry.records[urls[1]].down is None
        # a server that keeps dying: after rollout.relaunch_max relaunches it is given up, named
        servers[1].kill()
        _wait(lambda: 1 in supervisor.given_up, "give up")
        assert f"rollout server {urls[1]} given up: it exited again after 1 relaunch(es)" in caplog.text
        time.sleep(0.5)
        assert not servers[1].alive() and supervisor.relaunches == [0, 1]
        # the next sync leaves it out and reaches the other; a dead server is not re-admitted
        assert isinstance(_bounded(lambda: bridge.sync(_weights(model, 4), version=4)).get("error"), ServersLost)
        assert bridge.live == [urls[0]] and not registry.routable(urls[1], None)
        assert bridge.readmit() == [] and bridge.live == [urls[0]]
    finally:
        supervisor.stop()
        if servers[1].alive():
            os.killpg(servers[1].proc.pid, signal.SIGCONT)
        bridge.close()


@pytest.mark.slow
def test_a_server_down_at_a_sync_point_is_left_out_before_the_sync_then_re_admitted(servers):  # noqa: F811
    """SIGKILLed between two syncs and not yet relaunched when the next sync begins: the sync point finds it
    unreachable and re-forms the group without it, so the sync reaches the other at once (a broadcast to a
    group with a dead member would only end at the timeout, blaming the live server); started again on its
    port, the next sync point re-admits it and the sync gives it the current weights."""
    servers, model = servers
    urls = [s.url for s in servers]
    registry = ServerRegistry(urls, version=0)
    bridge = _bridge(urls, min_live=1, registry=registry, timeout_s=30.0)
    try:
        bridge.sync(_weights(model, 1), version=1)
        servers[1].kill()
        assert bridge.readmit() == [] and bridge.live == [urls[0]] and bridge.world_size == 2
        assert bridge.lost[urls[1]].startswith("unreachable: ") and registry.records[urls[1]].down is not None
        # with the dead server still in the group, server 0's update would time out and it be lost too
        assert _bounded(lambda: bridge.sync(_weights(model, 2), version=2)).get("value") is not None
        assert bridge.live == [urls[0]] and asyncio.run(_info_and_logprobs(urls[0], PROBE))[0] == "2"
        servers[1].restart(timeout_s=240)
        assert bridge.readmit() == [urls[1]] and bridge.live == urls and bridge.world_size == 3
        w3 = _weights(model, 3)
        assert _bounded(lambda: bridge.sync(w3, version=3)).get("value") is not None
        assert bridge.verify(PROBE, _reference_logprobs(model, w3, PROBE)) < 1e-4
    finally:
        bridge.close()


def test_a_live_server_routing_holds_down_is_routed_again_after_the_sync():
    """The router saw a server restarted (down) while the bridge still counted it live, and the sync (a retry
    that re-formed the group) gave it the weights: the trainer routes to it again, with the re-admitted ones;
    a server the bridge lost stays down."""
    import types

    from megatron_dapo.trainer.weight_sync import AllAtOnceSync

    urls = ["http://a", "http://b", "http://c"]
    registry = ServerRegistry(urls, version=2)
    registry.mark_down(urls[1], "restarted: holds weight version default, not 2")
    registry.mark_down(urls[2], "weight sync: unreachable")
    bridge, coord = types.SimpleNamespace(live=urls[:2]), types.SimpleNamespace(registry=registry)
    sync = types.SimpleNamespace(transport=bridge, coord=coord)
    AllAtOnceSync._route_to_synced_servers(sync, [], 3)
    assert registry.records[urls[1]].down is None and registry.records[urls[1]].version == 3
    assert registry.records[urls[2]].down is not None
    assert [s.url for s in registry.statuses()] == urls[:2]


async def _router_check(urls, registry):
    """The router's check of server 1 as its health loop makes it when the server answers again."""
    from megatron_dapo.coordinator.router import Router

    router = Router(urls, registry=registry)
    try:
        return await router._check_restarted(router.servers[1])
    finally:
        for s in router.servers:
            await s.client.aclose()


def _healthy(url: str) -> bool:
    from megatron_dapo.rollout.client import SGLangClient

    async def ask():
        async with SGLangClient(url, retries=0) as c:
            return await c.health(2.0)

    return asyncio.run(ask())


def test_relaunch_keys_are_checked_and_decide_what_the_driver_supervises(caplog):
    """rollout.relaunch_max below 1 is refused, named; the driver supervises only the servers it launched,
    and says so when there are none (external servers: re-admitted, never relaunched), never silently."""
    from megatron_dapo.apps.launch import EXTERNAL_ONLY, _supervise
    from megatron_dapo.config import ConfigError, load_config
    from tests.config.test_config import TINY

    with pytest.raises(ConfigError, match=r"rollout.relaunch_max=0 must be >= 1"):
        load_config(TINY, ["rollout.relaunch_max=0"])
    cfg = load_config(TINY, ["rollout.relaunch_max=2"])
    assert cfg.rollout.relaunch is True
    caplog.set_level(logging.INFO)
    assert _supervise(cfg, []) is None and EXTERNAL_ONLY in caplog.text
    launched = [object()]  # never asked: the supervisor is stopped before its first check
    assert _supervise(load_config(TINY, ["rollout.relaunch=false"]), launched) is None
    supervisor = _supervise(cfg, launched)
    supervisor.stop()
    assert supervisor.servers == launched and supervisor.max_relaunches == 2

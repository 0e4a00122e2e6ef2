"""Per-server sync parts on their own (fast): the server registry's routing and accounting on an
injected clock, the router sending a request only to a server that holds its V_traj (real HTTP
servers on loopback), and the weight store's snapshots. End to end: tests/trainer/test_loop_per_server_sync.py."""

import asyncio

import pytest
import torch

from megatron_dapo.coordinator.servers import ServerRegistry
from tests.fake_clock import FakeClock
from tests.http_stub import serve_app


def test_registry_routes_accounts_and_publishes():
    clock = FakeClock(100.0)
    reg = ServerRegistry(["http://a", "http://b/"], version=0, clock=clock)
    woken = []
    reg.add_listener(lambda: woken.append(1))
    assert reg.urls == ["http://a", "http://b"]
    assert reg.routable("http://a", 0) and not reg.routable("http://a", 1) and reg.routable("http://a", None)

    reg.request_started("http://a")  # a busy from t=100
    clock.t = 103.0
    reg.begin_sync("http://b")  # b idle 100..103, then out of routing
    assert not reg.routable("http://b", 0)
    with pytest.raises(RuntimeError, match="already syncing"):
        reg.begin_sync("http://b")
    clock.t = 105.0
    reg.end_sync("http://b", 1)  # 2 s syncing, now holds 1
    assert woken == [1] and reg.routable("http://b", 1) and reg.max_version() == 1
    reg.request_ended("http://a")
    clock.t = 106.0
    reg.begin_sync("http://a")
    clock.t = 107.0
    reg.end_sync("http://a", None)  # failed: keeps its version, counts no sync
    assert reg.version("http://a") == 0

    m = reg.metrics()  # at t=107
    assert m["server/0/version"] == 0 and m["server/0/syncs"] == 0 and m["server/0/sync_s"] == 1.0
    assert m["server/0/idle_s"] == 1.0  # idle 105..106 only (busy before, syncing after)
    assert m["server/1/version"] == 1 and m["server/1/syncs"] == 1 and m["server/1/sync_s"] == 2.0
    assert m["server/1/idle_s"] == 3.0 + 2.0  # 100..103 and 105..107
    assert reg.take_events() == [{"server": 1, "version": 1, "start": 103.0, "end": 105.0}]
    assert reg.take_events() == []

    # requests waiting at the router count as routable work for the servers that may serve them
    reg.waiting(1, +1)
    reg.waiting(0, +1)
    assert [s.routable for s in reg.statuses()] == [1, 2]
    reg.publish_all(2, seconds=0.5)
    assert [s.version for s in reg.statuses()] == [2, 2] and len(woken) == 3


def test_router_sends_a_request_only_to_a_server_holding_its_version():
    from aiohttp import web

    from megatron_dapo.coordinator.router import Router
    from megatron_dapo.rollout.types import SamplingParams

    async def serve(name, seen):
        async def generate(request):
            body = await request.json()
            seen.append(name)
            return web.json_response(
                {
                    "text": "",
                    "output_ids": [5],
                    "meta_info": {
                        "id": body.get("rid") or "r",
                        "finish_reason": {"type": "length", "length": 1},
                        "weight_version": "0",
                        "output_token_logprobs": [[-0.5, 5, None]],
                    },
                }
            )

        async def health(request):
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/health", health)
        return await serve_app(app)

    async def run():
        seen = []
        (ra, a), (rb, b) = await serve("a", seen), await serve("b", seen)
        reg = ServerRegistry([a, b], version=0)
        sp = SamplingParams(n=1, max_new_tokens=1)
        try:
            async with Router([a, b], registry=reg) as router:
                reg.begin_sync(b)
                reg.end_sync(b, 1)  # b now holds 1, a holds 0
                for _ in range(4):
                    await router.generate([1, 2], sp, min_version=1)
                assert seen == ["b"] * 4
                await router.generate([1, 2], sp, min_version=0)
                assert seen[4:] == ["a"]  # V_traj 0: a may serve it again (and has done the least)

                # no server holds 2 yet: the request waits, counted as routable work, until one publishes
                seen.clear()
                pending = asyncio.ensure_future(router.generate([1, 2], sp, min_version=2))
                await asyncio.sleep(0.2)
                assert not pending.done() and seen == []
                assert [s.routable for s in reg.statuses()] == [0, 0]
                reg.begin_sync(a)
                await asyncio.sleep(0.1)
                assert not pending.done()  # a syncing is not routable either
                await asyncio.to_thread(reg.end_sync, a, 2)  # published from another thread, as the syncer does
                await asyncio.wait_for(pending, 10)
                assert seen == ["a"]

                # a holds 2, b holds 1: continuations of V_traj 0 spread over both, unless their tokens
                # already reached version 2 (a trajectory never goes back to older weights)
                async def continuations(**kw):
                    seen.clear()
                    await asyncio.gather(
                        *(router.generate([1, 2, 7], sp, min_version=0, generated=1, **kw) for _ in range(6))
                    )
                    return sorted(set(seen))

                assert await continuations() == ["a", "b"]
                assert await continuations(newest_version=2) == ["a"]
                assert await continuations(newest_version=1) == ["a", "b"]
        finally:
            await ra.cleanup()
            await rb.cleanup()

    asyncio.run(run())


def test_weight_store_keeps_host_copies_and_immutable_snapshots():
    from megatron_dapo.sync.per_server import WeightStore

    store = WeightStore()
    assert store.snapshot() is None
    w = torch.ones(3)
    store.put(1, iter([("w", w), ("skipped_on_other_ranks", None)]), probe_logprobs=[-1.0, -2.0])
    first = store.snapshot()
    w.add_(1)  # the trainer moves on: the stored version must not
    assert first.version == 1 and [n for n, _ in first.tensors] == ["w"]
    assert torch.equal(first.tensors[0][1], torch.ones(3)) and first.nbytes == 12
    assert first.probe_logprobs == (-1.0, -2.0)
    store.put(2, iter([("w", w)]))
    assert store.snapshot().version == 2 and torch.equal(store.snapshot().tensors[0][1], torch.full((3,), 2.0))
    assert torch.equal(first.tensors[0][1], torch.ones(3))  # a reader of version 1 still has it
    with pytest.raises(RuntimeError, match="no tensors"):
        store.put(3, iter([]))
    assert store.snapshot().version == 2


def test_weight_store_holds_at_most_two_copies():
    """A new version waits while a sync still reads a snapshot older than the current one."""
    import threading

    from megatron_dapo.sync.per_server import WeightStore

    store = WeightStore()
    store.put(1, iter([("w", torch.zeros(2))]))
    slow = store.acquire()  # a server syncing version 1 ...
    store.put(2, iter([("w", torch.ones(2))]))  # ... does not hold back version 2 (two copies)
    third = threading.Thread(target=store.put, args=(3, iter([("w", torch.ones(2))])))
    third.start()
    third.join(0.3)
    assert third.is_alive() and store.snapshot().version == 2  # a third copy would be needed: waits
    store.release(slow)
    third.join(10)
    assert not third.is_alive() and store.snapshot().version == 3


def test_status_based_load_check_skips_a_hung_server_and_syncs_the_others(monkeypatch):
    """A lagging server whose /v1/loads never answers is left out of this round after the load timeout;
    the one that answers gets its load, and the check neither fails the run nor waits for the hung one."""
    import threading
    import time

    from aiohttp import web

    from megatron_dapo.config.schema import SyncConfig
    from megatron_dapo.sync import per_server
    from megatron_dapo.sync.per_server import PerServerSync, WeightStore

    row = {
        "num_running_reqs": 3,
        "num_waiting_reqs": 0,
        "num_used_tokens": 120,
        "max_total_num_tokens": 1000,
        "gen_throughput": 42.5,
        "token_usage": 0.12,
        "max_running_requests": 64,
    }
    hung = threading.Event()

    async def answering(request):
        return web.json_response({"loads": [row]})

    async def hanging(request):
        hung.set()
        await release.wait()  # until the test ends
        return web.json_response({"loads": [row]})

    loop, urls, runners, release = asyncio.new_event_loop(), [], [], None

    async def start():
        nonlocal release
        release = asyncio.Event()
        for handler in (answering, hanging):
            app = web.Application()
            app.router.add_get("/v1/loads", handler)
            runner, url = await serve_app(app)
            runners.append(runner)
            urls.append(url)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    monkeypatch.setattr(per_server, "LOAD_TIMEOUT_S", 0.5)
    syncer = PerServerSync(
        urls,
        SyncConfig(policy="status_based", indicator="kv_cache", threshold=0.5),
        ServerRegistry(urls, version=0),
        WeightStore(),
    )
    syncer._open_load_clients()
    try:
        t0 = time.monotonic()
        statuses = syncer._with_loads(syncer.registry.statuses(), latest=1)
        took = time.monotonic() - t0
        assert hung.is_set() and [s.url for s in statuses] == [urls[0]]  # the hung one: not this round
        s = statuses[0]
        assert (s.running, s.waiting, s.throughput, s.kv_cache) == (3, 0, 42.5, 0.12)
        assert took < 10  # the load timeout, not the 30 s (or 600 s) the whole round waited before
        assert syncer.policy.choose(statuses, 1) == [urls[0]]  # KV 0.12 <= 0.5: the answering one syncs
    finally:
        syncer.close()
        loop.call_soon_threadsafe(release.set)
        for runner in runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_failed_sync_on_a_pool_thread_is_kept_and_raised_by_check_even_when_reporting_it_fails(caplog):
    """A sync failing on the syncer's pool thread (here: a bridge never connected) is logged, kept and
    raised by `check()` as a named WeightSyncError, even when reporting it (on_error, the coordinator's
    fail) raises too: a failure in a thread nobody joins must never vanish."""
    import threading
    import time

    from megatron_dapo.config.schema import SyncConfig
    from megatron_dapo.sync.errors import WeightSyncError
    from megatron_dapo.sync.per_server import PerServerSync, WeightStore

    reported = threading.Event()

    def on_error(e):
        reported.set()
        raise ConnectionError("the coordinator is gone")

    urls = ["http://127.0.0.1:9"]
    registry, store = ServerRegistry(urls, version=0), WeightStore()
    store.put(1, iter([("w", torch.ones(2))]))
    syncer = PerServerSync(urls, SyncConfig(policy="greedy", check_interval_ms=20), registry, store, on_error=on_error)
    syncer.check()
    syncer.start()
    try:
        assert reported.wait(30), "the failure was never reported"
        deadline = time.monotonic() + 30
        while syncer._thread.is_alive():  # the policy loop stops after a failure
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        syncer.close()
    with pytest.raises(WeightSyncError, match=r"per-server weight sync failed: WeightSyncError\('sync\(\) before") as e:
        syncer.check()
    assert e.value.__cause__ is syncer.error
    assert "reporting the failure failed: ConnectionError('the coordinator is gone')" in caplog.text
    assert not registry.statuses()[0].syncing and registry.version(urls[0]) == 0  # routed to again, old version

"""Redundant slots, the proactive filter (`retry`) and request migration: each decision rule on
constructed states (pure, fast). The randomised invariants are in test_staleness.py."""

import asyncio
import math

import pytest

from megatron_dapo.config.coordination import MigrationConfig
from megatron_dapo.config.cost_model import CostModel
from megatron_dapo.coordinator.migration import MigrationPolicy
from megatron_dapo.coordinator.retry import ProactiveRetry
from megatron_dapo.coordinator.router import Router, server_rids
from megatron_dapo.coordinator.staleness import EMPTY, OCCUPIED, RESERVED, StalenessController
from megatron_dapo.coordinator.sync_policy import ServerStatus
from megatron_dapo.rollout.types import Sample, SamplingParams
from tests.fake_clock import FakeClock


def test_redundant_slots_admit_more_groups_and_the_first_b_fill_the_buffer():
    c = StalenessController(slots=2, staleness=0, extra=2)
    assert c.reservable(0) == 4  # B + extra groups in flight
    assert [c.reserve(k, 0) for k in "abcd"] == [(0, 3), (0, 2), (0, 1), (0, 0)]
    assert c.reserve("e", 0) is None
    c.occupy("c", "C")
    assert not c.ready() and c.take_dropped() == []
    c.occupy("a", "A")  # two completed: ready; the two slow ones cannot move later (staleness 0)
    assert c.ready() and sorted(c.take_dropped()) == ["b", "d"] and c.count(RESERVED) == 0
    assert c.consume() == ["C", "A"]
    assert c.reservable(0) == 0 and c.reservable(1) == 4


def test_a_full_buffers_surplus_moves_to_a_later_buffer_within_its_bound_or_is_dropped():
    c = StalenessController(slots=1, staleness=1, extra=1)
    assert [c.reserve(k, 0) for k in "abcd"] == [(1, 1), (1, 0), (0, 1), (0, 0)]
    c.occupy("a", "A")  # "d", reserved earliest, takes the slot "a" leaves; "a" the earliest empty slot
    assert c.where["a"] == (0, 0) and c.where["d"] == (1, 1) and c.ready()
    # buffer 0 filled: "c" (V_traj 0) would move to buffer 1, which has no empty slot: dropped
    assert c.take_dropped() == ["c"] and c.count(RESERVED, 0) == 0
    c.release("b")  # dropped by dynamic sampling: buffer 1 has room again
    c.reserve("e", 0)
    c.occupy("e", "E")
    assert c.take_dropped() == ["d"]  # buffer 1 filled; "d" may not go past 0 + 1
    assert c.consume() == ["A"] and c.consume() == ["E"]
    c2 = StalenessController(slots=1, staleness=1, extra=1)
    c2.reserve("x", 0)  # (1, 1)
    c2.reserve("y", 1)  # V_traj 1: may wait until buffer 2; (2, 1)
    c2.restore("z", 0, 1, 0, state=RESERVED)
    assert c2.where == {"x": (1, 1), "y": (2, 1), "z": (1, 0)}
    c2.occupy("x", "X")  # buffer 0 takes it
    c2.consume()
    c2.occupy("y", "Y")  # buffer 1 fills (y was reserved later, may train earlier): "z" is dropped
    assert c2.take_dropped() == ["z"] and c2.consume() == ["Y"]


def test_move_down_takes_the_newest_buffers_first_and_the_oldest_version_in_each():
    c = StalenessController(slots=3, staleness=3, next_buffer=4)
    c.restore("t0", 4, 4, 0, "T0")
    c.restore("r", 4, 4, 1, state=RESERVED)
    c.restore("r2", 4, 4, 2, state=RESERVED)
    c.restore("m0", 4, 5, 0, "M0")
    c.restore("n_new", 4, 6, 0, "N4")
    c.restore("n_old", 3, 6, 1, "N3")
    assert c.movable(4) == 3
    assert sorted(c.abort_reserved(4)) == ["r", "r2"] and c.count(RESERVED) == 0
    assert c.move_down(4, 2) == ["n_old", "n_new"]  # buffer 6 first, V_traj 3 before 4
    assert c.ready() and c.where["m0"] == (5, 0) and c.consume() == ["T0", "N3", "N4"]
    c2 = StalenessController(slots=2, staleness=1, next_buffer=0)
    c2.restore("future", 1, 1, 0, "F")  # V_traj 1 cannot be trained at step 0: never moved there
    assert c2.movable(0) == 0 and c2.move_down(0, 1) == []


def _waiting_state(later_completed: int, gap: int, slots: int = 4):
    c = StalenessController(slots=slots, staleness=1)
    for k in range(slots - gap):
        c.restore(f"done{k}", 0, 0, k, f"D{k}")
    for k in range(gap):
        c.restore(f"slow{k}", 0, 0, slots - gap + k, state=RESERVED)
    for k in range(later_completed):
        c.restore(f"next{k}", 0, 1, k, f"N{k}")
    return c


def test_retry_needs_a_waiting_trainer_a_small_gap_and_enough_completed_groups_later():
    clock = FakeClock(3.0)
    p = ProactiveRetry(threshold=2, clock=clock)
    assert not p.should_retry(_waiting_state(later_completed=2, gap=2), trainer_waiting=False)
    assert not p.should_retry(_waiting_state(later_completed=3, gap=3), trainer_waiting=True)  # gap > threshold
    assert not p.should_retry(_waiting_state(later_completed=1, gap=2), trainer_waiting=True)  # too few later
    c = _waiting_state(later_completed=3, gap=2)
    out = p.apply(c, trainer_waiting=True)
    assert sorted(out.aborted) == ["slow0", "slow1"] and len(out.moved) == 2 and out.at == 3.0
    assert c.ready() and c.count(OCCUPIED, 1) == 1 and c.count(EMPTY, 1) == 3  # freed slots: fresh prompts
    assert sorted(c.consume())[:2] == ["D0", "D1"] and c.next_buffer == 1
    assert p.apply(_waiting_state(later_completed=0, gap=0), trainer_waiting=True) is None  # already ready
    with pytest.raises(ValueError, match="rollout.retry.threshold"):
        ProactiveRetry(threshold=0)


def _server(url, version=0, running=0, waiting=0, throughput=0.0, kv=0.0, routable=0, syncing=False, kv_tokens=0):
    return ServerStatus(
        url,
        version,
        running=running,
        waiting=waiting,
        throughput=throughput,
        kv_cache=kv,
        routable=routable,
        syncing=syncing,
        kv_tokens=kv_tokens,
    )


def test_migration_picks_the_largest_ratio_above_threshold_for_a_starved_server():
    clock = FakeClock(9.0)
    p = MigrationPolicy(MigrationConfig(threshold=5.0, stop_threshold=10), clock)
    # s1 is starved (nothing waiting, nothing at the router for it); s0 has 12, s2 has 40 requests
    m = p.choose([_server("s0", running=12), _server("s1", running=2), _server("s2", running=40)])
    assert (m.source, m.starved, m.ratio, m.at) == ("s2", "s1", 20.0, 9.0)
    # ratio at or below the threshold: no migration
    assert p.choose([_server("s0", running=10), _server("s1", running=2)]) is None
    # the chosen source has fewer than stop_threshold requests left: not worth it
    assert p.choose([_server("s0", running=9), _server("s1")]) is None
    # nobody starved: work waits at the router for s1 (or in its queue)
    assert p.choose([_server("s0", running=40), _server("s1", routable=1)]) is None
    assert p.choose([_server("s0", running=40), _server("s1", waiting=1)]) is None
    # a source syncing, or holding a newer version than the starved server, is never chosen
    assert p.choose([_server("s0", running=40, syncing=True), _server("s1")]) is None
    assert p.choose([_server("s0", version=2, running=40), _server("s1", version=1)]) is None
    # an idle starved server makes the ratio infinite
    assert math.isinf(p.choose([_server("s0", running=40), _server("s1")]).ratio)
    assert len(p.history) == 2


def test_migration_indicators_throughput_and_kv_cache():
    p = MigrationPolicy(
        MigrationConfig(indicator="throughput", threshold=3.0, stop_indicator="kv_cache", stop_threshold=0.5)
    )
    assert (
        p.choose(
            [_server("a", running=8, throughput=400.0, kv=0.7), _server("b", running=8, throughput=100.0, kv=0.1)]
        ).source
        == "a"
    )
    assert (
        p.choose(
            [
                _server("a", running=8, throughput=400.0, kv=0.4),  # stop indicator too low
                _server("b", running=8, throughput=100.0, kv=0.1),
            ]
        )
        is None
    )
    assert MigrationConfig(indicator="kv_cache").needs_loads and not MigrationConfig().needs_loads
    with pytest.raises(ValueError, match="rollout.migration.stop_indicator"):
        MigrationConfig(stop_indicator="tokens")


def test_migration_on_uneven_engines_takes_work_off_the_slow_engine_not_the_fast_one():
    """Issue 25's defect: by throughput ratio every busy server's ratio to an idle one is infinite and
    the first listed (here the fast engine, which decodes most tokens/s because it is fast) was chosen.
    Now, with a cost model, a server is no source for a destination last seen at under 0.8 of its speed
    (model step time over reported step time), and equal ratios go to the slowest-stepping source."""
    model = CostModel(a_b=0.0, a_k=1e-7, o_thr=0.005, o_b=0.001, o_k=1e-4)
    cfg = MigrationConfig(indicator="throughput", threshold=5.0, stop_threshold=10)

    def engine(url, speed, running, kv_tokens, waiting=0):  # what an engine at `speed` x the model reports
        return _server(
            url,
            running=running,
            waiting=waiting,
            kv_tokens=kv_tokens,
            throughput=speed * model.throughput(running, kv_tokens),
        )

    fast = engine("f", 1.0, 40, 80_000)  # 0.013 s a step
    slow = engine("s", 0.25, 30, 60_000)  # 0.044 s a step
    idle = _server("d")
    # d, seen at a quarter of the model's speed with 4 requests: f's requests would progress slower there
    p = MigrationPolicy(cfg, cost_model=model)
    assert p.choose([fast, engine("d", 0.25, 4, 8000, waiting=1)]) is None  # busy: no destination
    assert p.choose([fast, idle]) is None
    m = p.choose([fast, slow, idle])
    assert (m.source, m.starved) == ("s", "d") and math.isinf(m.ratio)  # as fast as s: it may take s's work
    # d as fast as f, or only a little slower (fit noise): f may move
    for v in (1.0, 0.85):
        q = MigrationPolicy(cfg, cost_model=model)
        assert q.choose([fast, engine("d", v, 4, 8000, waiting=1)]) is None
        assert q.choose([fast, idle]).source == "f", v
    # among equal (infinite) ratios the slowest-stepping source goes first, whatever the order; with or
    # without a cost model
    for m in (model, None):
        assert MigrationPolicy(cfg, cost_model=m).choose([fast, slow, idle]).source == "s"
    # without a cost model the speeds are unknown: f may go to d (PSRL's rule)
    r = MigrationPolicy(cfg)
    assert r.choose([fast, engine("d", 0.25, 4, 8000, waiting=1)]) is None
    assert r.choose([fast, idle]).source == "f"
    # request counts without load reports (no throughput): no step time, PSRL's rule unchanged
    r = MigrationPolicy(MigrationConfig(threshold=5.0, stop_threshold=10))
    assert r.choose([_server("a", running=40), _server("b", running=2), _server("c", running=30)]).source == "a"


def test_migration_waits_until_starvation_has_lasted_min_starved_ms():
    """A server empty for a moment (just synced, its queue about to be refilled) triggers nothing; one
    starved at every check for min_starved_ms does; a check in between that sees it busy starts over."""
    clock = FakeClock(100.0)
    p = MigrationPolicy(MigrationConfig(threshold=5.0, stop_threshold=10, min_starved_ms=2000), clock)
    busy, empty = _server("s0", running=40, throughput=900.0), _server("s1")
    assert p.choose([busy, empty]) is None  # first seen starved now
    clock.t = 101.9
    assert p.choose([busy, empty]) is None  # 1.9 s
    clock.t = 102.0
    m = p.choose([busy, empty])
    assert (m.source, m.starved, m.at) == ("s0", "s1", 102.0)
    # a server refilled in between: its starvation starts again at the next empty check
    q = MigrationPolicy(MigrationConfig(threshold=5.0, stop_threshold=10, min_starved_ms=2000), clock)
    for t, s1 in ((200.0, empty), (201.0, _server("s1", routable=3)), (202.0, empty), (203.9, empty)):
        clock.t = t
        assert q.choose([busy, s1]) is None, t
    clock.t = 204.0
    assert q.choose([busy, empty]).starved == "s1"
    with pytest.raises(ValueError, match="rollout.migration.min_starved_ms=-1"):
        MigrationConfig(min_starved_ms=-1)


def test_migration_does_not_cascade():
    """The source a migration emptied is no destination at the next check (nor before it has been
    starved min_starved_ms again), and the server that received the work is no source meanwhile:
    with min_starved_ms 0 (PSRL's timing) for one check, with it set for that long."""
    clock = FakeClock(10.0)
    p = MigrationPolicy(MigrationConfig(threshold=5.0, stop_threshold=10), clock)
    assert p.choose([_server("a", running=40), _server("b"), _server("c", running=30)]).source == "a"
    # a emptied (its requests aborted, not yet re-placed), b still empty: neither a destination for a
    # third server's work, nor b a source, at the next check
    clock.t = 10.1
    after = [_server("a"), _server("b"), _server("c", running=30)]
    assert p.choose(after) is None
    # a check later both have settled: with min_starved_ms 0 either may take work again
    clock.t = 10.2
    assert p.choose(after).source == "c"

    q = MigrationPolicy(MigrationConfig(threshold=5.0, stop_threshold=10, min_starved_ms=1000), clock)
    clock.t = 20.0
    q.choose([_server("a", running=40), _server("b")])  # a starved-since is recorded for b
    clock.t = 21.0
    assert q.choose([_server("a", running=40), _server("b"), _server("c", running=30)]).source == "a"
    # b received a's work (it now runs 40, a runs 0): b is no source, a no destination, for 1 s ...
    moved = [_server("a"), _server("b", running=40, throughput=900.0), _server("c", running=30)]
    for t in (21.1, 21.5, 21.99):
        clock.t = t
        assert q.choose(moved) is None, t
    # ... and then a has to be starved for 1 s of its own: from 22.0 (first check after settling) to 23.0
    clock.t = 22.0
    assert q.choose(moved) is None
    clock.t = 22.99
    assert q.choose(moved) is None
    clock.t = 23.0
    m = q.choose(moved)
    assert (m.source, m.starved) == ("b", "a")  # b's 40 (largest ratio) may move now: it settled
    assert len(q.history) == 2


def test_migration_moves_only_what_the_router_may_abort():
    """Requests continuing an earlier migration stay where they are (the router keeps them): a server
    running only those is no source, and stop_threshold applies to the others."""
    from dataclasses import replace

    p = MigrationPolicy(MigrationConfig(threshold=5.0, stop_threshold=10), FakeClock(5.0))
    assert p.choose([replace(_server("a", running=40), protected=40), _server("b")]) is None
    assert p.choose([replace(_server("a", running=40), protected=31), _server("b")]) is None  # 9 movable
    assert p.choose([replace(_server("a", running=40), protected=30), _server("b")]).source == "a"
    k = MigrationPolicy(MigrationConfig(indicator="kv_cache", stop_indicator="kv_cache", stop_threshold=0.5))
    assert k.choose([replace(_server("a", running=4, kv=0.9), protected=4), _server("b")]) is None
    assert k.choose([replace(_server("a", running=4, kv=0.9), protected=3), _server("b")]).source == "a"


class HoldingClient:
    """A server client that answers a request only when it is aborted, with no new token."""

    def __init__(self, url, **_):
        self.url, self.held = url, {}

    async def generate(self, input_ids, sampling, rid=None):
        rids = server_rids(rid, sampling)  # what the router aborts by
        futs = [asyncio.get_running_loop().create_future() for _ in rids]
        self.held.update(zip(rids, futs))
        return list(await asyncio.gather(*futs))

    async def abort_request(self, rid=None, abort_all=False):
        fut = self.held.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(
                Sample(rid=rid, prompt_ids=[], output_ids=[], logprobs=[], finish_reason="abort", weight_version="0")
            )

    async def health(self, timeout_s=5.0):
        return True

    async def aclose(self):
        pass


def test_the_router_never_migrates_a_migrated_request_again():
    """A sample a migration aborted continues on some server; while that continuation runs (e.g. behind
    a static batch, without a token), `migrate_from` that server aborts everything else but not it.
    Real Router, clients that hold each request until it is aborted."""
    sp = SamplingParams(max_new_tokens=8)

    async def running(router, url) -> set[str]:
        await asyncio.sleep(0)
        return {rid for r in router._running.values() if r.server.url == url for rid in r.rids}

    async def go():
        async with Router(["http://a", "http://b"], client_factory=HoldingClient) as router:
            await asyncio.wait_for(scenario(router), 10)

    async def scenario(router):
        if True:
            g1 = asyncio.ensure_future(router.generate([1, 2], [sp], group_id="g1", rid="g1"))
            await asyncio.sleep(0)
            src = router.dispatcher.sticky("g1")
            assert await router.migrate_from(src) == 1
            (piece,) = await g1
            assert piece.aborted
            # its continuation (partial rollout: generated= set) and a fresh group land on one server
            cont = asyncio.ensure_future(router.generate([1, 2], [sp], group_id="g1", rid="g1-c", generated=0))
            fresh = asyncio.ensure_future(router.generate([3], [sp], group_id="g2", rid="g2"))
            for _ in range(3):
                await asyncio.sleep(0)
            for url in ("http://a", "http://b"):
                on = await running(router, url)
                assert await router.migrate_from(url) == len(on - {"g1-c-0"})
            assert (await fresh)[0].aborted and not cont.done()  # the continuation still runs
            # once it ends, the group's next continuation is an ordinary request again
            assert await router.abort_group("g1") == 1 and (await cont)[0].aborted
            again = asyncio.ensure_future(router.generate([1, 2], [sp], group_id="g1", rid="g1-d", generated=0))
            await asyncio.sleep(0)
            where = router.dispatcher.sticky("g1")
            assert await router.migrate_from(where) == 1 and (await again)[0].aborted

    asyncio.run(go())


def test_the_router_tracks_requests_by_the_rids_the_server_knows():
    from megatron_dapo.coordinator.router import server_rids
    from megatron_dapo.rollout import payloads
    from megatron_dapo.rollout.types import SamplingParams

    one, two = SamplingParams(n=1), SamplingParams(n=2)
    for rid, sampling in (("g", one), ("g", [one, one, one]), (None, one), ("g", two)):
        body = payloads.generate_body([1, 2], sampling, rid=rid if getattr(sampling, "n", 1) == 1 else None)
        sent = body.get("rid")
        assert server_rids(rid, sampling) == ([] if sent is None else [sent] if isinstance(sent, str) else sent)


def test_the_producer_applies_retry_while_the_trainer_waits():
    """The producer's wiring of the filter (no servers): the trainer waits on buffer 0, which lacks two
    groups still in flight while buffer 1 holds two completed ones. The filter cancels the two groups'
    tasks (their prompts count as aborted), moves the completed ones down, and the batch is ready."""
    import asyncio
    from types import SimpleNamespace

    from megatron_dapo.coordinator.producer import InFlight, ProducerSettings, RolloutProducer
    from megatron_dapo.data.dataset import PromptSampler
    from megatron_dapo.rollout.types import SamplingParams

    settings = ProducerSettings(
        train_batch_size=3, n=2, sampling=SamplingParams(), max_response_length=8, staleness=1, retry_threshold=2
    )
    p = RolloutProducer(lambda: None, None, PromptSampler(10), None, settings)
    st = p.state

    def group(draw):
        return SimpleNamespace(draw=draw, min_version=0)

    st.slots.restore(0, 0, 0, 0, group(0))
    for d in (1, 2):
        st.slots.restore(d, 0, 0, d, state=RESERVED)
        st.flight[d] = InFlight(idx=d, v_traj=0)
    st.slots.restore(3, 0, 1, 0, group(3))
    st.slots.restore(4, 0, 1, 1, group(4))

    async def go():
        tasks = {d: asyncio.ensure_future(asyncio.sleep(60)) for d in (1, 2)}
        st.tasks.update(tasks)
        with st.cv:
            p.batches.maybe_retry()  # the trainer is not waiting yet: nothing happens
            assert not st.slots.ready() and st.flight.keys() == {1, 2}
            p.batches.waiting_for = 0
            p.batches.maybe_retry()
        await asyncio.sleep(0)
        return [t.cancelled() for t in tasks.values()]

    assert asyncio.run(go()) == [True, True]
    info = p.take_batch(0, timeout_s=5)
    assert [g.draw for g in info.groups] == [0, 3, 4] and not st.flight and st.in_flight == 0
    assert (
        info.coordination["retries"],
        info.coordination["groups_aborted_retry"],
        info.coordination["groups_moved_down"],
    ) == (1, 2, 2)
    assert st.totals["aborted_retry"] == 2 and st.slots.reservable(1) == 6  # buffers 1 and 2: room for fresh prompts


def test_the_producer_dispatches_at_the_oldest_version_a_server_holds():
    """Per-server sync: servers hold versions 1 and 2, the trainer is at step 2 (staleness 1, B = 2).
    Buffers 2 (<= 1 + 1) take groups of V_traj 1, which any server may run; only buffer 3's slots
    need V_traj 2. Without a registry (all servers on the producer's version) every group is V_traj 2."""
    from types import SimpleNamespace

    from megatron_dapo.coordinator.producer import ProducerSettings, RolloutProducer
    from megatron_dapo.coordinator.servers import ServerRegistry
    from megatron_dapo.data.dataset import PromptSampler
    from megatron_dapo.rollout.types import SamplingParams

    def producer(router):
        settings = ProducerSettings(
            train_batch_size=2, n=2, sampling=SamplingParams(), max_response_length=8, staleness=1
        )
        p = RolloutProducer(lambda: None, None, PromptSampler(10), None, settings, version=2)
        p.state.slots.next_buffer = 2
        p.state.router = router
        return p

    registry = ServerRegistry(["http://a", "http://b"], version=2)
    registry.records["http://a"].version = 1
    router = SimpleNamespace(
        registry=registry, healthy=lambda: [SimpleNamespace(url="http://a"), SimpleNamespace(url="http://b")]
    )
    picks = producer(router).filler.dispatchable()
    assert sorted(v for _, _, v in picks) == [1, 1, 2, 2]
    p = producer(router)
    p.filler.dispatchable()
    st = p.state
    assert {d: st.slots.where[d][0] for d in st.flight if st.flight[d].v_traj == 1} and all(
        st.slots.where[d][0] == 2 for d in st.flight if st.flight[d].v_traj == 1
    )
    # the lagging server is unhealthy: only the up-to-date one counts
    router.healthy = lambda: [SimpleNamespace(url="http://b")]
    assert [v for _, _, v in producer(router).filler.dispatchable()] == [2, 2, 2, 2]
    assert [v for _, _, v in producer(None).filler.dispatchable()] == [2, 2, 2, 2]


def test_the_router_books_a_load_report_before_the_requests_that_end_after_it():
    """A server reports 2 running, then both requests end before the router dispatches again: the router
    must see 0 there (it read reports only when dispatching, so the older report overwrote the ends and
    a migrated server's continuations all went to its destination)."""
    from megatron_dapo.coordinator.servers import ServerRegistry
    from megatron_dapo.rollout.types import ServerLoad

    sp = SamplingParams(max_new_tokens=8)

    async def go():
        registry = ServerRegistry(["http://a", "http://b"])
        async with Router(["http://a", "http://b"], client_factory=HoldingClient, registry=registry) as router:
            reqs = [asyncio.ensure_future(router.generate([1], [sp], group_id="g", rid=f"r{i}")) for i in range(2)]
            await asyncio.sleep(0)
            url = router.dispatcher.sticky("g")
            registry.update_load(
                url,
                ServerLoad(
                    running=2,
                    waiting=0,
                    kv_tokens=20,
                    kv_capacity=1000,
                    throughput=5.0,
                    token_usage=0.02,
                    max_running_requests=8,
                ),
            )
            assert await router.migrate_from(url) == 2
            await asyncio.gather(*reqs)
            # the next request's dispatch reads that report: the server runs only what it places there
            h = asyncio.ensure_future(router.generate([1], [sp], group_id="h", rid="h"))
            await asyncio.sleep(0)
            assert router.dispatcher.loads.load(url)[0] == (router.dispatcher.sticky("h") == url)
            await router.abort_group("h")
            await h

    asyncio.run(asyncio.wait_for(go(), 10))


def test_migration_reads_loads_without_waiting_on_a_hung_server():
    """Migration on the servers' own loads: a server whose /v1/loads does not answer within the load
    timeout is no candidate this round; the others' reports are read (the migration loop is not held)."""
    import asyncio
    from types import SimpleNamespace

    from megatron_dapo.config.coordination import MigrationConfig
    from megatron_dapo.coordinator.migration import MigrationPolicy
    from megatron_dapo.coordinator.producer import ProducerSettings
    from megatron_dapo.coordinator.producer.migrate import Migration
    from megatron_dapo.coordinator.producer.state import ProducerState, Signals
    from megatron_dapo.coordinator.servers import ServerRegistry
    from megatron_dapo.data.dataset import PromptSampler
    from megatron_dapo.rollout.types import SamplingParams, ServerLoad

    class Answers:
        async def get_loads(self):
            return ServerLoad(
                running=7,
                waiting=0,
                kv_tokens=300,
                kv_capacity=1000,
                throughput=55.0,
                token_usage=0.3,
                max_running_requests=64,
            )

    class Hangs:
        async def get_loads(self):
            await asyncio.Event().wait()

    settings = ProducerSettings(
        train_batch_size=2,
        n=2,
        sampling=SamplingParams(),
        max_response_length=8,
        migration=MigrationConfig(enabled=True, indicator="kv_cache"),
    )
    state = ProducerState(settings, PromptSampler(10), version=0)
    migrator = Migration(
        settings, state, Signals(state.cv), MigrationPolicy(settings.migration, state.clock), load_timeout_s=0.2
    )
    servers = [SimpleNamespace(url="http://a", client=Answers()), SimpleNamespace(url="http://b", client=Hangs())]
    router = SimpleNamespace(
        registry=ServerRegistry(["http://a", "http://b"], version=0),
        servers=servers,
        healthy=lambda: servers,
        protected_on=lambda url: 0,
    )

    async def read():
        return await asyncio.wait_for(migrator.server_statuses(router), 5)  # without the load timeout: forever

    statuses = asyncio.run(read())
    assert [(s.url, s.running, s.throughput, s.kv_cache) for s in statuses] == [("http://a", 7, 55.0, 0.3)]

"""Routing policies, request queues and load estimates (megatron_dapo.coordinator.routing / queues /
load_estimate) on constructed server states; the decision rules checked against hand computations."""

from __future__ import annotations

import asyncio

import pytest

from megatron_dapo.config.coordination import QueueConfig
from megatron_dapo.config.cost_model import QWEN_7B_1GPU, CostModel
from megatron_dapo.coordinator.load_estimate import LoadBook
from megatron_dapo.coordinator.queues import Placement, QueuedRequest, RequestQueues
from megatron_dapo.coordinator.routing import (
    RouteRequest,
    RoutingConfig,
    ServerView,
    Verdict,
    make_routing_policy,
)
from tests.http_stub import serve_app

M = QWEN_7B_1GPU


def T(n: int, k: float) -> float:
    """Throughput written out from the issue's formula, in float64, independent of CostModel."""
    if n == 0:
        return 0.0
    step = 2.8e-3 + 3.35e-8 * k + max(6.4e-3, 2.7e-3 + 0.123e-3 * n)
    return n / step


def policy(method="throughput_optimal", concurrency=None, **kw):
    return make_routing_policy(RoutingConfig(method=method, **kw), concurrency, model=M)


def srv(url, version=0, **kw) -> ServerView:
    return ServerView(url, version=version, **kw)


# ---- throughput_optimal ---------------------------------------------------------------------------
def test_gain_is_the_throughput_difference_and_the_best_gain_wins():
    p = policy(delta_throughput_threshold=0.0)
    req = RouteRequest(prompt_tokens=300, generated_tokens=200)
    servers = [
        srv("a", running=40, kv_tokens=400_000),
        srv("b", running=10, kv_tokens=20_000),
        srv("c", running=90, kv_tokens=50_000),
    ]
    for s in servers:
        hand = T(s.running + 1, s.kv_tokens + 500) - T(s.running, s.kv_tokens)
        assert p.gain(req, s) == pytest.approx(hand, rel=1e-12, abs=0)
    gains = {s.url: T(s.running + 1, s.kv_tokens + 500) - T(s.running, s.kv_tokens) for s in servers}
    assert p.choose(req, servers).url == max(gains, key=gains.get)
    # m sequences in one request: T(n+m, K+m r) - T(n, K)
    req4 = RouteRequest(prompt_tokens=300, generated_tokens=200, sequences=4)
    s = servers[0]
    assert p.gain(req4, s) == pytest.approx(T(44, 400_000 + 2000) - T(40, 400_000), rel=1e-12)
    assert p.threshold(req4) == 0.0


def test_threshold_is_delta_times_the_gain_on_an_idle_server():
    req = RouteRequest(prompt_tokens=1000)
    busy = srv("a", running=100, kv_tokens=2_000_000)
    ratio = (T(101, 2_001_000) - T(100, 2_000_000)) / T(1, 1000)
    assert 0 < ratio < 1
    assert policy(delta_throughput_threshold=ratio * (1 - 1e-9)).choose(req, [busy]).url == "a"
    refused = policy(delta_throughput_threshold=ratio * (1 + 1e-9)).choose(req, [busy])
    assert refused.verdict is Verdict.REFUSED and refused.url is None
    # an idle server always accepts (gain == T(1, r)), whatever the threshold in [0, 1]
    assert policy(delta_throughput_threshold=1.0).choose(req, [busy, srv("idle")]).url == "idle"


def test_eligibility_waiting_queue_kv_room_concurrency_cap():
    p = policy(delta_throughput_threshold=0.0, concurrency=4)
    req = RouteRequest(prompt_tokens=100)
    # the best gain would be on "w" (fewest running), but its engine queues requests
    w = srv("w", running=1, waiting=1, kv_tokens=100)
    full = srv("full", running=2, kv_tokens=950, kv_capacity=1000)  # 950 + 100 > 1000
    capped = srv("capped", running=2, outstanding=4, kv_tokens=100)  # at rollout.concurrency
    ok = srv("ok", running=30, kv_tokens=3000, kv_capacity=10_000, outstanding=3)
    assert p.choose(req, [w, full, capped, ok]).url == "ok"
    assert p.choose(req, [w, full, capped]).verdict is Verdict.REFUSED
    # an idle server is eligible even if the request alone exceeds its KV capacity
    assert p.choose(RouteRequest(prompt_tokens=5000), [srv("tiny", kv_capacity=1000)]).url == "tiny"


def test_every_server_saturated_the_group_server_else_the_least_queued_one_takes_the_request():
    """No server eligible only because each is saturated (own queue non-empty or KV full): the request is
    not held but goes to its group's sticky server, else to the server with the fewest sequences queued
    (the report's plus those placed since it); a server at the concurrency cap or an eligible one gaining
    too little keeps the refusal."""
    p = policy(delta_throughput_threshold=0.0, concurrency=4)
    req = RouteRequest(prompt_tokens=100)
    queueing = srv("queueing", running=1, waiting=3, kv_tokens=100)
    full = srv("full", running=3, kv_tokens=950, kv_capacity=1000, placed_since=2)  # 950 + 100 > 1000
    fuller = srv("fuller", running=3, waiting=1, kv_tokens=990, kv_capacity=1000)
    servers = [queueing, full, fuller]
    assert not any(p.eligible(req, s) for s in servers)
    # queued: 3, 0 + 2 placed since the report, 1: the least queued takes it
    assert p.choose(req, servers).url == "fuller"
    # with its siblings on the most queued server, it joins them there
    assert p.choose(RouteRequest(prompt_tokens=100, sticky="queueing"), servers).url == "queueing"
    # one server at the concurrency cap: refused as before
    capped = srv("capped", running=4, outstanding=4, kv_tokens=990, kv_capacity=1000)
    assert p.choose(req, [*servers, capped]).verdict is Verdict.REFUSED
    # an eligible server that gains too little: the threshold's refusal stands
    busy = srv("busy", running=100, kv_tokens=2_000_000)
    strict = policy(delta_throughput_threshold=0.99)
    assert strict.choose(req, [busy, full]).verdict is Verdict.REFUSED
    assert strict.choose(req, [full]).url == "full"  # saturated only: no gain test


def test_dispatcher_counts_placements_since_the_report_as_queued_on_saturated_servers():
    from megatron_dapo.coordinator.router_core import Dispatcher

    d = Dispatcher(policy(delta_throughput_threshold=0.0), QueueConfig("fifo"))
    for key in ("r1", "r2", "r3"):
        d.submit(key, RouteRequest(prompt_tokens=600))
    full = [srv(u, running=8, kv_tokens=900, kv_capacity=1000, load_time=1.0) for u in "ab"]
    # none fits; each placement counts as queued where it went until the next report: a, b, a
    assert d.dispatch(full).placed == [("r1", "a"), ("r2", "b"), ("r3", "a")] and d.refusals == 0
    d.submit("r4", RouteRequest(prompt_tokens=600))
    # the next reports: a's engine started both, b's still queues r2: r4 goes to a
    reports = [
        srv("a", running=10, kv_tokens=990, kv_capacity=1000, load_time=2.0),
        srv("b", running=8, waiting=1, kv_tokens=900, kv_capacity=1000, load_time=2.0),
    ]
    assert d.dispatch(reports).placed == [("r4", "a")]


def test_version_order_new_requests_newest_first_resumed_oldest_allowed():
    p = policy(delta_throughput_threshold=0.5)
    old_idle, new_busy = srv("old", version=1), srv("new", version=2, running=8, kv_tokens=8000)
    # the idle old server has the larger gain, but a new request prefers the newest version group
    new_req = RouteRequest(prompt_tokens=1000, min_version=1)
    assert p.gain(new_req, old_idle) > p.gain(new_req, new_busy) >= p.threshold(new_req)
    assert p.choose(new_req, [old_idle, new_busy]).url == "new"
    # a resumed one takes the oldest version it may use ...
    resumed = RouteRequest(prompt_tokens=500, generated_tokens=500, min_version=1, resumed=True)
    old_busy, new_idle = srv("old", version=1, running=8, kv_tokens=8000), srv("new", version=2)
    assert p.choose(resumed, [new_idle, old_busy]).url == "old"
    # ... but never one below its V_traj
    assert (
        p.choose(
            RouteRequest(prompt_tokens=500, generated_tokens=5, min_version=2, resumed=True), [new_idle, old_busy]
        ).url
        == "new"
    )
    # a group whose best gain is under the threshold hands over to the next group
    crowded = srv("new", version=2, running=400, kv_tokens=3_000_000)
    assert p.gain(new_req, crowded) < p.threshold(new_req)
    assert p.choose(new_req, [old_idle, crowded]).url == "old"
    # a group with no eligible server too
    assert p.choose(new_req, [old_idle, srv("new", version=2, running=3, waiting=2)]).url == "old"


def test_reserve_capability_prefers_the_siblings_version():
    p = policy(delta_throughput_threshold=0.2, server_order="reserve_capability")
    a, b, c = srv("a", version=3, running=20, kv_tokens=20_000), srv("b", version=2), srv("c", version=1)
    req = RouteRequest(prompt_tokens=800, min_version=1, sibling_versions=frozenset({2}))
    assert p.choose(req, [a, b, c]).url == "b"  # not the newest: the group's siblings run at version 2
    # no sibling version among the candidates: plain version order (newest first for a new request)
    req = RouteRequest(prompt_tokens=800, min_version=1, sibling_versions=frozenset({7}))
    assert p.choose(req, [a, b, c]).url == "a"
    # the version order alone would have taken "a"
    assert (
        policy(delta_throughput_threshold=0.2)
        .choose(RouteRequest(prompt_tokens=800, min_version=1, sibling_versions=frozenset({2})), [a, b, c])
        .url
        == "a"
    )


def test_budget_rounds_the_generated_part_up():
    p = policy("throughput_optimal_with_budget", request_budget=1024)
    # PSRL's rule: ceil((generated + 1) / budget) * budget, i.e. room for at least one more token
    for generated, charged in [(0, 1024), (1, 1024), (1023, 1024), (1024, 2048), (2047, 2048), (5000, 5120)]:
        req = RouteRequest(prompt_tokens=100, generated_tokens=generated)
        assert p.request_tokens(req) == 100 + charged
    s = srv("a", running=50, kv_tokens=100_000)
    req = RouteRequest(prompt_tokens=100, generated_tokens=10)
    assert p.gain(req, s) == pytest.approx(T(51, 100_000 + 1124) - T(50, 100_000), rel=1e-12)
    assert policy().request_tokens(req) == 110


def test_sticky_server_first_when_it_passes_the_policys_test():
    p = policy(delta_throughput_threshold=0.2)
    a, b = srv("a", running=60, kv_tokens=60_000), srv("b")
    req = RouteRequest(prompt_tokens=500, sticky="a")
    assert p.accepts(req, a)
    assert p.choose(req, [a, b]).url == "a"
    assert p.choose(RouteRequest(prompt_tokens=500, sticky="a"), [srv("a", waiting=1, running=3), b]).url == "b"


def test_unroutable_without_a_server_holding_the_version():
    req = RouteRequest(prompt_tokens=10, min_version=3)
    servers = [srv("a", version=2), srv("b", version=5, syncing=True), srv("c", version=4, healthy=False)]
    for method in ("least_outstanding", "request_num_balance", "throughput_optimal"):
        assert policy(method).choose(req, servers).verdict is Verdict.UNROUTABLE


def test_throughput_policies_need_a_cost_model(tmp_path):
    with pytest.raises(ValueError, match="rollout.routing.cost_model"):
        make_routing_policy(RoutingConfig(method="throughput_optimal"))
    path = tmp_path / "cm.json"
    CostModel(1e-3, 1e-8, 5e-3, 2e-3, 1e-4).save(path)
    p = make_routing_policy(RoutingConfig(method="throughput_optimal", cost_model=str(path)))
    assert p.model == CostModel(1e-3, 1e-8, 5e-3, 2e-3, 1e-4)
    with pytest.raises(ValueError, match="delta_throughput_threshold"):
        RoutingConfig(delta_throughput_threshold=1.5)
    with pytest.raises(ValueError, match="request_budget"):
        RoutingConfig(request_budget=0)
    with pytest.raises(ValueError, match="rollout.routing.method"):
        RoutingConfig(method="round_robin")


# ---- least_outstanding / request_num_balance ------------------------------------------------------
def test_least_outstanding_is_the_old_rule():
    p = policy("least_outstanding")
    servers = [
        srv("a", outstanding=3, completed=0),
        srv("b", outstanding=1, completed=9),
        srv("c", outstanding=1, completed=2),
    ]
    assert p.choose(RouteRequest(prompt_tokens=1), servers).url == "c"
    assert p.choose(RouteRequest(prompt_tokens=1, sticky="a"), servers).url == "a"
    assert p.choose(RouteRequest(prompt_tokens=1, sticky="a", exclude=frozenset({"a"})), servers).url == "c"
    # servers that failed the request are used only when nothing else is left
    assert p.choose(RouteRequest(prompt_tokens=1, exclude=frozenset({"a", "b", "c"})), servers).url == "c"


def test_request_num_balance_fewest_sequences_and_the_cap():
    p = policy("request_num_balance", concurrency=2)
    servers = [
        srv("a", running=5, waiting=0, outstanding=1),
        srv("b", running=2, waiting=2, outstanding=1),
        srv("c", running=3, waiting=0, outstanding=0),
    ]
    assert p.choose(RouteRequest(prompt_tokens=1), servers).url == "c"
    full = [srv("a", running=1, outstanding=2), srv("b", running=4, outstanding=1)]
    assert p.choose(RouteRequest(prompt_tokens=1), full).verdict is Verdict.REFUSED  # least loaded "a" is capped
    assert p.choose(RouteRequest(prompt_tokens=1, sticky="b"), full).url == "b"


# ---- queues ---------------------------------------------------------------------------------------
def q(v, resumed=True, tokens=10, validation=False, name=None):
    return QueuedRequest(v, resumed, tokens, validation, item=name)


def drain_all(queues, refuse=()):
    order = []

    def place(r):
        if r.item in refuse:
            return Placement.REFUSED
        order.append(r.item)
        return Placement.PLACED

    queues.drain(place)
    return order


def test_priority_queues_oldest_version_first_new_requests_last():
    qs = RequestQueues(QueueConfig("priority", "id"))
    for r in [
        q(0, False, name="new0"),
        q(3, name="r3"),
        q(1, name="r1a"),
        q(0, False, name="new1"),
        q(1, name="r1b"),
        q(1, validation=True, name="val1"),
    ]:
        qs.put(r)
    assert [r.item for r in qs] == ["val1", "r1a", "r1b", "r3", "new0", "new1"]
    assert drain_all(qs) == ["val1", "r1a", "r1b", "r3", "new0", "new1"] and len(qs) == 0


def test_priority_queue_orders_short_long():
    for order, expect in (("short", ["s", "m", "l"]), ("long", ["l", "m", "s"]), ("id", ["m", "l", "s"])):
        qs = RequestQueues(QueueConfig("priority", order))
        for name, tokens in (("m", 50), ("l", 90), ("s", 10)):
            qs.put(q(2, tokens=tokens, name=name))
        assert drain_all(qs) == expect


def test_draining_is_strict():
    qs = RequestQueues(QueueConfig("priority"))
    for r in [q(1, name="old-a"), q(1, name="old-b"), q(2, name="newer"), q(0, False, name="brand-new")]:
        qs.put(r)
    assert drain_all(qs, refuse={"old-b"}) == ["old-a"]  # old-b refused: nothing newer that pass
    assert [r.item for r in qs] == ["old-b", "newer", "brand-new"]
    assert drain_all(qs) == ["old-b", "newer", "brand-new"]


def test_fifo_is_arrival_order_and_lets_unroutable_requests_wait_aside():
    qs = RequestQueues(QueueConfig("fifo"))
    for r in [q(0, False, name="a"), q(5, True, name="needs-v5"), q(0, False, name="b"), q(0, False, name="c")]:
        qs.put(r)
    seen = []

    def place(r):
        seen.append(r.item)
        if r.item == "needs-v5":
            return Placement.UNROUTABLE
        return Placement.REFUSED if r.item == "c" else Placement.PLACED

    assert qs.drain(place) == 2
    assert seen == ["a", "needs-v5", "b", "c"]
    assert [r.item for r in qs] == ["needs-v5", "c"]  # kept their places
    # priority is strict on an unroutable head too
    pq = RequestQueues(QueueConfig("priority"))
    pq.put(q(5, name="needs-v5"))
    pq.put(q(0, False, name="new"))
    assert pq.drain(lambda r: Placement.UNROUTABLE if r.item == "needs-v5" else Placement.PLACED) == 0
    # cancelled requests are dropped
    assert pq.drain(lambda r: Placement.GONE if r.item == "needs-v5" else Placement.PLACED) == 1
    assert len(pq) == 0


def test_queue_config_rejects_unknown_and_meaningless_values():
    with pytest.raises(ValueError, match="rollout.queue.policy"):
        QueueConfig("lifo")
    with pytest.raises(ValueError, match="rollout.queue.order"):
        QueueConfig("priority", "random")
    with pytest.raises(ValueError, match="needs rollout.queue.policy=priority"):
        QueueConfig("fifo", "short")


# ---- load estimates -------------------------------------------------------------------------------
def test_load_book_adds_admissions_to_the_last_report_until_the_next():
    book = LoadBook()
    assert book.load("a") == (0, 0, 0.0)
    book.admitted("r1", "a", 2, 200)  # no report yet: own bookkeeping
    assert book.load("a") == (2, 0, 200.0)
    book.observe("a", stamp=1.0, running=5, waiting=1, kv_tokens=1000)  # includes r1
    assert book.load("a") == (5, 1, 1000.0)
    book.admitted("r2", "a", 1, 300)
    assert book.load("a") == (6, 1, 1300.0)
    book.observe("a", stamp=1.0, running=0, waiting=0, kv_tokens=0)  # the same report again: no change
    assert book.load("a") == (6, 1, 1300.0)
    book.ended("r2", generated=50)  # admitted after the report: exactly what was added comes off ...
    assert book.load("a") == (6, 0, 1000.0)  # ... and its place goes to the sequence the engine had queued
    book.ended("r1", generated=100)  # in the report with its prompt and part of its output
    assert book.load("a") == (4, 0, 700.0)
    book.ended("r1")  # twice: nothing
    assert book.load("a") == (4, 0, 700.0)
    book.observe("a", stamp=2.0, running=1, waiting=0, kv_tokens=90)
    assert book.load("a") == (1, 0, 90.0)
    # a report that missed a request the router has in flight never hides it
    book.admitted("r3", "a", 4, 400)
    book.observe("a", stamp=3.0, running=1, waiting=1, kv_tokens=50)
    assert book.load("a") == (3, 1, 400.0)  # 4 in flight, 1 of them may be the engine's waiting one
    book.ended("r3", generated=8)  # its 4 places: 1 to the queued sequence
    assert book.load("a") == (0, 0, 0.0)


def test_load_book_starts_the_engines_queued_sequences_as_its_requests_end():
    """An engine admits from its own queue as places free: a report that saw sequences queued stops
    counting them as queued once as many have ended, so the server does not look queued until the
    next report (throughput_optimal takes no server with a queue)."""
    book = LoadBook()
    for key in ("r1", "r2", "r3"):
        book.admitted(key, "a", 1, 100)
    book.observe("a", stamp=1.0, running=3, waiting=2, kv_tokens=900)  # 2 queued that are not the router's
    book.ended("r1", generated=200)  # one place frees: a queued sequence starts in it
    assert book.load("a") == (3, 1, 600.0)
    book.ended("r2", generated=200)
    assert book.load("a") == (3, 0, 300.0)
    book.ended("r3", generated=200)  # nothing queued any more: a place stays empty
    assert book.load("a") == (2, 0, 0.0)
    book.observe("a", stamp=2.0, running=2, waiting=1, kv_tokens=500)  # a new report is taken as it is
    assert book.load("a") == (2, 1, 500.0)


# ---- config ---------------------------------------------------------------------------------------
TINY = "configs/qwen3/tiny_qwen3_cpu.yaml"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["rollout.routing.method=throughput_optimal"],
            "rollout.routing.method=throughput_optimal needs rollout.routing.cost_model",
        ),
        (
            ["rollout.routing.method=throughput_optimal", "rollout.routing.cost_model=/nonexistent/cm.json"],
            "rollout.routing.cost_model: cost model /nonexistent/cm.json",
        ),
        (["rollout.routing.cost_model=/x.json"], "rollout.routing.cost_model is used only by throughput_optimal"),
        (
            ["rollout.routing.delta_throughput_threshold=2"],
            "rollout.routing.delta_throughput_threshold must be in [0, 1]",
        ),
        (["rollout.routing.request_budget=0"], "rollout.routing.request_budget must be >= 1"),
        (["rollout.queue.order=short"], "rollout.queue.order='short' needs rollout.queue.policy=priority"),
        (["rollout.routing.method=round_robin"], "rollout.routing.method"),
        (["rollout.queue.policy=lifo"], "rollout.queue.policy"),
    ],
)
def test_config_rejects_bad_routing_and_queue_keys(overrides, expected):
    from megatron_dapo.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_config_routing_keys_reach_the_router(tmp_path):
    from megatron_dapo.config import load_config
    from megatron_dapo.coordinator.build import build_producer

    path = tmp_path / "cm.json"
    M.save(path)
    cfg = load_config(
        TINY,
        [
            "rollout.routing.method=throughput_optimal_with_budget",
            f"rollout.routing.cost_model={path}",
            "rollout.routing.delta_throughput_threshold=0.2",
            "rollout.routing.request_budget=256",
            "rollout.routing.server_order=reserve_capability",
            "rollout.queue.policy=priority",
            "rollout.queue.order=long",
            "rollout.concurrency=7",
        ],
    )
    producer = build_producer(cfg, ["http://127.0.0.1:1"], dataset=[None], tokenizer=None)
    router = producer.router_factory()
    asyncio.run(router.aclose())
    p = router.policy
    assert type(p).__name__ == "ThroughputOptimalWithBudget" and p.model == M and p.cap == 7
    assert (p.cfg.delta_throughput_threshold, p.cfg.request_budget, p.cfg.server_order) == (
        0.2,
        256,
        "reserve_capability",
    )
    assert (router.dispatcher.queue.cfg.policy, router.dispatcher.queue.cfg.order) == ("priority", "long")


# ---- the dispatcher (queue + policy + load estimates + sticky groups) -----------------------------
def test_dispatcher_counts_each_placement_before_the_next_decision():
    from megatron_dapo.coordinator.router_core import Dispatcher

    d = Dispatcher(policy(delta_throughput_threshold=0.0), QueueConfig("priority"))
    for key in ("r1", "r2", "r3"):
        d.submit(key, RouteRequest(prompt_tokens=600))
    servers = [srv("a", kv_capacity=1000), srv("b", kv_capacity=1000)]
    # r1 fills most of a's KV cache by the router's own estimate, so r2 goes to b; r3 fits nowhere, and
    # with every server saturated it queues on the least queued one (a and b: one each; the first)
    out = d.dispatch(servers)
    assert out.placed == [("r1", "a"), ("r2", "b"), ("r3", "a")] and out.failed == [] and len(d) == 0
    assert d.refusals == 0 and d.dispatch(servers).placed == []  # nothing waiting
    d.finished("r1", generated=50)
    d.submit("r4", RouteRequest(prompt_tokens=600))
    assert d.dispatch(servers).placed == [("r4", "a")]  # a: r3, b: r2, neither fits; one queued each: the first
    # load reports replace the estimate: r2 and r4 ended, but b's engine reports a queue of its own
    d.finished("r2", generated=10)
    d.finished("r4", generated=10)
    d.submit("r5", RouteRequest(prompt_tokens=600))
    busy_b = srv("b", kv_capacity=1000, running=3, waiting=2, kv_tokens=300, load_time=1.0)
    assert d.dispatch([srv("a", kv_capacity=1000), busy_b]).placed == [("r5", "a")]  # a: r3 queued; b: 2
    d.finished("r5", generated=0)
    d.submit("r6", RouteRequest(prompt_tokens=600))
    assert d.dispatch([srv("a", kv_capacity=1000), srv("b", kv_capacity=1000, load_time=2.0)]).placed == [("r6", "b")]


def test_dispatcher_sticky_groups_cancel_and_unroutable():
    from megatron_dapo.coordinator.router_core import Dispatcher

    d = Dispatcher(policy("least_outstanding"))
    d.submit("g1-0", RouteRequest(prompt_tokens=5), group_id="g1")
    d.submit("g2-0", RouteRequest(prompt_tokens=5), group_id="g2")
    d.submit("g1-1", RouteRequest(prompt_tokens=5), group_id="g1")
    servers = [srv("a", version=4), srv("b", version=4)]
    assert d.dispatch(servers).placed == [("g1-0", "a"), ("g2-0", "b"), ("g1-1", "a")]  # g1 stays on a
    assert d.sticky("g1") == "a" and d._sticky["g1"][1] == frozenset({4})
    assert d.unpin("b") == ["g2"] and d.sticky("g2") is None and d.sticky("g1") == "a"
    d.submit("gone", RouteRequest(prompt_tokens=5))
    d.cancel("gone")
    d.submit("v9", RouteRequest(prompt_tokens=5, min_version=9))
    d.submit("later", RouteRequest(prompt_tokens=5))
    out = d.dispatch(servers)  # fifo: the request waiting for version 9 holds nobody up
    assert out.placed == [("later", "a")] and len(d) == 1
    out = d.dispatch(servers, fail_unroutable=True)
    assert out.failed == ["v9"] and len(d) == 0


@pytest.mark.parametrize("queue", ["fifo", "priority"])
def test_dispatcher_repeats_an_unchanged_refusal_exactly_as_deciding_again(queue):
    """A dispatch with nothing changed since one that placed nothing is not decided again; the
    reference decides every time. Same placements, failures and refusals over a random history of
    submits, cancels, request ends, unpins, new load reports and views changed in place."""
    import random

    from megatron_dapo.coordinator.router_core import Dispatcher

    class Deciding(Dispatcher):
        def dispatch(self, servers, fail_unroutable=False):
            self._idle = None  # forget the last outcome: decide every time
            return super().dispatch(servers, fail_unroutable)

    rng = random.Random(5)
    route = dict(delta_throughput_threshold=0.6, server_order="reserve_capability")
    fast, ref = (cls(policy(concurrency=3, **route), QueueConfig(queue)) for cls in (Dispatcher, Deciding))
    views = [srv(u, version=1, kv_capacity=40_000) for u in "abc"]
    placed, n = [], 0
    for _ in range(1500):
        act = rng.random()
        if act < 0.25:
            n += 1
            req = RouteRequest(
                prompt_tokens=rng.randint(100, 9000),
                generated_tokens=rng.choice([0, 500]),
                min_version=rng.choice([None, 1, 1, 2]),
                resumed=rng.random() < 0.3,
            )
            for d in (fast, ref):
                d.submit(n, req, group_id=f"g{n % 7}", v_traj=req.min_version)
        elif act < 0.3 and n:
            key = rng.randint(1, n)
            for d in (fast, ref):
                d.cancel(key)
        elif act < 0.4 and placed:
            key = placed.pop(rng.randrange(len(placed)))
            generated = rng.randint(0, 300)  # one draw for both: their load books must stay the same
            for d in (fast, ref):
                d.finished(key, generated=generated)
        elif act < 0.43:
            url = rng.choice("abc")
            assert fast.unpin(url) == ref.unpin(url)
        elif act < 0.55:  # a new load report (a new stamp)
            v = rng.choice(views)
            v.running, v.kv_tokens, v.load_time = rng.randint(0, 4), rng.randint(0, 30_000), rng.random()
        elif act < 0.6:  # a view changed in place, same object (version, syncing, router counts)
            v = rng.choice(views)
            v.version, v.syncing, v.outstanding = rng.choice([1, 2]), rng.random() < 0.2, rng.randint(0, 3)
        fail = rng.random() < 0.05
        got, want = fast.dispatch(views, fail), ref.dispatch(views, fail)
        assert (got.placed, got.failed, fast.refusals, len(fast)) == (want.placed, want.failed, ref.refusals, len(ref))
        placed += [key for key, _ in got.placed]
    assert fast.refusals > 50 and n > 100  # the history did exercise admission control


# ---- the router: admission control over real HTTP on loopback ------------------------------------
def test_router_holds_requests_back_and_serves_resumed_ones_first(tmp_path):
    """throughput_optimal with one request in flight per server and priority queues: a server whose
    load report shows a non-empty engine queue takes nothing, a request no server should take waits
    at the router, a resumed trajectory that arrives later is placed before it, and a new load report
    (from another thread, as the poller's) places the waiting one."""
    from aiohttp import web

    from megatron_dapo.coordinator.router import Router
    from megatron_dapo.coordinator.servers import ServerRegistry
    from megatron_dapo.rollout.types import SamplingParams, ServerLoad

    async def serve(name, seen, gate):
        async def generate(request):
            body = await request.json()
            seen.append((name, body["rid"]))
            await gate.get()  # held until the test lets one request finish
            return web.json_response(
                {
                    "text": "",
                    "output_ids": [5],
                    "meta_info": {
                        "id": body["rid"],
                        "finish_reason": {"type": "length", "length": 1},
                        "weight_version": "0",
                        "output_token_logprobs": [[-0.5, 5, None]],
                    },
                }
            )

        app = web.Application()
        app.router.add_post("/generate", generate)
        return await serve_app(app)

    M.save(tmp_path / "cost.json")

    def load(running, waiting):
        return ServerLoad(
            running=running,
            waiting=waiting,
            kv_tokens=0,
            kv_capacity=100_000,
            throughput=0.0,
            token_usage=0.0,
            max_running_requests=64,
        )

    async def run():
        seen, gates = [], {"a": asyncio.Queue(), "b": asyncio.Queue()}
        (ra, a), (rb, b) = await serve("a", seen, gates["a"]), await serve("b", seen, gates["b"])
        reg = ServerRegistry([a, b], version=0)
        reg.update_load(a, load(running=2, waiting=3))  # a's engine has a queue of its own
        sp = SamplingParams(n=1, max_new_tokens=1)

        async def until(cond):
            for _ in range(200):
                if cond():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"timed out: {seen}")

        try:
            async with Router(
                [a, b],
                registry=reg,
                max_in_flight_per_server=1,
                routing=RoutingConfig("throughput_optimal", cost_model=str(tmp_path / "cost.json")),
                queue=QueueConfig("priority"),
            ) as router:
                r1 = asyncio.ensure_future(router.generate([1, 2, 3], sp, rid="new-1", min_version=0))
                await until(lambda: len(seen) == 1)
                r2 = asyncio.ensure_future(router.generate([1, 2, 3], sp, rid="new-2", min_version=0))
                r3 = asyncio.ensure_future(
                    router.generate([1, 2, 3, 7, 7], sp, rid="resumed-3", min_version=0, generated=2)
                )
                await asyncio.sleep(0.3)
                assert seen == [("b", "new-1")] and router.refusals >= 2  # a's engine queue is not empty
                assert [s.routable for s in reg.statuses()] == [2, 2]  # both wait at the router
                gates["b"].put_nowait(1)
                await asyncio.wait_for(r1, 10)
                await until(lambda: len(seen) == 2)
                await asyncio.sleep(0.2)
                assert seen[1] == ("b", "resumed-3") and not r2.done()  # arrived later, placed first
                # a's next report says it is idle: the report alone lets the waiting request go there
                await asyncio.to_thread(reg.update_load, a, load(running=0, waiting=0))  # as the poller thread
                await until(lambda: len(seen) == 3)
                assert seen[2] == ("a", "new-2")
                gates["a"].put_nowait(1)
                gates["b"].put_nowait(1)
                await asyncio.wait_for(asyncio.gather(r2, r3), 10)
        finally:
            await ra.cleanup()
            await rb.cleanup()

    asyncio.run(run())


def test_routing_methods_that_read_loads_turn_the_poller_on():
    from megatron_dapo.config.load import config_from_dict
    from megatron_dapo.coordinator.load_poller import poll_interval_s

    for method, interval in (
        ("least_outstanding", None),
        ("request_num_balance", 0.2),
        ("throughput_optimal", 0.2),
        ("throughput_optimal_with_budget", 0.2),
    ):
        assert poll_interval_s(config_from_dict({"rollout": {"routing": {"method": method}}}).rollout) == interval

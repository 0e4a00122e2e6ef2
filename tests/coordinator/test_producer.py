"""The rollout side of a step against two real embedded servers: staleness budget, dynamic
sampling (uninformative groups never reach a batch), the generation-batch limit, checkpoint state."""

import pytest

pytestmark = pytest.mark.slow


def _setup(tmp_path_factory, *server_args):
    from transformers import AutoTokenizer

    from megatron_dapo.data.arithmetic import ArithmeticTask, write_task
    from megatron_dapo.data.char_tokenizer import build_char_tokenizer
    from megatron_dapo.data.dataset import PromptDataset
    from megatron_dapo.models.tiny import save_tiny_hf_model
    from megatron_dapo.rollout.launcher import launch_embedded_servers

    root = tmp_path_factory.mktemp("producer")
    model = save_tiny_hf_model("qwen3", root / "model")
    build_char_tokenizer(model)
    tok = AutoTokenizer.from_pretrained(model)
    train, _ = write_task(root / "data", ArithmeticTask(max_operand=4, ops="+"), num_test=5)
    ds = PromptDataset(train, tok, max_prompt_length=64)
    servers = launch_embedded_servers(str(model), 2, root / "logs", timeout_s=240, extra_args=list(server_args))
    try:
        yield ds, [s.url for s in servers]
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    yield from _setup(tmp_path_factory)


@pytest.fixture(scope="module")
def continuous_setup(tmp_path_factory):
    """Servers that schedule as SGLang does: arrivals join the running batch, within a KV pool small
    enough that decode steps retract sequences."""
    yield from _setup(tmp_path_factory, "--batching", "continuous", "--max-total-tokens", "256")


def _set_server_version(urls, version):
    import asyncio
    import contextlib

    from megatron_dapo.rollout.client import SGLangClient

    async def go():
        # as the broadcast transport's global sync: every server paused (in place) before any changes
        # version and none goes on before all have, so no request continues on the older weights
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(SGLangClient(u)) for u in urls]
            for c in clients:
                await c.pause_generation("in_place")
            try:
                for c in clients:
                    await c.update_weight_version(str(version))
            finally:
                for c in clients:
                    await c.continue_generation()

    asyncio.run(go())


def _producer(
    ds,
    urls,
    reward,
    staleness=1,
    B=3,
    max_gen=10,
    seed=0,
    sampling_seed=None,
    max_new_tokens=6,
    router_kw=None,
    routers=None,
    **kw,
):
    from megatron_dapo.config.schema import OverlongBufferConfig
    from megatron_dapo.coordinator.producer import ProducerSettings, RolloutProducer
    from megatron_dapo.coordinator.router import Router
    from megatron_dapo.data.dataset import PromptSampler
    from megatron_dapo.rewards import RewardRunner
    from megatron_dapo.rollout.types import SamplingParams

    settings = ProducerSettings(
        train_batch_size=B,
        n=4,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens),
        max_response_length=max_new_tokens,
        staleness=staleness,
        gen_batch_size=B,
        max_num_gen_batches=max_gen,
        filter_metric="acc",
        overlong=OverlongBufferConfig(enable=True, len=2, penalty_factor=0.5),
        seed=sampling_seed,
        **kw,
    )

    def router():
        r = Router(urls, **(router_kw or {}))
        if routers is not None:
            routers.append(r)
        return r

    return RolloutProducer(
        router, ds, PromptSampler(len(ds), seed=seed), RewardRunner(default=reward, timeout_s=5), settings
    )


def test_dynamic_sampling_staleness_and_state(setup):
    ds, urls = setup

    # Prompts with an even ground truth are all-correct (uninformative); the others are judged on
    # the first output token's parity, so they are mixed in most groups.
    def reward(response, ground_truth, **_):
        if int(ground_truth) % 2 == 0:
            return 1.0
        return 1.0 if response and ord(response[0]) % 2 else -1.0

    p = _producer(ds, urls, reward, staleness=1)
    p.start()
    try:
        for step in range(3):
            info = p.take_batch(step, timeout_s=120)
            assert len(info.groups) == 3
            for g in info.groups:
                assert int(ds[g.prompt_index].ground_truth) % 2 == 1  # all-correct groups never kept
                assert len(set(g.accs)) == 2 and len(g.samples) == 4
                assert step - g.min_version <= 1
                assert all(len(s.output_ids) == len(s.logprobs) <= 6 for s in g.samples)
                # soft overlong penalty: 0 up to 4 tokens, then -0.25 per token (buffer 2, factor 0.5)
                for s, o in zip(g.samples, g.overlong):
                    assert o == pytest.approx(-0.5 * max(0, len(s.output_ids) - 4) / 2)
            # the producer never has more than (version + s + 1) * B groups produced
            st = p.state
            with st.cv:
                assert st.consumed + len(st.buffer) + st.in_flight <= (st.version + 2) * 3
            _set_server_version(urls, step + 1)  # what a weight sync does last
            p.set_version(step + 1)
        state = p.state_dict()
    finally:
        p.stop()
    assert state["consumed"] == 9 and state["version"] == 3
    # the buffer and data position survive a checkpoint round trip
    q = _producer(ds, urls, reward, staleness=1)
    q.load_state_dict(state)
    assert [g.prompt_index for g in q.state.buffer] == [g["prompt_index"] for g in state["buffer"]]
    assert q.state.sampler.state_dict() == state["sampler"]


def test_uninformative_rewards_exhaust_generation_batches(setup):
    from megatron_dapo.coordinator.producer import DynamicSamplingExhausted

    ds, urls = setup
    p = _producer(ds, urls, lambda response, ground_truth, **_: 1.0, staleness=0, B=2, max_gen=2)
    p.start()
    try:
        with pytest.raises(
            DynamicSamplingExhausted, match=r"4 groups judged in 2 generation batches.*only 0 kept.*4 all-correct"
        ):
            p.take_batch(0, timeout_s=120)
    finally:
        p.stop()


def _mixed_reward(response, ground_truth, **_):
    if int(ground_truth) % 2 == 0:
        return 1.0
    return 1.0 if response and ord(response[0]) % 2 else -1.0


def test_seeded_producers_regenerate_the_same_batches(setup):
    """Per-sample seeds: two producers with one seed give the same batches (prompts, order, tokens),
    whichever of the two differently seeded servers served each request and whatever else they were
    batching; the n samples of a group still differ, and another seed gives other samples."""
    ds, urls = setup

    def batches(sampling_seed, steps=2):
        p = _producer(ds, urls, _mixed_reward, staleness=0, sampling_seed=sampling_seed)
        p.start()
        out = []
        try:
            for step in range(steps):
                info = p.take_batch(step, timeout_s=120)
                out.append([(g.prompt_index, g.draw, [tuple(s.output_ids) for s in g.samples]) for g in info.groups])
                p.set_version(step + 1)
        finally:
            p.stop()
        return out

    a, b, c = batches(5), batches(5), batches(6, steps=1)
    assert a == b
    for batch in a:
        assert [draw for _, draw, _ in batch] == sorted(draw for _, draw, _ in batch)  # draw order
        for _, _, outputs in batch:
            assert len(set(outputs)) == 4, outputs  # n distinct seeds, n distinct samples
    assert [o for _, _, o in c[0]] != [o for _, _, o in a[0]]


def _interrupt_until(urls, stop, pauses: int, every_s: float = 0.3):
    """Pause every server in abort mode every `every_s` (what a sync that aborts requests does), `pauses` times."""
    import asyncio

    from megatron_dapo.rollout.client import SGLangClient

    async def go():
        clients = [SGLangClient(u) for u in urls]
        try:
            for _ in range(pauses):
                if stop.wait(every_s):
                    break
                await asyncio.gather(*(c.pause_generation("abort") for c in clients))
                await asyncio.gather(*(c.continue_generation() for c in clients))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    asyncio.run(go())


def test_throughput_routing_and_priority_queues_keep_every_group(setup, tmp_path):
    """throughput_optimal routing (reserve_capability order) on the servers' polled /v1/loads, priority
    queues (shortest first) and one request in flight per server, while both servers are paused in
    abort mode again and again (the continuations re-enter the queues by version, ahead of new groups):
    requests wait at the router (admission control) and still every group completes, none lost or
    duplicated, and the seeded batches equal those of the default router on undisturbed servers."""
    import threading
    import time

    from megatron_dapo.config.coordination import QueueConfig, RoutingConfig
    from megatron_dapo.config.cost_model import QWEN_7B_1GPU
    from megatron_dapo.coordinator.load_poller import LoadPoller
    from megatron_dapo.coordinator.servers import ServerRegistry

    ds, urls = setup
    QWEN_7B_1GPU.save(tmp_path / "cost.json")
    _set_server_version(urls, 0)  # the servers' labels follow the registry's versions (earlier tests moved them)
    registry = ServerRegistry(urls, version=0)
    advanced = dict(
        routing=RoutingConfig("throughput_optimal", 0.5, "reserve_capability", cost_model=str(tmp_path / "cost.json")),
        queue=QueueConfig("priority", "short"),
        max_in_flight_per_server=1,
        registry=registry,
    )

    def run(router_kw, pauses, steps=2, every_s=0.3):
        routers = []
        p = _producer(
            ds,
            urls,
            _mixed_reward,
            staleness=0,
            sampling_seed=3,
            max_new_tokens=32,
            max_resubmits=50,
            router_kw=router_kw,
            routers=routers,
        )
        stop = threading.Event()
        t = threading.Thread(target=_interrupt_until, args=(urls, stop, pauses, every_s))
        batches, resumes, refusals = [], 0, 0
        p.start()
        t.start()
        try:
            for step in range(steps):
                info = p.take_batch(step, timeout_s=300)
                refusals += info.coordination["routing_refusals"]
                for g in info.groups:
                    assert [s.index for s in g.samples] == [0, 1, 2, 3] and not any(s.aborted for s in g.samples)
                batches.append(
                    [(g.draw, g.prompt_index, [tuple(s.output_ids) for s in g.samples]) for g in info.groups]
                )
                resumes += info.partial_resumes
                if "registry" in router_kw:  # the same weights, relabelled: V_traj moves on
                    _set_server_version(urls, step + 1)
                    registry.publish_all(step + 1)
                p.set_version(step + 1)
        finally:
            stop.set()
            t.join()
            p.stop()
        return batches, resumes, routers[0], refusals

    t0 = time.monotonic()
    plain, _, _, none = run({}, pauses=0)
    every_s = min(0.3, (time.monotonic() - t0) / 16)  # pauses inside the run on a fast machine too
    with LoadPoller(registry, 0.05) as poller:
        batches, resumes, router, refusals = run(advanced, pauses=1000, every_s=every_s)
    draws = [d for batch in batches for d, _, _ in batch]
    assert len(draws) == len(set(draws)) == 6
    assert batches == plain
    assert resumes > 0 and router.refusals > 0
    assert none == 0 and 0 < refusals <= router.refusals  # the per-step metric (the rest came after the last take)
    assert all(n > 0 for n in poller.polls.values()) and all(r.load_time for r in registry.records_snapshot())


def test_partial_rollout_keeps_aborted_work_and_the_batches(setup):
    """Both servers paused in abort mode again and again while a seeded producer runs (what a sync that
    aborts requests does to it): with partial rollout the aborted samples continue from their tokens
    (resumes counted, nothing regenerated) and the batch equals an uninterrupted run's; without it
    the aborted groups start over (their tokens counted as regenerated; two pauses only, or groups
    longer than the pause interval would never finish), again with an equal batch."""
    import threading
    import time

    from megatron_dapo.rollout.client import SGLangClient

    ds, urls = setup

    def run(pauses, partial, every_s=0.3):
        p = _producer(
            ds,
            urls,
            _mixed_reward,
            staleness=0,
            sampling_seed=3,
            max_new_tokens=32,
            partial_rollout=partial,
            max_resubmits=50,
        )
        stop = threading.Event()
        t = threading.Thread(target=_interrupt_until, args=(urls, stop, pauses, every_s))
        out, resumes, regenerated = [], 0, 0
        p.start()
        t.start()
        try:
            for step in range(1):
                info = p.take_batch(step, timeout_s=300)
                out.append([(g.prompt_index, [tuple(s.output_ids) for s in g.samples]) for g in info.groups])
                assert all(not s.aborted for g in info.groups for s in g.samples)
                resumes, regenerated = resumes + info.partial_resumes, regenerated + info.tokens_regenerated
                p.set_version(step + 1)  # the servers keep version 0: weights never change here
        finally:
            stop.set()
            t.join()
            p.stop()
        return out, resumes, regenerated

    def checkpointed():
        """Paused in abort mode mid-generation and saved while the continuations wait; a new producer
        loaded from that state continues the saved partial samples."""
        import asyncio
        import time

        async def admin(method, *args, **kw):
            clients = [SGLangClient(u) for u in urls]
            try:
                await asyncio.gather(*(getattr(c, method)(*args, **kw) for c in clients))
            finally:
                await asyncio.gather(*(c.aclose() for c in clients))

        def partial_samples(state):
            return [
                s
                for f in state["in_flight"]
                for s in f["samples"] or ()
                if s["finish_reason"] == "abort" and len(s["output_ids"]) < 32
            ]

        def pause_until_partial_work(p):
            """Pause in abort mode until a pause catches a sample part-way (on a quiet machine the first
            groups may finish before any pause, on a loaded one a pause may come before any token):
            each miss continues generation (the producer resubmits what was aborted) and pauses again."""
            deadline = time.monotonic() + 120
            while True:
                asyncio.run(admin("pause_generation", "abort"))
                settle = time.monotonic() + 5
                while time.monotonic() < settle:
                    with p.state.cv:
                        if any(f.samples for f in p.state.flight.values()):
                            break
                    time.sleep(0.05)
                time.sleep(0.3)  # let the other aborted answers arrive
                state = p.state_dict()
                if any(s["output_ids"] for s in partial_samples(state)):
                    return state
                assert time.monotonic() < deadline, "no pause caught a sample part-way in 120 s"
                asyncio.run(admin("continue_generation"))
                time.sleep(0.1)

        make = lambda: _producer(ds, urls, _mixed_reward, staleness=0, sampling_seed=3, max_new_tokens=32)
        p = make()
        p.start()
        try:
            time.sleep(0.2)
            state = pause_until_partial_work(p)
        finally:
            p.stop()
            asyncio.run(admin("abort_request", abort_all=True))
            asyncio.run(admin("continue_generation"))
        q = make()
        q.load_state_dict(state)
        q.start()
        try:
            info = q.take_batch(0, timeout_s=300)
        finally:
            q.stop()
        batch = [(g.prompt_index, [tuple(s.output_ids) for s in g.samples]) for g in info.groups]
        return batch, state, partial_samples(state), info

    def until_a_pause_catches_work(pauses, partial, caught, plain_s):
        """Pauses come at a fraction of the undisturbed run's time, so they fall inside the batch on a fast
        machine as on a slow one; a run may still miss (each pause coming while every sample is prefilling,
        or a burst of load): such a run shows nothing about the aborted work, so it runs again with pauses
        twice as often (four tries)."""
        every_s = plain_s / 8
        for _ in range(4):
            out = run(pauses, partial, every_s)
            if caught(out):
                break
            every_s /= 2
        return out

    t0 = time.monotonic()
    plain = run(0, True)
    plain_s = time.monotonic() - t0
    partial = until_a_pause_catches_work(1000, True, lambda out: out[1] > 0, plain_s)
    restarted = until_a_pause_catches_work(2, False, lambda out: out[2] > 0, plain_s)
    assert plain[1:] == (0, 0)
    batch, state, saved_partial, info = checkpointed()
    assert state["in_flight"] and saved_partial and any(s["output_ids"] for s in saved_partial)
    # every saved partial sample was continued (one request each), none regenerated, same batch
    assert info.partial_resumes == len(saved_partial) and info.tokens_regenerated == 0
    assert batch == plain[0][0]
    assert partial[0] == plain[0] and partial[1] > 0 and partial[2] == 0
    assert restarted[0] == plain[0] and restarted[1] == 0 and restarted[2] > 0


def _starve_one_server(p, router, prompt, urls, version, timeout_s=120.0):
    """Bring about, at a known point, what migration acts on, and wait until the producer has migrated.

    Left to timing, a server is seen starved (nothing waiting) only in a short window at the end of a
    wave of groups, and the continuous batcher's small KV pool keeps a queue on both servers almost
    always: a loaded machine easily goes a dozen steps without a check falling into such a window.
    Here, with the producer at `version` - 1 and unable to reserve more (its open buffer full, nothing
    in flight, the servers idle), each server gets two requests of ours, a long one running (KV in
    use) and behind it one of `block` tokens that cannot start beside it (a static batch admits
    nothing while one runs; in the continuous batcher's pool the queue's head does not fit, and
    admission is first come first served), and is paused in place. `set_version(version)` dispatches
    the B + extra groups of the one new buffer, each pinned whole to one server: one server (busy)
    gets at least extra + 1 of them, so the other cannot fill the buffer without it. The busy one
    takes its requests into its queue, behind ours, and is paused in place again; the other has ours
    aborted, goes on, runs its groups (and the prompts that replace dropped ones) and idles: nothing
    waiting, no KV in use, while the busy one holds KV and the producer's queued requests. Starved
    against busy until the producer migrates (waited for with a deadline, never a number of checks);
    then ours on the busy server are aborted and it goes on."""
    import asyncio
    import contextlib
    import time
    import uuid

    from megatron_dapo.rollout.client import SGLangClient
    from megatron_dapo.rollout.types import SamplingParams

    settings = p.settings
    assert len(urls) == 2 and settings.staleness == 1 and settings.extra_prompts > 0
    groups, per_group = settings.train_batch_size + settings.extra_prompts, settings.n + settings.extra_samples
    long, one = SamplingParams(max_new_tokens=400, ignore_eos=True), SamplingParams(max_new_tokens=1)
    block = 250  # fits the continuous fixture's 256-token pool alone, never beside a running sequence

    async def until(cond, what, state=None):
        deadline = time.monotonic() + timeout_s
        while not await cond():
            if time.monotonic() > deadline:
                seen = f"; last seen: {await state()}" if state is not None else ""
                raise AssertionError(f"not within {timeout_s}s: {what}{seen}")
            await asyncio.sleep(0.01)

    def quiesced() -> bool:
        st = p.state
        with st.cv:  # a consistent snapshot: the next buffer full, no reservation left to dispatch
            return st.slots.ready() and st.in_flight == 0 and st.version + settings.staleness == st.slots.next_buffer

    def on_loop(fn):  # the producer's state and its router belong to its event loop
        return asyncio.to_thread(p.handoff.call, fn)

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            clients = {u: await stack.enter_async_context(SGLangClient(u)) for u in urls}

            async def idle():
                return quiesced() and all(
                    x.running + x.waiting == 0 for x in [await c.get_loads() for c in clients.values()]
                )

            await until(idle, "the producer's open buffer full and both servers idle")
            ours: dict[str, list[str]] = {u: [] for u in urls}
            tasks = []

            async def send(u, ids, sampling, running, waiting):
                rid = f"ours-{uuid.uuid4().hex[:8]}"
                ours[u].append(rid)
                tasks.append(asyncio.ensure_future(clients[u].generate(ids, sampling, rid=rid)))

                async def there():
                    x = await clients[u].get_loads()
                    return (x.running, x.waiting) == (running, waiting)

                await until(there, f"our request on {u} (running, waiting) = {(running, waiting)}")

            try:
                for u in urls:  # ours first, each server then paused in place: ours stay as they are
                    await send(u, prompt, long, 1, 0)
                    await send(u, (prompt * block)[:block], one, 1, 1)
                    await clients[u].pause_generation("in_place")
                await asyncio.to_thread(p.set_version, version)

                async def placed():  # on the paused servers' doorsteps (they take nothing in while paused)
                    return sum(await on_loop(lambda: [router.running_on(u) for u in urls])) == groups * per_group

                await until(placed, f"{groups} groups of {per_group} requests placed")
                sent = dict(zip(urls, await on_loop(lambda: [router.running_on(u) for u in urls])))
                busy = max(sent, key=sent.get)
                (free,) = [u for u in urls if u != busy]
                assert sent[busy] >= per_group * (settings.extra_prompts + 1), sent  # free cannot fill the buffer
                await clients[busy].continue_generation()  # they join its queue, behind ours

                async def queued():
                    return (await clients[busy].get_loads()).waiting == 1 + sent[busy]

                async def busy_state():  # which premise broke: ours ended early, or theirs never arrived
                    loads = await clients[busy].get_loads()
                    ended = [t.done() for t in tasks]
                    placed = await on_loop(lambda: router.running_on(busy))
                    return f"running {loads.running}, waiting {loads.waiting}, ours ended {ended}, placed {placed}"

                await until(queued, f"{sent[busy]} requests queued on {busy}", busy_state)
                await clients[busy].pause_generation("in_place")
                frozen = await clients[busy].get_loads()
                assert (frozen.running, frozen.waiting) == (1, 1 + sent[busy]), frozen  # ours running, all queued
                counted = await on_loop(lambda: p.state.counters.coordination["migrations"])  # loop-owned
                for rid in ours[free]:
                    await clients[free].abort_request(rid)
                await clients[free].continue_generation()

                async def migrated():  # the one brought about here (one by timing may have come before)
                    return await on_loop(lambda: p.state.counters.coordination["migrations"]) > counted

                await until(migrated, f"a migration off {busy} ({sent[busy]} queued) to idle {free}")
            finally:
                for u, c in clients.items():
                    for rid in ours[u]:
                        await c.abort_request(rid)
                    await c.continue_generation()
                await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(go())


@pytest.mark.parametrize("servers", ["setup", "continuous_setup"])
def test_redundancy_retry_and_migration_together_lose_nothing(request, servers):
    """Every rollout-coordination switch on, against two real servers (batching statically, or
    continuously as SGLang does): sample- and prompt-level
    redundancy, the proactive filter and migration (on the servers' own KV use from /v1/loads,
    thresholds low enough that it fires whenever one server is idle; after the first step one server
    is made idle while the other holds work, `_starve_one_server`, so a migration happens whatever the
    timing). Each batch has B groups of
    exactly n finished samples, within the staleness bound, each token's weight version between the
    group's V_traj and the step; every prompt drawn is trained, waiting, in flight, dropped by
    dynamic sampling or aborted (counted), never twice."""
    from collections import Counter

    from megatron_dapo.config.coordination import MigrationConfig
    from megatron_dapo.coordinator.groups import token_versions

    ds, urls = request.getfixturevalue(servers)
    _set_server_version(urls, 0)  # earlier tests leave the servers labelled with later versions
    B, n, staleness, min_steps, starve_after = 3, 4, 1, 4, 0
    routers = []
    p = _producer(
        ds,
        urls,
        _mixed_reward,
        staleness=staleness,
        B=B,
        sampling_seed=11,
        max_new_tokens=24,
        extra_samples=2,
        extra_prompts=2,
        retry_threshold=2,
        check_interval_s=0.05,
        migration=MigrationConfig(enabled=True, indicator="kv_cache", threshold=1.0, stop_threshold=1),
        routers=routers,
    )
    trained, counts, taken, retractions = [], Counter(), 0, 0
    p.start()
    try:
        for step in range(min_steps):
            info = p.take_batch(step, timeout_s=300)
            taken += 1
            counts.update(info.coordination)
            retractions += info.metrics()["rollout/retractions"]
            assert len(info.groups) == B
            for g in info.groups:
                assert [s.index for s in g.samples] == list(range(n)) and len(g.accs) == n
                assert not any(s.aborted for s in g.samples)
                assert 0 <= step - g.v_traj <= staleness and step - g.min_version <= staleness
                for s in g.samples:
                    versions = token_versions(s)
                    assert len(versions) == len(s.output_ids) == len(s.logprobs)
                    assert versions == sorted(versions) and all(g.v_traj <= v <= step for v in versions)
                trained.append(g.draw)
            _set_server_version(urls, step + 1)
            if step == starve_after:  # it sets the producer's version itself
                _starve_one_server(p, routers[0], list(ds[0].prompt_ids), urls, step + 1)
            else:
                p.set_version(step + 1)
        st = p.state
        with st.cv:  # a consistent snapshot of the running producer (stopping cancels what is in flight)
            waiting = [g.draw for g in st.buffer]
            in_flight = list(st.flight)
            drawn = st.sampler.epoch * st.sampler.size + st.sampler.offset
            totals = dict(st.totals)
        state = p.state_dict()
    finally:
        p.stop()
    # a checkpoint keeps the groups in flight (with their n + 2 partial answers) and the wider buffers
    q = _producer(ds, urls, _mixed_reward, staleness=staleness, B=B, extra_samples=2, extra_prompts=2)
    q.load_state_dict(state)
    assert q.state.slots.capacity == B + 2 and sorted(q.state.flight) == sorted(f["draw"] for f in state["in_flight"])
    assert all(f.samples is None or len(f.samples) == n + 2 for f in q.state.flight.values())
    assert len(trained) == len(set(trained)) == taken * B and taken >= min_steps
    assert not set(trained) & set(waiting)
    accounted = (
        len(trained)
        + len(waiting)
        + len(in_flight)
        + totals.get("dropped", 0)
        + totals.get("aborted_surplus", 0)
        + totals.get("aborted_retry", 0)
    )
    assert accounted == drawn, (accounted, drawn, totals, counts)
    print("coordination counts:", dict(counts), "totals:", totals, "retractions:", retractions)
    assert counts["samples_aborted_surplus"] > 0  # n + 2 sent, n kept
    assert counts["migrations"] > 0 and counts["requests_migrated"] > 0
    assert (retractions > 0) == (servers == "continuous_setup"), retractions  # only there is the pool small


def test_router_aborts_one_group_or_every_request_of_a_server(setup):
    """The router knows which rids run where: abort_group ends only that group's requests (they answer
    finish_reason abort with the tokens so far), migrate_from every request on one server and unpins
    its groups. Requests ignore EOS, so none can finish on its own within the test."""
    import asyncio

    from megatron_dapo.coordinator.router import Router
    from megatron_dapo.rollout.client import SGLangClient
    from megatron_dapo.rollout.types import SamplingParams

    ds, urls = setup
    prompt = list(ds[0].prompt_ids)
    sp = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True)

    async def on_servers(clients) -> int:
        loads = [await c.get_loads() for c in clients]
        return sum(load.running + load.waiting for load in loads)

    async def go():
        clients = [SGLangClient(u) for u in urls]
        try:
            async with Router(urls) as router:
                a = asyncio.ensure_future(router.generate(prompt, [sp, sp], group_id="ga", rid="ga"))
                b = asyncio.ensure_future(router.generate(prompt, [sp], group_id="gb", rid="gb"))
                for _ in range(500):
                    if await on_servers(clients) == 3:
                        break
                    await asyncio.sleep(0.02)
                assert await router.abort_group("ga") == 2
                out_a = await asyncio.wait_for(a, 60)
                assert [s.finish_reason for s in out_a] == ["abort", "abort"]
                assert all(len(s.output_ids) < 400 for s in out_a)
                assert not b.done() and await on_servers(clients) == 1
                where_b = router.dispatcher.sticky("gb")
                assert router.running_on(where_b) == 1
                assert await router.migrate_from(where_b) == 1 and router.dispatcher.sticky("gb") is None
                (out_b,) = await asyncio.wait_for(b, 60)
                assert out_b.finish_reason == "abort" and len(out_b.output_ids) < 400
                assert router.running_on(where_b) == 0
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    asyncio.run(go())


def _fails_on_even_first_char(response, ground_truth, **_):
    """Raises JudgeDown for responses whose first character is even (or that are empty): a group is
    informative exactly when some of its calls failed and some did not."""
    from tests.workers.pool_rewards import JudgeDown

    if not response or ord(response[0]) % 2 == 0:
        raise JudgeDown("judge unreachable")
    return 1.0


def test_reward_failures_by_type_and_throughput_reach_the_batch(setup):
    ds, urls = setup
    p = _producer(ds, urls, _fails_on_even_first_char, staleness=0)
    p.start()
    try:
        info = p.take_batch(0, timeout_s=120)
    finally:
        p.stop()
    assert len(info.groups) == 3 and all(
        g.reward_failure_types == {"JudgeDown": g.reward_failures} for g in info.groups
    )
    assert info.reward_failures >= 3  # each kept group holds a failed call
    assert info.reward_failure_types == {"JudgeDown": info.reward_failures}
    assert info.reward_calls_per_s > 0


def test_a_raising_reward_exhausts_with_its_failures_named(setup):
    from megatron_dapo.coordinator.producer import DynamicSamplingExhausted
    from tests.workers.pool_rewards import always_raises

    ds, urls = setup
    p = _producer(ds, urls, always_raises, staleness=0, B=2, max_gen=2)
    p.start()
    try:
        with pytest.raises(
            DynamicSamplingExhausted,
            match=r"4 all-wrong groups.*reward function failed in 4 of the 4 groups \(16 calls: JudgeDown 16;",
        ):
            p.take_batch(0, timeout_s=120)
    finally:
        p.stop()


def test_dispatch_never_starts_more_groups_than_max_num_gen_batches_allows():
    """max_num_gen_batches x gen_batch_size bounds the groups judged towards one batch: with groups still in
    flight, no more start than would take the count past it (else the groups dispatched while the last
    ones were being judged overshoot it, by up to a batch's worth, depending on timing)."""
    from megatron_dapo.coordinator.producer import ProducerSettings, RolloutProducer
    from megatron_dapo.data.dataset import PromptSampler
    from megatron_dapo.rollout.types import SamplingParams

    settings = ProducerSettings(
        train_batch_size=2,
        n=4,
        sampling=SamplingParams(max_new_tokens=4),
        max_response_length=4,
        staleness=1,
        gen_batch_size=2,
        max_num_gen_batches=2,  # 4 groups
    )
    p = RolloutProducer(None, None, PromptSampler(100, seed=0), None, settings)

    st = p.state

    def dispatchable():  # as the producer's loop calls it: under its lock
        with st.cv:
            return p.filler.dispatchable()

    first = dispatchable()
    assert len(first) == 4  # two buffers of 2: all four may be judged
    st.counters.judged = 1  # one of them judged (dropped by the filter), three still in flight
    st.slots.release(first[0][1])
    assert dispatchable() == []  # 1 judged + 3 in flight = the limit
    st.counters.judged = 4
    for _, draw, _ in first[1:]:
        st.slots.release(draw)
    assert dispatchable() == [] and p.signals.exhausted

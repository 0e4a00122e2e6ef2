"""Staleness by reservation (reserve / occupy / consume) and partial-rollout merging: pure, fast."""

import asyncio
import random
from dataclasses import replace

import pytest

from megatron_dapo.coordinator import (
    StalenessController,
    StalenessError,
    continuation_ids,
    finish_partial,
    merge_continuation,
)
from megatron_dapo.coordinator.groups import token_versions
from megatron_dapo.coordinator.staleness import EMPTY, OCCUPIED, RESERVED
from megatron_dapo.rollout.types import Sample, SamplingParams, WeightVersionSpan
from tests.fake_clock import FakeClock


def test_reserve_fills_from_the_back_and_occupy_takes_the_earliest_slot():
    clock = FakeClock()
    c = StalenessController(slots=3, staleness=1, clock=clock)
    assert c.reservable(0) == 6  # buffers 0 and 1
    # worst case first: the highest buffer <= V_traj + s, its last empty slot
    assert [c.reserve(k, 0) for k in "abcd"] == [(1, 2), (1, 1), (1, 0), (0, 2)]
    clock.t = 5.0
    # completed: "d", reserved earlier (buffer 0) and allowed in buffer 1, takes the slot "c" leaves;
    # "c" takes the earliest empty slot, buffer 0
    assert c.occupy("c", "C") == (0, 0) and c.where["d"] == (1, 0)
    assert c.reserve("e", 0) == (0, 2)  # buffer 1 is full: the last empty slot of buffer 0
    assert c.reserve("f", 0) == (0, 1)
    assert c.oldest_reservation_age() == 5.0
    c.release("a")  # dropped by dynamic sampling: the slot is free for a fresh prompt
    assert c.count(RESERVED) == 4 and c.count(OCCUPIED) == 1 and c.reservable(0) == 1
    # "b" (reserved in buffer 1) completes first: it swaps with the earliest in-flight group whose
    # bound allows buffer 1 ("f", V_traj 0), so the trainer's next buffer fills in completion order
    assert c.occupy("b", "B") == (0, 1) and c.where["f"] == (1, 1)
    with pytest.raises(StalenessError, match="already holds a slot"):
        c.reserve("b", 0)
    with pytest.raises(StalenessError, match="holds no reservation"):
        c.occupy("c", "again")
    with pytest.raises(StalenessError, match="not full"):
        c.consume()
    for k in "def":
        c.occupy(k, k.upper())
    assert c.ready() and c.consume() == ["C", "B", "D"] and c.next_buffer == 1
    assert [item for _, _, item in c.occupied_items()] == ["E", "F"]


def test_staleness_zero_dispatches_nothing_while_the_batch_trains():
    c = StalenessController(slots=2, staleness=0)
    for k in "ab":
        c.reserve(k, 0)
        c.occupy(k, k)
    c.consume()  # step 0 trains with version 0: buffer 1 needs version-1 samples
    assert c.reservable(0) == 0 and c.reserve("c", 0) is None
    assert c.reservable(1) == 2


def test_occupy_moves_the_earliest_reservation_later_even_past_an_empty_slot():
    # PSRL's occupy: the slot a completed group leaves always goes to the earliest in-flight group
    # that may wait there, so buffer 0 is left to groups that complete, not to "u" that may be slow
    c = StalenessController(slots=3, staleness=1)
    assert [c.reserve(k, 0) for k in "xyzwut"] == [(1, 2), (1, 1), (1, 0), (0, 2), (0, 1), (0, 0)]
    c.release("t")  # dropped: (0, 0) is empty, before "u"'s reservation
    assert c.occupy("x", "X") == (0, 0)
    assert c.where["u"] == (1, 2) and c.where["w"] == (0, 2) and c.count(RESERVED, 0) == 1
    assert c.reserve("v", 0) == (0, 1)


def test_a_group_never_swaps_into_a_slot_beyond_the_other_groups_bound():
    c = StalenessController(slots=1, staleness=1)
    assert c.reserve("old", 0) == (1, 0)
    assert c.reserve("older", 0) == (0, 0)
    c.occupy("old", "O")  # "older" may move to buffer 1 (0 + 1): swap
    assert c.where == {"old": (0, 0), "older": (1, 0)}
    c.consume()
    assert c.reserve("new", 1) == (2, 0)
    c.occupy("new", "N")  # "older" may not move to buffer 2: "new" stays in its own slot
    assert c.where == {"new": (2, 0), "older": (1, 0)}


def test_restore_checks_the_bound_and_the_slot():
    c = StalenessController(slots=2, staleness=1, next_buffer=3)
    c.restore("a", 2, 3, 1, "A")
    with pytest.raises(StalenessError, match="cannot sit in buffer 5"):
        c.restore("b", 3, 5, 0, "B")
    with pytest.raises(StalenessError, match="taken"):
        c.restore("c", 3, 3, 1, "C")
    c.restore("e", 3, 4, 1, state=RESERVED)  # in flight at save time: dispatched again
    assert c.reserve("d", 3) == (4, 0)
    c.occupy("e", "E")
    assert [item for _, _, item in c.occupied_items()] == ["E", "A"]  # the earliest slot: (3, 0)


def _simulate(
    rng: random.Random,
    slots: int,
    staleness: int,
    steps: int,
    p_drop: float,
    lazy: bool = False,
    extra: int = 0,
    retry: int = 0,
):
    """One run of the protocol: a producer that dispatches whenever it may (`lazy`: only some of the
    groups it may, as a producer short of prompts or server room does), groups that complete in a
    random order (some dropped by dynamic sampling), a trainer that consumes ready buffers and syncs
    weights at random times. `extra`: redundant slots per buffer (surplus groups dropped by the
    controller); `retry`: the proactive filter's threshold (0 = off), applied whenever the trainer
    waits. Checks every invariant along the way."""
    from megatron_dapo.coordinator.retry import ProactiveRetry

    clock = FakeClock()
    c = StalenessController(slots, staleness, clock=clock, extra=extra)
    policy = ProactiveRetry(retry, clock) if retry else None
    version, draw = 0, 0
    in_flight: dict[int, int] = {}  # draw -> V_traj
    dispatched, dropped, kept, trained, given_up = [], set(), set(), [], set()
    planned: dict[int, int] = {}  # completed draw -> the buffer it occupied
    while c.next_buffer < steps:
        n = c.reservable(version)
        for _ in range(rng.randint(0 if in_flight else min(n, 1), n) if lazy else n):
            b, _ = c.reserve(draw, version)
            assert version <= b + staleness and b <= version + staleness
            in_flight[draw] = version
            dispatched.append(draw)
            draw += 1
        actions = []
        if in_flight:
            actions += ["complete"] * 3
        waiting = version == c.next_buffer  # the trainer holds the newest weights: it waits for data
        if c.ready() and waiting:
            actions.append("consume")
        if version < c.next_buffer:  # a step trained: its weights reach the servers at some point
            actions.append("sync")
        if policy is not None and policy.should_retry(c, waiting):
            actions += ["retry"] * 2
        assert actions, "deadlock: nothing in flight, nothing to train, nothing to sync"
        act = rng.choice(actions)
        if act == "complete":
            key = rng.choice(sorted(in_flight))
            v_traj = in_flight.pop(key)
            if rng.random() < p_drop:
                c.release(key)
                dropped.add(key)
            else:
                reserved_in = c.where[key][0]
                b, _ = c.occupy(key, (key, v_traj, version))  # tokens come from versions in [V_traj, version]
                assert b <= reserved_in <= v_traj + staleness
                planned[key] = b
                kept.add(key)
            for k in c.take_dropped():  # surplus reservations of a buffer that just filled
                assert extra > 0
                in_flight.pop(k)
                given_up.add(k)
        elif act == "retry":
            out = policy.apply(c, waiting)
            assert c.ready() and out.buffer == c.next_buffer and len(out.moved) == out.gap
            for k in out.aborted:
                in_flight.pop(k)
                given_up.add(k)
            for k in out.moved:
                assert c.where[k][0] < planned[k]  # moved down: trained earlier, staleness only drops
                planned[k] = c.where[k][0]
        elif act == "consume":
            b = c.next_buffer
            items = c.consume()
            assert len(items) == slots  # every buffer fills
            for key, v_traj, _ in items:
                assert 0 <= b - v_traj <= staleness  # the bound, worst token included (all >= V_traj)
                trained.append(key)
        else:
            version += 1
        # slot invariants: every placed key is where the controller says; reservations are exactly
        # the groups in flight; no buffer holds more than `slots` completed groups
        assert {k for k, (b, i) in c.where.items() if c.buffers[b][i].key == k} == set(c.where)
        assert {k for k, (b, i) in c.where.items() if c.buffers[b][i].state == RESERVED} == set(in_flight)
        assert all(
            sum(s.state == OCCUPIED for s in buf) <= slots and len(buf) == slots + extra for buf in c.buffers.values()
        )
        # the controller's per-buffer tallies are what a scan of the slots counts
        assert all(
            c.count(state, b) == sum(s.state == state for s in buf)
            for b, buf in c.buffers.items()
            for state in (EMPTY, RESERVED, OCCUPIED)
        )
        clock.t += rng.random()
    waiting_items = [item[0] for _, _, item in c.occupied_items()]
    # no prompt lost or duplicated; nothing completed was discarded except surplus / given-up groups
    assert len(trained) == len(set(trained)) == steps * slots
    assert sorted(trained + waiting_items + list(in_flight) + sorted(dropped) + sorted(given_up)) == dispatched
    assert kept == set(trained) | set(waiting_items)
    if not extra and not retry:
        assert not given_up
    return {"dropped": len(dropped), "given_up": len(given_up), "retries": len(policy.history) if policy else 0}


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
def test_property_bound_kept_and_nothing_lost(staleness, lazy):
    total_dropped = 0
    for seed in range(40):
        rng = random.Random(1000 * staleness + seed)
        total_dropped += _simulate(
            rng,
            slots=rng.randint(1, 6),
            staleness=staleness,
            steps=rng.randint(3, 12),
            p_drop=rng.choice([0.0, 0.3, 0.7]),
            lazy=lazy,
        )["dropped"]
    assert total_dropped > 0  # dynamic sampling was exercised


@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
def test_property_with_redundant_slots_and_proactive_retry(staleness):
    """The same invariants with surplus reservations per buffer and the proactive filter on: the bound
    holds, every buffer trains exactly B groups, and every dispatched prompt is trained, waiting, in
    flight, dropped by dynamic sampling, or given up (surplus / retried) -- never lost or twice."""
    given_up = retries = 0
    for seed in range(40):
        rng = random.Random(7000 + 1000 * staleness + seed)
        out = _simulate(
            rng,
            slots=rng.randint(1, 6),
            staleness=staleness,
            steps=rng.randint(3, 12),
            p_drop=rng.choice([0.0, 0.3]),
            lazy=rng.random() < 0.5,
            extra=rng.choice([0, 1, 3]),
            retry=rng.choice([0, 1, 2, 4]),
        )
        given_up, retries = given_up + out["given_up"], retries + out["retries"]
    assert given_up > 0
    if staleness > 0:
        assert retries > 0  # the proactive filter was exercised (it needs later buffers)


def _piece(out, version, reason, spans=(), prompt=(1, 2)):
    return Sample(
        rid="x",
        prompt_ids=list(prompt),
        output_ids=list(out),
        logprobs=[-0.1 * t for t in out],
        finish_reason=reason,
        weight_version=version,
        weight_versions=[WeightVersionSpan(*s) for s in spans],
        text="".join(chr(96 + t) for t in out),
        group_id="g",
        index=2,
    )


def test_merge_continuation_keeps_tokens_logprobs_and_versions():
    a = replace(_piece([1, 2, 3], "4", "abort"), num_retractions=1)
    b = _piece([4, 5], "5", "abort", prompt=(1, 2, 1, 2, 3))
    c = replace(
        _piece([6], "6", "stop", spans=[("5", 0, 0), ("6", 0, 1)], prompt=(1, 2, 1, 2, 3, 4, 5)), num_retractions=2
    )
    m = merge_continuation(merge_continuation(a, b), c)
    assert m.num_retractions == 3  # every piece's
    assert m.prompt_ids == [1, 2] and m.output_ids == [1, 2, 3, 4, 5, 6] and m.index == 2
    assert m.logprobs == pytest.approx([-0.1 * t for t in range(1, 7)]) and m.text == "abcdef"
    assert m.finish_reason == "stop" and token_versions(m) == [4, 4, 4, 5, 5, 6]
    # an empty last piece at a newer version does not relabel the tokens
    same = merge_continuation(_piece([1], "3", "abort"), _piece([], "4", "abort", prompt=(1, 2, 1)))
    assert token_versions(same) == [3] and same.weight_version == "3" and same.aborted


def test_finish_partial_continues_with_fewer_tokens_and_gives_up_without_progress():
    calls = []

    async def generate(so_far, sampling):
        input_ids = continuation_ids(so_far)
        calls.append((input_ids, sampling.max_new_tokens, sampling.sampling_seed))
        n = len(input_ids) - 2
        return _piece([n + 1], str(n), "abort" if n < 3 else "stop", prompt=input_ids)

    sp = SamplingParams(max_new_tokens=10, sampling_seed=7)
    resumes = []
    out = asyncio.run(finish_partial(generate, _piece([1], "0", "abort"), sp, on_resume=lambda: resumes.append(1)))
    assert out.output_ids == [1, 2, 3, 4] and out.finish_reason == "stop" and len(resumes) == 3
    assert calls == [([1, 2, 1], 9, 7), ([1, 2, 1, 2], 8, 7), ([1, 2, 1, 2, 3], 7, 7)]
    assert token_versions(out) == [0, 1, 2, 3]

    async def stuck(so_far, sampling):
        return _piece([], "0", "abort", prompt=continuation_ids(so_far))

    with pytest.raises(RuntimeError, match="without a new token"):
        asyncio.run(finish_partial(stuck, _piece([1], "0", "abort"), sp, max_stalls=2))
    full = asyncio.run(finish_partial(stuck, _piece(list(range(1, 11)), "0", "abort"), sp))
    assert full.finish_reason == "length" and len(full.output_ids) == 10

"""The simulator (megatron_dapo.sim): engine timing against a per-step reference, the real coordinator
end to end in virtual time (bound kept, nothing lost), lengths, the CLI."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import math
import random
import re
from pathlib import Path

import pytest

from megatron_dapo.config.cost_model import CostModel
from megatron_dapo.sim.engine import SimEngine
from megatron_dapo.sim.vtime import run_virtual

COST = CostModel(a_b=2e-3, a_k=1e-6, o_thr=5e-3, o_b=1e-3, o_k=0.5e-3)


def reference_finish_times(cost, arrivals, max_running, static=False, split=False, calls=None):
    """A naive engine stepping token by token: arrivals (time, input, target) join at the first step
    boundary at or after their time (FIFO, up to max_running), each join prefilling its input
    (cost.p_k per token, nothing decodes meanwhile; what arrives during a prefill joins the next one,
    before the decode step); returns each request's finish time.
    static (the embedded server's batching): only into an empty engine; split: after a batch ends
    everything waiting joins, but on arrivals at an idle engine only the entries of the first one's call
    (`calls[i]`, default: each its own)."""
    calls = calls or list(range(len(arrivals)))
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    running, done, t, batch_ended = {}, {}, 0.0, False
    while len(done) < len(arrivals):
        while True:
            joined = []
            may_join = not (static and running)
            first_call = calls[pending[0]] if pending else None
            while may_join and pending and arrivals[pending[0]][0] <= t and len(running) < max_running:
                if split and not batch_ended and calls[pending[0]] != first_call:
                    break
                i = pending.pop(0)
                running[i] = 0
                joined.append(i)
            batch_ended = False
            if not joined:
                break
            t += cost.p_k * sum(arrivals[i][1] for i in joined)
        if not running:
            t = max(t, arrivals[pending[0]][0])
            continue
        kv = sum(arrivals[i][1] + g for i, g in running.items())
        t += cost.a_b + cost.a_k * kv + max(cost.o_thr, cost.o_b + cost.o_k * len(running))
        for i in list(running):
            running[i] += 1
            if running[i] == arrivals[i][2]:
                done[i] = t
                del running[i]
        batch_ended = not running
    return [done[i] for i in range(len(arrivals))]


def engine_finish_times(
    cost, arrivals, max_running, kv_capacity=10**9, admission=None, engine_cls=SimEngine, calls=None
):
    calls = calls or list(range(len(arrivals)))

    async def main():
        loop = asyncio.get_running_loop()
        engine = engine_cls(cost, kv_capacity, max_running, loop=loop, admission=admission)
        times = [None] * len(arrivals)

        def submit(i):
            fut = engine.submit(f"r{calls[i]}-{i}", arrivals[i][1], arrivals[i][2])
            fut.add_done_callback(lambda f: times.__setitem__(i, (loop.time(), f.result())))

        for i, (at, _, _) in enumerate(arrivals):
            loop.call_at(at, submit, i)
        while any(t is None for t in times):
            await asyncio.sleep(1.0)
        return times, engine

    return run_virtual(main())


def test_engine_two_requests_by_hand():
    # A (10 input, 3 new) and B (20 input, 5 new) at t=0: three steps with n=2, then two with n=1
    # after A's KV is freed (B holds 20 + 3 tokens then).
    times, engine = engine_finish_times(COST, [(0.0, 10, 3), (0.0, 20, 5)], max_running=8)
    flat2, flat1 = COST.a_b + max(COST.o_thr, COST.o_b + 2 * COST.o_k), COST.a_b + max(COST.o_thr, COST.o_b + COST.o_k)
    t_a = sum(flat2 + COST.a_k * (30 + 2 * k) for k in range(3))
    t_b = t_a + sum(flat1 + COST.a_k * (23 + k) for k in range(2))
    assert times[0][0] == pytest.approx(t_a, rel=1e-12)
    assert times[1][0] == pytest.approx(t_b, rel=1e-12)
    assert [r.generated for _, r in times] == [3, 5] and not any(r.aborted for _, r in times)
    assert engine.stats.tokens == 8 and engine.stats.busy_s == pytest.approx(t_b, rel=1e-12)


def test_engine_matches_per_step_reference_with_arrivals_mid_step():
    rng = random.Random(3)
    arrivals = [(rng.uniform(0, 2.0), rng.randint(5, 300), rng.randint(1, 400)) for _ in range(60)]
    ref = reference_finish_times(COST, arrivals, max_running=16)
    times, engine = engine_finish_times(COST, arrivals, max_running=16)
    assert [t for t, _ in times] == pytest.approx(ref, rel=1e-9)
    assert engine.stats.tokens == sum(a[2] for a in arrivals)
    assert engine.stats.steps < 2 * len(arrivals) + sum(a[2] for a in arrivals)  # sanity: counted, not looped


@pytest.mark.parametrize("split", [False, True])
def test_static_batch_engines_match_the_per_step_reference_of_the_embedded_batching(split):
    from megatron_dapo.sim.static_engine import SplitArrivalsEngine, StaticBatchEngine

    rng = random.Random(5)
    # at t = 0 one /generate of three entries (always one batch) and another call of two, then random singles
    arrivals = [(0.0, 10, 50), (0.0, 10, 70), (0.0, 10, 90), (0.0, 20, 30), (0.0, 20, 40)]
    calls = ["a", "a", "a", "b", "b"]
    arrivals += [(rng.uniform(0, 2.0), rng.randint(5, 300), rng.randint(1, 400)) for _ in range(40)]
    calls += [f"c{i}" for i in range(40)]
    ref = reference_finish_times(COST, arrivals, max_running=16, static=True, split=split, calls=calls)
    # split: the second call waits for the first one's batch; else the burst is one batch
    assert (min(ref[3:5]) > max(ref[:3])) == split
    times, engine = engine_finish_times(
        COST, arrivals, max_running=16, calls=calls, engine_cls=SplitArrivalsEngine if split else StaticBatchEngine
    )
    assert [t for t, _ in times] == pytest.approx(ref, rel=1e-9)
    assert engine.stats.tokens == sum(a[2] for a in arrivals)
    # both differ from continuous batching here: late arrivals wait for the running batch's longest request
    assert max(ref) > max(reference_finish_times(COST, arrivals, max_running=16, calls=calls)) * 1.05


def test_engine_prefill_matches_per_step_reference():
    """Admissions cost p_k per input token and stall decoding, as in the naive reference."""
    cost = dataclasses.replace(COST, p_k=2e-5)
    rng = random.Random(5)
    arrivals = [(rng.uniform(0, 2.0), rng.randint(5, 3000), rng.randint(1, 400)) for _ in range(60)]
    ref = reference_finish_times(cost, arrivals, max_running=16)
    times, engine = engine_finish_times(cost, arrivals, max_running=16)
    assert [t for t, _ in times] == pytest.approx(ref, rel=1e-9)
    assert engine.stats.prefill_s == pytest.approx(2e-5 * sum(a[1] for a in arrivals), rel=1e-9)
    free = engine_finish_times(COST, arrivals, max_running=16)[0]
    assert all(t > f for (t, _), (f, _) in zip(times, free))  # prefill delays every request


def test_engine_sglang_admission_holds_back_room_for_running_outputs():
    """SGLang's budget: C (input 700) fits the pool's free tokens but not once A's and B's remaining
    outputs are reserved, so it waits for A to finish; greedy admission takes it at once."""
    from megatron_dapo.sim.engine import KVAdmission

    adm = KVAdmission(init_ratio=0.5, min_factor=0.2, decay_steps=10, clip_new_tokens=100)
    arrivals = [(0.0, 100, 50), (0.0, 100, 80), (0.0, 700, 5)]

    async def run(admission):
        loop = asyncio.get_running_loop()
        engine = SimEngine(COST, 1000, 8, loop=loop, admission=admission)
        futs = [engine.submit(f"r{i}", inp, tgt, max_new=300) for i, (_, inp, tgt) in enumerate(arrivals)]
        starts = {}
        while len(starts) < 3:
            starts.update({rid: engine.step for rid in engine.running if rid not in starts})
            await asyncio.sleep(COST.step_time(1, 0) / 4)
        await asyncio.gather(*futs)
        return starts, engine

    starts, engine = run_virtual(run(adm))
    # A's KV 100 + B's need 100 + min(300, 100) = 200 <= 1000 - 100 - 0.5 * 100; C needs 700 + 100 more
    # than 1000 - 200 - 0.5 * 200 = 700 leaves, and only A's end (step 50) frees enough
    assert starts == {"r0": 0, "r1": 0, "r2": 50}
    assert engine.ratio == pytest.approx(adm.min_ratio)  # decayed by (0.5 - 0.1) / 10 per step, floored
    greedy, _ = run_virtual(run(None))
    assert greedy == {"r0": 0, "r1": 0, "r2": 0}


def test_engine_held_back_tokens_kept_without_a_scan_equal_the_scan():
    """The running requests' held-back tokens, kept incrementally (clip, then linear), equal the sum
    min(max_new - generated, clip) over them at every event of a run with retractions and aborts."""
    from megatron_dapo.sim.engine import KVAdmission

    adm = KVAdmission(clip_new_tokens=50)
    rng = random.Random(7)

    async def main():
        loop = asyncio.get_running_loop()
        engine = SimEngine(COST, kv_capacity=3000, max_running=16, loop=loop, admission=adm)
        checked = 0
        futs = []
        for i in range(120):
            target = rng.randint(1, 200)
            futs.append(engine.submit(f"r{i}", rng.randint(5, 300), target, max_new=target + rng.randint(0, 100)))
            if rng.random() < 0.1:
                engine.abort(f"r{rng.randrange(i + 1)}")
            await asyncio.sleep(rng.uniform(0, 0.05))
            engine.catch_up()
            scan = sum(min(r.max_new - engine._out(r), adm.clip_new_tokens) for r in engine.running.values())
            assert engine._held() == scan
            checked += bool(engine.running)
        await asyncio.gather(*futs)
        return engine, checked

    engine, checked = run_virtual(main())
    assert engine.stats.retractions > 0 and checked > 50 and engine._held() == 0


def test_engine_retracts_fewest_generated_first_and_resets_the_ratio():
    from megatron_dapo.sim.engine import KVAdmission

    adm = KVAdmission(init_ratio=0.01, min_factor=1.0, clip_new_tokens=1, retract_decode_steps=20)

    async def main():
        loop = asyncio.get_running_loop()
        engine = SimEngine(COST, kv_capacity=200, max_running=8, loop=loop, admission=adm)
        old = engine.submit("old", 50, 60, max_new=100)
        await asyncio.sleep(COST.step_time(1, 50) * 10.5)  # "old" has 10 tokens (+1 in the step in progress)
        new = engine.submit("new", 50, 60, max_new=100)
        seen = []
        while not old.done():
            if engine.stats.retractions and not seen:
                seen.append((dict(engine.running), engine.ratio, engine._out(engine.running["old"])))
            await asyncio.sleep(COST.step_time(2, 100) / 3)
        await new
        return seen, engine

    seen, engine = run_virtual(main())
    running, ratio, out = seen[0]
    # the pool (200) fills when 50 + 50 + 11 + 2k > 200: "new" has fewer tokens, so it goes
    assert list(running) == ["old"] and engine.stats.retractions == 1
    assert ratio == pytest.approx((out + 20 * 1) / (100 + 1))


def test_engine_abort_returns_tokens_and_kv_pool_retracts():
    async def main():
        loop = asyncio.get_running_loop()
        engine = SimEngine(COST, kv_capacity=120, max_running=8, loop=loop)
        a = engine.submit("a", 50, 40)
        b = engine.submit("b", 50, 40)  # both fit at first (100 <= 120); at 10 steps each the pool is full
        await asyncio.sleep(COST.step_time(2, 100) * 3.5)  # mid-step 4
        engine.abort("a")
        ra = await a
        rb = await b
        return ra, rb, engine

    ra, rb, engine = run_virtual(main())
    assert ra.aborted and ra.generated == 4  # the step in progress completes before the abort takes effect
    assert not rb.aborted and rb.generated == 40
    assert engine.stats.aborted_tokens == 4


def test_engine_retracts_newest_when_kv_full():
    async def main():
        engine = SimEngine(COST, kv_capacity=130, max_running=8, loop=asyncio.get_running_loop())
        futs = [engine.submit(r, 50, 30) for r in ("old", "new")]
        results = await asyncio.gather(*futs)
        return results, engine

    (old, new), engine = run_virtual(main())
    # after 15 steps (130 tokens) "new" is retracted, keeps 15 tokens, and finishes after "old"
    assert engine.stats.retractions == 1
    assert old.generated == new.generated == 30 and engine.stats.tokens == 60


# ---- the real coordinator in virtual time ------------------------------------------------------


def tiny_cfg(staleness, policy="all_at_once", pause_mode="in_place", **extra):
    from megatron_dapo.config.load import load_config

    over = [
        f"algo.staleness={staleness}",
        f"rollout.sync.policy={policy}",
        f"rollout.sync.pause_mode={pause_mode}",
        "algo.train_batch_size=6",
        "rollout.n_resp_per_prompt=4",
        "data.max_response_length=400",
        "algo.overlong_buffer.len=100",
        "rollout.num_servers=2",
        *[f"{k}={v}" for k, v in extra.items()],
    ]
    return load_config("configs/qwen3/tiny_qwen3_cpu.yaml", over, validate=False)


def tiny_world(**kw):
    from megatron_dapo.planner.lengths import dapo_like
    from megatron_dapo.sim.world import World

    args = dict(
        cost=COST,
        kv_capacity=200_000,
        max_running=64,
        train_s=lambda tokens: tokens / 5000.0,
        sync_s=0.5,
        keep_prob=0.6,
        lengths=dapo_like(400),
        prompt_len=40,
        token_unit=2,
        steps=4,
        warmup_steps=1,
    )
    return World(**{**args, **kw})


def expected_units(cfg, world, group, sample):
    """The length model's total for this sample's seed (in ids of token_unit tokens)."""
    from megatron_dapo.coordinator.producer import sample_seed

    # its seed index: the position it was drawn at (with redundant samples, rid "...-s<i>-..." says which
    # of the N' it was; the kept n are renumbered)
    drawn = re.search(r"-s(\d+)-", sample.rid)
    seed = sample_seed(cfg.trainer.seed, group.draw, int(drawn.group(1)) if drawn else sample.index)
    total = world.lengths.total(group.prompt_index + 1, seed)
    return min(math.ceil(400 / world.token_unit), math.ceil(total / world.token_unit))


ADVANCED = {
    "rollout.routing.method": "throughput_optimal",
    "rollout.routing.delta_throughput_threshold": 0.2,
    "rollout.routing.server_order": "reserve_capability",
    "rollout.queue.policy": "priority",
    "rollout.migration.enabled": "true",
    "rollout.migration.indicator": "throughput",
    "rollout.migration.threshold": 5,
    "rollout.retry.enabled": "true",
    "rollout.retry.threshold": 4,
}


@pytest.mark.parametrize(
    "staleness,policy,pause_mode,extra",
    [
        (0, "all_at_once", "in_place", {}),
        (2, "all_at_once", "abort", {}),
        (1, "greedy", "abort", {}),
        (2, "status_based", "in_place", {}),
        (2, "status_based", "abort", ADVANCED),
        (1, "all_at_once", "in_place", {"rollout.redundancy.extra_samples": 2, "rollout.redundancy.extra_prompts": 2}),
    ],
)
def test_simulation_keeps_the_bound_and_loses_nothing(staleness, policy, pause_mode, extra):
    from megatron_dapo.sim.world import simulate

    cfg, world = (
        tiny_cfg(
            staleness,
            policy,
            pause_mode,
            **{
                "rollout.sync.threshold": 1.0,
                "rollout.sync.indicator": "kv_cache",
                "rollout.loads.interval_ms": 50,
                **extra,
            },
        ),
        tiny_world(),
    )
    r = simulate(cfg, world)
    assert len(r.batches) == 5 and r.steps == 4
    draws = [g.draw for info in r.batches for g in info.groups]
    assert len(draws) == len(set(draws)) == 5 * 6  # no group trained twice
    for step, info in enumerate(r.batches):
        assert max(info.staleness) <= staleness and sum(info.staleness.values()) == 6
        for g in info.groups:
            assert len(g.samples) == 4 and g.kept
            assert step - g.min_version <= staleness
            for s in g.samples:  # aborted and continued samples come back whole: the seed's full length
                assert s.finish_reason in ("stop", "length")
                assert len(s.output_ids) == expected_units(cfg, world, g, s)
    assert r.max_staleness <= staleness and 0 < r.rollout_busy <= 1 and 0 < r.trainer_busy <= 1
    if pause_mode == "abort":
        assert r.aborted_tokens > 0  # the syncs aborted requests, which partial rollout continued


@pytest.mark.parametrize("batching", ["static", "static_split"])
def test_simulation_with_embedded_batching_keeps_the_bound_and_loses_nothing(batching):
    from megatron_dapo.sim.world import simulate

    cfg, world = tiny_cfg(1, "status_based", "in_place"), tiny_world(batching=batching)
    r = simulate(cfg, world)
    draws = [g.draw for info in r.batches for g in info.groups]
    assert len(draws) == len(set(draws)) == 5 * 6 and r.max_staleness <= 1
    for info in r.batches:
        for g in info.groups:
            assert all(len(s.output_ids) == expected_units(cfg, world, g, s) for s in g.samples)
    # a batch runs to its end before waiting requests start: slower than continuous batching here
    assert r.step_s > simulate(cfg, tiny_world()).step_s


def test_routing_refusals_are_counted_per_batch():
    from megatron_dapo.sim.world import simulate

    def refusals(**extra):
        r = simulate(tiny_cfg(1, **extra), tiny_world())
        return [info.coordination["routing_refusals"] for info in r.batches]

    assert sum(refusals()) == 0  # least_outstanding never refuses
    # one request per server at a time, 6 groups (one request each) per batch on 2 servers: the rest wait
    capped = refusals(**{"rollout.routing.method": "request_num_balance", "rollout.concurrency": 1})
    assert all(n > 0 for n in capped)


def test_async_beats_sync_and_ends_match_step_times():
    from megatron_dapo.sim.world import simulate

    world = tiny_world()
    sync, async2 = simulate(tiny_cfg(0), world), simulate(tiny_cfg(2), world)
    assert async2.tokens_per_s > 1.2 * sync.tokens_per_s
    # synchronous: the trainer never overlaps generation, so a step is generation + train + sync
    assert sync.trainer_busy < 0.5 and sync.mean_staleness == 0
    assert async2.mean_staleness > 0


def test_produced_tokens_count_the_groups_held_for_later_steps():
    """What a run banks (completed groups held for later steps) is what its continuation trains next:
    the same run, three steps longer, trains exactly those groups after the shorter run's end."""
    from megatron_dapo.sim.world import simulate

    def tokens(g, unit):
        return unit * sum(len(s.prompt_ids) + len(s.output_ids) for s in g.samples)

    world = tiny_world(warmup_steps=0, steps=3)
    short, longer = simulate(tiny_cfg(2), world), simulate(tiny_cfg(2), tiny_world(warmup_steps=0, steps=6))
    draws = lambda r: [[g.draw for g in info.groups] for info in r.batches[:3]]  # noqa: E731
    assert draws(longer) == draws(short)  # the same run up to the shorter one's end
    assert short.banked_draws  # not vacuous: staleness 2 lets groups complete ahead of their step
    later = {g.draw: g for info in longer.batches[3:] for g in info.groups}
    assert set(short.banked_draws) <= set(later)
    banked = sum(tokens(later[d], world.token_unit) for d in short.banked_draws)
    assert short.banked_change == banked  # window from t = 0: nothing banked at its start
    trained = sum(tokens(g, world.token_unit) for info in short.batches for g in info.groups)
    assert short.produced_per_s * short.wall_s == pytest.approx(trained + banked)
    assert short.tokens_per_s * short.wall_s == pytest.approx(trained)
    sync = simulate(tiny_cfg(0), world)  # a synchronous step trains all it generated
    assert sync.banked_change == 0 and sync.produced_per_s == sync.tokens_per_s


# ---- lengths and the CLI -----------------------------------------------------------------------


def test_lognormal_fit_reproduces_mean_and_cut_fraction():
    from megatron_dapo.planner.lengths import dapo_like, fit_lognormal

    truth = dapo_like(20480)
    xs = [truth.total(i % 500, i) for i in range(20000)]
    mean, cut = sum(xs) / len(xs), sum(x >= 20480 for x in xs) / len(xs)
    fit = fit_lognormal(mean, cut, 20480)
    ys = [fit.total(i % 500, i + 10**6) for i in range(20000)]
    assert sum(ys) / len(ys) == pytest.approx(mean, rel=0.08)
    assert sum(y >= 20480 for y in ys) / len(ys) == pytest.approx(cut, abs=0.02)


def test_cli_prints_table_and_rejects_bad_lengths(tmp_path, capsys):
    from megatron_dapo.sim.cli import main

    out = tmp_path / "rows.json"
    argv = [
        "configs/qwen3/tiny_qwen3_cpu.yaml",
        "algo.train_batch_size=4",
        "rollout.n_resp_per_prompt=4",
        "data.max_response_length=256",
        "algo.overlong_buffer.len=64",
        "--step-time",
        "0.5",
        "--steps",
        "2",
        "--warmup-steps",
        "1",
        "--staleness",
        "0,1",
        "--modes",
        "sync,async",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "sync | 0 |" in text and "async | 1 |" in text
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["staleness"]) for r in rows] == [("sync", 0), ("async", 1)]
    bad = tmp_path / "lengths.json"
    bad.write_text('{"lengths": []}')
    assert main([*argv[:-2], "--lengths", str(bad)]) == 2
    assert "--lengths" in capsys.readouterr().err
    flops_timed = [a for a in argv[:-2] if a not in ("--step-time", "0.5")]  # plan's estimate, at --mfu 0
    assert main([*flops_timed, "--mfu", "0"]) == 2
    assert "simulate error: --mfu=0.0 must be in (0, 1]" in capsys.readouterr().err


def test_ceiling_mode_frees_the_trainer_and_the_syncs_only(tmp_path, capsys):
    from megatron_dapo.sim.cli import main

    out = tmp_path / "rows.json"
    argv = [
        "configs/qwen3/tiny_qwen3_cpu.yaml",
        "algo.train_batch_size=4",
        "rollout.n_resp_per_prompt=4",
        "data.max_response_length=256",
        "algo.overlong_buffer.len=64",
        "--step-time",
        "30",
        "--sync-s",
        "10",
        "--steps",
        "2",
        "--warmup-steps",
        "1",
        "--staleness",
        "1,2",
        "--modes",
        "async,ceiling",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    rows = {(r["mode"], r["staleness"]): r for r in json.loads(out.read_text())}
    assert set(rows) == {("async", 1), ("async", 2), ("ceiling", 2)}  # the ceiling at the largest staleness
    ceiling, async2 = rows["ceiling", 2], rows["async", 2]
    assert ceiling["trainer_busy"] == 0
    # a 30 s step and a 10 s sync bound the async run (trainer busy most of the time); without them the
    # tiny engines train several times faster, and their share of time decoding rises
    assert async2["trainer_busy"] > 0.5
    assert ceiling["tokens_per_s"] > 3 * async2["tokens_per_s"]
    assert ceiling["rollout_busy"] > async2["rollout_busy"]
    text = capsys.readouterr().out
    assert "ceiling | 2 |" in text and "of the ceiling: async@1 " in text


def test_command_line_overrides_win_over_the_mode_switches(monkeypatch):
    from megatron_dapo.sim import cli, world
    from megatron_dapo.sim.world import SimResult

    seen = []

    def fake_simulate(cfg, w):
        seen.append(cfg)
        return SimResult(
            steps=1,
            wall_s=1.0,
            tokens_per_s=1.0,
            rollout_busy=1.0,
            trainer_busy=0.0,
            mean_staleness=0.0,
            max_staleness=0,
            step_s=1.0,
            aborted_tokens=0,
            regenerated_tokens=0,
            retractions=0,
            migrations=0,
        )

    monkeypatch.setattr(world, "simulate", fake_simulate)
    args = cli.build_parser().parse_intermixed_args(
        ["configs/qwen3/qwen3_8b.yaml", "--modes", "advanced,async", "--staleness", "2", "--step-time", "1"]
    )
    cli.run_all(
        args.config,
        ["rollout.migration.enabled=false", "rollout.routing.method=request_num_balance"],
        args,
        out=io.StringIO(),
    )
    advanced, plain = seen
    assert advanced.rollout.sync.policy == "greedy" and advanced.rollout.retry.enabled  # the YAML's
    assert not advanced.rollout.migration.enabled  # ... but the command line's where it says so
    assert advanced.rollout.routing.method == plain.rollout.routing.method == "request_num_balance"
    assert plain.rollout.sync.policy == "all_at_once" and advanced.algo.staleness == plain.algo.staleness == 2


@pytest.mark.parametrize("advanced", sorted(Path("configs/qwen3").glob("advanced_*.yaml")), ids=lambda p: p.stem)
def test_advanced_mode_is_the_advanced_yaml_rollout_switches(advanced):
    from megatron_dapo.config.load import load_config
    from megatron_dapo.sim.cli import ADVANCED_KEYS, mode_overrides

    plain = "configs/qwen3/qwen3_8b.yaml"
    got = load_config(plain, mode_overrides("advanced", advanced), validate=False)
    want, base = load_config(str(advanced), [], validate=False), load_config(plain, [], validate=False)

    def at(cfg, key):
        value = cfg.rollout
        for part in key.split("."):
            value = getattr(value, part)
        return value

    for key in ADVANCED_KEYS:
        if key == "routing":  # the router's cost model is the simulated engines' (--cost-model)
            assert dataclasses.replace(at(got, key), cost_model=None) == dataclasses.replace(
                at(want, key), cost_model=None
            )
        else:
            assert at(got, key) == at(want, key), key
    assert got.rollout.sync.policy == "greedy" and got.rollout.migration.enabled and got.rollout.retry.enabled
    # the simulated setting itself (cluster, batch, staleness) stays the plain config's
    assert (got.rollout.server_tp, got.algo.train_batch_size, got.algo.staleness) == (
        base.rollout.server_tp,
        base.algo.train_batch_size,
        base.algo.staleness,
    )
    assert mode_overrides("async") == ["rollout.sync.policy=all_at_once"]
    with pytest.raises(ValueError, match="--advanced-config"):
        mode_overrides("advanced", "configs/qwen3/nope.yaml")
    with pytest.raises(ValueError, match="--modes"):
        mode_overrides("fast")
    assert mode_overrides("ceiling") == mode_overrides("async")


@pytest.mark.parametrize("batch,extra,retry", [(512, 32, 4), (128, 8, 1), (64, 4, None), (1024, 64, 8)])
def test_advanced_mode_scales_the_yamls_group_counts_to_the_simulated_batch(batch, extra, retry):
    """The advanced YAMLs size redundancy (32 spare prompts) and the proactive filter (4 groups) for their
    512-prompt batch; simulated at another batch, advanced takes the same shares of it (retry off where
    its threshold rounds to 0), and a command-line override still wins."""
    from megatron_dapo.config.load import load_config
    from megatron_dapo.sim.cli import mode_overrides

    yaml = load_config("configs/qwen3/advanced_qwen3_8b.yaml", [], validate=False)
    assert (yaml.algo.train_batch_size, yaml.rollout.redundancy.extra_prompts, yaml.rollout.retry.threshold) == (
        512,
        32,
        4,
    )
    over = mode_overrides("advanced", batch=batch)
    got = load_config("configs/qwen3/qwen3_8b.yaml", [*over, f"algo.train_batch_size={batch}"], validate=False)
    assert got.rollout.redundancy.extra_prompts == extra
    assert got.rollout.retry.enabled == (retry is not None)
    if retry is not None:
        assert got.rollout.retry.threshold == retry
    mine = load_config("configs/qwen3/qwen3_8b.yaml", [*over, "rollout.redundancy.extra_prompts=0"], validate=False)
    assert mine.rollout.redundancy.extra_prompts == 0


def test_engine_retraction_order_and_rids_in_flight():
    async def main():
        engine = SimEngine(COST, kv_capacity=330, max_running=8, loop=asyncio.get_running_loop())
        old = engine.submit("old", 100, 200)
        await asyncio.sleep(COST.step_time(1, 100) * 2.5)  # "old" runs alone for a few steps
        later = [engine.submit(r, 100, 200) for r in ("x", "y")]  # admitted together, at one step
        with pytest.raises(ValueError, match="already in flight"):
            engine.submit("x", 10, 10)
        while engine.stats.retractions == 0:
            await asyncio.sleep(0.01)
        first = [r.rid for r in engine.waiting]  # what the full pool retracted first
        engine.abort("y")
        again = engine.submit("y", 10, 1)  # an aborted rid may be used again
        results = await asyncio.gather(old, *later, again)
        return first, results, engine

    first, (old, x, y, again), engine = run_virtual(main())
    # x and y have generated nothing (fewest tokens first), same input, same step: the first admitted goes
    assert first == ["x"]
    assert not old.aborted and y.aborted and not x.aborted and x.generated == 200 and again.generated == 1
    assert not engine.running and not engine.waiting and not engine._rids


@pytest.mark.parametrize("min_starved_ms", [0, 300])
def test_simulated_migrations_neither_cascade_nor_stall(monkeypatch, min_starved_ms):
    """The advanced switches (PSRL's thresholds) on engines that batch statically and step about as fast
    for 1 as for 16 sequences, like the embedded CPU server (where a migrated request waits behind the
    running batch without a token): every run completes (partial rollout's stall guard never fires, as
    it did on 1 of these 8 seeds when a migrated request could be migrated again), and no server takes
    part in two migrations in roles the rules forbid (a destination as source or destination again, a
    source as destination) within two checks or min_starved_ms."""
    from megatron_dapo.coordinator import migration
    from megatron_dapo.sim.world import simulate

    policies = []
    init = migration.MigrationPolicy.__init__
    monkeypatch.setattr(
        migration.MigrationPolicy, "__init__", lambda self, *a, **k: (init(self, *a, **k), policies.append(self))[0]
    )
    cpu_like = CostModel(a_b=0.0, a_k=4e-6, o_thr=0.03, o_b=0.0, o_k=0.002)  # the CPU benchmark's fit, rounded
    cfg = tiny_cfg(
        2,
        "status_based",
        "in_place",
        **{
            "rollout.sync.indicator": "kv_cache",
            "rollout.sync.threshold": 0.6,
            "rollout.sync.check_req_before_sync": "false",
            "rollout.loads.interval_ms": 200,
            "rollout.num_servers": 4,
            "algo.train_batch_size": 4,
            **ADVANCED,
            "rollout.migration.min_starved_ms": min_starved_ms,
        },
    )
    check_s = cfg.rollout.sync.check_interval_ms / 1000.0
    settle = max(2 * check_s, min_starved_ms / 1000.0) - 1e-9
    migrations = 0
    for seed in range(8):
        r = simulate(cfg, tiny_world(batching="static_split", cost=cpu_like, kv_capacity=64 * 440, steps=6, seed=seed))
        assert len(r.batches) == 7
        history = policies.pop().history
        migrations += len(history)
        for i, m2 in enumerate(history):
            for m1 in history[:i]:
                if m2.at - m1.at < settle:
                    assert m2.starved not in (m1.source, m1.starved) and m2.source != m1.starved, (seed, m1, m2)
    assert not policies and migrations > 0  # the setting does migrate

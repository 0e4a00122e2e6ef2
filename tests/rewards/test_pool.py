"""Rewards scored in worker processes (reward.num_workers > 0): the same values as in process, and
a reward that raises, crashes its interpreter or hangs is a counted reward failure within the time
limit, never a hang; the pool goes on with fresh workers."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_dapo.rewards import RewardRunner
from megatron_dapo.rewards.registry import RewardCall
from tests.workers.pool_rewards import JudgeDown, always_raises, judged, misbehaving, sleeper

pytestmark = pytest.mark.slow  # worker processes


def _items(n):
    return [
        (f"resp {i} {'x' * (i % 5)}", str(i % 3), "src", {"bonus": i, "unknown_extra": "ignored"}) for i in range(n)
    ]


def test_pool_scores_what_the_process_scores():
    items = _items(12)
    local = RewardRunner(default=RewardCall(judged), timeout_s=30)
    pooled = RewardRunner(default=RewardCall(judged), timeout_s=30, num_workers=2)
    try:
        want, got = local.score_many(items), pooled.score_many(items)  # 12 items on 2 workers: queued
        # groups are scored from several threads of the coordinator at once: they share the workers
        with ThreadPoolExecutor(3) as ex:
            parts = list(ex.map(pooled.score_many, [items[:4], items[4:8], items[8:]]))
    finally:
        local.close()
        pooled.close()
    assert got == want and len({r.score for r in got}) > 3
    assert [r for part in parts for r in part] == want
    assert local.counters() == {"scored": 12, "errors": 0, "timeouts": 0, "nonfinite": 0}
    assert pooled.counters() == {"scored": 24, "errors": 0, "timeouts": 0, "nonfinite": 0}


def test_crashing_hanging_and_raising_rewards_are_failures_not_hangs():
    runner = RewardRunner(default=RewardCall(misbehaving), timeout_s=3.0, failure_score=-1.0, num_workers=2)
    try:
        t0 = time.monotonic()
        out = runner.score_many([(r, "1", "src", {}) for r in ("ok", "crash", "hang", "raise", "nan", "ok")])
        took = time.monotonic() - t0
        assert took < 3.0 + 5.0, took  # the time limit, plus killing and respawning a worker
        assert [r.failed for r in out] == [False, True, True, True, True, False]
        assert out[0] == out[5] and out[0].score == judged("ok", "1")["score"]
        assert all(r.score == -1.0 and not r.acc for r in out[1:5])
        assert "worker died (exit code 7)" in out[1].error and "timed out" in out[2].error
        assert "reward service unavailable" in out[3].error and "non-finite" in out[4].error
        assert runner.counters() == {"scored": 6, "errors": 2, "timeouts": 1, "nonfinite": 1}
        assert runner.failures_by_type == {
            "RewardWorkerDied": 1,
            "RewardTimeout": 1,
            "RuntimeError": 1,
            "NonFiniteReward": 1,
        }
        assert [r.error_type for r in out] == [None, "RewardWorkerDied", "RewardTimeout", "RuntimeError"] + [
            "NonFiniteReward",
            None,
        ]
        assert runner.pool.restarts == 2  # the crashed and the hung worker were replaced
        # the pool goes on: fresh workers answer, in other processes than this one
        pids = {r.score for r in runner.score_many([("pid", "", "src", {})] * 4)}
        assert pids and os.getpid() not in pids
        workers = [w.process for w in runner.pool._idle]
    finally:
        runner.close()
    assert len(workers) == 2 and not any(p.is_alive() for p in workers)


def test_a_function_that_cannot_reach_the_workers_is_a_named_error():
    with pytest.raises(ValueError, match="reward.num_workers"):
        RewardRunner(default=lambda response, ground_truth, **_: 1.0, num_workers=1)


def test_calls_waiting_for_a_worker_are_not_late():
    """Fault-campaign case: a healthy 0.3 s reward, limit 3 s, 2 workers and 24 calls (3.6 s of work per
    worker, from three callers at once): the limit counts from each call's start, so none fails."""
    runner = RewardRunner(default=RewardCall(sleeper), timeout_s=3.0, num_workers=2)
    items = [("0.3", "", "src", {})] * 8
    try:
        with ThreadPoolExecutor(3) as ex:
            parts = list(ex.map(runner.score_many, [items] * 3))
        calls, busy_s = runner.activity()
    finally:
        runner.close()
    assert [r.failed for part in parts for r in part] == [False] * 24
    assert runner.counters() == {"scored": 24, "errors": 0, "timeouts": 0, "nonfinite": 0}
    assert runner.pool.restarts == 0
    # the throughput: 2 workers, 0.3 s per call, at most 2 / 0.3 calls per second of scoring
    assert calls == 24 and busy_s >= 24 * 0.3 / 2
    assert 0 < calls / busy_s <= 2 / 0.3


def test_a_call_past_its_limit_still_fails_among_queued_ones():
    runner = RewardRunner(default=RewardCall(sleeper), timeout_s=1.0, num_workers=2)
    try:
        out = runner.score_many([("0.3", "", "src", {})] * 6 + [("30", "", "src", {})] + [("0.3", "", "src", {})] * 6)
    finally:
        runner.close()
    assert [r.error_type for r in out] == [None] * 6 + ["RewardTimeout"] + [None] * 6
    assert runner.pool.restarts == 1  # the late call's worker was killed and replaced


def test_an_always_raising_reward_is_counted_and_logged_by_type(caplog):
    runner = RewardRunner(default=RewardCall(always_raises), timeout_s=10.0, num_workers=2)
    try:
        with caplog.at_level("WARNING", logger="megatron_dapo.rewards.registry"):
            out = runner.score_many([(f"answer {i}", "1", "src", {}) for i in range(8)])
    finally:
        runner.close()
    assert all(r.failed and r.error_type == JudgeDown.__name__ for r in out)
    assert "judge unreachable for 'answer 3'" in out[3].error
    assert runner.failures_by_type == {"JudgeDown": 8}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5 and all("JudgeDown" in line and "judge unreachable" in line for line in lines)


def test_a_slow_worker_start_is_not_the_first_calls_time():
    from tests.workers.slow_start_reward import quick

    runner = RewardRunner(default=RewardCall(quick), timeout_s=1.0, num_workers=2)
    try:
        out = runner.score_many([("a", "", "src", {})] * 4)  # the workers take 3 s to import `quick`
    finally:
        runner.close()
    assert [r.failed for r in out] == [False] * 4 and runner.pool.restarts == 0

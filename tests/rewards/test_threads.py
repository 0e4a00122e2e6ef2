"""Rewards scored on the coordinator's threads (reward.num_workers = 0): the time limit counts from each
call's start, a hanging reward holds a bounded number of threads and then stops the run with
RewardCallsHang, and failures are counted and logged by type."""

import threading
import time

import pytest

from megatron_dapo.rewards import RewardRunner
from megatron_dapo.rewards.threads import MAX_HUNG, NUM_THREADS, RewardCallsHang, RewardThreads
from tests.workers.pool_rewards import JudgeDown, always_raises, sleeper


def _threads_of(threads: RewardThreads) -> int:
    """Threads alive that belong to this thread set (hung ones included)."""
    return sum(t.name == threads.thread_name for t in threading.enumerate())


def _eventually(condition, within_s=60.0):
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.05)


def test_calls_waiting_for_a_thread_are_not_late():
    """A healthy 0.3 s reward, limit 3 s, 2 threads and 24 calls (3.6 s of waiting for the last ones)."""
    runner = RewardRunner(default=sleeper, timeout_s=3.0, num_threads=2)
    try:
        out = runner.score_many([("0.3", "", "src", {})] * 24)
        calls, busy_s = runner.activity()
    finally:
        runner.close()
    assert [r.failed for r in out] == [False] * 24
    assert runner.counters() == {"scored": 24, "errors": 0, "timeouts": 0, "nonfinite": 0}
    assert calls == 24 and 0 < calls / busy_s <= 2 / 0.3  # 2 threads, 0.3 s a call


def test_a_call_past_its_limit_still_fails_among_queued_ones():
    release = threading.Event()

    def slow_or_hung(response, ground_truth, **_):
        if response == "hang":
            release.wait(120)
        return sleeper(response if response != "hang" else "0", ground_truth)

    runner = RewardRunner(default=slow_or_hung, timeout_s=1.0, num_threads=2, max_hung=1)
    try:
        out = runner.score_many([("0.3", "", "src", {})] * 6 + [("hang", "", "src", {})] + [("0.3", "", "src", {})] * 6)
        assert [r.error_type for r in out] == [None] * 6 + ["RewardTimeout"] + [None] * 6
        assert "timed out after 1.0s" in out[6].error
        assert runner.counters()["timeouts"] == 1 and runner.threads.hung == 1
    finally:
        release.set()
        runner.close()
    _eventually(lambda: _threads_of(runner.threads) == 0)


def test_a_hanging_reward_holds_a_bounded_number_of_threads():
    release = threading.Event()

    def hangs(response, ground_truth, **_):
        if response == "hang":
            release.wait(120)
        return 1.0

    runner = RewardRunner(default=hangs, timeout_s=0.2, num_threads=2, max_hung=3)
    try:
        assert _threads_of(runner.threads) == 2
        for _ in range(3):  # each hung call's thread is replaced: scoring goes on
            out = runner.score_many([("hang", "", "src", {}), ("ok", "", "src", {})])
            assert [r.error_type for r in out] == ["RewardTimeout", None]
        assert runner.threads.hung == 3 and _threads_of(runner.threads) == 2 + 3
        with pytest.raises(RewardCallsHang, match=r"4 reward calls .* cap of 3 .* reward.num_workers > 0"):
            runner.score_many([("hang", "", "src", {}), ("ok", "", "src", {})])
        with pytest.raises(RewardCallsHang):  # and from then on: the run stops with it
            runner.score_many([("ok", "", "src", {})])
        assert _threads_of(runner.threads) == 2 + 3
        # hung calls that return at last free their places: their abandoned threads exit
        release.set()
        _eventually(lambda: runner.threads.hung == 0 and _threads_of(runner.threads) == 2)
    finally:
        release.set()
        runner.close()
    _eventually(lambda: _threads_of(runner.threads) == 0)


def test_the_fault_campaign_hang_at_default_sizes():
    """160 calls of a reward that hangs (a thread each before: 4 -> 163 threads): at most
    NUM_THREADS + MAX_HUNG threads, then RewardCallsHang."""
    release = threading.Event()
    runner = RewardRunner(default=lambda response, ground_truth, **_: release.wait(120), timeout_s=0.2)
    try:
        with pytest.raises(RewardCallsHang):
            runner.score_many([("x", "", "src", {})] * 160)
        assert _threads_of(runner.threads) <= NUM_THREADS + MAX_HUNG
    finally:
        release.set()
        runner.close()
    _eventually(lambda: _threads_of(runner.threads) == 0)


def test_an_always_raising_reward_is_counted_and_logged_by_type_rate_limited(caplog):
    runner = RewardRunner(default=always_raises, timeout_s=10.0)
    try:
        with caplog.at_level("WARNING", logger="megatron_dapo.rewards.registry"):
            out = runner.score_many([(f"answer {i}", "1", "src", {}) for i in range(250)])
    finally:
        runner.close()
    assert all(r.failed and r.score == -1.0 and r.error_type == JudgeDown.__name__ for r in out)
    assert runner.failures_by_type == {"JudgeDown": 250} and runner.counters()["errors"] == 250
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5 + 2  # the first 5, then the 100th and the 200th
    assert all("JudgeDown" in line and "judge unreachable for 'answer" in line for line in lines)
    assert "every 100th" in lines[4] and "#100" in lines[5] and "#200" in lines[6]


def test_closed_threads_finish_queued_calls_then_exit():
    pool = RewardThreads(num_threads=2, max_hung=0)
    out = pool.run([lambda: 1, lambda: 1 / 0], timeout_s=5)
    assert out == [("ok", 1), ("error", "ZeroDivisionError", "division by zero")]
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run([lambda: 1], timeout_s=5)
    _eventually(lambda: _threads_of(pool) == 0)

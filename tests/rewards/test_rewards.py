"""Rewards: the DAPO math rule, the registry, and failure handling of reward functions."""

import threading
import time

import pytest
import torch

from megatron_dapo.rewards import RewardRunner, get_reward, register_reward
from megatron_dapo.rewards.math_dapo import INVALID, compute_score, extract_answer, normalize_answer


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("34", "34"),
        ("1,000", "1000"),
        ("x = 5", "5"),
        ("$\\frac12$", "\\frac{1}{2}"),
        ("\\boxed{42}", "42"),
        ("12 dollars", "12"),
        ("\\text{(B)}", "(B)"),
        ("90^\\circ", "90"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("  -7 ", "-7"),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_answer_is_the_last_answer_line():
    assert extract_answer("Answer: 3\nthinking more\nAnswer: 5") == "5"
    assert extract_answer("answer :  1,234\n") == "1234"
    assert extract_answer("no final line") == INVALID
    # only the last 300 characters are judged
    assert extract_answer("Answer: 9\n" + "z" * 400) == INVALID


def test_math_dapo_scores_plus_minus_one():
    assert compute_score("so it is\nAnswer: 12", "12") == {"score": 1.0, "acc": True, "pred": "12"}
    assert compute_score("Answer: 13", "12")["score"] == -1.0
    assert compute_score("12", "12")["score"] == -1.0  # no Answer: line
    assert compute_score("Answer: $\\frac{1}{2}$", "\\frac12")["acc"]


def test_registry_builtin_registered_and_import_path():
    assert get_reward("math_dapo") is compute_score

    @register_reward("always_one")
    def always_one(response, ground_truth, **_):
        return 1.0

    assert get_reward("always_one") is always_one
    assert get_reward("megatron_dapo.rewards.math_dapo:compute_score") is compute_score
    with pytest.raises(ValueError, match="unknown reward function 'nope'"):
        get_reward("nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        get_reward("no_such_module_xyz:fn")


def test_math_verify_backend_is_lazy_with_clear_message():
    fn = get_reward("math_verify")  # resolving the name must not import math-verify
    try:
        import math_verify  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install 'math-verify"):
            fn("Answer: 1/2", "0.5")
    else:
        assert fn("Answer: 1/2", "0.5")["score"] == 1.0


def test_runner_counts_raising_and_slow_functions_without_crashing():
    def flaky(response, ground_truth, **_):
        if response == "boom":
            raise RuntimeError("reward server down")
        if response == "slow":
            threading.Event().wait(30)  # far beyond the limit
        return {"score": 1.0 if response == ground_truth else -1.0}

    runner = RewardRunner(default=compute_score, by_data_source={"custom": flaky}, timeout_s=0.5, failure_score=-1.0)
    t0 = time.monotonic()
    out = runner.score_many(
        [
            ("ok", "ok", "custom", {}),
            ("boom", "x", "custom", {}),
            ("slow", "slow", "custom", {}),
            ("Answer: 4", "4", "math_dapo", {}),
        ]
    )
    assert time.monotonic() - t0 < 5
    assert [r.score for r in out] == [1.0, -1.0, -1.0, 1.0]
    assert [r.failed for r in out] == [False, True, True, False]
    assert "reward server down" in out[1].error and "timed out" in out[2].error
    assert runner.counters() == {"scored": 4, "errors": 1, "timeouts": 1, "nonfinite": 0}


def test_non_finite_rewards_are_scored_as_failures_and_counted():
    import numpy as np

    from megatron_dapo.coordinator.groups import batch_advantages, judge_group
    from megatron_dapo.rollout.types import Sample

    values = {
        "nan": float("nan"),
        "inf": float("inf"),
        "-inf": -float("inf"),
        "npnan": np.float32("nan"),
        "dictnan": {"score": float("nan"), "acc": True},
        "good": 1.0,
        "bad": -1.0,
    }

    def fn(response, ground_truth, **_):
        return values[response]

    runner = RewardRunner(default=fn, timeout_s=5, failure_score=-2.0)
    out = runner.score_many([(k, "", "x", {}) for k in values])
    assert [r.score for r in out] == [-2.0] * 5 + [1.0, -1.0]  # the worst score, never NaN
    assert [r.acc for r in out] == [False] * 5 + [True, False]
    assert all("non-finite score" in r.error for r in out[:5])
    assert runner.counters() == {"scored": 7, "errors": 0, "timeouts": 0, "nonfinite": 5}
    # the scores reach the advantages without the non-finite check there firing
    samples = [
        Sample(
            rid=str(i),
            prompt_ids=[1],
            output_ids=[2, 3],
            logprobs=[-0.1, -0.2],
            finish_reason="stop",
            weight_version="0",
        )
        for i in range(len(out))
    ]
    group = judge_group(0, samples, out, max_response_length=8, filter_metric=None)
    assert group.reward_failures == 5
    assert torch.isfinite(batch_advantages([group])).all()

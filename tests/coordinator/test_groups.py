"""Judging groups and building the trainer batch (pure functions, float64 references)."""

import math

import pytest
import torch

from megatron_dapo.config.schema import OverlongBufferConfig
from megatron_dapo.coordinator.batch import build_batch
from megatron_dapo.coordinator.groups import JudgedGroup, judge_group, token_versions
from megatron_dapo.rewards import RewardResult
from megatron_dapo.rollout.types import Sample, WeightVersionSpan


def _sample(i, n_out, reason="stop", version="3", spans=()):
    return Sample(
        rid=f"r{i}",
        prompt_ids=[1, 2, 3],
        output_ids=list(range(10, 10 + n_out)),
        logprobs=[-0.5] * n_out,
        finish_reason=reason,
        weight_version=version,
        weight_versions=[WeightVersionSpan(*s) for s in spans],
        index=i,
    )


def test_token_versions_follow_spans():
    assert token_versions(_sample(0, 3, version="2")) == [2, 2, 2]
    s = _sample(0, 5, version="4", spans=[("3", 0, 2), ("4", 2, 5)])
    assert token_versions(s) == [3, 3, 4, 4, 4]
    assert token_versions(_sample(0, 2, version="default")) == [0, 0]


def test_judge_group_overlong_and_filter():
    samples = [_sample(0, 4), _sample(1, 7, "length"), _sample(2, 6), _sample(3, 2, spans=[("1", 0, 1), ("3", 1, 2)])]
    rewards = [
        RewardResult(1.0, True),
        RewardResult(-1.0, False),
        RewardResult(1.0, True),
        RewardResult(-1.0, False, failed=True, error="x"),
    ]
    g = judge_group(7, samples, rewards, max_response_length=6, overlong_cfg=OverlongBufferConfig(True, 4, 1.0))
    # DAPO soft punishment: 0 up to 6 - 4 = 2 tokens, linear to -1 at 6 tokens, -1 beyond
    assert g.overlong == pytest.approx([-0.5, -1.0, -1.0, 0.0])
    assert g.seq_rewards == pytest.approx([0.5, -2.0, 0.0, -1.0])
    assert g.kept and g.reward_failures == 1 and g.min_version == 1
    same = judge_group(8, samples[:2], [RewardResult(1.0, True)] * 2, 6, None, "acc")
    assert not same.kept and same.overlong == [0.0, 0.0]
    assert judge_group(9, samples[:2], [RewardResult(1.0, True)] * 2, 6, None, None).kept  # filter off
    back = JudgedGroup.from_state(g.to_state())
    assert back.samples[3].weight_versions[0].version == "1" and back.seq_rewards == g.seq_rewards


def test_build_batch_advantages_masks_and_layout():
    ga = judge_group(
        0, [_sample(0, 3), _sample(1, 5, "length")], [RewardResult(1.0, True), RewardResult(-1.0, False)], 8
    )
    gb = judge_group(
        5,
        [_sample(0, 2), _sample(1, 2), _sample(2, 4)],
        [RewardResult(1.0, True), RewardResult(-1.0, False), RewardResult(-1.0, False)],
        8,
    )
    b = build_batch([ga, gb], step=4, temperature=0.7, overlong_filter=True)
    assert b.num_samples == 5 and b.num_groups == 2 and b.prompt_indices == [0, 5]
    assert b.group_index.tolist() == [0, 0, 1, 1, 1]
    assert b.input_ids[1] == [1, 2, 3] + list(range(10, 15)) and b.response_lengths == [3, 5, 2, 2, 4]
    assert b.response_loss_mask == [1, 0, 1, 1, 1]  # the truncated one leaves the loss ...

    # ... but stays in its group's baseline: GRPO advantages over the seq rewards, float64 reference
    def ref(r):
        m = sum(r) / len(r)
        sd = math.sqrt(sum((x - m) ** 2 for x in r) / (len(r) - 1))
        return [(x - m) / (sd + 1e-6) for x in r]

    want = ref([1.0, -1.0]) + ref([1.0, -1.0, -1.0])
    assert torch.allclose(b.advantages.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)
    assert b.staleness() == [1, 1, 1, 1, 1]


def test_reward_failures_by_type_reach_the_step_metrics_and_survive_a_checkpoint():
    from collections import Counter
    from types import SimpleNamespace

    from megatron_dapo.coordinator.producer import BatchInfo
    from megatron_dapo.coordinator.service import batch_info_from_state, batch_info_state, step_metrics
    from megatron_dapo.rewards import RewardRunner

    def reward(response, ground_truth, **_):
        return {"div": lambda: 1 / 0, "nan": lambda: math.nan}.get(response, lambda: 1.0)()

    runner = RewardRunner(default=reward)
    try:
        rewards = runner.score_many([(r, "", "src", {}) for r in ("div", "ok", "nan", "div")])
    finally:
        runner.close()
    g = judge_group(0, [_sample(i, 3) for i in range(4)], rewards, max_response_length=6)
    assert g.reward_failures == 3 and g.reward_failure_types == {"ZeroDivisionError": 2, "NonFiniteReward": 1}
    info = BatchInfo(
        [g],
        kept=1,
        dropped_all_correct=0,
        dropped_all_wrong=0,
        gen_batches=1,
        reward_failures=3,
        reward_failure_types=Counter(g.reward_failure_types),
        reward_calls_per_s=12.5,
        staleness=Counter({0: 1}),
    )
    restored = batch_info_from_state(batch_info_state(info))
    assert restored.reward_failure_types == info.reward_failure_types and restored.reward_calls_per_s == 12.5
    assert restored.groups[0].reward_failure_types == g.reward_failure_types
    m = step_metrics(restored, SimpleNamespace(algo=SimpleNamespace(staleness=1)), build_batch([g], 0, 1.0))
    assert m["reward/failures"] == 3 and m["reward/calls_per_s"] == 12.5
    assert m["reward/failures/ZeroDivisionError"] == 2 and m["reward/failures/NonFiniteReward"] == 1


def _scored_groups():
    """Two groups of 3 and 2 samples with known rewards and response lengths 2, 4, 1 | 3, 5."""
    out = []
    for scores, lengths in (([1.0, 0.0, 0.5], [2, 4, 1]), ([0.0, 1.0], [3, 5])):
        samples = [
            Sample(
                rid=f"{len(out)}-{i}",
                prompt_ids=[1],
                output_ids=[2] * n,
                logprobs=[-0.1] * n,
                finish_reason="stop",
                weight_version="0",
            )
            for i, n in enumerate(lengths)
        ]
        rewards = [RewardResult(score=s, acc=s > 0) for s in scores]
        out.append(judge_group(len(out), samples, rewards, max_response_length=8, filter_metric=None))
    return out


def test_batch_advantages_by_estimator():
    """algo.adv_estimator reaches the step batch: rloo, reinforce_plus_plus (weighted by loss tokens: an
    overlong-filtered response counts 0) and a module:function hook, whose bad output is refused by name."""
    from megatron_dapo.algo import reinforce_plus_plus_advantages, rloo_advantages
    from megatron_dapo.coordinator.groups import batch_advantages

    groups = _scored_groups()
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0])
    ids = torch.tensor([0, 0, 0, 1, 1])
    assert torch.equal(batch_advantages(groups, estimator="rloo"), rloo_advantages(rewards, ids))
    rpp = batch_advantages(groups, estimator="reinforce_plus_plus")
    assert torch.equal(rpp, reinforce_plus_plus_advantages(rewards, torch.tensor([2, 4, 1, 3, 5])))
    b = build_batch(groups, step=0, temperature=1.0, adv_estimator="reinforce_plus_plus")
    assert torch.equal(b.advantages, rpp)
    hook = batch_advantages(groups, estimator="tests.coordinator.test_groups:_centred")
    assert torch.allclose(hook, rewards - rewards.mean())
    with pytest.raises(ValueError, match="algo.adv_estimator 'tests.coordinator.test_groups:_wrong_shape' returned"):
        batch_advantages(groups, estimator="tests.coordinator.test_groups:_wrong_shape")


def _centred(rewards, group_ids, token_counts):
    return rewards - rewards.mean()


def _wrong_shape(rewards, group_ids, token_counts):
    return rewards[:2]

"""A judged prompt group: its n samples with rewards, the dynamic-sampling verdict, and versions.

Pure functions over rollout samples: scoring order, overlong shaping and the spread test follow
DAPO (task reward +-1, plus the soft overlong penalty, then group-normalised advantages).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_dapo.algo import (
    dynamic_sampling_filter,
    group_advantages,
    overlong_reward,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from megatron_dapo.rollout.types import Sample
from megatron_dapo.runtime.hooks import import_function
from megatron_dapo.types import routing_from_state, routing_to_state

if TYPE_CHECKING:
    from megatron_dapo.config.schema import OverlongBufferConfig


def version_number(v: str | int | None) -> int:
    """Weight versions travel as strings (SGLang); ours are step counts. "default" = the initial 0."""
    if isinstance(v, int):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def token_versions(sample: Sample) -> list[int]:
    """The weight version that produced each output token (spans when a response crossed an update)."""
    n = len(sample.output_ids)
    if not sample.weight_versions:
        return [version_number(sample.weight_version)] * n
    out = [version_number(sample.weight_version)] * n
    for span in sample.weight_versions:
        lo, hi = max(0, span.start), min(n, span.end)
        if hi > lo:
            out[lo:hi] = [version_number(span.version)] * (hi - lo)
    return out


@dataclass
class JudgedGroup:
    """The n samples of one prompt, scored."""

    prompt_index: int  # PromptRecord.index
    samples: list[Sample]
    scores: list[float]  # task reward (+-1 for the math rule; failed reward calls score failure_score)
    accs: list[bool]
    overlong: list[float]  # soft overlong penalty (<= 0), 0 when disabled
    reward_failures: int = 0
    reward_failure_types: dict[str, int] = field(default_factory=dict)  # failed reward calls by type
    kept: bool = True
    token_versions: list[list[int]] = field(default_factory=list)
    draw: int = -1  # the sampler's draw number of this prompt (batches are ordered by it); -1 = unknown
    v_traj: int = -1  # servers' weight version when the group was first dispatched (staleness slot); -1 = unknown

    @property
    def seq_rewards(self) -> list[float]:
        return [s + o for s, o in zip(self.scores, self.overlong)]

    @property
    def min_version(self) -> int:
        """Oldest weight version behind any token of the group (its staleness is measured from this)."""
        return min(
            (min(v) for v in self.token_versions if v),
            default=min(version_number(s.weight_version) for s in self.samples),
        )

    def metric(self, name: str) -> list[float]:
        if name == "acc":
            return [float(a) for a in self.accs]
        if name == "score":
            return list(self.scores)
        if name == "seq_reward":
            return self.seq_rewards
        raise ValueError(f"unknown dynamic-sampling metric {name!r} (acc, score, seq_reward)")

    def to_state(self) -> dict:
        """Plain data (JSON-able) for checkpoints of the rollout buffer."""

        d = asdict(self)
        d["samples"] = [sample_to_state(s) for s in self.samples]
        return d

    @classmethod
    def from_state(cls, d: dict) -> "JudgedGroup":
        return cls(**{**d, "samples": [sample_from_state(s) for s in d["samples"]]})


def sample_to_state(s: Sample) -> dict:
    """Plain data (JSON-able) of a sample, for checkpoints: its fields, the routing as `routing_to_state`."""
    d = asdict(s)
    d["routed_experts"] = routing_to_state(s.routed_experts)
    return d


def sample_from_state(d: dict) -> Sample:
    """A Sample from its `sample_to_state` form (checkpoints)."""
    from megatron_dapo.rollout.types import WeightVersionSpan

    d = dict(d)
    d["weight_versions"] = [WeightVersionSpan(**w) for w in d.get("weight_versions") or []]
    d["routed_experts"] = routing_from_state(d.get("routed_experts"))
    return Sample(**d)


def judge_group(
    prompt_index: int,
    samples: list[Sample],
    rewards,  # list[RewardResult], same order as samples
    max_response_length: int,
    overlong_cfg: OverlongBufferConfig | None = None,
    filter_metric: str | None = "acc",  # None = dynamic sampling off (every group kept)
) -> JudgedGroup:
    lengths = torch.tensor([len(s.output_ids) for s in samples])
    if overlong_cfg is not None and overlong_cfg.enable:
        pen = overlong_reward(lengths, max_response_length, overlong_cfg.len, overlong_cfg.penalty_factor).tolist()
    else:
        pen = [0.0] * len(samples)
    g = JudgedGroup(
        prompt_index,
        samples,
        scores=[r.score for r in rewards],
        accs=[r.acc for r in rewards],
        overlong=pen,
        reward_failures=sum(r.failed for r in rewards),
        reward_failure_types=dict(Counter(r.error_type or "unknown" for r in rewards if r.failed)),
        token_versions=[token_versions(s) for s in samples],
    )
    if filter_metric is not None:
        res = dynamic_sampling_filter(
            torch.tensor(g.metric(filter_metric), dtype=torch.float64),
            torch.zeros(len(samples), dtype=torch.long),
            correct_threshold=0.5 if filter_metric == "acc" else 0.0,
        )
        g.kept = res.num_kept == 1
    return g


def batch_advantages(
    groups: list[JudgedGroup],
    norm_by_std: bool = True,
    estimator: str = "grpo",
    loss_token_counts: list[int] | None = None,
) -> torch.Tensor:
    """Per-sample advantages by `estimator` (algo.adv_estimator), groups concatenated in order (float32
    [sum n]). grpo: group-normalised (norm_by_std); rloo: leave-one-out; reinforce_plus_plus: whitened over
    the batch's loss tokens (`loss_token_counts`, default the response lengths); else a `module:function`
    called as fn(rewards [N], group_ids [N], loss_token_counts [N]) -> [N]."""
    rewards = torch.tensor([r for g in groups for r in g.seq_rewards], dtype=torch.float32)
    ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples], dtype=torch.long)
    counts = torch.tensor(
        [len(s.output_ids) for g in groups for s in g.samples] if loss_token_counts is None else loss_token_counts,
        dtype=torch.long,
    )
    if estimator == "grpo":
        return group_advantages(rewards, ids, norm_by_std=norm_by_std)
    if estimator == "rloo":
        return rloo_advantages(rewards, ids)
    if estimator == "reinforce_plus_plus":
        return reinforce_plus_plus_advantages(rewards, counts)
    out = import_function(estimator, "algo.adv_estimator")(rewards, ids, counts)
    out = torch.as_tensor(out, dtype=torch.float32)
    if out.shape != rewards.shape or not torch.isfinite(out).all():
        raise ValueError(
            f"algo.adv_estimator {estimator!r} returned shape {tuple(out.shape)} (finite: "
            f"{bool(torch.isfinite(out).all())}); expected {tuple(rewards.shape)} finite advantages"
        )
    return out

"""The trainer's input for one step, built from judged groups (rank 0) and sent to every rank.

One row per sample, the n samples of a group contiguous, groups in the order they were taken.
The actor packs rows into micro-batches by its token budget; data-parallel ranks split rows by
group so that no group straddles two ranks.
"""

from __future__ import annotations

import torch

from megatron_dapo.coordinator.groups import JudgedGroup, batch_advantages
from megatron_dapo.types import RolloutBatch


def build_batch(
    groups: list[JudgedGroup],
    step: int,
    temperature: float,
    norm_adv_by_std: bool = True,
    overlong_filter: bool = False,
    adv_estimator: str = "grpo",
) -> RolloutBatch:
    samples = [s for g in groups for s in g.samples]
    # Truncated responses stay in their group's baseline (advantages below) but may leave the loss.
    loss_mask = [0 if overlong_filter and s.finish_reason == "length" else 1 for s in samples]
    return RolloutBatch(
        input_ids=[list(s.prompt_ids) + list(s.output_ids) for s in samples],
        prompt_lengths=[len(s.prompt_ids) for s in samples],
        response_lengths=[len(s.output_ids) for s in samples],
        advantages=batch_advantages(
            groups, norm_adv_by_std, adv_estimator, [m * len(s.output_ids) for m, s in zip(loss_mask, samples)]
        ),
        rollout_logprobs=[list(s.logprobs) for s in samples],
        response_loss_mask=loss_mask,
        token_versions=[v for g in groups for v in g.token_versions],
        group_index=torch.tensor([i for i, g in enumerate(groups) for _ in g.samples], dtype=torch.long),
        temperature=temperature,
        step=step,
        prompt_indices=[g.prompt_index for g in groups],
        routed_experts=batch_routing(samples),
    )


def batch_routing(samples) -> list[torch.Tensor] | None:
    """Each sample's routed experts (routing replay), checked to cover every position the model was fed
    (prompt + response - 1); None when the samples carry none."""
    if all(s.routed_experts is None for s in samples):
        return None
    for s in samples:
        want = len(s.prompt_ids) + len(s.output_ids) - 1
        got = None if s.routed_experts is None else s.routed_experts.shape[0]
        if got != want:
            raise ValueError(f"sample {s.rid}: routed experts for {got} positions, expected {want}")
    return [s.routed_experts for s in samples]


def probe_batch(token_ids: list[int], step: int = 0) -> RolloutBatch:
    """One sequence whose tokens after the first are scored (a weight-sync check: the trainer's
    logprobs of it must equal the servers' prompt logprobs)."""
    n = len(token_ids) - 1
    return RolloutBatch(
        input_ids=[list(token_ids)],
        prompt_lengths=[1],
        response_lengths=[n],
        advantages=torch.zeros(1),
        rollout_logprobs=[[0.0] * n],
        response_loss_mask=[1],
        token_versions=[[step] * n],
        group_index=torch.zeros(1, dtype=torch.long),
        temperature=1.0,
        step=step,
        prompt_indices=[-1],
    )

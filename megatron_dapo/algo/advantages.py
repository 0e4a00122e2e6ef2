"""Group-normalised (GRPO) advantages: every sample is compared with the other samples of its prompt.

For a group g of n samples with rewards r_1..r_n:

    mean_g = sum_i r_i / n
    std_g  = sqrt(sum_i (r_i - mean_g)^2 / (n - 1))        (unbiased, as torch.std and verl)
    A_i    = (r_i - mean_g) / (std_g + eps)                 norm_by_std=True  (GRPO / DAPO)
    A_i    = r_i - mean_g                                   norm_by_std=False (Dr.GRPO)

Other estimators (algo.adv_estimator):

    rloo:                A_i = r_i - sum_{j != i} r_j / (n - 1) = n / (n - 1) (r_i - mean_g)
                         (leave-one-out baseline; Ahmadian et al. 2024, arXiv:2402.14740)
    reinforce_plus_plus: A_i = (r_i - mu) / sqrt(var + 1e-8), mu and var over the whole batch's loss
                         tokens (each sample weighted by its token count w_i; var unbiased:
                         sum_i w_i (r_i - mu)^2 / (sum_i w_i - 1)): REINFORCE++'s global batch
                         normalisation (Hu 2025, arXiv:2501.03262) with an outcome reward, gamma = 1.

A single-sample group has no baseline (std undefined): its advantage is 0 in both modes, so it
contributes no gradient. A group of equal rewards has advantage 0 (dynamic sampling drops it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GroupIndex:
    """Dense group numbering of a batch: `inverse[i]` is sample i's group in [0, num_groups)."""

    inverse: torch.Tensor  # [N] int64
    counts: torch.Tensor  # [G] int64

    @property
    def num_groups(self) -> int:
        return int(self.counts.numel())


def index_groups(group_ids: torch.Tensor) -> GroupIndex:
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D [N], got shape {tuple(group_ids.shape)}")
    if group_ids.is_floating_point():
        raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return GroupIndex(inverse, counts)


def check_group_inputs(values: torch.Tensor, group_ids: torch.Tensor, name: str, field: str) -> None:
    if values.dim() != 1 or values.shape != group_ids.shape:
        raise ValueError(
            f"{name}: {field} shape {tuple(values.shape)} and group_ids shape "
            f"{tuple(group_ids.shape)} must be the same 1-D [N]"
        )
    if not torch.isfinite(values).all():
        raise ValueError(f"{name}: {field} holds non-finite values")


def group_mean_std(values: torch.Tensor, index: GroupIndex) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group mean and unbiased std (0 for single-sample groups)."""
    g = index.num_groups
    counts = index.counts.to(values.dtype)
    mean = torch.zeros(g, dtype=values.dtype, device=values.device).index_add_(0, index.inverse, values) / counts
    dev = values - mean[index.inverse]
    sq = torch.zeros_like(mean).index_add_(0, index.inverse, dev * dev)
    std = torch.where(index.counts > 1, torch.sqrt(sq / (counts - 1).clamp(min=1)), torch.zeros_like(mean))
    return mean, std


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sample advantages [N] (fp32, fp64 for fp64 rewards); formulas in the module doc."""
    check_group_inputs(rewards, group_ids, "group_advantages", "rewards")
    values = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    index = index_groups(group_ids)
    mean, std = group_mean_std(values, index)
    centred = values - mean[index.inverse]
    adv = centred / (std[index.inverse] + eps) if norm_by_std else centred
    return torch.where(index.counts[index.inverse] > 1, adv, torch.zeros_like(adv))


def token_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sample advantages [N] to the loss tokens [N, S] (0 outside the mask)."""
    if loss_mask.dim() != 2 or loss_mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"token_advantages: loss_mask shape {tuple(loss_mask.shape)} must be [{advantages.shape[0]}, S]"
        )
    return advantages[:, None] * loss_mask.to(advantages.dtype)


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Leave-one-out advantages [N] (module doc); 0 for a single-sample group."""
    check_group_inputs(rewards, group_ids, "rloo_advantages", "rewards")
    values = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    index = index_groups(group_ids)
    mean, _ = group_mean_std(values, index)
    n = index.counts[index.inverse].to(values.dtype)
    adv = (values - mean[index.inverse]) * n / (n - 1).clamp(min=1)
    return torch.where(n > 1, adv, torch.zeros_like(adv))


def reinforce_plus_plus_advantages(
    rewards: torch.Tensor, token_counts: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++ advantages [N] (module doc): rewards whitened over the batch's tokens. A sample with
    token count 0 gets advantage 0; fewer than two tokens in all: every advantage 0 (no variance)."""
    if rewards.dim() != 1 or token_counts.shape != rewards.shape:
        raise ValueError(
            f"reinforce_plus_plus_advantages: rewards {tuple(rewards.shape)} and token_counts "
            f"{tuple(token_counts.shape)} must be the same 1-D [N]"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("reinforce_plus_plus_advantages: rewards holds non-finite values")
    if (token_counts < 0).any():
        raise ValueError("reinforce_plus_plus_advantages: token_counts must be >= 0")
    values = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    w = token_counts.to(values.dtype)
    total = w.sum()
    if total < 2:
        return torch.zeros_like(values)
    mu = (w * values).sum() / total
    var = (w * (values - mu) ** 2).sum() / (total - 1)
    adv = (values - mu) * torch.rsqrt(var + eps)
    return torch.where(w > 0, adv, torch.zeros_like(adv))

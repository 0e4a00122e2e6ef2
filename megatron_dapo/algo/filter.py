"""DAPO dynamic sampling: keep only groups whose metric varies, since a group where every sample
scores the same has zero advantage everywhere and only dilutes the batch.

A group is kept when max(metric) > min(metric) over its samples (single-sample groups have zero
spread and are dropped). Dropped groups are counted as all-correct when their common value is
>= `correct_threshold` and as all-wrong otherwise: for the 0/1 metric `acc` (default threshold
0.5) that is every sample acc == 1 vs every sample acc == 0; for a +-1 `score` or a shaped
`seq_reward`, pass threshold 0 (zero spread above / below it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .advantages import check_group_inputs, index_groups


@dataclass
class FilterResult:
    keep: torch.Tensor  # [N] bool, True for samples of kept groups
    num_groups: int
    num_kept: int  # groups kept
    num_all_correct: int  # dropped groups whose common value >= threshold
    num_all_wrong: int  # dropped groups whose common value < threshold


def dynamic_sampling_filter(
    metric: torch.Tensor, group_ids: torch.Tensor, correct_threshold: float = 0.5
) -> FilterResult:
    """Keep mask and group counts for one generation batch (see the module doc)."""
    check_group_inputs(metric, group_ids, "dynamic_sampling_filter", "metric")
    index = index_groups(group_ids)
    values = metric.to(torch.promote_types(metric.dtype, torch.float32))
    g = index.num_groups
    gmax = torch.full((g,), -torch.inf, dtype=values.dtype, device=values.device)
    gmax = gmax.scatter_reduce(0, index.inverse, values, reduce="amax")
    gmin = torch.full_like(gmax, torch.inf).scatter_reduce(0, index.inverse, values, reduce="amin")
    group_keep = gmax > gmin
    correct = ~group_keep & (gmin >= correct_threshold)
    return FilterResult(
        keep=group_keep[index.inverse],
        num_groups=g,
        num_kept=int(group_keep.sum()),
        num_all_correct=int(correct.sum()),
        num_all_wrong=int((~group_keep & ~correct).sum()),
    )

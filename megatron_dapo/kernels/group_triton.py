"""Segmented group reduction in Triton: the GPU path of `group_advantages`,
`dynamic_sampling_filter` and `token_advantages` (megatron_dapo.algo).

Samples are ordered by group on the host (torch.unique + a stable argsort); then one program per
group loads its contiguous segment once and computes mean, unbiased std, min / max spread, the
advantages of its members and the keep flag. A second kernel broadcasts per-sample advantages
to the loss tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_dapo.algo.advantages import check_group_inputs, index_groups
from megatron_dapo.algo.filter import FilterResult
from megatron_dapo.kernels.logprobs_triton import block_for


@triton.jit
def _group_stats_kernel(
    values_ptr,
    order_ptr,
    offsets_ptr,
    counts_ptr,
    adv_ptr,
    keep_ptr,
    correct_ptr,
    eps,
    threshold,
    NORM_BY_STD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    g = tl.program_id(0)
    start = tl.load(offsets_ptr + g)
    n = tl.load(counts_ptr + g)
    idx = tl.arange(0, BLOCK)
    valid = idx < n
    members = tl.load(order_ptr + start + idx, mask=valid, other=0)
    r = tl.load(values_ptr + members, mask=valid, other=0.0).to(tl.float32)
    nf = n.to(tl.float32)
    mean = tl.sum(r, axis=0) / nf
    dev = tl.where(valid, r - mean, 0.0)
    var = tl.sum(dev * dev, axis=0) / tl.maximum(nf - 1.0, 1.0)
    std = tl.sqrt(var)
    if NORM_BY_STD:
        adv = dev / (std + eps)
    else:
        adv = dev
    adv = tl.where(n > 1, adv, 0.0)
    tl.store(adv_ptr + members, adv, mask=valid)
    hi = tl.max(tl.where(valid, r, float("-inf")), axis=0)
    lo = tl.min(tl.where(valid, r, float("inf")), axis=0)
    keep = hi > lo
    tl.store(keep_ptr + g, keep.to(tl.int8))
    tl.store(correct_ptr + g, ((~keep) & (lo >= threshold)).to(tl.int8))


@triton.jit
def _broadcast_kernel(adv_ptr, mask_ptr, out_ptr, seq_len, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inb = cols < seq_len
    a = tl.load(adv_ptr + row)
    m = tl.load(mask_ptr + row * seq_len + cols, mask=inb, other=0).to(tl.float32)
    tl.store(out_ptr + row * seq_len + cols, a * m, mask=inb)


def _group_stats(values, group_ids, norm_by_std, eps, threshold):
    index = index_groups(group_ids)
    order = torch.argsort(index.inverse, stable=True)
    offsets = torch.cumsum(index.counts, 0) - index.counts
    g = index.num_groups
    adv = torch.empty(values.shape[0], dtype=torch.float32, device=values.device)
    keep = torch.empty(g, dtype=torch.int8, device=values.device)
    correct = torch.empty_like(keep)
    if g:
        block = triton.next_power_of_2(max(int(index.counts.max()), 2))
        _group_stats_kernel[(g,)](
            values.float().contiguous(),
            order,
            offsets,
            index.counts,
            adv,
            keep,
            correct,
            float(eps),
            float(threshold),
            NORM_BY_STD=bool(norm_by_std),
            BLOCK=block,
        )
    return index, adv, keep.bool(), correct.bool()


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Triton version of `megatron_dapo.algo.advantages.group_advantages` (fp32 output)."""
    check_group_inputs(rewards, group_ids, "group_advantages", "rewards")
    return _group_stats(rewards, group_ids, norm_by_std, eps, 0.0)[1]


def dynamic_sampling_filter(
    metric: torch.Tensor, group_ids: torch.Tensor, correct_threshold: float = 0.5
) -> FilterResult:
    """Triton version of `megatron_dapo.algo.filter.dynamic_sampling_filter`."""
    check_group_inputs(metric, group_ids, "dynamic_sampling_filter", "metric")
    index, _, keep, correct = _group_stats(metric, group_ids, True, 1e-6, correct_threshold)
    return FilterResult(
        keep=keep[index.inverse],
        num_groups=index.num_groups,
        num_kept=int(keep.sum()),
        num_all_correct=int(correct.sum()),
        num_all_wrong=int((~keep & ~correct).sum()),
    )


def token_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Triton version of `megatron_dapo.algo.advantages.token_advantages` (fp32 output)."""
    if loss_mask.dim() != 2 or loss_mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"token_advantages: loss_mask shape {tuple(loss_mask.shape)} must be [{advantages.shape[0]}, S]"
        )
    n, s = loss_mask.shape
    out = torch.empty(n, s, dtype=torch.float32, device=advantages.device)
    block = block_for(s, block)
    if n and s:
        mask = loss_mask.to(torch.float32).contiguous()
        _broadcast_kernel[(n, triton.cdiv(s, block))](advantages.float().contiguous(), mask, out, s, BLOCK=block)
    return out

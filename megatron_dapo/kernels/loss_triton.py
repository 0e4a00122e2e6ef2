"""Fused Triton DAPO token loss: the GPU path of `megatron_dapo.algo.loss.dapo_policy_loss`.

One program per sequence streams its tokens once: clamped log-ratio, ratio, asymmetric / dual
clip, truncated importance weight, masked sums and clip counts, giving the same per-sequence
partials [B, NUM_ROW_STATS] as the torch path, plus d L_t / d logprob_t per token for backward. The
argument checks, the aggregation over sequences and the global normalisation are the torch
reference's (`dapo_policy_loss` takes this kernel as its `row_stats`), so both backends share one
definition of every check, loss mode and metric.
Only `logprobs` receives a gradient (old logprobs, advantages and weights are data).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from megatron_dapo.algo.loss import LOG_RATIO_BOUND, NUM_ROW_STATS
from megatron_dapo.algo.loss import dapo_policy_loss as reference_dapo_policy_loss
from megatron_dapo.kernels.logprobs_triton import block_for

DEFAULT_BLOCK_S = 1024


@triton.jit
def _dapo_loss_fwd_kernel(
    lp_ptr,
    old_ptr,
    adv_ptr,
    mask_ptr,
    w_ptr,
    rows_ptr,
    dpg_ptr,
    seq_len,
    clip_low,
    clip_high,
    clip_c,
    is_cap,
    log_ratio_bound,
    HAS_DUAL: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_CAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * seq_len
    offs = tl.arange(0, BLOCK)
    acc_loss = tl.zeros((), tl.float32)
    acc_tok = tl.zeros((), tl.float32)
    acc_up = tl.zeros((), tl.float32)
    acc_low = tl.zeros((), tl.float32)
    acc_dual = tl.zeros((), tl.float32)
    acc_ratio = tl.zeros((), tl.float32)
    acc_kl = tl.zeros((), tl.float32)
    ratio_max = tl.zeros((), tl.float32)
    for start in range(0, seq_len, BLOCK):
        cols = start + offs
        inb = cols < seq_len
        m = (tl.load(mask_ptr + base + cols, mask=inb, other=0) != 0) & inb
        lp = tl.load(lp_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
        old = tl.load(old_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
        adv = tl.load(adv_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
        raw = tl.where(m, lp - old, 0.0)
        # the torch path's clamp: finite exp, and no gradient beyond the bound (the clamp is flat there)
        log_ratio = tl.minimum(tl.maximum(raw, -log_ratio_bound), log_ratio_bound)
        flat = (raw > log_ratio_bound) | (raw < -log_ratio_bound)
        ratio = tl.exp(log_ratio)
        upper = m & (adv > 0) & (ratio > 1 + clip_high)
        lower = m & (adv < 0) & (ratio < 1 - clip_low)
        clipped = upper | lower
        bounded = tl.minimum(tl.maximum(ratio, 1 - clip_low), 1 + clip_high)
        pg = -adv * tl.where(clipped, bounded, ratio)
        dpg = tl.where(clipped | flat, 0.0, -adv * ratio)
        dual = upper & lower  # mutually exclusive: all False unless HAS_DUAL
        if HAS_DUAL:
            bound = -adv * clip_c
            dual = m & (adv < 0) & (pg > bound)
            pg = tl.where(dual, bound, pg)
            dpg = tl.where(dual, 0.0, dpg)
        if HAS_W:
            w = tl.load(w_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
            if HAS_CAP:
                w = tl.minimum(w, is_cap)
            pg = pg * w
            dpg = dpg * w
        pg = tl.where(m, pg, 0.0)
        tl.store(dpg_ptr + base + cols, tl.where(m, dpg, 0.0), mask=inb)
        acc_loss += tl.sum(pg, axis=0)
        acc_tok += tl.sum(m.to(tl.float32), axis=0)
        acc_up += tl.sum(upper.to(tl.float32), axis=0)
        acc_low += tl.sum(lower.to(tl.float32), axis=0)
        acc_dual += tl.sum(dual.to(tl.float32), axis=0)
        acc_ratio += tl.sum(tl.where(m, ratio, 0.0), axis=0)
        acc_kl += tl.sum(tl.where(m, ratio - 1 - log_ratio, 0.0), axis=0)
        ratio_max = tl.maximum(ratio_max, tl.max(tl.where(m, ratio, 0.0), axis=0))
    out = rows_ptr + row * 8
    tl.store(out + 0, acc_loss)
    tl.store(out + 1, acc_tok)
    tl.store(out + 2, acc_up)
    tl.store(out + 3, acc_low)
    tl.store(out + 4, acc_dual)
    tl.store(out + 5, acc_ratio)
    tl.store(out + 6, acc_kl)
    tl.store(out + 7, ratio_max)


class _TritonRowStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logprobs, old_logprobs, advantages, loss_mask, weights, clip_low, clip_high, clip_c, cap, block_s):
        b, s = logprobs.shape
        f32 = dict(dtype=torch.float32, device=logprobs.device)
        rows = torch.empty(b, NUM_ROW_STATS, **f32)
        dpg = torch.empty(b, s, **f32)
        lp = logprobs.detach().contiguous()
        if b:
            _dapo_loss_fwd_kernel[(b,)](
                lp,
                old_logprobs.contiguous(),
                advantages.contiguous(),
                loss_mask.bool().to(torch.int8).contiguous(),
                weights.contiguous() if weights is not None else lp,
                rows,
                dpg,
                s,
                float(clip_low),
                float(clip_high),
                float(clip_c or 0.0),
                float(cap or 0.0),
                LOG_RATIO_BOUND,
                HAS_DUAL=clip_c is not None,
                HAS_W=weights is not None,
                HAS_CAP=cap is not None,
                BLOCK=block_s,
            )
        ctx.save_for_backward(dpg)
        ctx.in_dtype = logprobs.dtype
        return rows

    @staticmethod
    def backward(ctx, grad_rows):
        (dpg,) = ctx.saved_tensors
        grad = dpg * grad_rows[:, :1]
        return grad.to(ctx.in_dtype), None, None, None, None, None, None, None, None, None


def row_stats_triton(
    logprobs, old_logprobs, advantages, loss_mask, clip_low, clip_high, clip_c, weights, cap, block_s
) -> torch.Tensor:
    """The fused kernel's per-sequence partials of [B, S] rows (a `RowStats` of algo.loss, plus its tile)."""
    block_s = block_for(logprobs.shape[-1], block_s)
    return _TritonRowStats.apply(
        logprobs,
        old_logprobs.detach(),
        advantages.detach().expand_as(logprobs),
        loss_mask,
        None if weights is None else weights.detach(),
        clip_low,
        clip_high,
        clip_c,
        cap,
        block_s,
    )


def dapo_policy_loss(*args, block_s: int = DEFAULT_BLOCK_S, **kwargs):
    """Triton version of `megatron_dapo.algo.loss.dapo_policy_loss` (same arguments and semantics), plus
    the kernel's token tile `block_s`: the reference with this module's row partials."""
    return reference_dapo_policy_loss(*args, row_stats=functools.partial(row_stats_triton, block_s=block_s), **kwargs)

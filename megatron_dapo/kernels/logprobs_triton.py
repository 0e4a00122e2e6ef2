"""Fused Triton log-prob / entropy over a vocab shard: the GPU path of
`megatron_dapo.algo.logprobs.vocab_parallel_logprobs` (same signature, same math).

Forward: one program per token streams its logits row once (bf16 read as is), keeping an online
max, sum-exp, the target logit and the entropy partial sum exp(x - m)(x - m). The per-shard
partials go through the same MAX + one SUM all-reduce as the torch path (`merge_partials`).
Backward: one program per token streams the row once more and writes
grad = (g_lp (onehot - p) + g_H p (E[z] - z)) / temperature straight into a tensor of the
logits' dtype; no [T, V] fp32 temporary exists at any point.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_dapo.algo.logprobs import (
    GlobalStats,
    ShardPartials,
    check_logprob_inputs,
    compute_dtype,
    shard_logprobs_backward,
    shard_logprobs_forward,
)

DEFAULT_BLOCK_V = 4096


@triton.jit
def _logprob_fwd_kernel(
    logits_ptr,
    row_stride,
    target_ptr,
    inside_ptr,
    max_ptr,
    sum_ptr,
    tgt_ptr,
    ent_ptr,
    n_cols,
    inv_temp,
    WITH_ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    offs = tl.arange(0, BLOCK)
    m = tl.full((), -3.0e38, tl.float32)  # finite: shift * s must stay 0 on the first block
    s = tl.zeros((), tl.float32)
    q = tl.zeros((), tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        valid = cols < n_cols
        x = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = m - m_new
        alpha = tl.exp(shift)
        # finite everywhere (padding, -inf logits), so e * z never forms 0 * inf
        z = tl.where(valid, tl.maximum(x - m_new, -1e30), 0.0)
        e = tl.where(valid, tl.exp(z), 0.0)
        if WITH_ENTROPY:
            # sum e^(x-m)(x-m) rescaled to the new max: alpha * (q + shift * s)
            q = alpha * (q + shift * s) + tl.sum(e * z, axis=0)
        s = s * alpha + tl.sum(e, axis=0)
        m = m_new
    tgt = tl.load(target_ptr + row)
    inside = tl.load(inside_ptr + row) != 0
    x_t = tl.load(base + tgt, mask=inside, other=0.0).to(tl.float32) * inv_temp
    tl.store(max_ptr + row, m)
    tl.store(sum_ptr + row, s)
    tl.store(tgt_ptr + row, tl.where(inside, x_t - m, 0.0))
    if WITH_ENTROPY:
        tl.store(ent_ptr + row, q)


@triton.jit
def _logprob_bwd_kernel(
    logits_ptr,
    row_stride,
    grad_ptr,
    grad_stride,
    target_ptr,
    inside_ptr,
    max_ptr,
    lse_ptr,
    meanz_ptr,
    glp_ptr,
    gh_ptr,
    n_cols,
    inv_temp,
    HAS_GLP: tl.constexpr,
    HAS_GH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    gbase = grad_ptr + row * grad_stride
    offs = tl.arange(0, BLOCK)
    m = tl.load(max_ptr + row)
    lse = tl.load(lse_ptr + row)
    tgt = tl.load(target_ptr + row)
    inside = tl.load(inside_ptr + row) != 0
    glp = 0.0
    gh = 0.0
    mean_z = 0.0
    if HAS_GLP:
        glp = tl.load(glp_ptr + row)
    if HAS_GH:
        gh = tl.load(gh_ptr + row)
        mean_z = tl.load(meanz_ptr + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        valid = cols < n_cols
        z = tl.maximum(tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp - m, -1e30)
        p = tl.exp(z - lse)
        g = tl.zeros((BLOCK,), tl.float32)
        if HAS_GLP:
            g = tl.where((cols == tgt) & inside, glp, 0.0) - glp * p
        if HAS_GH:
            g += gh * p * (mean_z - z)
        tl.store(gbase + cols, (g * inv_temp).to(grad_ptr.dtype.element_ty), mask=valid)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    x = logits.reshape(-1, logits.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def block_for(n_cols: int, block_v: int = DEFAULT_BLOCK_V) -> int:
    """The tile of a row of n_cols elements: block_v, or the next power of two >= n_cols (>= 16) if smaller.
    Every kernel of this package that tiles a row (vocabulary, tokens of a sequence) sizes its tile so."""
    return min(block_v, triton.next_power_of_2(max(n_cols, 16)))


def shard_partials_triton(
    logits2d, local_target, inside, inv_temp, with_entropy, block_v, out: ShardPartials | None = None
) -> ShardPartials:
    """Per-row partials of a [T, V] block (rows of unit column stride); written into `out`'s fp32 [T]
    vectors when given (their ent_term present iff with_entropy)."""
    n_tok, vocab = logits2d.shape
    if out is None:
        f32 = dict(dtype=torch.float32, device=logits2d.device)
        new = [torch.empty(n_tok, **f32) for _ in range(4 if with_entropy else 3)]
        out = ShardPartials(*new[:3], new[3] if with_entropy else None)
    m, s, t = out.max, out.sum_exp, out.target_rel
    q = out.ent_term if with_entropy else m
    if n_tok:
        _logprob_fwd_kernel[(n_tok,)](
            logits2d,
            logits2d.stride(0),
            local_target,
            inside.to(torch.int8),
            m,
            s,
            t,
            q,
            vocab,
            inv_temp,
            WITH_ENTROPY=with_entropy,
            BLOCK=block_v,
        )
    return out


def grad_logits_triton(logits2d, local_target, inside, stats: GlobalStats, inv_temp, glp, gh, block_v, out=None):
    """d loss / d logits of a [T, V] block, into `out` (default: a new tensor like logits2d); out may be
    logits2d itself: each program reads a tile before it writes the same tile."""
    n_tok, vocab = logits2d.shape
    grad = torch.empty_like(logits2d) if out is None else out
    dummy = stats.max
    if n_tok:
        _logprob_bwd_kernel[(n_tok,)](
            logits2d,
            logits2d.stride(0),
            grad,
            grad.stride(0),
            local_target,
            inside.to(torch.int8),
            stats.max,
            stats.log_sum_exp,
            stats.mean_z if gh is not None else dummy,
            glp.float().contiguous() if glp is not None else dummy,
            gh.float().contiguous() if gh is not None else dummy,
            vocab,
            inv_temp,
            HAS_GLP=glp is not None,
            HAS_GH=gh is not None,
            BLOCK=block_v,
        )
    return grad


class _TritonVocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, temperature, with_entropy, block_v):
        return shard_logprobs_forward(
            ctx, _rows(logits), target, tp_group, temperature, with_entropy, block_v, shard_partials_triton
        )

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        return shard_logprobs_backward(ctx, grad_logprobs, grad_entropy, grad_logits_triton)


def vocab_parallel_logprobs(
    logits_shard: torch.Tensor,
    target_ids: torch.Tensor,
    tp_group=None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    block_v: int = DEFAULT_BLOCK_V,
):
    """Triton version of `megatron_dapo.algo.logprobs.vocab_parallel_logprobs` (fp32 outputs)."""
    check_logprob_inputs(logits_shard, target_ids, temperature)
    if compute_dtype(logits_shard.dtype) != torch.float32:
        raise TypeError(
            f"triton vocab_parallel_logprobs computes in fp32; got {logits_shard.dtype} logits "
            "(use the torch backend for float64)"
        )
    block_v = block_for(logits_shard.shape[-1], block_v)
    logprobs, entropy = _TritonVocabParallelLogprobs.apply(
        logits_shard, target_ids, tp_group, float(temperature), bool(with_entropy), int(block_v)
    )
    return (logprobs, entropy) if with_entropy else logprobs

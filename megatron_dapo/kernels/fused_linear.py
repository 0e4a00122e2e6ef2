"""Fused LM head + target log-probs (+ entropy), chunked over tokens: the [T, V] logits never exist.

    logprobs, entropy = fused_linear_logprobs(hidden, weight, target_ids, tp_group=tp, temperature=0.7)

Contract
    hidden     [T, H]        the final hidden states (replicated across the TP group, any float dtype).
    weight     [V_local, H]  this TP rank's shard of the output embedding: rank r holds the rows
                             r * V_local .. (r + 1) * V_local - 1 of the padded vocabulary
                             (megatron-core's ColumnParallelLinear / VocabParallelEmbedding layout).
    target_ids [T]           global token ids. An id outside [0, vocab_size) (e.g. -100) gets logprob 0
                             and passes no gradient back through it; its entropy is still real.
    vocab_size               the real vocabulary (default: V_local * tp_size). Rows at global index
                             >= vocab_size are padding: they are left out of every chunk's matmul, which
                             is exactly masking those logits to -inf (exp(-inf) = 0) without computing them
                             or building a masked copy; their dW rows are 0.
    Returns (logprobs [T] fp32, entropy [T] fp32 or None), both differentiable w.r.t. hidden and weight.

Formulas (per token; x = hidden @ weight.T / temperature over the whole vocabulary, in fp32)
    m        = max_v x_v                                   (MAX all-reduce of the per-rank maxima)
    log Z    = m + log sum_v exp(x_v - m)                  (max-shifted logsumexp; SUM all-reduce)
    logprob  = x_target - log Z                            (the owning rank's x_target, others 0; SUM)
    entropy  = log Z - sum_v p_v x_v,  p_v = exp(x_v - log Z)     (sum_v p_v x_v: SUM all-reduce)
    backward, with g_lp, g_H the incoming gradients of logprob and entropy:
    d logprob / d x_v = onehot_v - p_v
    d entropy / d x_v = -p_v (x_v - sum_u p_u x_u)
    d loss / d logits_v = (g_lp (onehot_v - p_v) - g_H p_v (x_v - E_p[x])) / temperature
    dH = (d loss / d logits) @ weight      dW = (d loss / d logits).T @ hidden

Memory: forward and backward loop over chunks of `chunk_tokens` rows, recomputing that chunk's logits
from hidden and weight (backward recomputes them instead of saving them). Saved for backward: hidden,
weight, the targets and per-token statistics (m, log sum exp, E_p[x - m]) of size [T]. The peak extra
memory is O(chunk_tokens * V_local) (a logits block and its softmax, buffers reused by every chunk), besides
dH and dW themselves (accumulated in fp32; for a bf16 weight that is an fp32 [V_local, H] accumulator and an
fp32 copy of the weight) -- never O(T * V).

Tensor parallel: the per-rank partials (relative to the rank's own max) are combined by
megatron_dapo.algo.logprobs.merge_partials: one MAX and one SUM all-reduce for the whole batch, after the
chunk loop. In backward each rank's dH is only its vocab shard's contribution: dH is SUM all-reduced over
tp_group here (reduce_hidden_grad=True), as the backward of megatron-core's
copy_to_tensor_model_parallel_region would. Pass reduce_hidden_grad=False when the caller already routes
hidden through such a region (or reduce-scatters it for sequence parallelism). dW stays local to the rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_dapo.algo.logprobs import Z_FLOOR, GlobalStats, ShardPartials, merge_partials


def _shard_layout(v_local: int, tp_group, vocab_size: int | None) -> tuple[int, int, int]:
    """(vocab_start, rows of this shard that are real vocabulary, global vocab size)."""
    rank, world = (0, 1) if tp_group is None else (dist.get_rank(tp_group), dist.get_world_size(tp_group))
    vocab = v_local * world if vocab_size is None else int(vocab_size)
    if not 0 < vocab <= v_local * world:
        raise ValueError(f"fused_linear_logprobs: vocab_size {vocab} must be in (0, {v_local * world}]")
    start = rank * v_local
    return start, max(0, min(v_local, vocab - start)), vocab


def _chunk_logits(hidden, w32, lo, hi, inv_temp, buf):
    """x = hidden[lo:hi] @ w.T / temperature in fp32, into a buffer reused by every chunk."""
    x = torch.matmul(hidden[lo:hi].float(), w32.t(), out=buf[: hi - lo])
    return x if inv_temp == 1.0 else x.mul_(inv_temp)


def _forward_partials(hidden, w32, local_target, inside, inv_temp, with_entropy, chunk) -> ShardPartials:
    """Per-token partials of this rank's shard relative to its own max m_r, one token chunk at a time."""
    n_tok, n_valid = hidden.shape[0], w32.shape[0]
    m_r, s_r, tgt = (hidden.new_zeros(n_tok, dtype=torch.float32) for _ in range(3))
    ent = hidden.new_zeros(n_tok, dtype=torch.float32) if with_entropy else None
    if n_valid == 0:  # a shard of padding only: its max is "-inf" and it adds nothing to the sums
        return ShardPartials(m_r.fill_(Z_FLOOR), s_r, tgt, ent)
    xbuf, ebuf = (hidden.new_empty(min(chunk, n_tok), n_valid, dtype=torch.float32) for _ in range(2))
    for lo in range(0, n_tok, chunk):
        hi = min(lo + chunk, n_tok)
        x = _chunk_logits(hidden, w32, lo, hi, inv_temp, xbuf)
        m = x.amax(dim=1)
        m_r[lo:hi] = m
        tgt[lo:hi] = x.gather(1, local_target[lo:hi, None]).squeeze(1) - m
        z = x.sub_(m[:, None])  # z_r = x - m_r <= 0: exp never overflows
        e = torch.exp(z, out=ebuf[: hi - lo])
        s_r[lo:hi] = e.sum(dim=1)
        if with_entropy:
            ent[lo:hi] = e.mul_(z).sum(dim=1)  # sum exp(z_r) z_r: entropy relative to m_r, no cancellation
    tgt = torch.where(inside, tgt, torch.zeros_like(tgt))  # only the owning rank contributes x_target
    return ShardPartials(m_r, s_r, tgt, ent)


def _backward_chunks(hidden, w32, n_rows, local_target, inside, stats, inv_temp, glp, gh, need_dh, need_dw, chunk):
    """dH (this shard's contribution) and dW [n_rows, H], recomputing each chunk's p; both fp32."""
    n_tok, n_valid = hidden.shape[0], w32.shape[0]
    dh = hidden.new_zeros(hidden.shape, dtype=torch.float32) if need_dh else None
    # the full-size dW, padding rows 0; accumulate into its valid rows (a contiguous view) in fp32
    dw = hidden.new_zeros((n_rows, hidden.shape[1]), dtype=torch.float32) if need_dw else None
    if n_valid == 0:
        return dh, dw
    zbuf, pbuf = (hidden.new_empty(min(chunk, n_tok), n_valid, dtype=torch.float32) for _ in range(2))
    for lo in range(0, n_tok, chunk):
        hi = min(lo + chunk, n_tok)
        z = _chunk_logits(hidden, w32, lo, hi, inv_temp, zbuf).sub_(stats.max[lo:hi, None])  # x - m
        p = torch.sub(z, stats.log_sum_exp[lo:hi, None], out=pbuf[: hi - lo]).exp_()
        if gh is not None:  # g_H p (E[z] - z), written over z: E[z] - z = E[x] - x
            z.neg_().add_(stats.mean_z[lo:hi, None]).mul_(p).mul_(gh[lo:hi, None])
        if glp is not None:  # g_lp (onehot - p), written over p
            p.mul_(-glp[lo:hi, None])
            onehot = torch.where(inside[lo:hi], glp[lo:hi], torch.zeros_like(glp[lo:hi]))
            p.scatter_add_(1, local_target[lo:hi, None], onehot[:, None])
        else:
            p.zero_()
        g = p.add_(z) if gh is not None else p
        if inv_temp != 1.0:
            g.mul_(inv_temp)  # x = logits / temperature
        if need_dh:
            torch.matmul(g, w32, out=dh[lo:hi])
        if need_dw:
            dw[:n_valid].addmm_(g.t(), hidden[lo:hi].float())
    return dh, dw


class _FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, tp_group, temperature, with_entropy, vocab_size, chunk, reduce_dh):
        ctx.set_materialize_grads(False)  # an unused output (often the entropy) costs no backward work
        start, n_valid, vocab = _shard_layout(weight.shape[0], tp_group, vocab_size)
        local = target - start
        inside = (local >= 0) & (local < n_valid)
        valid = (target >= 0) & (target < vocab)
        local_target = torch.where(inside, local, torch.zeros_like(local)).contiguous()
        w32 = weight[:n_valid].float()  # a view when the weight is already fp32
        inv_temp = 1.0 / temperature
        partials = _forward_partials(hidden, w32, local_target, inside, inv_temp, with_entropy, chunk)
        stats = merge_partials(partials, inside, tp_group)
        mean_z = stats.mean_z if with_entropy else stats.max  # a placeholder: save_for_backward takes no None
        ctx.save_for_backward(hidden, weight, local_target, inside, valid, stats.max, stats.log_sum_exp, mean_z)
        ctx.meta = (tp_group, n_valid, inv_temp, with_entropy, chunk, reduce_dh)
        logprobs = torch.where(valid, stats.logprobs, torch.zeros_like(stats.logprobs))
        entropy = stats.log_sum_exp - stats.mean_z if with_entropy else logprobs.new_empty(0)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local_target, inside, valid, m, log_s, mean_z = ctx.saved_tensors
        tp_group, n_valid, inv_temp, with_entropy, chunk, reduce_dh = ctx.meta
        need_dh, need_dw = ctx.needs_input_grad[:2]
        # a target outside the vocabulary has the constant logprob 0: no gradient flows back from it
        glp = None if grad_logprobs is None else torch.where(valid, grad_logprobs.float(), 0.0)
        gh = grad_entropy.float() if with_entropy and grad_entropy is not None else None
        if (glp is None and gh is None) or not (need_dh or need_dw):
            return (None,) * 9
        stats = GlobalStats(m, log_s, None, mean_z)
        w32 = weight[:n_valid].float()
        dh, dw = _backward_chunks(
            hidden, w32, weight.shape[0], local_target, inside, stats, inv_temp, glp, gh, need_dh, need_dw, chunk
        )
        if need_dh:
            if reduce_dh and tp_group is not None and dist.get_world_size(tp_group) > 1:
                dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=tp_group)  # sum of every shard's contribution
            dh = dh.to(hidden.dtype)
        if need_dw:
            dw = dw.to(weight.dtype)
        return dh, dw, None, None, None, None, None, None, None


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    tp_group=None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    vocab_size: int | None = None,
    chunk_tokens: int = 1024,
    reduce_hidden_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target log-probs (and entropy) of softmax(hidden @ weight.T / temperature) over the whole
    (vocab-parallel) vocabulary, without materialising the logits; see the module docstring."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"fused_linear_logprobs: hidden {tuple(hidden.shape)} / weight {tuple(weight.shape)}")
    if target_ids.shape != hidden.shape[:1] or target_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_linear_logprobs: target_ids must be int [T={hidden.shape[0]}]")
    if not temperature > 0 or chunk_tokens < 1:
        raise ValueError(f"fused_linear_logprobs: temperature {temperature} / chunk_tokens {chunk_tokens}")
    logprobs, entropy = _FusedLinearLogprobs.apply(
        hidden,
        weight,
        target_ids.long(),
        tp_group,
        float(temperature),
        bool(with_entropy),
        vocab_size,
        int(chunk_tokens),
        bool(reduce_hidden_grad),
    )
    return logprobs, (entropy if with_entropy else None)

"""Log-probabilities (and entropy) of target tokens from vocab-parallel logits.

The logits of one tensor-parallel rank cover the vocabulary slice
[rank * V_shard, (rank + 1) * V_shard), as megatron-core's output layer produces them.
With x = logits / temperature and the global log-partition log Z = log sum_v exp(x_v):

    logprob(t) = x_t - log Z
    entropy    = log Z - sum_v p_v x_v,          p_v = exp(x_v - log Z)

Each rank reduces its shard to per-token partials relative to its own max m_r:
s_r = sum exp(x - m_r), the target logit (if the target lies in the shard), and for the
entropy q_r = sum exp(x - m_r) (x - m_r). After one MAX all-reduce of m_r, the partials are
rescaled to the global max m and summed with ONE all-reduce of the stacked
(sum-exp, target logit[, q]) tensor. Working relative to m keeps entropy exact for logits of
+-1e4, where log Z - E[x] would cancel catastrophically in fp32.

Backward needs no communication: d logprob / dx_v = onehot_v - p_v and
d entropy / dx_v = p_v (E[z] - z_v) with z = x - m only use the local shard and the
saved per-token (m, log s, E[z]). Logits are processed in row chunks so that no fp32 copy of
the whole shard (nor of its softmax) ever exists; backward recomputes p chunk by chunk and
writes the gradient directly in the logits' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# Elements of one fp32 working chunk (rows x V_shard), whose buffers are reused by every chunk:
# 16M fp32 = 64 MiB, ~110 tokens of a 151936 vocabulary. Each chunk costs ~10 torch ops, and on
# a loaded CPU every op pays a thread-pool barrier, so much smaller chunks get slow (measured:
# 1 row per chunk is 25x slower than this, 13 rows 1.5x); the work memory stays constant in T.
DEFAULT_CHUNK_ELEMENTS = 1 << 24

# Floor for z = x - m: -inf logits (a padded vocabulary masked out) become a finite number whose
# exp is still exactly 0, so e * z and p * (E[z] - z) stay 0 instead of 0 * inf = NaN.
Z_FLOOR = -1e30


@dataclass
class ShardPartials:
    """Per-token reductions of one vocab shard, relative to the shard's own max."""

    max: torch.Tensor  # m_r                               [T]
    sum_exp: torch.Tensor  # sum exp(x - m_r)                [T]
    target_rel: torch.Tensor  # x_target - m_r (0 when not in the shard) [T]
    ent_term: torch.Tensor | None  # sum exp(x - m_r) (x - m_r)  [T] or None


@dataclass
class GlobalStats:
    """Per-token statistics over the full vocabulary, relative to the global max."""

    max: torch.Tensor  # m
    log_sum_exp: torch.Tensor  # log sum exp(x - m)        (log Z = m + log_sum_exp)
    logprobs: torch.Tensor  # x_target - log Z
    mean_z: torch.Tensor | None  # E_p[x - m]              (entropy = log_sum_exp - mean_z)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, the input's own precision otherwise (float64 stays float64 for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def shard_info(vocab_shard: int, tp_group) -> tuple[int, int]:
    """(vocab_start, tp_world_size) of this rank; tp_group None means an unsharded vocabulary."""
    if tp_group is None:
        return 0, 1
    rank = dist.get_rank(group=tp_group)
    return rank * vocab_shard, dist.get_world_size(group=tp_group)


def target_in_shard(target: torch.Tensor, vocab_start: int, vocab_shard: int, tp_world: int):
    """(local index clamped into the shard, targets inside this shard, targets inside the whole vocabulary)."""
    local = target - vocab_start
    inside = (local >= 0) & (local < vocab_shard)
    valid = (target >= 0) & (target < vocab_shard * tp_world)
    return torch.where(inside, local, torch.zeros_like(local)), inside, valid


def chunk_buffers(rows: int, vocab: int, dtype: torch.dtype, device, count: int) -> list[torch.Tensor]:
    """Work buffers reused by every chunk: fresh allocations per chunk would page-fault on each one."""
    return [torch.empty(rows, vocab, dtype=dtype, device=device) for _ in range(count)]


def load_chunk(buf: torch.Tensor, logits: torch.Tensor, lo: int, hi: int, inv_temp: float) -> torch.Tensor:
    """x = logits[lo:hi] / temperature in the compute dtype, written into a reused buffer."""
    x = buf[: hi - lo].copy_(logits[lo:hi])
    return x if inv_temp == 1.0 else x.mul_(inv_temp)


def shard_partials_torch(
    logits: torch.Tensor,
    local_target: torch.Tensor,
    inside: torch.Tensor,
    inv_temp: float,
    with_entropy: bool,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> ShardPartials:
    """Reduce a [T, V_shard] shard to ShardPartials, one row chunk at a time."""
    n_tok, vocab = logits.shape
    cdtype = compute_dtype(logits.dtype)
    out = [torch.empty(n_tok, dtype=cdtype, device=logits.device) for _ in range(4 if with_entropy else 3)]
    rows = max(1, min(n_tok, chunk_elements // max(vocab, 1)))
    bufs = chunk_buffers(rows, vocab, cdtype, logits.device, 2 if with_entropy else 1)
    for lo in range(0, n_tok, rows):
        hi = min(lo + rows, n_tok)
        x = load_chunk(bufs[0], logits, lo, hi, inv_temp)
        m = x.amax(dim=-1).clamp_(min=Z_FLOOR)  # a shard row of only -inf has no max
        out[0][lo:hi] = m
        out[2][lo:hi] = x.gather(1, local_target[lo:hi, None]).squeeze(1) - m
        x.sub_(m[:, None])  # z_r = x - m_r
        if with_entropy:
            x.clamp_(min=Z_FLOOR)
            e = torch.exp(x, out=bufs[1][: hi - lo])
            out[1][lo:hi] = e.sum(dim=-1)
            out[3][lo:hi] = e.mul_(x).sum(dim=-1)
        else:
            out[1][lo:hi] = x.exp_().sum(dim=-1)
    target_rel = torch.where(inside, out[2], torch.zeros_like(out[2]))
    return ShardPartials(out[0], out[1], target_rel, out[3] if with_entropy else None)


def merge_partials(p: ShardPartials, inside: torch.Tensor, tp_group) -> GlobalStats:
    """Combine shard partials across the TP group: one MAX all-reduce, then ONE SUM all-reduce."""
    m = p.max.clone()
    if tp_group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    shift = p.max - m  # <= 0
    alpha = torch.exp(shift)
    cols = [p.sum_exp * alpha, torch.where(inside, p.target_rel + shift, torch.zeros_like(shift))]
    if p.ent_term is not None:
        cols.append(alpha * (p.ent_term + shift * p.sum_exp))
    stacked = torch.stack(cols, dim=0)
    if tp_group is not None:
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp_group)
    log_s = torch.log(stacked[0])
    logprobs = stacked[1] - log_s
    mean_z = stacked[2] / stacked[0] if p.ent_term is not None else None
    return GlobalStats(m, log_s, logprobs, mean_z)


def grad_logits_torch(
    logits: torch.Tensor,
    local_target: torch.Tensor,
    inside: torch.Tensor,
    stats: GlobalStats,
    inv_temp: float,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """d loss / d logits for one shard, recomputing p chunk by chunk, written in the logits' dtype.

    grad = (g_lp (onehot - p) + g_H p (E[z] - z)) / temperature, with at most two chunk temporaries.
    """
    n_tok, vocab = logits.shape
    grad = torch.empty_like(logits)
    rows = max(1, min(n_tok, chunk_elements // max(vocab, 1)))
    zbuf, pbuf = chunk_buffers(rows, vocab, compute_dtype(logits.dtype), logits.device, 2)
    for lo in range(0, n_tok, rows):
        hi = min(lo + rows, n_tok)
        z = load_chunk(zbuf, logits, lo, hi, inv_temp).sub_(stats.max[lo:hi, None])
        p = torch.sub(z, stats.log_sum_exp[lo:hi, None], out=pbuf[: hi - lo]).exp_()
        if grad_entropy is not None:
            gh = grad_entropy[lo:hi].to(z.dtype)
            z.clamp_(min=Z_FLOOR).neg_().add_(stats.mean_z[lo:hi, None]).mul_(p).mul_(gh[:, None])  # g_H p (E[z] - z)
        if grad_logprobs is not None:
            glp = grad_logprobs[lo:hi].to(p.dtype)
            p.mul_(-glp[:, None])
            onehot = torch.where(inside[lo:hi], glp, torch.zeros_like(glp))
            p.scatter_add_(1, local_target[lo:hi, None], onehot[:, None])
        else:
            p.zero_()
        if grad_entropy is not None:
            p.add_(z)
        grad[lo:hi] = p.mul_(inv_temp) if inv_temp != 1.0 else p
    return grad


def masked_grad(grad: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Targets outside the vocabulary have logprob 0 (a constant): no gradient flows back from them."""
    return torch.where(valid, grad, torch.zeros_like(grad))


def shard_logprobs_forward(ctx, logits2d, target, tp_group, temperature, with_entropy, tuning, shard_partials):
    """The forward shared by the torch and Triton autograd functions; they differ only in the
    per-shard kernels (`shard_partials` here, the gradient kernel in the backward) and their tuning knob."""
    ctx.set_materialize_grads(False)  # an unused output (often the entropy) costs no backward work
    shape = target.shape
    vocab = logits2d.shape[-1]
    vocab_start, tp_world = shard_info(vocab, tp_group)
    local_target, inside, valid = target_in_shard(target.reshape(-1), vocab_start, vocab, tp_world)
    local_target = local_target.contiguous()
    inv_temp = 1.0 / temperature
    partials = shard_partials(logits2d, local_target, inside, inv_temp, with_entropy, tuning)
    stats = merge_partials(partials, inside, tp_group)
    ctx.save_for_backward(
        logits2d, local_target, inside, valid, stats.max, stats.log_sum_exp, stats.mean_z if with_entropy else stats.max
    )
    ctx.meta = (shape + (vocab,), inv_temp, with_entropy, tuning)
    logprobs = torch.where(valid, stats.logprobs, torch.zeros_like(stats.logprobs)).reshape(shape)
    if with_entropy:
        return logprobs, (stats.log_sum_exp - stats.mean_z).reshape(shape)
    return logprobs, logprobs.new_empty(0)


def shard_logprobs_backward(ctx, grad_logprobs, grad_entropy, grad_logits):
    """The backward shared by the torch and Triton autograd functions (see shard_logprobs_forward)."""
    logits2d, local_target, inside, valid, m, log_s, mean_z = ctx.saved_tensors
    shape, inv_temp, with_entropy, tuning = ctx.meta
    glp = None if grad_logprobs is None else masked_grad(grad_logprobs.reshape(-1), valid)
    gh = grad_entropy.reshape(-1) if (with_entropy and grad_entropy is not None) else None
    if glp is None and gh is None:
        return None, None, None, None, None, None
    stats = GlobalStats(m, log_s, None, mean_z if with_entropy else None)
    grad = grad_logits(logits2d, local_target, inside, stats, inv_temp, glp, gh, tuning)
    return grad.reshape(shape), None, None, None, None, None


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, temperature, with_entropy, chunk_elements):
        logits2d = logits.reshape(-1, logits.shape[-1])
        return shard_logprobs_forward(
            ctx, logits2d, target, tp_group, temperature, with_entropy, chunk_elements, shard_partials_torch
        )

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        return shard_logprobs_backward(ctx, grad_logprobs, grad_entropy, grad_logits_torch)


def check_logprob_inputs(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float) -> None:
    if logits.shape[:-1] != target_ids.shape:
        raise ValueError(
            f"vocab_parallel_logprobs: logits_shard shape {tuple(logits.shape)} must be target_ids shape "
            f"{tuple(target_ids.shape)} + (vocab_shard,)"
        )
    if not logits.is_floating_point():
        raise TypeError(f"vocab_parallel_logprobs: logits_shard must be floating point, got {logits.dtype}")
    if target_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"vocab_parallel_logprobs: target_ids must be int32/int64, got {target_ids.dtype}")
    if not temperature > 0:
        raise ValueError(f"vocab_parallel_logprobs: temperature must be > 0, got {temperature}")


def vocab_parallel_logprobs(
    logits_shard: torch.Tensor,
    target_ids: torch.Tensor,
    tp_group=None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
):
    """Log-probabilities of `target_ids` under softmax(logits / temperature) over the whole vocabulary.

    logits_shard: [..., V_shard] this rank's vocabulary slice (any float dtype; bf16 is read as is).
                  -inf entries (a padded vocabulary masked out) have probability 0 and grad 0.
    target_ids:   [...] global token ids. An id outside [0, V) (padding such as -100) gets
                  logprob 0 and passes no gradient back through it (its entropy is still real).
    tp_group:     the tensor-parallel process group the vocabulary is split over (equal slices in
                  rank order, as megatron-core's ColumnParallelLinear output); None = unsharded.
    Returns logprobs [...] (fp32, fp64 for fp64 input), or (logprobs, entropy) with with_entropy.
    Differentiable w.r.t. logits_shard through both outputs.
    """
    check_logprob_inputs(logits_shard, target_ids, temperature)
    logprobs, entropy = _VocabParallelLogprobs.apply(
        logits_shard, target_ids, tp_group, float(temperature), bool(with_entropy), int(chunk_elements)
    )
    return (logprobs, entropy) if with_entropy else logprobs

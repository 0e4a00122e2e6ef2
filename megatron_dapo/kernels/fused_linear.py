"""Fused LM head + target log-probs (+ entropy), chunked over tokens: the [T, V] logits never exist.

    logprobs, entropy = fused_linear_logprobs(hidden, weight, target_ids, tp_group=tp, temperature=0.7)

Contract
    hidden     [T, H]        the final hidden states, replicated across the TP group (any float dtype);
                             with sequence_parallel=True this TP rank's [T / TP, H] shard of them (rank r
                             holds rows r * T/TP ..), gathered inside.
    weight     [V_local, H]  this TP rank's shard of the output embedding: rank r holds the rows
                             r * V_local .. (r + 1) * V_local - 1 of the padded vocabulary
                             (megatron-core's ColumnParallelLinear / VocabParallelEmbedding layout).
    target_ids [T]           global token ids of all T tokens (also under sequence parallelism). An id
                             outside [0, vocab_size) (e.g. -100) gets logprob 0 and passes no gradient
                             back through it; its entropy is still real.
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

Memory: forward and backward loop over token chunks, recomputing each chunk's fp32 logits from hidden
and weight (backward recomputes them instead of saving them). The chunk is sized from `workspace_mib`
(the two reused [chunk, V_local] fp32 blocks together), so the workspace does not grow with T. A half
weight is upcast one vocab block (<= 16 MiB fp32) at a time, never as a whole. Saved for backward: the
(local) hidden, weight, the targets and per-token statistics of size [T]. dH is written chunk by chunk
in hidden's dtype. dW is accumulated in fp32 where it lands in fp32 anyway (an fp32 weight, or
megatron-core's fp32 main_grad); for a half weight without main_grad a second pass runs over vocab
blocks (each block's dW summed over all token chunks in an fp32 block, then stored), which costs one more
logits recompute but no full-size fp32 copy of dW.

Backends (`backend`: "auto" | "torch" | "triton", resolved by megatron_dapo.kernels.backend on hidden's
device: "auto" is Triton on CUDA and torch elsewhere, float64 under "auto" stays torch, and
MEGATRON_DAPO_KERNELS overrides "auto"). Both share everything above: the matmuls stay in torch (cuBLAS on
a GPU), and so do the chunk loop, the TP merge, the sequence-parallel gather / reduce-scatter and
main_grad. They differ only in the per-chunk work on the [chunk, n_valid] fp32 logits block (RowOps):
  torch   several torch ops per chunk (max, gather, exp, sums; backward in place plus a second block);
          CPU, and the reference;
  triton  megatron_dapo.kernels.fused_linear_triton: forward one pass over the block per row with an
          online max (the temperature applied on load), backward d loss / d logits written over the
          block in place (no second block); CUDA, or CPU under TRITON_INTERPRET=1 (tests only).

Gradient-accumulation fusion (gradient_accumulation_fusion=True and the weight has megatron-core's
`main_grad`): dW is added straight into weight.main_grad, as megatron-core's own linear layer does, and
the weight's autograd gradient is the same dummy that layer returns (so DDP's hook does not add it again).

Tensor parallel: the per-rank partials (relative to the rank's own max) are combined by
megatron_dapo.algo.logprobs.merge_partials: one MAX and one SUM all-reduce for the whole batch, after the
chunk loop. In backward each rank's dH is only its vocab shard's contribution: it is SUM all-reduced over
tp_group (reduce_hidden_grad=True), as the backward of megatron-core's copy_to_tensor_model_parallel_region
would, or with sequence_parallel=True reduce-scattered back to the rank's shard. Pass
reduce_hidden_grad=False when the caller already routes hidden through such a region. dW stays local.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo.algo.logprobs import Z_FLOOR, GlobalStats, ShardPartials, merge_partials
from megatron_dapo.kernels.backend import resolve_fp32_backend, triton_module

WORKSPACE_MIB = 64.0  # the two [chunk, V_local] fp32 blocks of one token chunk, together
WEIGHT_BLOCK_MIB = 16.0  # one fp32 vocab block of a half weight (upcast block by block)
_F32 = 4  # bytes


def chunk_tokens_for(v_local: int, workspace_mib: float = WORKSPACE_MIB, hidden_size: int = 0) -> int:
    """Tokens per chunk so that two [chunk, v_local] fp32 blocks and the chunk's fp32 hidden rows
    [chunk, hidden_size] fit in workspace_mib."""
    return max(1, int(workspace_mib * 2**20) // (_F32 * (2 * max(1, v_local) + hidden_size)))


def _shard_layout(v_local: int, tp_group, vocab_size: int | None) -> tuple[int, int, int]:
    """(vocab_start, rows of this shard that are real vocabulary, global vocab size)."""
    rank, world = _rank_world(tp_group)
    vocab = v_local * world if vocab_size is None else int(vocab_size)
    if not 0 < vocab <= v_local * world:
        raise ValueError(f"fused_linear_logprobs: vocab_size {vocab} must be in (0, {v_local * world}]")
    start = rank * v_local
    return start, max(0, min(v_local, vocab - start)), vocab


def _rank_world(tp_group) -> tuple[int, int]:
    return (0, 1) if tp_group is None else (dist.get_rank(tp_group), dist.get_world_size(tp_group))


def _gather_rows(local: torch.Tensor, tp_group) -> torch.Tensor:
    """All-gather sequence-parallel shards along dim 0 (a list all_gather: gloo has no tensor form)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_rows(full: torch.Tensor, tp_group) -> torch.Tensor:
    """Sum over the TP group and keep this rank's rows (gloo has no reduce_scatter: all_reduce + slice)."""
    rank, world = _rank_world(tp_group)
    rows = full.shape[0] // world
    if dist.get_backend(tp_group) == "gloo":
        dist.all_reduce(full, group=tp_group)
        return full[rank * rows : (rank + 1) * rows].clone()
    out = full.new_empty(rows, *full.shape[1:])
    dist.reduce_scatter_tensor(out, full.contiguous(), group=tp_group)
    return out


@dataclass(frozen=True)
class _Head:
    """The valid rows of this rank's weight shard, read as fp32 one vocab block at a time."""

    weight: torch.Tensor  # [n_valid, H] (a view of the shard's real-vocabulary rows)
    inv_temp: float

    @property
    def n_valid(self) -> int:
        return self.weight.shape[0]

    def blocks(self, rows: int | None = None):
        """(lo, hi, fp32 weight rows lo..hi); an fp32 weight is one block, a view (no copy)."""
        n, h = self.weight.shape
        if rows is None:
            rows = n if self.weight.dtype == torch.float32 else int(WEIGHT_BLOCK_MIB * 2**20) // (_F32 * h)
        rows = max(1, rows)
        for lo in range(0, n, rows):
            hi = min(lo + rows, n)
            yield lo, hi, self.weight[lo:hi].float()

    def logits(self, h32: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = h32 @ weight.T in fp32, [chunk, n_valid] (the row ops divide by the temperature)."""
        for lo, hi, w in self.blocks():
            if hi - lo == self.n_valid:
                torch.matmul(h32, w.t(), out=out)
            else:
                out[:, lo:hi] = h32 @ w.t()
        return out


@dataclass(frozen=True)
class RowOps:
    """The per-chunk work on a [rows, cols] block of raw fp32 logits (hidden @ weight.T, not yet divided
    by the temperature), one implementation per backend: this module's torch functions, or the Triton
    kernels of megatron_dapo.kernels.fused_linear_triton. Both may overwrite the block.

    partials(x, local_target, inside, inv_temp, out: ShardPartials of [rows] views, scratch) writes the
        rows' partials relative to their own max (target_rel 0 where the target is not in the shard).
    grad_logits(x, up: Upstream, lo, hi, col_lo, inv_temp, scratch) returns d loss / d x of tokens
        lo..hi, x holding the columns col_lo.. of the shard.
    scratch is a second [rows, cols] fp32 block when needs_scratch, else None."""

    partials: Callable
    grad_logits: Callable
    needs_scratch: bool


def _row_ops(backend: str) -> RowOps:
    return triton_module("fused_linear_triton").ROW_OPS if backend == "triton" else TORCH_ROW_OPS


def _blocks(like: torch.Tensor, rows: int, cols: int, ops: RowOps):
    """The reused fp32 logits block of a chunk and, if the row ops need one, its scratch block."""
    new = lambda: like.new_empty(rows, cols, dtype=torch.float32)
    return new(), (new() if ops.needs_scratch else None)


def _first_rows(buf: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if buf is None else buf[:n]


def _scaled(x: torch.Tensor, inv_temp: float) -> torch.Tensor:
    return x if inv_temp == 1.0 else x.mul_(inv_temp)


def _partials_torch(x, local_target, inside, inv_temp, out: ShardPartials, scratch) -> None:
    x = _scaled(x, inv_temp)
    m = x.amax(dim=1)
    out.max.copy_(m)
    # only the owning rank contributes x_target
    out.target_rel.copy_(torch.where(inside, x.gather(1, local_target[:, None]).squeeze(1) - m, 0.0))
    z = x.sub_(m[:, None])  # z_r = x - m_r <= 0: exp never overflows
    e = torch.exp(z, out=scratch)
    out.sum_exp.copy_(e.sum(dim=1))
    if out.ent_term is not None:  # sum exp(z_r) z_r: entropy relative to m_r, no cancellation
        out.ent_term.copy_(e.mul_(z).sum(dim=1))


def _forward_partials(hidden, head: _Head, local_target, inside, with_entropy, chunk, ops) -> ShardPartials:
    """Per-token partials of this rank's shard relative to its own max m_r, one token chunk at a time."""
    n_tok = hidden.shape[0]
    m_r, s_r, tgt = (hidden.new_zeros(n_tok, dtype=torch.float32) for _ in range(3))
    ent = hidden.new_zeros(n_tok, dtype=torch.float32) if with_entropy else None
    if head.n_valid == 0:  # a shard of padding only: its max is "-inf" and it adds nothing to the sums
        return ShardPartials(m_r.fill_(Z_FLOOR), s_r, tgt, ent)
    xbuf, scratch = _blocks(hidden, min(chunk, n_tok), head.n_valid, ops)
    for lo in range(0, n_tok, chunk):
        hi = min(lo + chunk, n_tok)
        x = head.logits(hidden[lo:hi].float(), xbuf[: hi - lo])
        rows = ShardPartials(m_r[lo:hi], s_r[lo:hi], tgt[lo:hi], None if ent is None else ent[lo:hi])
        ops.partials(x, local_target[lo:hi], inside[lo:hi], head.inv_temp, rows, _first_rows(scratch, hi - lo))
    return ShardPartials(m_r, s_r, tgt, ent)


@dataclass(frozen=True)
class Upstream:
    """What the backward needs per token: the incoming gradients and the saved global statistics."""

    stats: GlobalStats
    local_target: torch.Tensor
    inside: torch.Tensor
    glp: torch.Tensor | None
    gh: torch.Tensor | None


def _grad_logits_torch(x, up: Upstream, lo, hi, col_lo, inv_temp, pbuf):
    """d loss / d x for tokens lo..hi and the columns col_lo.. of x (in place over x; pbuf a scratch)."""
    z = _scaled(x, inv_temp).sub_(up.stats.max[lo:hi, None])  # x - m
    p = torch.sub(z, up.stats.log_sum_exp[lo:hi, None], out=pbuf).exp_()
    if up.gh is not None:  # g_H p (E[z] - z), written over z: E[z] - z = E[x] - x
        z.neg_().add_(up.stats.mean_z[lo:hi, None]).mul_(p).mul_(up.gh[lo:hi, None])
    if up.glp is not None:  # g_lp (onehot - p), written over p
        p.mul_(-up.glp[lo:hi, None])
        col = up.local_target[lo:hi] - col_lo
        hit = up.inside[lo:hi] & (col >= 0) & (col < p.shape[1])
        onehot = torch.where(hit, up.glp[lo:hi], torch.zeros_like(up.glp[lo:hi]))
        p.scatter_add_(1, torch.where(hit, col, torch.zeros_like(col))[:, None], onehot[:, None])
    else:
        p.zero_()
    g = p.add_(z) if up.gh is not None else p
    return _scaled(g, inv_temp)  # x = logits / temperature


TORCH_ROW_OPS = RowOps(_partials_torch, _grad_logits_torch, needs_scratch=True)


def _backward_by_tokens(hidden, head: _Head, up: Upstream, dh, dw32, chunk, ops: RowOps):
    """One pass over token chunks: dh[lo:hi] (this shard's contribution, hidden's dtype) and, when dw32
    (fp32 [n_valid, H]) is given, dW accumulated into it."""
    n_tok = hidden.shape[0]
    zbuf, pbuf = _blocks(hidden, min(chunk, n_tok), head.n_valid, ops)
    for lo in range(0, n_tok, chunk):
        hi = min(lo + chunk, n_tok)
        h32 = hidden[lo:hi].float()
        x = head.logits(h32, zbuf[: hi - lo])
        g = ops.grad_logits(x, up, lo, hi, 0, head.inv_temp, _first_rows(pbuf, hi - lo))
        if dh is not None:
            acc = None
            for c_lo, c_hi, w in head.blocks():
                part = g[:, c_lo:c_hi] @ w
                acc = part if acc is None else acc.add_(part)
            dh[lo:hi] = acc
        if dw32 is not None:
            dw32.addmm_(g.t(), h32)


def _backward_weight_by_blocks(hidden, head: _Head, up: Upstream, store, workspace_mib, ops: RowOps):
    """dW of a half weight without a fp32 target: vocab block by block, each block's fp32 dW summed over
    all token chunks and handed to store(lo, hi, block)."""
    n_tok = hidden.shape[0]
    for c_lo, c_hi, w in head.blocks():
        acc = torch.zeros(c_hi - c_lo, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        chunk = min(n_tok, chunk_tokens_for(c_hi - c_lo, workspace_mib, hidden.shape[1]))
        xbuf, pbuf = _blocks(hidden, chunk, c_hi - c_lo, ops)
        for lo in range(0, n_tok, chunk):
            hi = min(lo + chunk, n_tok)
            h32 = hidden[lo:hi].float()
            x = torch.matmul(h32, w.t(), out=xbuf[: hi - lo])
            g = ops.grad_logits(x, up, lo, hi, c_lo, head.inv_temp, _first_rows(pbuf, hi - lo))
            acc.addmm_(g.t(), h32)
        store(c_lo, c_hi, acc)


def _weight_grad(hidden, weight, head: _Head, up: Upstream, main_grad, dh, chunk, opts):
    """Run the backward passes; returns the weight's autograd gradient (None when it went to main_grad)."""
    ops = _row_ops(opts.backend)
    n_valid = head.n_valid
    fresh = None if main_grad is not None else torch.zeros_like(weight)  # padding rows stay 0
    target = main_grad if main_grad is not None else fresh
    if n_valid == 0:  # a shard of padding only: no logits, dH and dW contributions are 0
        return fresh
    if target.dtype == torch.float32:
        _backward_by_tokens(hidden, head, up, dh, target[:n_valid], chunk, ops)
        return fresh
    if dh is not None:
        _backward_by_tokens(hidden, head, up, dh, None, chunk, ops)

    def store(lo, hi, block):
        target[lo:hi].add_(block)  # target rows lo..hi are 0 when fresh: this is a cast

    _backward_weight_by_blocks(hidden, head, up, store, opts.workspace_mib, ops)
    return fresh


def _main_grad_dummy(weight):
    """What megatron-core's linear layer returns as the weight's grad once dW went into main_grad: a
    dummy marked as already added (DDP's hook then skips it), or None without grad_added_to_main_grad."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return make(weight.main_grad.shape, dtype=weight.dtype, device=weight.device, requires_grad=False)


class _FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, opts):
        ctx.set_materialize_grads(False)  # an unused output (often the entropy) costs no backward work
        full = _gather_rows(hidden, opts.tp_group) if opts.sequence_parallel else hidden
        if full.shape[0] != target.shape[0]:
            raise ValueError(f"fused_linear_logprobs: {full.shape[0]} hidden rows for {target.shape[0]} targets")
        start, n_valid, vocab = _shard_layout(weight.shape[0], opts.tp_group, opts.vocab_size)
        local = target - start
        inside = (local >= 0) & (local < n_valid)
        valid = (target >= 0) & (target < vocab)
        local_target = torch.where(inside, local, torch.zeros_like(local)).contiguous()
        head = _Head(weight[:n_valid], 1.0 / opts.temperature)
        chunk = opts.chunk_tokens or chunk_tokens_for(n_valid, opts.workspace_mib, hidden.shape[1])
        ops = _row_ops(opts.backend)
        partials = _forward_partials(full, head, local_target, inside, opts.with_entropy, chunk, ops)
        stats = merge_partials(partials, inside, opts.tp_group)
        mean_z = stats.mean_z if opts.with_entropy else stats.max  # a placeholder: save_for_backward takes no None
        ctx.save_for_backward(hidden, weight, local_target, inside, valid, stats.max, stats.log_sum_exp, mean_z)
        # like megatron-core's linear layer: main_grad is kept on ctx, not saved (it is modified in place)
        ctx.main_grad = weight.main_grad if opts.gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.opts, ctx.chunk, ctx.n_valid = opts, chunk, n_valid
        logprobs = torch.where(valid, stats.logprobs, torch.zeros_like(stats.logprobs))
        entropy = stats.log_sum_exp - stats.mean_z if opts.with_entropy else logprobs.new_empty(0)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local_target, inside, valid, m, log_s, mean_z = ctx.saved_tensors
        opts, main_grad = ctx.opts, ctx.main_grad
        need_dh, need_dw = ctx.needs_input_grad[:2]
        # a target outside the vocabulary has the constant logprob 0: no gradient flows back from it
        glp = None if grad_logprobs is None else torch.where(valid, grad_logprobs.float(), 0.0)
        gh = grad_entropy.float() if opts.with_entropy and grad_entropy is not None else None
        if (glp is None and gh is None) or not (need_dh or need_dw):
            return None, None, None, None
        full = _gather_rows(hidden, opts.tp_group) if opts.sequence_parallel else hidden
        up = Upstream(GlobalStats(m, log_s, None, mean_z), local_target, inside, glp, gh)
        head = _Head(weight[: ctx.n_valid], 1.0 / opts.temperature)
        dh = full.new_zeros(full.shape) if need_dh else None
        dw = None
        if need_dw:
            dw = _weight_grad(full, weight, head, up, main_grad, dh, ctx.chunk, opts)
            if main_grad is not None:
                dw = _main_grad_dummy(weight)
        elif dh is not None and head.n_valid:
            _backward_by_tokens(full, head, up, dh, None, ctx.chunk, _row_ops(opts.backend))
        if need_dh:
            dh = _reduce_hidden_grad(dh, opts)
        return dh, dw, None, None


def _reduce_hidden_grad(dh, opts):
    """Sum every vocab shard's contribution to dH over TP (reduce-scatter it under sequence parallel)."""
    if opts.tp_group is None or dist.get_world_size(opts.tp_group) == 1:
        return dh
    if opts.sequence_parallel:
        return _reduce_scatter_rows(dh, opts.tp_group)
    if opts.reduce_hidden_grad:
        dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=opts.tp_group)
    return dh


@dataclass(frozen=True)
class _Options:
    tp_group: object
    temperature: float
    with_entropy: bool
    vocab_size: int | None
    chunk_tokens: int | None
    workspace_mib: float
    reduce_hidden_grad: bool
    sequence_parallel: bool
    gradient_accumulation_fusion: bool
    backend: str  # "torch" | "triton" (resolved)


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    tp_group=None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    vocab_size: int | None = None,
    sequence_parallel: bool = False,
    gradient_accumulation_fusion: bool = False,
    chunk_tokens: int | None = None,
    workspace_mib: float = WORKSPACE_MIB,
    reduce_hidden_grad: bool = True,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target log-probs (and entropy) of softmax(hidden @ weight.T / temperature) over the whole
    (vocab-parallel) vocabulary, without materialising the logits; see the module docstring.
    chunk_tokens (default: sized from workspace_mib) fixes the token chunk. backend: "auto" (None),
    "torch" or "triton" for the per-chunk row work, resolved on hidden as megatron_dapo.kernels.backend
    does (float64 under "auto" stays torch)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"fused_linear_logprobs: hidden {tuple(hidden.shape)} / weight {tuple(weight.shape)}")
    if target_ids.dim() != 1 or target_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_linear_logprobs: target_ids must be int [T], got {tuple(target_ids.shape)}")
    if not temperature > 0 or (chunk_tokens is not None and chunk_tokens < 1) or not workspace_mib > 0:
        raise ValueError(
            f"fused_linear_logprobs: temperature {temperature} / chunk_tokens {chunk_tokens} / "
            f"workspace_mib {workspace_mib}"
        )
    if sequence_parallel and tp_group is None:
        raise ValueError("fused_linear_logprobs: sequence_parallel=True needs a tp_group")
    opts = _Options(
        tp_group,
        float(temperature),
        bool(with_entropy),
        vocab_size,
        chunk_tokens,
        float(workspace_mib),
        bool(reduce_hidden_grad),
        bool(sequence_parallel),
        bool(gradient_accumulation_fusion),
        resolve_fp32_backend(hidden, backend),
    )
    logprobs, entropy = _FusedLinearLogprobs.apply(hidden, weight, target_ids.long(), opts)
    return logprobs, (entropy if with_entropy else None)

"""The Triton row ops of the fused LM head (`megatron_dapo.kernels.fused_linear`, backend "triton").

fused_linear keeps the matmuls in torch (cuBLAS on a GPU), the token-chunk loop, the TP merge, the
sequence-parallel gather / reduce-scatter and main_grad; per chunk it hands a [rows, cols] block of raw
fp32 logits to these two functions, which run the kernels of `logprobs_triton` on it:
  forward   one program per row streams the block once over vocab tiles with an online (running) max:
            m_r, sum exp(x - m_r), sum exp(x - m_r)(x - m_r) and x_target - m_r, the temperature applied
            on load, written straight into the per-token vectors of the whole batch;
  backward  one program per row turns the recomputed block into d loss / d logits in place (no scratch
            block), a block that starts at column col_lo seeing its targets shifted by col_lo, so a
            target outside the block (or the shard) matches no column and adds no onehot.
Importing this module imports triton; fused_linear loads it only for backend "triton".
"""

from __future__ import annotations

from megatron_dapo.algo.logprobs import GlobalStats, ShardPartials
from megatron_dapo.kernels.fused_linear import RowOps, Upstream
from megatron_dapo.kernels.logprobs_triton import block_for, grad_logits_triton, shard_partials_triton


def chunk_partials(x, local_target, inside, inv_temp, out: ShardPartials, scratch) -> None:
    """RowOps.partials: the rows' partials of x / temperature into `out` (x is only read)."""
    shard_partials_triton(x, local_target, inside, inv_temp, out.ent_term is not None, block_for(x.shape[1]), out=out)


def grad_logits(x, up: Upstream, lo, hi, col_lo, inv_temp, scratch):
    """RowOps.grad_logits: d loss / d x of tokens lo..hi, written over x and returned."""
    s = up.stats
    stats = GlobalStats(s.max[lo:hi], s.log_sum_exp[lo:hi], None, s.mean_z[lo:hi])
    glp = None if up.glp is None else up.glp[lo:hi]
    gh = None if up.gh is None else up.gh[lo:hi]
    target = up.local_target[lo:hi] - col_lo
    return grad_logits_triton(x, target, up.inside[lo:hi], stats, inv_temp, glp, gh, block_for(x.shape[1]), out=x)


ROW_OPS = RowOps(chunk_partials, grad_logits, needs_scratch=False)

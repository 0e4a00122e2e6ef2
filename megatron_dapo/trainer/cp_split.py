"""Context parallelism: a packed micro-batch cut across the CP ranks the way megatron-core expects.

Every sequence of the packed row (and the trailing padding segment) is padded to a multiple of 2*cp
(`pack(..., seq_multiple=2 * cp)`) and cut into 2*cp equal chunks; CP rank r keeps chunks r and 2cp-1-r
of each (the load-balanced layout of megatron-core / Transformer Engine: under a causal mask the early
and late chunks cost the same in total on every rank). A rank's local row is those chunks, sequence by
sequence. Per-position outputs (logprobs, entropy) are gathered back into packed token order with
`gather_token_order`, so the loss sees every token once and in order, exactly as without CP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo.trainer.packing import PackedMicroBatch


def load_balanced_index(cu_seqlens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Packed positions held by CP `rank`: chunks rank and 2cp-1-rank of each segment, in order."""
    parts = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        n = end - start
        if n % (2 * cp):
            raise ValueError(f"packed segment [{start}, {end}) of {n} tokens is not a multiple of 2*cp = {2 * cp}")
        chunk = n // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass
class ContextParallelSlice:
    """This CP rank's share of a packed micro-batch."""

    index: torch.Tensor  # [L / cp] packed positions this rank holds, in local order
    order: torch.Tensor  # [L] packed position of each slot of the gathered row (rank 0's tokens, rank 1's, ...)
    segment: torch.Tensor  # [L] segment (sequence) id of each packed position
    tokens: torch.Tensor  # [1, L / cp]
    position_ids: torch.Tensor  # [1, L / cp], per-sequence positions of the local tokens
    target_ids: torch.Tensor  # [1, L / cp]

    def attention_mask(self) -> torch.Tensor:
        """[1, 1, L / cp, L] bool, True where local query i may NOT attend gathered key j: a key is
        visible when it is in the query's sequence and not after it in packed order (causal)."""
        q, k = self.index, self.order
        allowed = (self.segment[q][:, None] == self.segment[k][None, :]) & (k[None, :] <= q[:, None])
        return (~allowed)[None, None]


def split_micro_batch(mb: PackedMicroBatch, cp: int, rank: int) -> ContextParallelSlice:
    index = load_balanced_index(mb.cu_seqlens, cp, rank)
    order = torch.cat([load_balanced_index(mb.cu_seqlens, cp, r) for r in range(cp)])
    segment = torch.zeros(mb.length, dtype=torch.long)
    segment[mb.cu_seqlens[1:-1].long()] = 1
    segment = segment.cumsum(0)
    return ContextParallelSlice(
        index, order, segment, mb.tokens[:, index], mb.position_ids[:, index], mb.target_ids[:, index]
    )


class _GatherTokenOrder(torch.autograd.Function):
    """[1, L / cp] local values -> [1, L] in packed order. Every CP rank then computes the same loss from
    the same gathered values, so the gradient of a rank's own values is its slots of the incoming
    gradient (no reduction: summing over ranks would count each token cp times)."""

    @staticmethod
    def forward(ctx, local, index, order, group):
        parts = [torch.empty_like(local) for _ in range(group.size())]
        dist.all_gather(parts, local.contiguous(), group=group)
        out = torch.empty((local.shape[0], order.numel(), *local.shape[2:]), dtype=local.dtype, device=local.device)
        out[:, order.to(local.device)] = torch.cat(parts, dim=1)
        ctx.save_for_backward(index)
        return out

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad[:, index.to(grad.device)], None, None, None


def gather_token_order(local: torch.Tensor, part: ContextParallelSlice, group) -> torch.Tensor:
    """Per-position values of this rank's tokens [1, L / cp, ...] -> every token's [1, L, ...], in packed order."""
    return _GatherTokenOrder.apply(local, part.index, part.order, group)

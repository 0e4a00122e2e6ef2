"""Core attention of the local (torch) layer spec: torch's scaled_dot_product_attention, with context
parallelism.

megatron-core 0.16.1's local `DotProductAttention` materialises the [heads, Lq, Lk] scores and keeps the
softmax probabilities for backward (T^2 memory per layer: 16K tokens did not fit 24 GiB), and refuses
`context_parallel_size > 1` (only Transformer Engine's attention implements CP). This subclass replaces its
forward by `torch.nn.functional.scaled_dot_product_attention`, which on the CPU runs a flash-attention
kernel (query/key blocks, online softmax; backward recomputes the blocks from a saved logsumexp) and, on
a GPU without Transformer Engine, PyTorch's memory-efficient kernel. The only [Lq, Lk] tensor left is the
mask, converted once per micro-batch to an additive float mask shared by all layers.

With CP each rank holds its own query rows; keys and values are all-gathered over the CP group
(megatron-core's sequence-parallel gather with the CP group: all-gather forward, reduce-scatter backward).
The caller passes a boolean mask [1, 1, local tokens, all tokens] (True = not allowed) whose key columns
are in the gathered order (rank 0's local tokens, then rank 1's, ...): with megatron-core's load-balanced
layout that is the causal, per-sequence mask of `trainer.cp_split`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch.utils.weak import WeakIdKeyDictionary

# bool mask -> {dtype: additive mask}; an entry lives as long as the caller's mask, so every layer of a
# micro-batch (and its recompute) shares one additive mask instead of SDPA converting one per layer.
_ADDITIVE_MASKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask (True = not allowed) as 0 / -inf in `dtype`, cached per mask tensor."""
    per_dtype = _ADDITIVE_MASKS.setdefault(mask, {})
    if dtype not in per_dtype:
        per_dtype[dtype] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return per_dtype[dtype]


class SdpaDotProductAttention(DotProductAttention):
    """DotProductAttention computed by torch SDPA, over keys / values all-gathered across the CP group."""

    def __init__(self, config, *args, **kwargs):
        # The parent asserts cp == 1; the CP split is handled here, so it sees a CP-free copy of the config.
        cp_free = config if config.context_parallel_size == 1 else dataclasses.replace(config, context_parallel_size=1)
        super().__init__(cp_free, *args, **kwargs)
        self.cp_group = parallel_state.get_context_parallel_group() if config.context_parallel_size > 1 else None
        unsupported = {
            "attention_dropout": self.attention_dropout.p > 0,
            "window_size": self.scale_mask_softmax.window_size is not None,
            "softmax_type": self.softmax_offset is not None,
        }
        for field, used in unsupported.items():
            if used:
                raise ValueError(f"the local spec's SDPA attention does not implement TransformerConfig.{field}")
        # The parent splits the scale between the scores and FusedScaleMaskSoftmax's coefficient.
        self.sdpa_scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if attention_mask is None:
            raise ValueError("the local spec's SDPA attention needs an explicit attention mask")
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("the local spec's SDPA attention takes no attention_bias / packed_seq_params (THD)")
        if self.cp_group is not None:
            key = gather_from_sequence_parallel_region(key, group=self.cp_group)
            value = gather_from_sequence_parallel_region(value, group=self.cp_group)
        if attention_mask.shape[-2:] != (query.shape[0], key.shape[0]):
            raise ValueError(
                f"attention mask covers {tuple(attention_mask.shape[-2:])} (queries, keys); "
                f"this rank has {query.shape[0]} queries and {key.shape[0]} keys"
            )
        # [s, b, heads, d] -> [b, heads, s, d]; grouped K/V heads are expanded inside SDPA (enable_gqa).
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=additive_mask(attention_mask, q.dtype), scale=self.sdpa_scale, enable_gqa=True
        )
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)

"""Context-parallel core attention for the local (torch) layer spec.

megatron-core 0.16.1's local `DotProductAttention` refuses `context_parallel_size > 1` (only Transformer
Engine's attention implements CP). This subclass makes CP run on the local spec, so it is tested for real
on the CPU: each CP rank holds its own query rows; keys and values are all-gathered over the CP group
(megatron-core's sequence-parallel gather with the CP group: all-gather forward, reduce-scatter backward),
and the parent's attention runs on local queries against all keys under the caller's mask.

The caller passes a boolean mask [1, 1, local tokens, all tokens] (True = not allowed) whose key columns are
in the gathered order (rank 0's local tokens, then rank 1's, ...): with megatron-core's load-balanced
layout that is the causal, per-sequence mask of `trainer.cp_split`. Memory: the scores of one rank are
[heads, L/cp, L], 1/cp of the unsplit attention's; the gathered K/V are full length.
"""

from __future__ import annotations

import dataclasses

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention


class ContextParallelDotProductAttention(DotProductAttention):
    """DotProductAttention over keys / values all-gathered across the context-parallel group."""

    def __init__(self, config, *args, **kwargs):
        # The parent asserts cp == 1; the CP split is handled here, so it sees a CP-free copy of the config.
        super().__init__(dataclasses.replace(config, context_parallel_size=1), *args, **kwargs)
        self.cp_group = parallel_state.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, **kwargs):
        if attention_mask is None:
            raise ValueError("context-parallel attention on the local spec needs an explicit attention mask")
        key = gather_from_sequence_parallel_region(key, group=self.cp_group)
        value = gather_from_sequence_parallel_region(value, group=self.cp_group)
        if attention_mask.shape[-2:] != (query.shape[0], key.shape[0]):
            raise ValueError(
                f"context-parallel attention mask covers {tuple(attention_mask.shape[-2:])} (queries, keys); "
                f"this rank has {query.shape[0]} queries and the CP group {key.shape[0]} keys"
            )
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, **kwargs)

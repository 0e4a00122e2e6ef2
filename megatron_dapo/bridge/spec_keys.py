"""One checkpoint for megatron-core's local and Transformer Engine layer specs.

megatron-core 0.16.1's two GPT layer specs (`models/gpt/gpt_layer_specs.py`) save the same sharded keys for
every tensor but one, the pre-MLP norm of a MoE layer:

    local spec   <layers>.mlp.linear_fc1.layer_norm_weight   its `sharded_state_dict_keys_map` renames
                                                             `pre_mlp_layernorm.` as if the norm were fused
                                                             into a dense fc1, in MoE layers too
    TE spec      <layers>.pre_mlp_layernorm.weight           a TENorm of its own: TE fuses that norm only
                                                             into a dense MLP's LayerNormLinear

(dense layers: `mlp.linear_fc1.layer_norm_weight` in both; `input_layernorm` is
`self_attention.linear_qkv.layer_norm_weight` in both; experts: SequentialMLP and TEGroupedMLP write the
same `mlp.experts.experts.linear_fc{1,2}.weight` / `_extra_state` keys). Each spec saves its own name, as
Megatron-LM does; on load, a model key the checkpoint lacks is read from the other spec's name for it.
"""

from __future__ import annotations

import re

# (this spec's key, the other spec's key for the same tensor); each direction
_ALIASES = (
    (re.compile(r"^(.*layers\.(?:\d+\.)?)mlp\.linear_fc1\.layer_norm_(weight|bias)$"), r"\1pre_mlp_layernorm.\2"),
    (re.compile(r"^(.*layers\.(?:\d+\.)?)pre_mlp_layernorm\.(weight|bias)$"), r"\1mlp.linear_fc1.layer_norm_\2"),
)


def other_spec_key(key: str) -> str | None:
    """The name the other layer spec saves this sharded key under, or None when both use `key`."""
    for pattern, replacement in _ALIASES:
        if pattern.match(key):
            return pattern.sub(replacement, key)
    return None


def read_keys_as_saved(sharded_state_dict, saved_keys) -> list[tuple[str, str]]:
    """Point each ShardedTensor of `sharded_state_dict` whose key is not among `saved_keys`, but whose
    other-spec name is, at that name (in place), so a model of either spec loads a checkpoint of either.
    Optimizer state built from the model's sharded state dict afterwards follows. Returns the renames."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    renamed = []
    for sh in nested_values(sharded_state_dict):
        if not isinstance(sh, ShardedTensor) or sh.key in saved_keys:
            continue
        alias = other_spec_key(sh.key)
        if alias is not None and alias in saved_keys:
            renamed.append((sh.key, alias))
            sh.key = alias
    return renamed


def load_model_state(chunk, state: dict) -> None:
    """`chunk.load_state_dict(state)`, strict except for `_extra_state` entries the model's sharded state dict
    never asks for (Transformer Engine's DotProductAttention has extra state megatron-core does not
    checkpoint): those modules keep their own, which is empty unless FP8 is on. Megatron-LM instead
    retries any failed load with strict=False."""
    result = chunk.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint state does not fit the model: missing {missing[:4]}, unexpected {result.unexpected_keys[:4]}"
        )

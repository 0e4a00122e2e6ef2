"""Layer specs: Transformer Engine modules when TE imports, megatron-core's local modules otherwise.

Both come from megatron-core's own spec builders; the local one has its norms replaced by the
project's sequence-parallel-capable `RMSNorm` and its core attention by `SdpaDotProductAttention` (torch
SDPA: no [heads, T, T] scores kept; context parallelism, which megatron-core's local attention refuses).
Parameter names (and hence the bridge's tables and dist_checkpointing keys) are megatron-core's.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron_dapo.models.norm import RMSNorm


@functools.lru_cache(maxsize=1)
def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def _replace_modules(spec, swaps: dict):
    """A copy of a (nested) ModuleSpec with each module class in `swaps` replaced by its value."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, type) and spec in swaps:
        return swaps[spec]
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(
            spec, module=_replace_modules(spec.module, swaps), submodules=_replace_modules(spec.submodules, swaps)
        )
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _replace_modules(getattr(spec, f.name), swaps) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    if isinstance(spec, list):
        return [_replace_modules(s, swaps) for s in spec]
    return spec


def _local_swaps() -> dict:
    """The local spec's module replacements: the SP-capable RMSNorm and the SDPA (and CP) core attention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_dapo.models.core_attention import SdpaDotProductAttention

    return {WrappedTorchNorm: RMSNorm, DotProductAttention: SdpaDotProductAttention}


def decoder_block_spec(config, use_te: bool, vp_stage: int | None):
    """The TransformerBlockSubmodules for this rank's pipeline stage / virtual chunk.

    Dense and MoE layers mix per `config.moe_layer_freq` (1 for all-MoE Qwen3, a per-layer list for mixed models).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage)
    if not use_te:
        spec = _replace_modules(spec, _local_swaps())
        spec.layer_norm = RMSNorm
    return spec

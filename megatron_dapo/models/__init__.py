"""Model providers: megatron-core GPTModels for Qwen3, Qwen3-MoE and Qwen2.5 from HF configs.

Public API:
    QwenArch.from_hf(cfg)                -> the architecture facts of an HF config
    hf_config_family(cfg)                -> 'qwen3' | 'qwen3_moe' | 'qwen2' (errors on others)
    ModelParallel(tp, pp, vpp, ep, etp, cp, sequence_parallel, dtype)
    transformer_config(arch, parallel, **overrides) -> megatron TransformerConfig
    build_gpt_model(hf_config_or_dir, parallel=None, *, use_te=None, config_overrides=None,
                    parallel_output=True) -> list[GPTModel]   (one per virtual pipeline chunk)
    padded_vocab_size(vocab_size, tp), mask_padded_vocab_logits(logits, vocab_size, vocab_start=None)
"""

from megatron_dapo.models.arch import ARCHITECTURES, QwenArch, UnsupportedArchitectureError, hf_config_family
from megatron_dapo.models.provider import (
    ModelParallel,
    build_gpt_model,
    check_divisibility,
    mask_padded_vocab_logits,
    padded_vocab_size,
    transformer_config,
)

__all__ = [
    "ARCHITECTURES",
    "QwenArch",
    "UnsupportedArchitectureError",
    "hf_config_family",
    "ModelParallel",
    "build_gpt_model",
    "check_divisibility",
    "mask_padded_vocab_logits",
    "padded_vocab_size",
    "transformer_config",
]

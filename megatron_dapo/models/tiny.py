"""Tiny random Hugging Face models of the three trained families.

Tests and the CPU demo build their models here (there is no model hub on CI machines).
The shapes keep every structural feature of the real models: GQA (more query heads than
KV heads), qk-norm for Qwen3, QKV bias for Qwen2.5, top-k routed experts with
`norm_topk_prob` and a dense layer via `mlp_only_layers` for Qwen3-MoE.
"""

from __future__ import annotations

from pathlib import Path

FAMILIES = ("qwen3", "qwen3_moe", "qwen2")

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.1,  # large enough that logits differ visibly between tokens
)


def tiny_hf_config(family: str, **overrides):
    """A transformers config object for a tiny model of `family` (see FAMILIES)."""
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    kw = dict(_COMMON)
    if family == "qwen3":
        cls = Qwen3Config
    elif family == "qwen3_moe":
        cls = Qwen3MoeConfig
        kw.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            router_aux_loss_coef=0.001,
        )
    elif family == "qwen2":
        cls = Qwen2Config
        kw.pop("head_dim")
    else:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {FAMILIES}")
    kw.update(overrides)
    return cls(**kw)


def save_tiny_hf_model(family: str, out_dir: str | Path, seed: int = 0, dtype=None, **overrides) -> Path:
    """Build a random tiny model of `family`, save it with save_pretrained, return the directory."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    config = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    model.save_pretrained(out_dir)
    return out_dir

"""Model providers: HF config parsing, layouts and the padded-vocabulary helpers (fast, no ranks)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_dapo.models import (
    ModelParallel,
    QwenArch,
    UnsupportedArchitectureError,
    check_divisibility,
    hf_config_family,
    mask_padded_vocab_logits,
    padded_vocab_size,
)
from megatron_dapo.models.tiny import tiny_hf_config

HUB_QWEN3_MOE = {  # the spelling of Qwen3-30B-A3B's config.json on the hub (transformers 4)
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "max_position_embeddings": 40960,
}


def test_both_config_spellings_parse_to_the_same_arch():
    hub = QwenArch.from_hf(HUB_QWEN3_MOE)
    v5 = dict(HUB_QWEN3_MOE)
    v5["num_local_experts"] = v5.pop("num_experts")
    v5["rope_parameters"] = {"rope_theta": v5.pop("rope_theta"), "rope_type": "default"}
    assert QwenArch.from_hf(v5) == hub
    assert hub.num_experts == 128 and hub.rope_theta == 1e6 and hub.norm_topk_prob
    assert all(hub.moe_layers) and len(hub.moe_layers) == 48


def test_transformers_written_tiny_configs(tmp_path):
    for family in ("qwen3", "qwen3_moe", "qwen2"):
        cfg = tiny_hf_config(family)
        cfg.save_pretrained(tmp_path / family)
        arch = QwenArch.from_hf(tmp_path / family)
        assert arch.family == family and arch.head_dim == 16 and arch.num_kv_heads == 2
        assert arch.qk_norm == (family != "qwen2") and arch.qkv_bias == (family == "qwen2")
    moe = QwenArch.from_hf(tmp_path / "qwen3_moe")
    assert moe.num_experts == 4 and moe.moe_layers == (False, True, True, True)  # mlp_only_layers=[0]


def test_moe_layer_pattern_follows_hf_rule():
    d = dict(HUB_QWEN3_MOE, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    # HF: layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    assert QwenArch.from_hf(d).moe_layers == (False, True, False, False, False, True)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        hf_config_family(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        QwenArch.from_hf(tmp_path / "config.json")


def test_missing_field_is_named():
    d = dict(HUB_QWEN3_MOE)
    del d["moe_intermediate_size"]
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        QwenArch.from_hf(d)


def test_padded_vocab():
    assert padded_vocab_size(151936, 1) == 151936
    assert padded_vocab_size(151936, 8) == 152576  # next multiple of 1024
    assert padded_vocab_size(250, 2) == 256


def test_divisibility_errors_name_the_field():
    arch = QwenArch.from_hf(HUB_QWEN3_MOE)
    check_divisibility(arch, ModelParallel(tp=4, pp=4, ep=8))
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=32"):
        check_divisibility(arch, ModelParallel(tp=3))
    with pytest.raises(ValueError, match="tp=8 does not divide num_key_value_heads=4"):
        check_divisibility(arch, ModelParallel(tp=8))
    with pytest.raises(ValueError, match="ep=3 does not divide num_experts=128"):
        check_divisibility(arch, ModelParallel(ep=3))
    with pytest.raises(ValueError, match="pp\\*vpp=10 does not divide num_hidden_layers=48"):
        check_divisibility(arch, ModelParallel(pp=5, vpp=2))


def test_mask_padded_vocab_logits_keeps_logprobs():
    torch.manual_seed(0)
    vocab, tp = 250, 2
    full = torch.randn(3, padded_vocab_size(vocab, tp), dtype=torch.float64)
    full[:, vocab:] = 0.0  # what a zero-padded output layer produces
    ref = torch.log_softmax(full[:, :vocab], dim=-1)
    width = full.shape[-1] // tp
    shards = [
        mask_padded_vocab_logits(full[:, r * width : (r + 1) * width], vocab, vocab_start=r * width) for r in range(tp)
    ]
    masked = torch.log_softmax(torch.cat(shards, dim=-1), dim=-1)
    assert torch.allclose(masked[:, :vocab], ref, atol=0, rtol=1e-12)
    assert torch.isinf(masked[:, vocab:]).all()
    # unmasked, the padded zeros would shift every logprob
    assert not torch.allclose(torch.log_softmax(full, dim=-1)[:, :vocab], ref)

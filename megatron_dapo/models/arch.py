"""The architecture facts of an HF Qwen-family checkpoint, read from its config.json.

`QwenArch` is the one place that knows the HF field names (and their transformers-4 / -5
spellings). The model provider and the bridge both read a `QwenArch`, never the raw config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

# HF `architectures` value -> family name used throughout the package.
ARCHITECTURES: dict[str, str] = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2ForCausalLM": "qwen2",  # Qwen2 and Qwen2.5 share the architecture
}


class UnsupportedArchitectureError(ValueError):
    pass


def _as_dict(cfg: Any) -> dict:
    """config.json contents from a dict, a transformers config object, a file or a directory."""
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if isinstance(cfg, (str, Path)):
        path = Path(cfg)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no HF config.json at {path}")
        return json.loads(path.read_text())
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    raise TypeError(f"expected an HF config (dict, config object, config.json or model dir), got {type(cfg)!r}")


def hf_config_family(cfg: Any) -> str:
    """'qwen3' | 'qwen3_moe' | 'qwen2' for an HF config; errors on any other `architectures` value."""
    d = _as_dict(cfg)
    archs = d.get("architectures") or []
    if not archs and d.get("model_type") in ARCHITECTURES.values():
        return d["model_type"]  # a config saved without a model has only model_type
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported HF architectures {archs!r}: megatron-dapo supports {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[archs[0]]


def _rope_theta(d: dict) -> float:
    # transformers 5 writes rope_parameters.rope_theta; hub configs (transformers 4) say rope_theta.
    params = d.get("rope_parameters") or {}
    theta = params.get("rope_theta", d.get("rope_theta"))
    if theta is None:
        raise ValueError("HF config has neither rope_theta nor rope_parameters.rope_theta")
    rope_type = params.get("rope_type") or (d.get("rope_scaling") or {}).get("rope_type") or "default"
    if rope_type != "default":
        raise ValueError(f"HF config rope type {rope_type!r} is not supported (only 'default' RoPE)")
    return float(theta)


@dataclass(frozen=True)
class QwenArch:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    initializer_range: float = 0.02
    # MoE (qwen3_moe only)
    num_experts: int = 0
    moe_topk: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0
    moe_layers: tuple[bool, ...] = field(default=())  # per layer: True = routed experts, False = dense MLP

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and self.moe_layers[layer]

    @classmethod
    def from_hf(cls, cfg: Any) -> "QwenArch":
        """Parse an HF config (dict, transformers config, config.json path or model directory)."""
        d = _as_dict(cfg)
        family = hf_config_family(d)

        def need(key: str):
            if key not in d or d[key] is None:
                raise ValueError(f"HF config for {family} is missing {key!r}")
            return d[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        num_layers = int(need("num_hidden_layers"))
        kw: dict[str, Any] = dict(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_attention_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rope_theta=_rope_theta(d),
            rms_norm_eps=float(need("rms_norm_eps")),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has QKV bias (its config has no field for it); Qwen3 has none.
            qkv_bias=family == "qwen2",
            qk_norm=family in ("qwen3", "qwen3_moe"),
            max_position_embeddings=int(d.get("max_position_embeddings") or 32768),
            initializer_range=float(d.get("initializer_range") or 0.02),
        )
        if family != "qwen2" and d.get("attention_bias"):
            raise ValueError(f"HF config {family}: attention_bias=true (bias on q/k/v/o) is not supported")
        if family == "qwen3_moe":
            # transformers 5 writes num_local_experts; hub configs say num_experts.
            experts = d.get("num_local_experts", d.get("num_experts"))
            if not experts:
                raise ValueError("HF config for qwen3_moe has neither num_experts nor num_local_experts")
            step = int(d.get("decoder_sparse_step") or 1)
            dense = set(d.get("mlp_only_layers") or [])
            kw.update(
                num_experts=int(experts),
                moe_topk=int(need("num_experts_per_tok")),
                moe_intermediate_size=int(need("moe_intermediate_size")),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(d.get("router_aux_loss_coef") or 0.0),
                # the rule of HF's Qwen3MoeDecoderLayer
                moe_layers=tuple((i not in dense) and (i + 1) % step == 0 for i in range(num_layers)),
            )
            if d.get("shared_expert_intermediate_size"):
                raise ValueError("HF config qwen3_moe: shared experts are not supported")
        return cls(**kw)

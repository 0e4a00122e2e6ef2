"""Model shapes for validation and planning, read from HF config.json fields.

`ModelShape` holds only what parallel-layout checks and memory estimates need. It is read from
(in order) `<model.hf_path>/config.json`, the inline `model.hf_config`, or a built-in table keyed
by the last component of `model.hf_path` (so `Qwen/Qwen3-8B` works without the checkpoint).
Reading HF fields accepts both spellings transformers uses (hub `num_experts` / transformers-5
`num_local_experts`; `rope_theta` / `rope_parameters.rope_theta`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_dapo.config.errors import ConfigError

# HF `architectures[0]` -> model family name used across the project.
ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2ForCausalLM": "qwen2",
}
# HF `model_type` -> family, for configs written without `architectures`.
MODEL_TYPES = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "qwen2": "qwen2"}


@dataclass(frozen=True)
class ModelShape:
    family: str  # qwen3 | qwen3_moe | qwen2
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int  # dense MLP intermediate size
    num_attention_heads: int
    num_kv_heads: int  # query groups (GQA)
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm on q and k per head
    qkv_bias: bool  # Qwen2.5: bias on the q, k, v projections
    num_experts: int = 0  # 0 = dense
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple[int, ...] = field(default=())  # indices of layers with a routed MoE MLP

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def family_of(hf: dict[str, Any]) -> str:
    """Model family from an HF config dict (`architectures`, else `model_type`)."""
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if hf.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf["model_type"]]
    got = archs or hf.get("model_type")
    raise ValueError(f"unsupported model architecture {got!r}; supported: {', '.join(ARCHITECTURES)}")


def shape_from_hf(hf: dict[str, Any]) -> ModelShape:
    """Normalise an HF config.json dict into a ModelShape; KeyError names a missing field."""
    family = family_of(hf)
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    layers = int(hf["num_hidden_layers"])
    num_experts = int(hf.get("num_experts", hf.get("num_local_experts", 0)) or 0) if family == "qwen3_moe" else 0
    moe_layers: tuple[int, ...] = ()
    if num_experts:
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        dense = set(hf.get("mlp_only_layers") or [])
        # Qwen3-MoE rule (transformers modeling_qwen3_moe): MoE where (i + 1) % step == 0, unless listed dense.
        moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return ModelShape(
        family=family,
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=int(hf["intermediate_size"]),
        num_attention_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        vocab_size=int(hf["vocab_size"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        qkv_bias=family == "qwen2",
        num_experts=num_experts,
        moe_topk=int(hf.get("num_experts_per_tok", 0) or 0) if num_experts else 0,
        moe_ffn_hidden_size=int(hf.get("moe_intermediate_size", 0) or 0) if num_experts else 0,
        moe_layers=moe_layers,
    )


# Built-in HF config fields (copied from each model's config.json on the Hugging Face hub) so that
# validation and `megatron-dapo plan` work before the checkpoint is downloaded.
BUILTIN_HF_CONFIGS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    "Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    # https://huggingface.co/Qwen/Qwen2.5-3B-Instruct/blob/main/config.json
    "Qwen2.5-3B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json (rope_theta 1e6, QKV bias); the
    # -Instruct model has the same shape.
    "Qwen2.5-7B": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
}
BUILTIN_HF_CONFIGS["Qwen2.5-7B-Instruct"] = BUILTIN_HF_CONFIGS["Qwen2.5-7B"]


@dataclass(frozen=True)
class ResolvedShape:
    shape: Optional[ModelShape]
    source: str  # where it came from, for messages: "<dir>/config.json", "model.hf_config", "built-in ..."


def read_hf_config_file(hf_path: str) -> Optional[dict[str, Any]]:
    """The config.json at `hf_path` as a dict, or None when the directory / file does not exist."""
    if not hf_path:
        return None
    path = Path(hf_path) / "config.json"
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)


def builtin_hf_config(hf_path: str) -> Optional[dict[str, Any]]:
    name = hf_path.rstrip("/").rpartition("/")[2]
    return BUILTIN_HF_CONFIGS.get(name)


# Fields compared when both config.json and the inline model.hf_config exist.
_CHECKED_FIELDS = (
    "architectures",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
)


def resolve_model_shape(model) -> ResolvedShape:
    """The shape of `model` (a ModelConfig): config.json, else inline hf_config, else built-in, else None."""

    try:
        on_disk = read_hf_config_file(model.hf_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf_path: cannot read {model.hf_path}/config.json: {e}") from None
    inline = model.hf_config
    if on_disk is not None and inline is not None:
        for key in _CHECKED_FIELDS:
            if key in inline and key in on_disk and inline[key] != on_disk[key]:
                raise ConfigError(
                    f"model.hf_config.{key}={inline[key]!r} disagrees with {model.hf_path}/config.json "
                    f"({on_disk[key]!r}); remove model.hf_config or fix it"
                )
    candidates = [
        (on_disk, f"{model.hf_path}/config.json", "model.hf_path"),
        (inline, "model.hf_config", "model.hf_config"),
        (builtin_hf_config(model.hf_path), f"built-in shape of {model.hf_path}", "model.hf_path"),
    ]
    for hf, source, key in candidates:
        if hf is None:
            continue
        try:
            return ResolvedShape(shape_from_hf(hf), source)
        except KeyError as e:
            raise ConfigError(f"{key}: {source} lacks field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{key}: {source}: {e}") from None
    return ResolvedShape(None, "")

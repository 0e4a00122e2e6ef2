"""Declarative HF <-> megatron-core name and layout mapping for the Qwen families.

One table (`RULES`) serves Qwen3, Qwen3-MoE and Qwen2.5, for both megatron-core's local spec and its
Transformer Engine spec (where the input / pre-MLP norms live inside the fused linear layers). Each
rule maps one megatron-core parameter to one or more HF on-disk tensors with a layout:

  REPLICATED  every TP rank holds the whole tensor (norms, router)
  ROW         TP-split along dim 0 (column-parallel linear: output features)
  COLUMN      TP-split along dim 1 (row-parallel linear: input features)
  VOCAB       TP-split along dim 0 with the vocabulary padded to `padded_vocab_size` (padding is zero
              on load and trimmed on export)
  QKV         HF q, k, v stacked per query group [q_g, k_g, v_g] and TP-split by whole query groups
  GATE_UP     HF gate and up, each TP-split along dim 0, stacked per rank as [gate_r; up_r]

Layer indices are global (megatron's `layer_number` - 1, which already includes the PP stage and
VPP chunk offset); expert indices are global (EP rank * local experts + local index). Expert
parameters are split over the expert-tensor-parallel group, the rest over the tensor-parallel group.
The layout functions are pure: `shard_from_hf` cuts a rank's shard out of (lazily read) HF tensors,
`hf_from_shards` rebuilds the HF tensors from all ranks' shards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from megatron_dapo.models.arch import QwenArch

REPLICATED, ROW, COLUMN, VOCAB, QKV, GATE_UP = "replicated", "row", "column", "vocab", "qkv", "gate_up"

_L = r"decoder\.layers\.(?P<layer>\d+)\."
_HL = "model.layers.{layer}."
_HE = _HL + "mlp.experts.{expert}."


@dataclass(frozen=True)
class Rule:
    pattern: str  # regex over a GPTModel parameter name
    hf: tuple[str, ...]  # HF name templates ({layer}, {expert})
    layout: str
    expert: bool = False

    def match(self, name: str):
        return re.fullmatch(self.pattern, name)


RULES: tuple[Rule, ...] = (
    Rule(r"embedding\.word_embeddings\.weight", ("model.embed_tokens.weight",), VOCAB),
    Rule(
        _L + r"(input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)",
        (_HL + "input_layernorm.weight",),
        REPLICATED,
    ),
    Rule(
        _L + r"self_attention\.linear_qkv\.weight",
        (_HL + "self_attn.q_proj.weight", _HL + "self_attn.k_proj.weight", _HL + "self_attn.v_proj.weight"),
        QKV,
    ),
    Rule(
        _L + r"self_attention\.linear_qkv\.bias",
        (_HL + "self_attn.q_proj.bias", _HL + "self_attn.k_proj.bias", _HL + "self_attn.v_proj.bias"),
        QKV,
    ),
    Rule(_L + r"self_attention\.q_layernorm\.weight", (_HL + "self_attn.q_norm.weight",), REPLICATED),
    Rule(_L + r"self_attention\.k_layernorm\.weight", (_HL + "self_attn.k_norm.weight",), REPLICATED),
    Rule(_L + r"self_attention\.linear_proj\.weight", (_HL + "self_attn.o_proj.weight",), COLUMN),
    Rule(
        _L + r"(pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight)",
        (_HL + "post_attention_layernorm.weight",),
        REPLICATED,
    ),
    Rule(_L + r"mlp\.linear_fc1\.weight", (_HL + "mlp.gate_proj.weight", _HL + "mlp.up_proj.weight"), GATE_UP),
    Rule(_L + r"mlp\.linear_fc2\.weight", (_HL + "mlp.down_proj.weight",), COLUMN),
    Rule(_L + r"mlp\.router\.weight", (_HL + "mlp.gate.weight",), REPLICATED),
    # SequentialMLP (local spec) and TEGroupedMLP (TE spec) name experts differently.
    Rule(
        _L + r"mlp\.experts\.(local_experts\.(?P<expert>\d+)\.linear_fc1\.weight|linear_fc1\.weight(?P<expert_te>\d+))",
        (_HE + "gate_proj.weight", _HE + "up_proj.weight"),
        GATE_UP,
        expert=True,
    ),
    Rule(
        _L + r"mlp\.experts\.(local_experts\.(?P<expert>\d+)\.linear_fc2\.weight|linear_fc2\.weight(?P<expert_te>\d+))",
        (_HE + "down_proj.weight",),
        COLUMN,
        expert=True,
    ),
    Rule(r"decoder\.final_layernorm\.weight", ("model.norm.weight",), REPLICATED),
    Rule(r"output_layer\.weight", ("lm_head.weight",), VOCAB),
)


class MappingError(ValueError):
    pass


# ---------------------------------------------------------------- the HF side, from the config alone


def hf_layer_names(arch: QwenArch, layer: int) -> list[str]:
    p = f"model.layers.{layer}."
    names = [p + "input_layernorm.weight"]
    for proj in ("q", "k", "v"):
        names.append(p + f"self_attn.{proj}_proj.weight")
        if arch.qkv_bias:
            names.append(p + f"self_attn.{proj}_proj.bias")
    if arch.qk_norm:
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    names += [p + "self_attn.o_proj.weight", p + "post_attention_layernorm.weight"]
    if arch.is_moe_layer(layer):
        names.append(p + "mlp.gate.weight")
        for e in range(arch.num_experts):
            names += [p + f"mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")]
    else:
        names += [p + f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")]
    return names


def hf_names(arch: QwenArch) -> list[str]:
    """Every tensor of the HF checkpoint, in the canonical (export) order."""
    names = ["model.embed_tokens.weight"]
    for layer in range(arch.num_layers):
        names += hf_layer_names(arch, layer)
    names.append("model.norm.weight")
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def hf_shape(arch: QwenArch, name: str) -> tuple[int, ...]:
    """The full HF shape of tensor `name`."""
    h, hd = arch.hidden_size, arch.head_dim
    leaf = name.rsplit(".", 2)[-2:]
    kind = ".".join(leaf)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (arch.vocab_size, h)
    if kind in ("input_layernorm.weight", "post_attention_layernorm.weight") or name == "model.norm.weight":
        return (h,)
    if kind in ("q_norm.weight", "k_norm.weight"):
        return (hd,)
    if leaf[0] in ("q_proj", "k_proj", "v_proj"):
        rows = (arch.num_attention_heads if leaf[0] == "q_proj" else arch.num_kv_heads) * hd
        return (rows, h) if leaf[1] == "weight" else (rows,)
    if kind == "o_proj.weight":
        return (h, arch.num_attention_heads * hd)
    if kind == "gate.weight":
        return (arch.num_experts, h)
    inter = arch.moe_intermediate_size if ".experts." in name else arch.intermediate_size
    if kind in ("gate_proj.weight", "up_proj.weight"):
        return (inter, h)
    if kind == "down_proj.weight":
        return (h, inter)
    raise MappingError(f"no HF shape rule for tensor {name!r}")


# ---------------------------------------------------------------- megatron parameter -> unit


@dataclass(frozen=True)
class Unit:
    """One megatron-core parameter and the HF tensors it holds (global layer / expert indices)."""

    param_name: str  # GPTModel-local name
    rule: Rule
    hf_names: tuple[str, ...]
    layer: int | None
    expert: int | None
    export: bool = True  # False for a tied output layer (its HF tensor is the embedding)

    @property
    def key(self) -> str:
        return self.hf_names[0]


def resolve(param_name: str, model, arch: QwenArch, ep_rank: int, num_local_experts: int) -> Unit:
    """The unit of GPTModel parameter `param_name`; raise MappingError naming an unknown parameter."""
    for rule in RULES:
        m = rule.match(param_name)
        if not m:
            continue
        groups = m.groupdict()
        layer = expert = None
        if groups.get("layer") is not None:
            layer = model.decoder.layers[int(groups["layer"])].layer_number - 1
        local_expert = groups.get("expert") or groups.get("expert_te")
        if local_expert is not None:
            expert = ep_rank * num_local_experts + int(local_expert)
        export = True
        hf = tuple(t.format(layer=layer, expert=expert) for t in rule.hf)
        if param_name == "output_layer.weight" and arch.tie_word_embeddings:
            # The last stage's copy of a tied embedding (pp > 1): loaded from the embedding, never exported.
            hf, export = ("model.embed_tokens.weight",), False
        return Unit(param_name, rule, hf, layer, expert, export)
    raise MappingError(f"megatron parameter {param_name!r} has no HF mapping (unsupported layer spec?)")


# ---------------------------------------------------------------- layouts (pure)

# read(name, dim, start, stop) -> the HF tensor `name` sliced to [start, stop) along `dim` (dim None: all)
Reader = Callable[[str, "int | None", int, int], torch.Tensor]


def _qkv_dims(arch: QwenArch) -> tuple[int, int, int]:
    return arch.num_kv_heads, arch.num_attention_heads // arch.num_kv_heads, arch.head_dim


def shard_from_hf(
    unit: Unit, arch: QwenArch, read: Reader, rank: int, size: int, local_shape: Sequence[int]
) -> torch.Tensor:
    """This rank's megatron shard of `unit`, reading only the HF slices it needs."""
    layout, names = unit.rule.layout, unit.hf_names
    if layout == REPLICATED:
        return read(names[0], None, 0, 0)
    if layout in (ROW, COLUMN):
        dim = 0 if layout == ROW else 1
        n = hf_shape(arch, names[0])[dim] // size
        return read(names[0], dim, rank * n, (rank + 1) * n)
    if layout == VOCAB:
        n = local_shape[0]
        start, stop = rank * n, min((rank + 1) * n, arch.vocab_size)
        shard = torch.zeros(tuple(local_shape), dtype=torch.float32)
        if stop > start:
            part = read(names[0], 0, start, stop)
            shard = shard.to(part.dtype)
            shard[: stop - start] = part
        return shard
    if layout == GATE_UP:
        n = hf_shape(arch, names[0])[0] // size
        return torch.cat([read(nm, 0, rank * n, (rank + 1) * n) for nm in names], dim=0)
    if layout == QKV:
        groups, q_per_group, hd = _qkv_dims(arch)
        g = groups // size
        q = read(names[0], 0, rank * g * q_per_group * hd, (rank + 1) * g * q_per_group * hd)
        k = read(names[1], 0, rank * g * hd, (rank + 1) * g * hd)
        v = read(names[2], 0, rank * g * hd, (rank + 1) * g * hd)
        rest = q.shape[1:]
        stacked = torch.cat(
            [q.reshape(g, q_per_group * hd, *rest), k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)], dim=1
        )
        return stacked.reshape(-1, *rest)
    raise MappingError(f"unknown layout {layout!r}")


def hf_from_shards(unit: Unit, arch: QwenArch, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The HF tensors of `unit` (in `unit.hf_names` order) from every TP rank's shard, in rank order."""
    layout = unit.rule.layout
    if layout == REPLICATED:
        return [shards[0]]
    if layout == ROW:
        return [torch.cat(list(shards), dim=0)]
    if layout == COLUMN:
        return [torch.cat(list(shards), dim=1)]
    if layout == VOCAB:
        return [torch.cat(list(shards), dim=0)[: arch.vocab_size]]
    if layout == GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    if layout == QKV:
        groups, q_per_group, hd = _qkv_dims(arch)
        full = torch.cat(list(shards), dim=0)
        rest = full.shape[1:]
        full = full.reshape(groups, (q_per_group + 2) * hd, *rest)
        q, k, v = full.split([q_per_group * hd, hd, hd], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]
    raise MappingError(f"unknown layout {layout!r}")

"""Load tensors named as in an HF checkpoint on disk into a transformers 5 model in memory.

The names are the checkpoint's (what SGLang and every HF checkpoint use). They equal the model's
in-memory names except for MoE experts: transformers 5 holds a layer's experts fused,
`mlp.experts.gate_up_proj` [E, 2I, H] (row block [:I] is expert e's gate_proj, [I:] its up_proj)
and `mlp.experts.down_proj` [E, H, I], while the checkpoint stores `mlp.experts.{e}.gate_proj.weight`
[I, H] etc. (transformers' own `conversion_mapping.py` for qwen2_moe / qwen3_moe merges them that way).
Per-expert tensors are copied into their slice, so a checkpoint streams in without being gathered.
Used by the embedded server and the FSDP2 actor; not re-exported by the package (it needs no megatron-core).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

_EXPERT = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class WeightLoadError(ValueError):
    """A tensor cannot be loaded: unknown name, wrong shape. The message names the tensor."""


class HFWeightLoader:
    """Maps checkpoint names onto a model's parameters and copies tensors in place."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))

    def target(self, name: str) -> tuple[torch.Tensor, str]:
        """The in-memory tensor (a view for an expert slice) that checkpoint tensor `name` fills."""
        if name in self.params:
            return self.params[name], name
        m = _EXPERT.match(name)
        if m:
            prefix, e, proj = m["prefix"], int(m["e"]), m["proj"]
            fused = f"{prefix}.down_proj" if proj == "down_proj" else f"{prefix}.gate_up_proj"
            if fused in self.params:
                p = self.params[fused]
                if e >= p.shape[0]:
                    raise WeightLoadError(f"{name}: expert {e} out of range, {fused} holds {p.shape[0]} experts")
                if proj == "down_proj":
                    return p[e], fused
                inter = p.shape[1] // 2
                return (p[e, :inter] if proj == "gate_proj" else p[e, inter:]), fused
        if name == "lm_head.weight" and self.tied:
            return self.params["model.embed_tokens.weight"], "model.embed_tokens.weight"
        raise WeightLoadError(f"{name}: no such tensor in {type(self.model).__name__}")

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy each (checkpoint name, tensor) into the model; returns the in-memory names touched."""
        touched = []
        for name, tensor in named_tensors:
            dst, mem_name = self.target(name)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise WeightLoadError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
            if (dst.data_ptr(), dst.dtype, dst.stride(), dst.device) == (
                tensor.data_ptr(),
                tensor.dtype,
                tensor.stride(),
                tensor.device,
            ):
                touched.append(mem_name)  # received straight into the parameter: nothing to copy
                continue
            dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))
            touched.append(mem_name)
        return touched

    def checkpoint_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every checkpoint name this model accepts, with its shape and dtype (experts expanded)."""
        out = {}
        for name, p in self.params.items():
            m = re.match(r"^(.+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
            if not m:
                out[name] = (tuple(p.shape), p.dtype)
                continue
            for e in range(p.shape[0]):
                if m[2] == "down_proj":
                    out[f"{m[1]}.{e}.down_proj.weight"] = (tuple(p.shape[1:]), p.dtype)
                else:
                    half = (p.shape[1] // 2, p.shape[2])
                    out[f"{m[1]}.{e}.gate_proj.weight"] = (half, p.dtype)
                    out[f"{m[1]}.{e}.up_proj.weight"] = (half, p.dtype)
        return out

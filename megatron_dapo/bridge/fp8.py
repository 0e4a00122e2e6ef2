"""FP8 block quantization of HF-named weights: the layout of the released Qwen3-FP8 checkpoints.

Each linear weight ([out, in]) becomes `float8_e4m3fn` plus `<name>_scale_inv` (float32,
[ceil(out/128), ceil(in/128)]): per 128 x 128 block, scale = amax(|block|) / 448 (amax clamped at 1e-4) and
the stored value is the weight divided by it, rounded to e4m3 (DeepSeek-V3's fine-grained contract, which
SGLang 0.5.23's Fp8LinearMethod reads: `weight * weight_scale_inv` per block). A partial block at the
edge (a dimension not a multiple of 128) is a block of what is there, as SGLang's own quantizer pads it
with zeros (`mxfp8_block_convert.bf16_to_block_fp8_128`). Embeddings, norms, MoE router gates and lm_head are
not linear projections and stay as they are.

`quantize_stream` is the stage the weight sync puts in front of any transport (per tensor, so per bucket, on
the tensor's device); `DequantizingStream` is its inverse on a server that computes in bf16 / fp32 (the
embedded server). `quantization_config()` is what an FP8 checkpoint's config.json carries.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
SCALE_SUFFIX = "_scale_inv"
WEIGHT_FORMATS = ("bf16", "fp8_block")
# Linear projections of Qwen2/3 dense and MoE decoders (experts included); not `mlp.gate.weight` (the
# router), not `shared_expert_gate`, embeddings, norms or lm_head.
_QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


class Fp8FormatError(ValueError):
    """A tensor or checkpoint cannot be (de)quantized as announced; the message names it."""


def quantization_config(not_converted: Iterable[str] = ("lm_head",)) -> dict:
    """The `quantization_config` of an FP8 block checkpoint (as Qwen3-8B-FP8 / Qwen3-30B-A3B-FP8 carry it)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": sorted(not_converted),
    }


def is_fp8_block_config(qc: dict | None) -> bool:
    """Whether a config.json's quantization_config is the FP8 block layout this module reads and writes."""
    if not qc:
        return False
    if qc.get("quant_method") != "fp8" or qc.get("weight_block_size") != [BLOCK, BLOCK]:
        raise Fp8FormatError(
            f"quantization_config {qc}: only quant_method=fp8 with weight_block_size=[{BLOCK}, {BLOCK}] is served"
        )
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise Fp8FormatError(f"quantization_config {qc}: block FP8 needs activation_scheme=dynamic")
    return True


def is_quantized(name: str) -> bool:
    """Whether the HF tensor `name` is stored in FP8 in the block layout."""
    return bool(_QUANTIZED.search(name))


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def scale_base(name: str) -> str | None:
    """The weight whose block scales `name` holds, or None when `name` is not such a scale."""
    base = name.removesuffix(SCALE_SUFFIX)
    return base if base != name and is_quantized(base) else None


def scale_shape(weight_shape) -> list[int]:
    """The `_scale_inv` shape of a 2-D weight: one scale per (possibly partial) 128 x 128 block."""
    return [-(-int(d) // BLOCK) for d in weight_shape]


def not_converted_modules(names: Iterable[str]) -> list[str]:
    """The modules a checkpoint leaves in bf16 that SGLang would otherwise build as FP8 linears: lm_head and
    the MoE router gates (what the released FP8 checkpoints list in modules_to_not_convert)."""
    out = set()
    for n in names:
        if n == "lm_head.weight" or n.endswith(".mlp.gate.weight") or n.endswith(".shared_expert_gate.weight"):
            out.add(n.removesuffix(".weight"))
    return sorted(out)


@torch.no_grad()
def quantize_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One 2-D weight -> (float8_e4m3fn weight, float32 scale_inv [ceil(out/128), ceil(in/128)]).

    Computed in float32 on `w`'s device. The padded copy is what makes a partial edge block a block of its
    real entries (zeros never raise an amax) and keeps every block the same shape for one vectorized pass."""
    if w.dim() != 2:
        raise Fp8FormatError(f"block quantization takes a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    pn, pk = -(-n // BLOCK) * BLOCK, -(-k // BLOCK) * BLOCK
    if (pn, pk) == (n, k):
        padded = w.to(torch.float32)
    else:
        padded = torch.zeros((pn, pk), dtype=torch.float32, device=w.device)
        padded[:n, :k] = w
    blocks = padded.view(pn // BLOCK, BLOCK, pk // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4) / FP8_MAX
    q = (blocks / scale).to(FP8).view(pn, pk)[:n, :k].contiguous()
    return q, scale.view(pn // BLOCK, pk // BLOCK).contiguous()


@torch.no_grad()
def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse: each 128 x 128 block of `q` times its scale, in `dtype` (the product is taken in float32)."""
    if q.dim() != 2 or list(scale_inv.shape) != scale_shape(q.shape):
        raise Fp8FormatError(
            f"weight {tuple(q.shape)} and scale_inv {tuple(scale_inv.shape)} are not a {BLOCK} x {BLOCK} block pair"
        )
    s = scale_inv.to(torch.float32).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return (q.to(torch.float32) * s[: q.shape[0], : q.shape[1]]).to(dtype)


def quantize_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor | None]],
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The export stream in the FP8 block layout: each linear weight is followed by its `_scale_inv`; other
    tensors pass as they are. A rank that holds no tensor (None) yields None for both names, so every rank
    of a collective export sees the same sequence of names."""
    for name, t in named_tensors:
        if not is_quantized(name):
            yield name, t
        elif t is None:
            yield name, None
            yield scale_name(name), None
        else:
            q, s = quantize_block(t)
            yield name, q
            yield scale_name(name), s


class DequantizingStream:
    """Pairs each float8 weight with its `_scale_inv` (in either order, across buckets of one update) and
    yields the dequantized weight in `dtype`; every other tensor passes. `pending()` names what waits for
    its other half: an update must end with none (`finish`)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        self._weights: dict[str, torch.Tensor] = {}
        self._scales: dict[str, torch.Tensor] = {}

    def feed(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """One bucket's tensors. A half still waiting for its other half when the bucket ends is copied out of
        it: the memory it arrived in may hold the next bucket by then (over IPC, the sender's shared-memory
        staging buffer, reused as soon as this bucket is answered; a freed CUDA IPC block)."""
        held: list[tuple[dict[str, torch.Tensor], str]] = []
        for name, t in named_tensors:
            base = scale_base(name)
            if base is not None:
                if base in self._weights:
                    yield base, self._pair(base, self._weights.pop(base), t)
                else:
                    self._scales[base] = t
                    held.append((self._scales, base))
            elif t.dtype == FP8:
                if not is_quantized(name):
                    raise Fp8FormatError(f"{name}: float8 weight of a tensor the FP8 block layout keeps in bf16")
                if name in self._scales:
                    yield name, self._pair(name, t, self._scales.pop(name))
                else:
                    self._weights[name] = t
                    held.append((self._weights, name))
            else:
                yield name, t
        for waiting, name in held:
            if name in waiting:
                waiting[name] = waiting[name].clone()

    def _pair(self, name: str, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        try:
            return dequantize_block(q, s, self.dtype)
        except Fp8FormatError as e:
            raise Fp8FormatError(f"{name}: {e}") from None

    def pending(self) -> list[str]:
        return sorted(set(self._weights) | set(self._scales))

    def reset(self) -> None:
        self._weights.clear()
        self._scales.clear()

    def finish(self) -> None:
        """End of an update: a weight without its scale (or a scale without its weight) is an error, named."""
        left = self.pending()
        self.reset()
        if left:
            raise Fp8FormatError(f"FP8 weights without their {SCALE_SUFFIX} (or the reverse): {left[:4]}")

"""What one refit (weight sync) costs end to end, in the servers' weight format (bf16 / fp8_block): pure arithmetic.

`planner.refit` gives the wire time (bytes / link). A sync also pays, and this module counts:
- the TP / expert-TP gathers that rebuild full HF tensors on the export sources (bytes over NVLink plus a
  latency per gathered megatron parameter);
- one call per bucket (rollout.sync.bucket_mb): an HTTP POST to every server with the bucket's names / dtypes /
  shapes, the scheduler's hand-off, the broadcast's launch, the wait for every server's answer;
- the session's calls (pause, begin, end, continue);
- the servers' loading: SGLang's `load_weights` calls a weight loader per HF tensor, one per expert for MoE
  (Qwen3-30B-A3B: 18,432 expert tensors), and copies the bytes; with fp8_block every linear weight brings a
  `weight_scale_inv` tensor, i.e. one more loader call;
- with fp8_block the quantization itself on the trainer GPUs.
The per-call figures are assumptions (`ASSUMPTIONS`, printed by `plan`); the per-tensor load time is a range
whose high end is calibrated on a published measurement (verl PR #6974: ~55 s of SGLang per-expert loading for
Qwen3-30B-A3B, i.e. ~3 ms per expert tensor). docs/fp8-rollout.md compares the totals with published refit times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_dapo.config import derived
from megatron_dapo.config.schema import DapoConfig
from megatron_dapo.config.shapes import ModelShape
from megatron_dapo.planner.memory import dtype_bytes, embedding_params
from megatron_dapo.planner.refit import NVLINK_GBPS, RefitEstimate

FP8_BLOCK = 128
GATHER_LATENCY_S = 50e-6  # one TP gather of a megatron parameter: NCCL in-node latency + Python dispatch
BUCKET_CALL_S = 10e-3  # one bucket: HTTP to every server, JSON of its names, scheduler hand-off, broadcast launch
SESSION_CALLS = 4  # pause, begin_weight_update, end_weight_update (SGLang's post-loading step), continue
LOAD_PER_TENSOR_S = (0.1e-3, 3e-3)  # SGLang weight-loader call per HF tensor: low assumed, high from verl #6974
SERVER_COPY_GBS = 2000.0  # GB/s of the loaders' copies into the model (HBM, effective)
QUANT_GBS = 1000.0  # GB/s of bf16 input the block quantization takes on a trainer GPU (memory bound, effective)
ASSUMPTIONS = (
    f"TP gather {GATHER_LATENCY_S * 1e6:.0f} us per megatron parameter + bytes at {NVLINK_GBPS:g} Gbit/s (NVLink)",
    f"{BUCKET_CALL_S * 1e3:.0f} ms per bucket call and per session call ({SESSION_CALLS}: pause, begin, end, continue)",
    f"server load {LOAD_PER_TENSOR_S[0] * 1e3:.1f}-{LOAD_PER_TENSOR_S[1] * 1e3:.0f} ms per HF tensor (high end: verl "
    f"#6974's ~55 s for Qwen3-30B-A3B's 18,432 expert tensors, as issue 39 quotes it; a scale tensor "
    f"counted as one more call) + bytes at {SERVER_COPY_GBS:g} GB/s",
    f"quantization at {QUANT_GBS:g} GB/s of bf16 on a trainer GPU (memory bound; not measured here)",
    "nothing overlapped (the export does overlap the next bucket's gathers with the broadcast: an upper bound)",
)


@dataclass(frozen=True)
class TensorCounts:
    """The HF checkpoint of one weight version, in a weight format."""

    tensors: int  # HF tensors sent (scales included): the servers' weight-loader calls
    expert_tensors: int
    nbytes: int
    quantized_params: int  # parameters stored in float8 (0 for bf16)


def _linears(shape: ModelShape) -> list[tuple[int, int, int]]:
    """(rows, cols, count) of every linear weight the FP8 block layout quantizes (HF names)."""
    h, a, kv, d = shape.hidden_size, shape.num_attention_heads, shape.num_kv_heads, shape.head_dim
    out = []
    for i in range(shape.num_layers):
        out += [(a * d, h, 1), (kv * d, h, 2), (h, a * d, 1)]
        if shape.is_moe and i in shape.moe_layers:
            f, e = shape.moe_ffn_hidden_size, shape.num_experts
            out += [(f, h, 2 * e), (h, f, e)]
        else:
            out += [(shape.ffn_hidden_size, h, 2), (h, shape.ffn_hidden_size, 1)]
    return out


def tensor_counts(shape: ModelShape, weight_format: str, dtype: str) -> TensorCounts:
    """Tensors and bytes of a sync: linear weights in float8 + float32 scales per 128 x 128 block with fp8_block,
    everything else (embeddings, norms, router gates, lm_head, biases) in the trainer's dtype."""
    from megatron_dapo.planner.memory import total_params

    per = dtype_bytes(dtype)
    total = total_params(shape)
    linears = _linears(shape)
    quantized = sum(r * c * n for r, c, n in linears)
    moe_layers = [i for i in range(shape.num_layers) if shape.is_moe and i in shape.moe_layers]
    expert = len(moe_layers) * 3 * shape.num_experts
    dense_layer = 2 + (2 if shape.qk_norm else 0) + (3 if shape.qkv_bias else 0)  # norms, q/k norm, q/k/v bias
    other = shape.num_layers * dense_layer + len(moe_layers)  # + a router gate per MoE layer
    other += 2 + (0 if shape.tie_embeddings else 1)  # embedding, final norm, lm_head
    linear_tensors = sum(n for (_, _, n) in linears)
    if weight_format != "fp8_block":
        return TensorCounts(linear_tensors + other, expert, total * per, 0)
    scales = sum(math.ceil(r / FP8_BLOCK) * math.ceil(c / FP8_BLOCK) * n for r, c, n in linears)
    nbytes = quantized + 4 * scales + (total - quantized) * per
    return TensorCounts(2 * linear_tensors + other, 2 * expert, nbytes, quantized)


def _gathers(cfg: DapoConfig, shape: ModelShape) -> tuple[int, int]:
    """(gather calls, bytes gathered into the sources) of one export in the trainer's dtype: every TP-split megatron
    parameter (qkv, proj, fc1, fc2, embedding, output layer) is gathered from its TP group; expert weights (one per
    expert and fc) from the expert-TP group."""
    p = cfg.parallel
    tp = p.tp if cfg.trainer.backend == "megatron" else 1
    etp = (p.etp or p.tp) if cfg.trainer.backend == "megatron" else 1
    per = dtype_bytes(cfg.model.dtype)
    calls, nbytes = 0, 0
    h, a, kv, d = shape.hidden_size, shape.num_attention_heads, shape.num_kv_heads, shape.head_dim
    if tp > 1:
        attn = (a + 2 * kv) * d * h + a * d * h
        dense_mlp = 3 * h * shape.ffn_hidden_size
        for i in range(shape.num_layers):
            moe = shape.is_moe and i in shape.moe_layers
            calls += 2 if moe else 4
            nbytes += attn + (0 if moe else dense_mlp)
        outputs = 1 if shape.tie_embeddings else 2
        calls += outputs
        nbytes += outputs * embedding_params(shape)
        nbytes = nbytes * (tp - 1) // tp
    if etp > 1 and shape.is_moe:
        layers = len(shape.moe_layers)
        calls += layers * shape.num_experts * 2
        nbytes += layers * shape.num_experts * 3 * h * shape.moe_ffn_hidden_size * (etp - 1) // etp
    return calls, nbytes * per


@dataclass(frozen=True)
class RefitCost:
    weight_format: str
    counts: TensorCounts
    buckets: int
    wire_s: float
    gather_calls: int
    gather_bytes: int
    calls_s: float  # buckets + session
    load_s: tuple[float, float]
    quantize_s: float

    @property
    def gather_s(self) -> float:
        return self.gather_calls * GATHER_LATENCY_S + self.gather_bytes * 8 / (NVLINK_GBPS * 1e9)

    @property
    def total_s(self) -> tuple[float, float]:
        fixed = self.wire_s + self.gather_s + self.calls_s + self.quantize_s
        return fixed + self.load_s[0], fixed + self.load_s[1]


def refit_cost(cfg: DapoConfig, shape: ModelShape, wire: RefitEstimate, weight_format: str) -> RefitCost:
    """One sync of `shape` in `weight_format`, through the chosen sync source (rollout.sync.sources) over the
    link `wire` assumes; the wire time scales with the bytes sent (fp8_block: the quantized layout)."""
    counts = tensor_counts(shape, weight_format, cfg.model.dtype)
    plain = tensor_counts(shape, "bf16", cfg.model.dtype)
    per_stage = derived.sync_sources(cfg) == "per_stage"
    wire_s = (wire.per_stage_s if per_stage else wire.rank0_s) * counts.nbytes / plain.nbytes
    bucket_bytes = cfg.rollout.sync.bucket_mb * 2**20
    buckets = max(len(wire.source_bytes) if per_stage else 1, math.ceil(counts.nbytes / bucket_bytes))
    gather_calls, gather_bytes = _gathers(cfg, shape)
    calls_s = (buckets + SESSION_CALLS) * BUCKET_CALL_S
    copy_s = counts.nbytes / (SERVER_COPY_GBS * 1e9)
    load_s = (counts.tensors * LOAD_PER_TENSOR_S[0] + copy_s, counts.tensors * LOAD_PER_TENSOR_S[1] + copy_s)
    quant_in = counts.quantized_params * 2  # the bf16 bytes the quantization reads
    sources = len(wire.source_bytes) if per_stage else 1  # the sources quantize their shares in parallel
    quantize_s = quant_in / (QUANT_GBS * 1e9) / sources
    return RefitCost(weight_format, counts, buckets, wire_s, gather_calls, gather_bytes, calls_s, load_s, quantize_s)


def format_refit_costs(costs: list[RefitCost], servers: int) -> list[str]:
    """A side-by-side table of the weight formats, then the assumptions."""
    gb = 1e9
    head = "".join(f"{c.weight_format:>26}" for c in costs)

    def row(label, fn):
        return f"  {label:<34}" + "".join(f"{fn(c):>26}" for c in costs)

    def rng(lo, hi):
        return f"{lo:.2f}-{hi:.2f} s"

    lines = [
        f"refit cost per sync, end to end (estimate; {servers} server(s) each receive and load it):",
        f"  {'':<34}{head}",
        row("weights on the wire", lambda c: f"{c.counts.nbytes / gb:.2f} GB"),
        row("HF tensors (server loader calls)", lambda c: f"{c.counts.tensors:,} ({c.counts.expert_tensors:,} expert)"),
        row("buckets (rollout.sync.bucket_mb)", lambda c: f"{c.buckets:,}"),
        row("wire (chosen sync source)", lambda c: f"{c.wire_s:.2f} s"),
        row("TP / expert-TP gathers", lambda c: f"{c.gather_s:.2f} s ({c.gather_calls:,})"),
        row("bucket + session calls", lambda c: f"{c.calls_s:.2f} s"),
        row("server weight loading", lambda c: rng(*c.load_s)),
        row("quantization (trainer GPUs)", lambda c: f"{c.quantize_s:.2f} s" if c.counts.quantized_params else "-"),
        row("total", lambda c: rng(*c.total_s)),
        "  assumptions: " + "; ".join(ASSUMPTIONS),
    ]
    return lines

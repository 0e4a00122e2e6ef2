"""Per-GPU memory estimates for training ranks and SGLang rollout engines.

Pure arithmetic on a `ModelShape` and a config; `megatron-dapo plan` prints and checks the
results. The model is deliberately simple and every term is written out so it can be checked by
hand (tests/planner/test_plan.py does):

Training, Megatron (per GPU, per pipeline stage), following Megatron-LM's
`megatron/training/theoretical_memory_usage.py` for the static part:
  params      P_local * 2 bytes (bf16/fp16) or 4 (fp32)
  grads       P_local * 4       (fp32 gradient buffers: DDP grad_reduce_in_fp32)
  optimizer   P_local * 12      (fp32 master copy + Adam m, v; 8 without the master copy for fp32)
              / (dp * cp) for dense params and / expert-dp for expert params with the distributed optimizer;
              with optimizer.cpu_offload, offload_fraction of it lives in CPU memory instead
              (`optimizer_cpu`, with a pinned fp32 copy of those parameters' gradients: 4 bytes each)
  activations tokens * bytes-per-token-per-layer * layers-per-stage * micro-batches in flight
  logits      tokens * vocab / tp * 4 bytes (bf16 logits and their gradient, last stage only)
where P_local counts the stage's parameters after TP / EP / ETP sharding (norms and the router are
replicated) and tokens = algo.max_tokens_per_micro_batch / cp.

Activations per token per layer (elements; bf16 = 2 bytes), flash attention (no s^2 term):
  norms / residual inputs   4h                     (/ tp with sequence parallel, else replicated)
  attention                 2 (a + 2 kv) d + a d   (q, k, v before and after qk-norm / RoPE, output) / tp
  dense MLP                 3 f / tp               (fc1 output [gate; up], SwiGLU output)
  MoE MLP                   k (2h + 3 f_moe / etp) (k routed copies in and out, expert fc1 / act) / tp with SP
Recompute "full" keeps only each layer's input (h per token, / tp with SP) and rematerialises one
layer at a time; "selective" recomputes core attention, whose internals flash attention never
stores, so it is estimated like "none". 1F1B keeps (pp - stage) micro-batches in flight on a stage;
the interleaved schedule multiplies that by 1 + (pp - 1) / (pp * vpp) (Megatron-LM's penalty).

Training, FSDP2: fp32 params, fp32 grads and Adam states all sharded over dp (16 bytes per param / dp),
plus the unsharded bf16 weights of the two largest blocks (one computing, one prefetched).

Rollout, SGLang (per GPU of a server with tensor parallel size t): bf16 weights (/ t; KV heads are
replicated when t > KV heads), and a KV cache pool of mem_fraction_static * GPU memory - weights,
at 2 (k, v) * layers * kv_heads_per_gpu * head_dim * 2 bytes per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_dapo.config import derived
from megatron_dapo.config.schema import DapoConfig
from megatron_dapo.config.shapes import ModelShape

GiB = 1024**3


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


# --------------------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer on one GPU, split by how they are sharded / replicated."""

    dense: int  # non-expert parameters on this GPU (TP-sharded linears + replicated norms / router)
    expert: int  # routed-expert parameters on this GPU (EP and ETP sharded)


def layer_params(shape: ModelShape, layer: int, tp: int = 1, ep: int = 1, etp: int = 1) -> LayerParams:
    """Parameters of decoder layer `layer` held by one GPU under tensor / expert parallelism."""
    h, a, kv, d = shape.hidden_size, shape.num_attention_heads, shape.num_kv_heads, shape.head_dim
    attn = (h * a * d + 2 * h * kv * d + a * d * h) // tp  # q, k, v, o projections
    if shape.qkv_bias:
        attn += (a + 2 * kv) * d // tp
    replicated = 2 * h  # input and pre-MLP RMSNorm
    if shape.qk_norm:
        replicated += 2 * d  # q-norm and k-norm over head_dim
    if shape.is_moe and layer in shape.moe_layers:
        router = h * shape.num_experts  # replicated over TP and EP in megatron-core
        experts = (shape.num_experts // ep) * 3 * h * shape.moe_ffn_hidden_size // etp
        return LayerParams(dense=attn + replicated + router, expert=experts)
    mlp = 3 * h * shape.ffn_hidden_size // tp
    return LayerParams(dense=attn + replicated + mlp, expert=0)


def embedding_params(shape: ModelShape, tp: int = 1) -> int:
    """Vocab-parallel embedding (or output layer) parameters on one GPU."""
    return math.ceil(shape.vocab_size / tp) * shape.hidden_size


def total_params(shape: ModelShape) -> int:
    """All parameters of the model (no sharding), as in the HF checkpoint."""
    layers = sum(layer_params(shape, i).dense + layer_params(shape, i).expert for i in range(shape.num_layers))
    outputs = 1 if shape.tie_embeddings else 2
    return layers + outputs * embedding_params(shape) + shape.hidden_size  # + final norm


def active_params(shape: ModelShape) -> int:
    """Parameters used per token (MoE: only top-k experts)."""
    if not shape.is_moe:
        return total_params(shape)
    per_expert = 3 * shape.hidden_size * shape.moe_ffn_hidden_size
    inactive = len(shape.moe_layers) * (shape.num_experts - shape.moe_topk) * per_expert
    return total_params(shape) - inactive


def stage_layers(shape: ModelShape, pp: int, vpp: int | None, stage: int) -> list[int]:
    """Decoder layer indices held by pipeline rank `stage` (interleaved chunks with vpp)."""
    chunks = pp * (vpp or 1)
    per_chunk = shape.num_layers // chunks
    layers = []
    for chunk in range(stage, chunks, pp):
        layers += range(chunk * per_chunk, (chunk + 1) * per_chunk)
    return layers


# ---------------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class StageMemory:
    """Estimated bytes on one training GPU of pipeline stage `stage`."""

    stage: int
    dense_params: int  # parameter counts (not bytes)
    expert_params: int
    params: int  # bytes from here on
    grads: int
    optimizer: int
    activations: int  # with the configured recompute
    activations_no_recompute: int
    activations_full_recompute: int
    logits: int
    optimizer_cpu: int = 0  # host bytes of the optimizer's CPU part (optimizer.cpu_offload)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.logits

    def terms(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "logits": self.logits,
        }


def activation_elements_per_token(shape: ModelShape, layer: int, cfg: DapoConfig) -> float:
    """Elements stored for backward per token of one layer on one GPU, without recompute."""
    parallel = cfg.parallel
    tp, etp = parallel.tp, derived.expert_tp_size(cfg)
    h, a, kv, d = shape.hidden_size, shape.num_attention_heads, shape.num_kv_heads, shape.head_dim
    sp = parallel.sequence_parallel and tp > 1
    norms = 4 * h / (tp if sp else 1)
    attention = (2 * (a + 2 * kv) * d + a * d) / tp
    if shape.is_moe and layer in shape.moe_layers:
        mlp = shape.moe_topk * (2 * h + 3 * shape.moe_ffn_hidden_size / etp) / (tp if sp else 1)
    else:
        mlp = 3 * shape.ffn_hidden_size / tp
    return norms + attention + mlp


def micro_batches_in_flight(cfg: DapoConfig, stage: int) -> float:
    pp, vpp = cfg.parallel.pp, cfg.parallel.vpp
    inflight = float(pp - stage)
    if vpp and vpp > 1 and pp > 1:
        inflight *= 1 + (pp - 1) / (pp * vpp)
    return inflight


def megatron_stage_memory(cfg: DapoConfig, shape: ModelShape, stage: int) -> StageMemory:
    parallel = cfg.parallel
    tp, ep, etp, pp = parallel.tp, parallel.ep, derived.expert_tp_size(cfg), parallel.pp
    layers = stage_layers(shape, pp, parallel.vpp, stage)
    dense = expert = 0
    for i in layers:
        lp = layer_params(shape, i, tp, ep, etp)
        dense, expert = dense + lp.dense, expert + lp.expert
    first, last = stage == 0, stage == pp - 1
    if first:
        dense += embedding_params(shape, tp)
    if last:
        dense += shape.hidden_size  # final norm
        if not shape.tie_embeddings or pp > 1:  # tied weights need a copy on the last stage when pp > 1
            dense += embedding_params(shape, tp)

    param_bytes = dtype_bytes(cfg.model.dtype)
    opt_bytes = 8 if cfg.model.dtype == "fp32" else 12
    n_params = dense + expert
    if cfg.optimizer.use_distributed_optimizer:
        dp_cp = derived.data_parallel_size(cfg) * parallel.cp
        edp = derived.expert_data_parallel_size(cfg) if shape.is_moe else 1
        optimizer = opt_bytes * dense / dp_cp + opt_bytes * expert / edp
    else:
        optimizer = opt_bytes * n_params
    optimizer_cpu = 0.0
    if cfg.optimizer.cpu_offload:
        fraction = cfg.optimizer.offload_fraction
        optimizer_cpu = fraction * optimizer * (opt_bytes + 4) / opt_bytes  # + the pinned fp32 gradients
        optimizer = (1 - fraction) * optimizer

    tokens = derived.max_tokens_per_micro_batch(cfg) / parallel.cp
    act_bytes = dtype_bytes(cfg.model.dtype)
    per_token = [activation_elements_per_token(shape, i, cfg) for i in layers]
    inflight = micro_batches_in_flight(cfg, stage)
    none = tokens * sum(per_token) * act_bytes * inflight
    sp = parallel.sequence_parallel and tp > 1
    layer_input = shape.hidden_size / (tp if sp else 1)
    full = tokens * layer_input * len(layers) * act_bytes * inflight + tokens * max(per_token) * act_bytes
    configured = full if cfg.model.recompute_granularity == "full" else none
    logits = tokens * math.ceil(shape.vocab_size / tp) * 2 * 2 if last else 0
    return StageMemory(
        stage=stage,
        dense_params=dense,
        expert_params=expert,
        params=n_params * param_bytes,
        grads=n_params * 4,
        optimizer=int(optimizer),
        activations=int(configured),
        activations_no_recompute=int(none),
        activations_full_recompute=int(full),
        logits=int(logits),
        optimizer_cpu=int(optimizer_cpu),
    )


def fsdp2_memory(cfg: DapoConfig, shape: ModelShape) -> StageMemory:
    """One FSDP2 rank: everything sharded over dp, plus two gathered blocks in bf16."""
    dp = derived.data_parallel_size(cfg)
    n = total_params(shape)
    blocks = [layer_params(shape, i).dense + layer_params(shape, i).expert for i in range(shape.num_layers)]
    blocks.append(embedding_params(shape))
    gathered = 2 * sum(sorted(blocks)[-2:])  # bf16, computing + prefetched
    tokens = derived.max_tokens_per_micro_batch(cfg)
    per_token = [activation_elements_per_token(shape, i, cfg) for i in range(shape.num_layers)]
    none = tokens * sum(per_token) * 2
    full = tokens * shape.hidden_size * shape.num_layers * 2 + tokens * max(per_token) * 2
    configured = full if cfg.model.recompute_granularity == "full" else none
    return StageMemory(
        stage=0,
        dense_params=n,
        expert_params=0,
        params=int(4 * n / dp + gathered),
        grads=int(4 * n / dp),
        optimizer=int(8 * n / dp),
        activations=int(configured),
        activations_no_recompute=int(none),
        activations_full_recompute=int(full),
        logits=int(tokens * shape.vocab_size * 2 * 2),
    )


def training_memory(cfg: DapoConfig, shape: ModelShape) -> list[StageMemory]:
    """Estimated memory of a training GPU, one entry per pipeline stage."""
    if cfg.trainer.backend == "fsdp2":
        return [fsdp2_memory(cfg, shape)]
    return [megatron_stage_memory(cfg, shape, s) for s in range(cfg.parallel.pp)]


# ----------------------------------------------------------------------------------------- rollout


@dataclass(frozen=True)
class RolloutMemory:
    server_tp: int
    weights: int  # bytes per GPU
    static_budget: int  # mem_fraction_static * GPU memory
    kv_bytes_per_token: int  # per GPU
    kv_pool: int  # static_budget - weights (may be negative: does not fit)
    kv_tokens: int  # tokens the pool holds
    seq_len: int  # max_prompt_length + max_response_length
    full_sequences: int  # full-length sequences the pool holds at once


def rollout_memory(cfg: DapoConfig, shape: ModelShape, gpu_mem_bytes: int) -> RolloutMemory:
    server_tp = cfg.rollout.server_tp
    h, a, kv, d = shape.hidden_size, shape.num_attention_heads, shape.num_kv_heads, shape.head_dim
    kv_local = max(1, kv // server_tp)  # SGLang replicates KV heads when tp > num_key_value_heads
    layer_total = 0
    for i in range(shape.num_layers):
        layer_total += 2 * h * a * d // server_tp + 2 * h * kv_local * d + 2 * h + (2 * d if shape.qk_norm else 0)
        if shape.qkv_bias:
            layer_total += a * d // server_tp + 2 * kv_local * d
        if shape.is_moe and i in shape.moe_layers:
            layer_total += h * shape.num_experts + shape.num_experts * 3 * h * shape.moe_ffn_hidden_size // server_tp
        else:
            layer_total += 3 * h * shape.ffn_hidden_size // server_tp
    outputs = 1 if shape.tie_embeddings else 2
    n = layer_total + outputs * embedding_params(shape, server_tp) + h
    weights = 2 * n
    budget = int(cfg.rollout.mem_fraction_static * gpu_mem_bytes)
    kv_per_token = 2 * shape.num_layers * kv_local * d * 2
    pool = budget - weights
    tokens = max(0, pool) // kv_per_token
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    return RolloutMemory(
        server_tp=server_tp,
        weights=weights,
        static_budget=budget,
        kv_bytes_per_token=kv_per_token,
        kv_pool=pool,
        kv_tokens=tokens,
        seq_len=seq_len,
        full_sequences=tokens // seq_len,
    )


def weight_store_bytes(cfg: DapoConfig, shape: ModelShape) -> int:
    """Host memory of trainer rank 0 for per-server sync (megatron_dapo.sync.per_server.WeightStore): the
    newest exported weights, and the previous ones a lagging server may still be reading. 0 for all_at_once."""
    if cfg.rollout.sync.policy == "all_at_once":
        return 0
    return 2 * weight_bytes(cfg, shape)


def weight_bytes(cfg: DapoConfig, shape: ModelShape) -> int:
    """Bytes of one copy of the model's weights in the config's dtype (what a weight sync moves)."""
    return total_params(shape) * dtype_bytes(cfg.model.dtype)

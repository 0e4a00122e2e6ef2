"""Shared pieces of the runtime equivalence workers: a tiny Qwen3-shaped GPTModel on the local spec,
and moving full (TP=1, PP=1, EP=1) weights into any parallel layout by slicing.

The slicing here is written from megatron-core's documented layouts, independently of
megatron_dapo.bridge, so that these tests check megatron-core on CPU and nothing of ours.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

VOCAB = 256
SEQ = 32


def tiny_config(moe: bool = False, num_layers: int = 4, **overrides):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=num_layers,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.1,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        pipeline_dtype=torch.float32,
    )
    if moe:
        kw.update(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_ffn_hidden_size=32,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_pre_softmax=False,
            moe_grouped_gemm=False,
        )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt(config):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=True, normalization="RMSNorm")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=10000,
    )


def causal_mask(b: int, s: int) -> torch.Tensor:
    """[b, 1, s, s] bool, True where attention is not allowed (megatron's convention)."""
    return torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(b, 1, s, s).contiguous()


def batch(seed: int, b: int = 2, s: int = SEQ):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, s + 1), generator=g)
    return dict(
        tokens=tokens[:, :-1].contiguous(),
        labels=tokens[:, 1:].contiguous(),
        position_ids=torch.arange(s).expand(b, s).contiguous(),
        attention_mask=causal_mask(b, s),
    )


def run(model, bt):
    return model(bt["tokens"], bt["position_ids"], bt["attention_mask"])


def _global_name(name: str, config) -> str:
    """Map a local parameter name (this PP stage, this EP rank) to its name in the full model."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config)
    name = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + offset}.", name)
    if config.num_moe_experts:
        n_local = config.num_moe_experts // ps.get_expert_model_parallel_world_size()
        first = ps.get_expert_model_parallel_rank() * n_local
        name = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m[1]) + first}.", name)
    return name


def shard_of(full: torch.Tensor, name: str, param: torch.Tensor, config) -> torch.Tensor:
    """The slice of a full tensor that this rank's `param` holds (TP split along partition_dim)."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return full
    expert = ".experts." in name
    tp = ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size()
    rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight") and config.gated_linear_unit:
        # Column-parallel GLU: each rank holds [gate_r; up_r], not a contiguous block of [gate; up].
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    return full.chunk(tp, dim=dim)[rank]


def local_params(model, config):
    """(global name, local param) for every parameter of this rank's model chunk."""
    from megatron.core.utils import get_attr_wrapped_model  # noqa: F401 (import check only)

    inner = model.module if hasattr(model, "module") else model
    return [(_global_name(n, config), p) for n, p in inner.named_parameters()]


def load_full(model, full: dict[str, torch.Tensor], config) -> None:
    with torch.no_grad():
        for gname, p in local_params(model, config):
            p.copy_(shard_of(full[gname], gname, p, config))


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def gather_tp_last_dim(x: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def assert_close(name, got, want, rtol=1e-5, atol=1e-6):
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    ok = torch.allclose(got, want, rtol=rtol, atol=atol)
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"[rank {rank}] {name}: max abs err {err:.3e} (scale {scale:.3e}) {'ok' if ok else 'FAIL'}", flush=True)
    if not ok:
        raise AssertionError(f"{name}: max abs err {err:.3e} exceeds rtol={rtol} atol={atol}")
    return err

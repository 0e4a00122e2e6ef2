"""Build megatron-core GPTModels for Qwen3 / Qwen3-MoE / Qwen2.5 from an HF config.

    from megatron_dapo.runtime.distributed import init_distributed, init_model_parallel
    from megatron_dapo.models import ModelParallel, build_gpt_model

    init_distributed()
    init_model_parallel(tp=2, pp=1)
    chunks = build_gpt_model("/path/to/hf_dir", ModelParallel(tp=2, dtype="bfloat16"))

The builder assumes megatron-core's parallel state is initialised with the same sizes (it checks).
It returns one GPTModel per virtual-pipeline chunk of this rank's stage; `pre_process` /
`post_process` follow the stage. Weights are megatron-core's random init: load real ones with
`megatron_dapo.bridge.load_hf_into_megatron` or dist_checkpointing.

Padded vocabulary: the embedding and output layer have `padded_vocab_size(vocab, tp)` rows (a
multiple of 128 * TP). The padded rows are zero after loading, so the output logits of the padded
columns are exactly 0 -- NOT -inf: a softmax over them would shift every logprob. Callers must
either slice the gathered logits to `[..., :arch.vocab_size]` or, on vocab-parallel (TP-sharded)
logits, apply `mask_padded_vocab_logits` before any softmax / cross entropy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_dapo.models.arch import QwenArch
from megatron_dapo.models.specs import decoder_block_spec, te_available

VOCAB_PAD_MULTIPLE = 128

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class ModelParallel:
    """Parallel layout and precision of the model a rank builds (sizes as in megatron-core)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline chunks per stage (None = 1)
    ep: int = 1
    etp: int | None = None  # expert tensor parallel size (None = tp, megatron-core's default)
    cp: int = 1  # context parallel size: each rank holds 1/cp of every sequence (see trainer.cp_split)
    sequence_parallel: bool = False
    dtype: Any = "float32"  # params dtype: torch dtype or "float32" / "bfloat16" / "float16"

    @property
    def torch_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}")
        return _DTYPES[self.dtype]

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @classmethod
    def from_parallel_state(cls, dtype: Any = "float32", sequence_parallel: bool = False) -> "ModelParallel":
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        ep = ps.get_expert_model_parallel_world_size()
        return cls(
            tp=tp,
            pp=ps.get_pipeline_model_parallel_world_size(),
            vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
            ep=ep,
            etp=ps.get_expert_tensor_parallel_world_size(),
            cp=ps.get_context_parallel_world_size(),
            sequence_parallel=sequence_parallel,
            dtype=dtype,
        )


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of 128 * TP (megatron's convention)."""
    multiple = VOCAB_PAD_MULTIPLE * tp
    return -(-vocab_size // multiple) * multiple


def check_divisibility(arch: QwenArch, par: ModelParallel) -> None:
    """Raise a ValueError naming the first model dimension a parallel size does not divide."""
    chunks = par.pp * (par.vpp or 1)
    checks = [
        ("num_attention_heads", arch.num_attention_heads, "tp", par.tp),
        ("num_key_value_heads", arch.num_kv_heads, "tp", par.tp),
        ("intermediate_size", arch.intermediate_size, "tp", par.tp),
        ("num_hidden_layers", arch.num_layers, "pp*vpp", chunks),
    ]
    if arch.is_moe:
        checks += [
            ("num_experts", arch.num_experts, "ep", par.ep),
            ("moe_intermediate_size", arch.moe_intermediate_size, "etp", par.expert_tp),
        ]
    for field_name, value, size_name, size in checks:
        if size < 1 or value % size:
            raise ValueError(f"{size_name}={size} does not divide {field_name}={value}")
    if par.vpp is not None and par.vpp > 1 and par.pp < 2:
        raise ValueError(f"vpp={par.vpp} needs pp >= 2 (got pp={par.pp})")


def moe_layer_freq(arch: QwenArch) -> int | list[int]:
    """megatron-core's `moe_layer_freq` for `arch`: 1 when every layer is MoE, else a per-layer list.

    The value decides the checkpoint layout. With 1 (megatron-core's default, what Megatron-LM trains
    Qwen3-30B-A3B with) the layers are homogeneous and dist_checkpointing stacks them under
    `decoder.layers.<name>` with a layer axis; a list switches megatron-core to per-layer keys
    (`decoder.layers.<i>.<name>`), which only a truly mixed model (mlp_only_layers,
    decoder_sparse_step > 1) needs.
    """
    if all(arch.moe_layers):
        return 1
    return [1 if m else 0 for m in arch.moe_layers]


def transformer_config(arch: QwenArch, par: ModelParallel, use_te: bool | None = None, **overrides):
    """megatron-core TransformerConfig for `arch` at layout `par`; `overrides` are extra config fields.

    `use_te`: whether the layer spec will be Transformer Engine's (grouped expert GEMMs only then);
    default: TE imports and CUDA is present.
    """
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    check_divisibility(arch, par)
    dtype = par.torch_dtype
    on_cpu = not torch.cuda.is_available()
    if use_te is None:
        use_te = te_available() and not on_cpu
    kw: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
        attention_softmax_in_fp32=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if (par.vpp or 1) > 1 else None,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
        context_parallel_size=par.cp,
        sequence_parallel=par.sequence_parallel,
        use_cpu_initialization=on_cpu,
        # Fusions need CUDA kernels (apex / TE); all are off by default in TransformerConfig and
        # must stay off on the CPU. A GPU caller may switch them on through `overrides`.
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )
    if (par.vpp or 1) > 1:
        # The interleaved schedule sends activations and gradients both ways in one exchange. Batched
        # (batch_isend_irecv) at pp=2 both go to the one peer on one group, posted in an order the peer
        # does not receive them in: activations and gradients of equal shape swap silently. Megatron-LM
        # turns batching off with virtual pipelining; megatron-core's unbatched ops split the two
        # directions over two groups.
        kw["batch_p2p_comm"] = False
    if arch.is_moe:
        kw.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            # HF norm_topk_prob=True renormalises the top-k of a full softmax, which equals a softmax
            # over the top-k logits: megatron-core's pre_softmax=False. False keeps the full-softmax
            # probabilities of the chosen experts: pre_softmax=True.
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=arch.router_aux_loss_coef,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="alltoall",
            moe_layer_freq=moe_layer_freq(arch),
            moe_grouped_gemm=use_te,  # TEGroupedMLP; the local spec's grouped MLP needs the grouped_gemm package
            moe_shared_expert_intermediate_size=None,
        )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt_model(
    hf_config_or_dir: Any,
    parallel: ModelParallel | dict | None = None,
    *,
    use_te: bool | None = None,
    config_overrides: dict | None = None,
    parallel_output: bool = True,
) -> list:
    """GPTModel chunks (one per virtual pipeline stage) of this rank, for an HF Qwen config.

    hf_config_or_dir: an HF model directory, config.json path, dict or transformers config.
    parallel: the layout (a ModelParallel or a dict of its fields); None reads megatron-core's parallel
      state (dtype float32; sequence parallel for MoE with TP > 1, which megatron-core requires to
      train). It must agree with the initialised parallel state.
    use_te: Transformer Engine layer spec; default: when transformer_engine imports and CUDA is present.
    config_overrides: extra TransformerConfig fields (recompute, fusions, ...).
    parallel_output: keep logits vocab-parallel (TP-sharded, padded vocab); see the module docstring.

    Each returned model has `.arch` (the QwenArch) and `.vp_stage` set.
    """
    from megatron.core import parallel_state as ps

    from megatron_dapo.runtime.megatron_compat import gpt_model_class

    GPTModel = gpt_model_class()  # deprecated in megatron-core 0.19: see runtime/megatron_compat.py
    arch = hf_config_or_dir if isinstance(hf_config_or_dir, QwenArch) else QwenArch.from_hf(hf_config_or_dir)
    if parallel is None:
        # MoE layers refuse to train with TP > 1 unless sequence parallel is on.
        par = ModelParallel.from_parallel_state()
        if arch.is_moe and par.tp > 1:
            par = ModelParallel.from_parallel_state(sequence_parallel=True)
    elif isinstance(parallel, dict):
        par = ModelParallel(**parallel)
    else:
        par = parallel
    _check_matches_parallel_state(par)
    if use_te is None:
        use_te = te_available() and torch.cuda.is_available()
    config = transformer_config(arch, par, use_te=use_te, **(config_overrides or {}))
    vpp = par.vpp or 1
    chunks = []
    for i in range(vpp):
        vp_stage = i if vpp > 1 else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=decoder_block_spec(config, use_te=use_te, vp_stage=vp_stage),
            vocab_size=padded_vocab_size(arch.vocab_size, par.tp),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=arch.rope_theta,
            vp_stage=vp_stage,
        )
        model.arch = arch
        chunks.append(model)
    return chunks


def _check_matches_parallel_state(par: ModelParallel) -> None:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("megatron-core parallel state is not initialised: call init_model_parallel first")
    have = ModelParallel.from_parallel_state()
    for name in ("tp", "pp", "cp", "ep", "etp"):
        want = par.expert_tp if name == "etp" else getattr(par, name)
        if getattr(have, name) != want:
            raise ValueError(
                f"ModelParallel.{name}={want} but megatron-core's parallel state has {getattr(have, name)}"
            )
    if (have.vpp or 1) != (par.vpp or 1):
        raise ValueError(f"ModelParallel.vpp={par.vpp} but megatron-core's parallel state has {have.vpp}")


def mask_padded_vocab_logits(logits: torch.Tensor, vocab_size: int, vocab_start: int | None = None) -> torch.Tensor:
    """`logits` with its padded-vocabulary columns (global index >= vocab_size) set to -inf, out of place.

    `logits[..., j]` is global vocab column `vocab_start + j`. The default `vocab_start` is this TP
    rank's shard start (tp_rank * local width), right for GPTModel's vocab-parallel output; pass 0 for
    gathered logits (or simply slice those to `[..., :vocab_size]`).
    """
    width = logits.shape[-1]
    if vocab_start is None:
        from megatron.core import parallel_state as ps

        vocab_start = ps.get_tensor_model_parallel_rank() * width if ps.model_parallel_is_initialized() else 0
    if vocab_start + width <= vocab_size:
        return logits
    cols = torch.arange(vocab_start, vocab_start + width, device=logits.device)
    return logits.masked_fill(cols >= vocab_size, float("-inf"))

"""Context parallelism under torchrun, against Hugging Face models of the same weights.

Usage: cp_checks.py CHECK[,CHECK...] TMPDIR
  logprobs_cp2:      CP=2 (2 ranks): compute_logprobs equals HF (< 1e-5) at temperature 1 and 0.7, with and
                     without algo.fused_lm_head; a forward hook on the decoder sees each rank process
                     exactly its 1/cp share of every packed micro-batch. Also, at cp=1, the local spec's
                     SDPA core attention equals megatron-core's DotProductAttention (float64, forward and
                     gradients, grouped K/V heads, a packed block-causal mask).
  logprobs_cp2_tp2:  CP=2 x TP=2 (4 ranks): compute_logprobs equals HF (< 1e-5), without and with sequence
                     parallelism; with SP a train step equals the one-process reference step.
  train_cp2:         CP=2 (2 ranks): one train step (several packed micro-batches) equals one step on the
                     whole batch on one process (HF model + the DAPO loss + torch AdamW), unfused and fused;
                     its torch_dist checkpoint resumes at cp=2 (same weights, the same next step, bit for
                     bit) and at cp=1 x dp=2 (same weights, the next step to float32 rounding).
  moe_cp2_ep2:       Qwen3-MoE at CP=2 x EP=2 (2 ranks): compute_logprobs equals HF (< 1e-5); a CP=2 train
                     step with routing replay equals HF forced to the replayed routing.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.bridge.parallel import unwrap_model
from megatron_dapo.config.schema import RolloutCorrectionConfig
from megatron_dapo.runtime.distributed import init_model_parallel
from megatron_dapo.trainer.actor import build_actor
from tests.workers.actor_checks import (
    check_exact_update,
    check_resume,
    hf_logprobs,
    log,
    make_batch,
    make_config,
    max_err,
    run_checks,
    tiny_moe_dir,
)


def decoder_token_counts(actor, batch) -> tuple[list[int], list[int]]:
    """(tokens each decoder call saw on this rank, packed row lengths) of one compute_logprobs."""
    seen: list[int] = []
    decoder = unwrap_model(actor.engine.model[0]).decoder
    handle = decoder.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append((kwargs.get("hidden_states", args[0] if args else None)).shape[0]),
        with_kwargs=True,
    )
    try:
        actor.compute_logprobs(batch)
    finally:
        handle.remove()
    rows = actor._split(batch, list(range(batch.num_samples)))[actor.layout.dp_rank]
    return seen, [mb.length for mb in actor._packs(batch, rows)]


def check_logprobs(hf_dir, tp: int, cp: int, fused_too: bool, ep: int = 1, sp: bool = False):
    from transformers import AutoModelForCausalLM

    init_model_parallel(tp=tp, cp=cp, ep=ep, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for fused in (False, True) if fused_too else (False,):
        cfg = make_config(hf_dir, tp=tp, cp=cp, ep=ep, max_tokens_per_micro_batch=64, fused_lm_head=fused)
        cfg.parallel.sequence_parallel = sp
        actor = build_actor(cfg)
        assert actor.layout.cp == cp
        for temperature in (1.0, 0.7):
            batch = make_batch(seed=3, temperature=temperature)
            err = max_err(actor.compute_logprobs(batch), hf_logprobs(hf, batch))
            log(
                f"tp={tp} cp={cp} ep={ep} sp={sp} fused={fused} T={temperature}: "
                f"actor vs HF logprobs max abs err {err:.2e}"
            )
            assert err < 1e-5, err
    actor.max_tokens = 24  # several micro-batches
    seen, lengths = decoder_token_counts(actor, batch)
    log(f"cp={cp} sp={sp}: decoder saw {seen} tokens per micro-batch on rank 0 for packed rows of {lengths}")
    share = cp * (tp if sp else 1)  # sequence parallelism also splits the decoder's input over TP
    assert seen == [n // share for n in lengths] and len(seen) > 1, (seen, lengths)
    if cp > 1:
        assert all(n % (2 * cp) == 0 for n in lengths), lengths


def check_sdpa_equals_megatron_attention():
    """The local spec's SDPA attention (no CP) against the megatron-core attention it replaces."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dapo.models.core_attention import SdpaDotProductAttention
    from megatron_dapo.trainer.packing import block_causal_mask

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        params_dtype=torch.float64, attention_dropout=0.0, masked_softmax_fusion=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    s = 19
    inputs = [torch.randn(s, 1, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
    mask = block_causal_mask(torch.tensor([0, 7, 15, s]), s)
    results = []
    for cls in (DotProductAttention, SdpaDotProductAttention):
        q, k, v = (x.clone().requires_grad_() for x in inputs)
        out = cls(config, layer_number=1, attn_mask_type=AttnMaskType.padding, attention_type="self")(q, k, v, mask)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=torch.float64)).view_as(out))
        results.append([out, q.grad, k.grad, v.grad])
    err = max((a - b).abs().max().item() for a, b in zip(*results))
    log(f"SDPA vs megatron-core DotProductAttention (float64, output and q/k/v grads): max abs err {err:.1e}")
    assert err < 1e-12, err


def check_train(hf_dir, tmpdir, cp: int):
    for fused in (False, True):
        actor, cfg, _, after = check_exact_update(hf_dir, cp=cp, fused_lm_head=fused)
        assert actor.layout.cp == cp and actor.layout.dp == dist.get_world_size() // cp
        dist.barrier()
    check_cp_resume(actor, cfg, after, tmpdir)
    # GSPO's per-sequence mean log-ratio and the sequence-level correction under CP: the loss sees whole
    # sequences (each CP rank gathers every token's logprob), so the step still equals one process's
    check_exact_update(
        hf_dir,
        cp=cp,
        policy_loss="gspo",
        loss_agg_mode="seq-mean-token-mean",
        rollout_correction=RolloutCorrectionConfig(mode="seq_tis", upper=2.0),
    )


def check_cp_resume(actor, cfg, after, tmpdir):
    """A CP checkpoint resumes at the same CP size, and at cp=1 (the torch_dist checkpoint reshards: the
    weights are replicated over CP, the distributed optimizer's shards span DP x CP)."""
    after = check_resume(actor, cfg, after, str(Path(tmpdir) / "cp_ckpt"))
    no_cp = copy.deepcopy(cfg)
    no_cp.parallel.cp = 1
    # float32 rounding only: cp=1 x dp=2 packs and reduces the same rows in another order
    check_resume(actor, cfg, after, str(Path(tmpdir) / "cp_ckpt2"), no_cp, dict(tp=cfg.parallel.tp), tol=2e-6)


def check_moe(tmpdir, cp: int):
    """Qwen3-MoE with CP x EP (the experts split over the CP ranks' tokens): logprobs equal HF; and a CP
    training step replaying random routed experts (R3, each CP rank its own tokens' rows, recomputed in
    backward) equals an HF reference forced to route the same way."""
    moe_dir = tiny_moe_dir(tmpdir)
    check_logprobs(moe_dir, tp=1, cp=cp, ep=2, fused_too=False)
    check_exact_update(moe_dir, cp=cp, seed=8, replay_seed=4, recompute=True)


CHECKS = {
    "logprobs_cp2": lambda hf_dir, tmpdir: (
        check_logprobs(hf_dir, tp=1, cp=2, fused_too=True),
        check_sdpa_equals_megatron_attention(),
    ),
    "logprobs_cp2_tp2": lambda hf_dir, tmpdir: (
        check_logprobs(hf_dir, tp=2, cp=2, fused_too=False),
        check_logprobs(hf_dir, tp=2, cp=2, fused_too=False, sp=True),
        check_exact_update(hf_dir, cp=2, parallel=dict(tp=2, sp=True)),
    ),
    "train_cp2": lambda hf_dir, tmpdir: check_train(hf_dir, tmpdir, cp=2),
    "moe_cp2_ep2": lambda hf_dir, tmpdir: check_moe(tmpdir, cp=2),
}


if __name__ == "__main__":
    run_checks(sys.argv[1:], CHECKS)

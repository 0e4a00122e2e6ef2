"""An all-MoE Qwen3 checkpoint in megatron-core's canonical (stacked) layout, against a plain GPTModel.

usage: moe_layout.py HF_DIR CONVERTED_CKPT WORKDIR      (one rank)

HF_DIR is a tiny Qwen3-MoE with every layer MoE (Qwen3-30B-A3B's pattern), CONVERTED_CKPT its
`megatron-dapo convert hf-to-megatron` output. The "plain" model is what a Megatron-LM user builds:
TransformerConfig + get_gpt_layer_local_spec, default moe_layer_freq, nothing of megatron_dapo. Checks:
  converted      the converter wrote stacked keys; the plain model loads them with dist_checkpointing.load
                 (strict) and gives HF's logits
  old_per_layer  a checkpoint as this package wrote it before (per-layer keys) loads into today's
                 stacked model and gives HF's logits; the bridge export returns HF's tensors
  plain_save     a randomly initialised plain model saved as Megatron-LM saves it (iter_0000010 +
                 tracker): its logits go to WORKDIR/plain_logits.pt for the test to compare through HF
  actor_resume   actor checkpoints (model + optimizer) of the stacked model, and of the
                 per-layer model of before, resume exactly into today's actor, and load into a
                 bridge model the way `convert megatron-to-hf` reads them
Each prints `RESULT <check> rel=<err>` or `CHECK PASSED <check>`; any failure exits non-zero.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bridge_common import hf_logits, megatron_logits, rel_err  # noqa: E402

TOL = 1e-5
PER_LAYER = re.compile(r"(^|\.)decoder\.layers\.\d+\.")


def plain_gpt_model(hf_dir):
    """A GPTModel for the HF config, built the way megatron-core documents it (no megatron_dapo code)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    config = TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf["head_dim"],
        ffn_hidden_size=hf["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"],
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        num_moe_experts=experts,
        moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_router_pre_softmax=not hf["norm_topk_prob"],  # norm_topk_prob: softmax over the top-k
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=hf["router_aux_loss_coef"],
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )
    assert config.moe_layer_freq == 1, "the plain model must use megatron-core's default moe_layer_freq"
    spec = get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=hf["vocab_size"],
        max_sequence_length=hf["max_position_embeddings"],
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=hf["rope_parameters"]["rope_theta"],
    )


def saved_keys(ckpt_dir) -> dict:
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_tensors_metadata(str(ckpt_dir))


def check_converted(hf_dir, ckpt, ids, ref, num_layers):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    release = Path(ckpt) / "release"
    keys = saved_keys(release)
    per_layer = sorted(k for k in keys if PER_LAYER.search(k))
    assert not per_layer, f"converter wrote per-layer keys: {per_layer[:3]}"
    qkv = keys["decoder.layers.self_attention.linear_qkv.weight"]
    assert qkv.global_shape[0] == num_layers, qkv.global_shape  # the layer axis
    print(f"converted checkpoint: {len(keys)} stacked tensors, e.g. {qkv.key} {tuple(qkv.global_shape)}", flush=True)

    torch.manual_seed(1)
    plain = plain_gpt_model(hf_dir)
    state = dist_checkpointing.load(
        {"model": plain.sharded_state_dict()}, str(release), strict=StrictHandling.RAISE_ALL
    )
    plain.load_state_dict(state["model"], strict=True)
    err = rel_err(megatron_logits([plain], ids, ref.shape[-1]), ref)
    print(f"RESULT converted rel={err:.3e}", flush=True)
    assert err < TOL, err

    # A mixed dense / MoE model can never be stacked: loading this checkpoint into one is refused by name.
    from megatron_dapo.bridge.layer_layout import sharded_state_dict_metadata
    from megatron_dapo.models import build_gpt_model

    mixed = build_gpt_model(hf_dir, {"tp": 1}, config_overrides={"moe_layer_freq": [0] + [1] * (num_layers - 1)})
    try:
        sharded_state_dict_metadata(mixed, release)
    except ValueError as e:
        assert "stores homogeneous (stacked) decoder layers" in str(e), e
    else:
        raise AssertionError("a stacked checkpoint was accepted for a mixed model")


def check_old_per_layer(hf_dir, workdir, ids, ref, arch):
    from megatron_dapo.bridge import export_hf_weights, load_hf_into_megatron
    from megatron_dapo.bridge.checkpoint import load_megatron_checkpoint, save_megatron_checkpoint
    from megatron_dapo.bridge.hf_io import HFCheckpointReader
    from megatron_dapo.models import build_gpt_model

    # What the provider built for an all-MoE model before: a per-layer moe_layer_freq list.
    old = build_gpt_model(hf_dir, {"tp": 1}, config_overrides={"moe_layer_freq": [1] * arch.num_layers})
    load_hf_into_megatron(old, hf_dir)
    ckpt = save_megatron_checkpoint(old, Path(workdir) / "old_per_layer")
    keys = saved_keys(ckpt)
    assert any(PER_LAYER.search(k) for k in keys) and "decoder.layers.0.self_attention.linear_qkv.weight" in keys

    torch.manual_seed(2)
    (new,) = build_gpt_model(hf_dir, {"tp": 1})
    assert new.config.moe_layer_freq == 1
    load_megatron_checkpoint([new], ckpt.parent)
    err = rel_err(megatron_logits([new], ids, arch.vocab_size), ref)
    print(f"RESULT old_per_layer rel={err:.3e}", flush=True)
    assert err < TOL, err

    # Per-layer keys of layers a smaller model does not have: refused, not silently dropped.
    smaller = dataclasses.replace(arch, num_layers=2, moe_layers=(True, True))
    try:
        load_megatron_checkpoint(build_gpt_model(smaller, {"tp": 1}), ckpt.parent)
    except ValueError as e:
        assert "holds tensors the model lacks ['decoder.layers.2." in str(e), e
    else:
        raise AssertionError("a checkpoint with more layers than the model was accepted")

    reader = HFCheckpointReader(hf_dir)
    n = 0
    for name, tensor in export_hf_weights([new], dst_rank=None):
        want = reader.read(name)
        assert torch.equal(tensor, want), f"export of {name} differs from the HF file"
        n += 1
    print(f"CHECK PASSED old_per_layer (export of {n} tensors equals the HF files)", flush=True)


def check_plain_save(hf_dir, workdir, ids):
    """A plain model's own random init (norms perturbed so that a misplaced norm shows), saved as
    Megatron-LM does: CKPT/latest_checkpointed_iteration.txt + CKPT/iter_0000010/."""
    from megatron.core import dist_checkpointing

    torch.manual_seed(3)
    plain = plain_gpt_model(hf_dir)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    ckpt = Path(workdir) / "plain_ckpt"
    (ckpt / "iter_0000010").mkdir(parents=True)
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    # Megatron-LM also saves its RNG state (and optimizer): conversion must skip what is not the model.
    rng = ShardedObject("rng_state", [{"random_rng_state": torch.get_rng_state()}], (1, 1), (0, 0), replica_id=0)
    state = {"model": plain.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": 10, "rng_state": rng}
    dist_checkpointing.save(state, str(ckpt / "iter_0000010"))
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    logits = megatron_logits([plain], ids, plain.vocab_size)
    torch.save({"ids": ids, "logits": logits}, Path(workdir) / "plain_logits.pt")
    print("CHECK PASSED plain_save", flush=True)


def check_actor_resume(hf_dir, workdir):
    from actor_checks import exported, make_batch, make_config

    import megatron_dapo.models.provider as provider
    from megatron_dapo.bridge import export_hf_weights, load_megatron_checkpoint
    from megatron_dapo.models import build_gpt_model
    from megatron_dapo.trainer.actor import build_actor

    # the batches carry no routed experts: route with the trainer's own routers (replay is checked elsewhere)
    cfg = make_config(
        hf_dir, max_tokens_per_micro_batch=64, ppo_mini_batch_size=3, train_batch_size=3, routing_replay="none"
    )
    batch, batch2 = make_batch(seed=5), make_batch(seed=6)
    stacked = provider.moe_layer_freq
    for layout in ("stacked", "per-layer"):
        if layout == "per-layer":  # the provider of before
            provider.moe_layer_freq = lambda arch: [1] * arch.num_layers
        try:
            actor = build_actor(cfg)
        finally:
            provider.moe_layer_freq = stacked
        batch.rollout_logprobs = [o.tolist() for o in actor.compute_logprobs(batch)]
        actor.train_step(batch)
        ckpt = str(Path(workdir) / f"actor_{layout}")
        actor.save_checkpoint(ckpt)
        keys = saved_keys(ckpt)
        assert any(PER_LAYER.search(k) for k in keys) == (layout == "per-layer"), layout
        restored = build_actor(cfg)
        assert restored.engine.config.moe_layer_freq == 1
        restored.load_checkpoint(ckpt)
        before = exported(actor)
        assert all(torch.equal(v, before[k]) for k, v in exported(restored).items()), layout
        # The training checkpoint (model + optimizer) is also what `convert megatron-to-hf` reads.
        (chunk,) = build_gpt_model(hf_dir, {"tp": 1})
        load_megatron_checkpoint([chunk], ckpt)
        assert all(torch.equal(t, before[k]) for k, t in export_hf_weights([chunk], dst_rank=None)), layout
        batch2.rollout_logprobs = [o.tolist() for o in actor.compute_logprobs(batch2)]
        actor.train_step(batch2)
        restored.train_step(batch2)
        w1, w2 = exported(actor), exported(restored)
        err = max((w1[k] - w2[k]).abs().max().item() for k in w1)
        moved = max((w1[k] - before[k]).abs().max().item() for k in w1)
        print(f"RESULT actor_resume_{layout} next-step diff={err:.1e} (step moved {moved:.1e})", flush=True)
        assert err == 0.0 and moved > 0, (err, moved)
    print("CHECK PASSED actor_resume", flush=True)


def main(argv) -> int:
    from megatron_dapo.models import QwenArch
    from megatron_dapo.runtime.distributed import destroy_distributed, init_distributed, init_model_parallel

    hf_dir, ckpt, workdir = argv
    init_distributed()
    assert dist.get_world_size() == 1
    init_model_parallel(seed=1)
    arch = QwenArch.from_hf(hf_dir)
    assert arch.is_moe and all(arch.moe_layers), "the check needs an all-MoE model"
    ids = torch.randint(0, arch.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(hf_dir, ids)
    check_converted(hf_dir, ckpt, ids, ref, arch.num_layers)
    check_old_per_layer(hf_dir, workdir, ids, ref, arch)
    check_plain_save(hf_dir, workdir, ids)
    check_actor_resume(hf_dir, workdir)
    destroy_distributed()
    return 0


if __name__ == "__main__":  # dist_checkpointing.save spawns a process: keep the guard
    sys.exit(main(sys.argv[1:]))

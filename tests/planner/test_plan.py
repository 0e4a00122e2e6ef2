"""`megatron-dapo plan`: parameter counts, memory terms and layout against hand-computed figures.

Every expected number below is written out as arithmetic from the HF config fields, independently
of megatron_dapo.planner.memory, so a change in the estimate's formulas shows up here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.apps.plan import main
from megatron_dapo.config import load_config
from megatron_dapo.config.shapes import BUILTIN_HF_CONFIGS, shape_from_hf
from megatron_dapo.planner.memory import active_params, total_params, training_memory
from megatron_dapo.planner.plan import fit_errors, format_plan, make_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "qwen3"
GiB = 1024**3
T = 2048 + 20480  # max_tokens_per_micro_batch = one full DAPO prompt + response


def _cluster(name: str, nodes: int, *overrides: str):
    return load_config(CONFIGS / name, [f"trainer.nnodes={nodes}", "trainer.gpus_per_node=8", *overrides])


# ------------------------------------------------------------------------------------ parameter counts


def test_total_params_of_the_qwen3_models():
    # Qwen3-8B: per layer q,o 2*4096*4096 + k,v 2*4096*(8*128) + norms 2*4096 + qk-norm 2*128
    #           + SwiGLU 3*4096*12288; untied embedding and LM head 2*151936*4096; final norm 4096.
    layer_8b = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 4096 + 2 * 128 + 3 * 4096 * 12288
    assert total_params(shape_from_hf(BUILTIN_HF_CONFIGS["Qwen3-8B"])) == 36 * layer_8b + 2 * 151936 * 4096 + 4096
    assert 36 * layer_8b + 2 * 151936 * 4096 + 4096 == 8_190_735_360  # "8.2B" on the model card

    # Qwen3-30B-A3B: attention q,o 2*2048*4096 + k,v 2*2048*512, norms 2*2048 + 2*128,
    #                router 2048*128, 128 experts of 3*2048*768.
    moe = shape_from_hf(BUILTIN_HF_CONFIGS["Qwen3-30B-A3B"])
    layer_30b = 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 2048 + 2 * 128 + 2048 * 128 + 128 * 3 * 2048 * 768
    total_30b = 48 * layer_30b + 2 * 151936 * 2048 + 2048
    assert total_params(moe) == total_30b == 30_532_122_624  # "30.5B"
    assert active_params(moe) == total_30b - 48 * (128 - 8) * 3 * 2048 * 768 == 3_353_032_704  # "3.3B activated"


def test_total_params_of_qwen2_5_7b():
    # per layer q,o 2*3584*3584 + k,v 2*3584*(4*128) + QKV bias 3584 + 2*512 + norms 2*3584
    # + SwiGLU 3*3584*18944; untied embedding and LM head 2*152064*3584; final norm 3584.
    layer = 2 * 3584 * 3584 + 2 * 3584 * 512 + 3584 + 2 * 512 + 2 * 3584 + 3 * 3584 * 18944
    expected = 28 * layer + 2 * 152064 * 3584 + 3584
    assert expected == 7_615_616_512  # "7.61B" on the model card
    assert total_params(shape_from_hf(BUILTIN_HF_CONFIGS["Qwen2.5-7B"])) == expected
    assert BUILTIN_HF_CONFIGS["Qwen2.5-7B-Instruct"] == BUILTIN_HF_CONFIGS["Qwen2.5-7B"]

    # Independent reference: the real transformers model built from the same fields.
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    fields = {k: v for k, v in BUILTIN_HF_CONFIGS["Qwen2.5-7B"].items() if k != "architectures"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**fields))
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize(
    "family, overrides", [("qwen3", {}), ("qwen3_moe", {}), ("qwen2", {"tie_word_embeddings": True})]
)
def test_total_params_equal_the_hf_model(family, overrides):
    """Independent reference: the parameter count of the real transformers model."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from megatron_dapo.models.tiny import tiny_hf_config

    hf = tiny_hf_config(family, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    n_hf = sum(p.numel() for p in model.parameters())  # tied weights appear once
    assert total_params(shape_from_hf(json.loads(hf.to_json_string()))) == n_hf


# ---------------------------------------------------------------------------------------- training


def test_qwen3_8b_on_4x8x80():
    cfg = _cluster("qwen3_8b.yaml", 4)  # tp=4, dp=4 (16 trainer GPUs), SP, full recompute
    plan = make_plan(cfg, gpu_mem_gib=80)
    (st,) = plan.stages
    # Per GPU: layer = q,o,k,v / 4 + replicated norms + MLP / 4.
    layer = (2 * 4096 * 4096 + 2 * 4096 * 1024) // 4 + (2 * 4096 + 2 * 128) + 3 * 4096 * 12288 // 4
    p_local = 36 * layer + 2 * (151936 // 4) * 4096 + 4096
    assert st.dense_params + st.expert_params == p_local == 2_047_915_008
    assert st.params == 2 * p_local
    assert st.grads == 4 * p_local
    assert st.optimizer == 12 * p_local // 4  # distributed over dp=4
    # Activations: per token per layer 4h/tp (SP) + (2(a+2kv)d + ad)/tp + 3f/tp elements, bf16.
    per_token = 4 * 4096 / 4 + (2 * (32 + 16) * 128 + 32 * 128) / 4 + 3 * 12288 / 4
    assert per_token == 17408
    assert st.activations_no_recompute == int(T * per_token * 2 * 36)
    assert st.activations_full_recompute == st.activations == int(T * (4096 / 4) * 36 * 2 + T * per_token * 2)
    assert st.logits == T * (151936 // 4) * 4
    assert st.total == 24_299_328_512  # 22.63 GiB
    assert fit_errors(plan) == []
    # The distributed optimizer off: the full 12 bytes per parameter on every rank.
    off = make_plan(load_config(CONFIGS / "qwen3_8b.yaml", ["optimizer.use_distributed_optimizer=false"]))
    assert off.stages[0].optimizer == 12 * p_local

    # Rollout: 8 engines x TP 2, each GPU holds half of q, o, MLP and embeddings, 4 of 8 KV heads.
    ro = plan.rollout
    layer_r = 2 * 4096 * 4096 // 2 + 2 * 4096 * 4 * 128 + 2 * 4096 + 2 * 128 + 3 * 4096 * 12288 // 2
    weights = 2 * (36 * layer_r + 2 * (151936 // 2) * 4096 + 4096)
    assert ro.weights == weights
    assert ro.kv_bytes_per_token == 2 * 36 * 4 * 128 * 2
    assert ro.kv_tokens == (int(0.8 * 80 * GiB) - weights) // (2 * 36 * 4 * 128 * 2)
    assert ro.full_sequences == ro.kv_tokens // T


def test_qwen3_8b_on_8x8x80_has_more_data_parallel_ranks():
    plan = make_plan(_cluster("qwen3_8b.yaml", 8), gpu_mem_gib=80)
    (st,) = plan.stages
    assert plan.layout.world_size == 64 - 8 * 2  # 48 trainer ranks -> dp = 48 / 4 = 12
    assert st.optimizer == 12 * 2_047_915_008 // 12
    assert fit_errors(plan) == []


def test_qwen3_30b_a3b_on_4x8x80():
    cfg = _cluster("qwen3_30b_a3b.yaml", 4)  # tp=2 + SP, ep=8, etp=1, dp=8, edp=16/8=2
    plan = make_plan(cfg, gpu_mem_gib=80)
    (st,) = plan.stages
    dense_layer = (2 * 2048 * 4096 + 2 * 2048 * 512) // 2 + 2 * 2048 + 2 * 128 + 2048 * 128
    expert_layer = (128 // 8) * 3 * 2048 * 768
    dense = 48 * dense_layer + 2 * (151936 // 2) * 2048 + 2048
    expert = 48 * expert_layer
    assert (st.dense_params, st.expert_params) == (dense, expert)
    assert st.params == 2 * (dense + expert) and st.grads == 4 * (dense + expert)
    assert st.optimizer == int(12 * dense / 8 + 12 * expert / 2)
    # MoE tokens: top-8 copies of (2h in/out + 3 f_moe), split over tp by sequence parallel.
    per_token = 4 * 2048 / 2 + (2 * (32 + 8) * 128 + 32 * 128) / 2 + 8 * (2 * 2048 + 3 * 768) / 2
    assert per_token == 36864
    assert st.activations == int(T * (2048 / 2) * 48 * 2 + T * per_token * 2)
    assert st.logits == T * (151936 // 2) * 4
    assert st.total == 8_801_644_544 + 17_603_289_088 + 22_908_687_360 + 3_875_536_896 + 6_845_628_416
    assert fit_errors(plan) == []

    # Rollout: 4 engines x TP 4; 4 KV heads -> 1 per GPU; experts split by TP.
    ro = plan.rollout
    layer_r = 2 * 2048 * 4096 // 4 + 2 * 2048 * 1 * 128 + 2 * 2048 + 2 * 128 + 2048 * 128 + 128 * 3 * 2048 * 768 // 4
    assert ro.weights == 2 * (48 * layer_r + 2 * (151936 // 4) * 2048 + 2048)
    assert ro.kv_bytes_per_token == 2 * 48 * 1 * 128 * 2


def test_qwen3_30b_a3b_on_8x8x80():
    plan = make_plan(_cluster("qwen3_30b_a3b.yaml", 8), gpu_mem_gib=80)
    (st,) = plan.stages
    # 48 trainer ranks: dp = 48 / 2 = 24, edp = 48 / (8 * 1) = 6.
    dense = 48 * ((2 * 2048 * 4096 + 2 * 2048 * 512) // 2 + 2 * 2048 + 2 * 128 + 2048 * 128) + 2 * 75968 * 2048 + 2048
    expert = 48 * 16 * 3 * 2048 * 768
    assert st.optimizer == int(12 * dense / 24 + 12 * expert / 6)
    assert fit_errors(plan) == []


def test_pipeline_stages_hold_embedding_first_and_head_last():
    cfg = _cluster("qwen3_8b.yaml", 4, "parallel.pp=2", "parallel.tp=2")  # 16 ranks: tp2 x pp2 x dp4
    first, last = training_memory(cfg, shape_from_hf(BUILTIN_HF_CONFIGS["Qwen3-8B"]))
    layer = (2 * 4096 * 4096 + 2 * 4096 * 1024) // 2 + 2 * 4096 + 2 * 128 + 3 * 4096 * 12288 // 2
    assert first.dense_params == 18 * layer + 75968 * 4096
    assert last.dense_params == 18 * layer + 75968 * 4096 + 4096
    # 1F1B: stage 0 keeps pp=2 micro-batches of activations, the last stage 1 (plus the logits).
    per_token = 4 * 4096 / 2 + (2 * 48 * 128 + 32 * 128) / 2 + 3 * 12288 / 2
    assert first.activations_no_recompute == int(T * per_token * 2 * 18 * 2)
    assert last.activations_no_recompute == int(T * per_token * 2 * 18 * 1)
    assert first.logits == 0 and last.logits == T * 75968 * 4


# ------------------------------------------------------------------------------------------ fitting


def test_not_fitting_names_the_largest_term():
    plan = make_plan(_cluster("qwen3_30b_a3b.yaml", 4, "optimizer.use_distributed_optimizer=false"), gpu_mem_gib=80)
    (err,) = fit_errors(plan)
    # 12 bytes * (dense + expert) = 49.2 GiB of optimizer states: the total exceeds 72 GiB.
    assert "training GPU (pipeline stage 0) needs 83.8 GiB > 72.0 GiB usable" in err
    assert "largest term: optimizer 49.2 GiB" in err and "use_distributed_optimizer" in err

    no_recompute = make_plan(_cluster("qwen3_30b_a3b.yaml", 4, "model.recompute_granularity=none"), gpu_mem_gib=80)
    assert "largest term: activations" in fit_errors(no_recompute)[0]

    rollout = make_plan(
        _cluster(
            "qwen3_30b_a3b.yaml", 4, "rollout.server_tp=1", "rollout.num_servers=16", "rollout.mem_fraction_static=0.6"
        ),
        gpu_mem_gib=80,
    )
    (err,) = fit_errors(rollout)
    assert "rollout GPU: weights 56.9 GiB exceed rollout.mem_fraction_static=0.6 x 80 GiB = 48.0 GiB" in err


# ------------------------------------------------------------------------------------------- layout


def test_layout_groups_and_engine_placement_30b():
    plan = make_plan(_cluster("qwen3_30b_a3b.yaml", 4))
    g = plan.layout.groups
    # megatron-core order tp-cp-ep-dp-pp: TP neighbours, DP strided by tp, EP over 8 consecutive ranks.
    assert g["tp"][:2] == [[0, 1], [2, 3]] and len(g["tp"]) == 8
    assert g["dp"] == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    assert g["ep"] == [list(range(0, 8)), list(range(8, 16))]
    assert g["edp"][0] == [0, 8]
    assert plan.layout.trainer_gpus[15] == (1, 7)
    assert plan.layout.servers == [
        [(2, 0), (2, 1), (2, 2), (2, 3)],
        [(2, 4), (2, 5), (2, 6), (2, 7)],
        [(3, 0), (3, 1), (3, 2), (3, 3)],
        [(3, 4), (3, 5), (3, 6), (3, 7)],
    ]
    text = format_plan(plan)
    assert "server 3: node 3 GPU 4-7" in text and "ep   size   8: [0-7] [8-15]" in text


def test_embedded_servers_go_round_robin_over_the_nodes_and_the_ray_launcher_follows_the_plan():
    from megatron_dapo.apps.launch import planned_nodes

    cfg = load_config(
        CONFIGS / "tiny_qwen3_cpu.yaml", ["trainer.nnodes=2", "trainer.gpus_per_node=1", "rollout.num_servers=3"]
    )
    plan = make_plan(cfg)
    assert plan.layout.trainer_gpus == [(0, 0), (1, 0)] and plan.layout.server_nodes == [0, 1, 0]
    assert "  server 1: node 1" in format_plan(plan) and "  server 2: node 0" in format_plan(plan)
    # the Ray launcher pins the bundles (ranks, then servers) to those nodes when every node carries its label
    assert planned_nodes(cfg, 3, {"0", "1"}) == [0, 1, 0, 1, 0]
    assert planned_nodes(cfg, 3, {"0"}) is None  # node 1 unlabelled (a Ray cluster started by hand): Ray packs
    # SGLang servers: the node of their GPUs
    sglang = make_plan(_cluster("qwen3_30b_a3b.yaml", 4))
    assert sglang.layout.server_nodes == [2, 2, 3, 3]


def test_engine_spanning_nodes_is_an_error():
    from megatron_dapo.config.errors import ConfigError

    cfg = _cluster(
        "qwen3_8b.yaml", 2, "parallel.tp=2", "trainer.world_size=6", "rollout.num_servers=1", "rollout.server_tp=4"
    )
    with pytest.raises(ConfigError, match="rollout server 0 .rollout.server_tp=4. would span nodes 0 and 1"):
        make_plan(cfg)
    with pytest.raises(ConfigError, match="trainer.world_size=16 plus 4 SGLang GPUs"):
        load_config(
            CONFIGS / "qwen3_8b.yaml",
            ["trainer.nnodes=2", "trainer.world_size=16", "rollout.num_servers=1", "rollout.server_tp=4"],
        )


def test_engine_larger_than_a_node_is_a_config_error():
    from megatron_dapo.config.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.server_tp=16 exceeds trainer.gpus_per_node=8"):
        _cluster("qwen3_8b.yaml", 4, "rollout.server_tp=16", "rollout.num_servers=1")


def test_cli(capsys):
    assert main([str(CONFIGS / "qwen3_8b.yaml"), "--nodes", "4", "--gpus-per-node", "8", "--gpu-mem-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out and "server 7: node 3 GPU 6,7" in out and "22.63" in out
    # Too small a GPU: exit 1 with the failing term; a config error: exit 2 naming the key.
    assert main([str(CONFIGS / "qwen3_8b.yaml"), "--nodes", "4", "--gpus-per-node", "8", "--gpu-mem-gib", "24"]) == 1
    assert "does not fit: training GPU" in capsys.readouterr().err
    assert main([str(CONFIGS / "qwen3_8b.yaml"), "parallel.tp=3", "--nodes", "4", "--gpus-per-node", "8"]) == 2
    assert "parallel.tp=3 does not divide num_attention_heads=32" in capsys.readouterr().err
    # The cluster shape is validated: 1 node of 8 GPUs leaves no trainer GPU after 8 x TP 2 engines.
    assert main([str(CONFIGS / "qwen3_8b.yaml"), "--nodes", "1", "--gpus-per-node", "8"]) == 2
    assert "trainer world size is -8" in capsys.readouterr().err


def test_weight_store_of_per_server_sync_is_reported():
    """greedy / status_based keep two bf16 copies of the HF weights on trainer rank 0; all_at_once none."""
    from megatron_dapo.planner.memory import weight_store_bytes

    cfg = _cluster("qwen3_8b.yaml", 4, "rollout.sync.policy=greedy")
    plan = make_plan(cfg, gpu_mem_gib=80)
    # Qwen3-8B: untied embeddings and head, 36 layers, qk-norm (counted by hand in the test above)
    want = 2 * 2 * 8_190_735_360
    assert weight_store_bytes(cfg, plan.shape) == want == 2 * 2 * total_params(plan.shape)
    assert f"weight store (rollout.sync.policy=greedy): {want / GiB:.2f} GiB" in format_plan(plan)
    assert "weight store" not in format_plan(make_plan(_cluster("qwen3_8b.yaml", 4), gpu_mem_gib=80))


# ------------------------------------------------------------------------------------- step time


def test_step_estimate_matches_a_flop_count_of_the_hf_model():
    """The estimate's forward FLOPs per token against torch's FLOP counter over a real (tiny) HF Qwen3
    forward: every matmul counted, attention over the whole L x L square (the estimate charges the causal
    half), norms not at all (the estimate counts them as 2 FLOPs per parameter: < 1 % here)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_dapo.planner.speed import trainer_speed

    hf = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    )
    model = Qwen3ForCausalLM(Qwen3Config(**hf, attn_implementation="eager")).eval()
    L = 384
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 512, (1, L)))
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = counts.get("aten.bmm", 0)  # QK^T and AV: 2 * 2 * L^2 * head_dim per head and layer
    assert attention == 3 * 4 * 2 * 2 * L * L * 16
    counted_causal = counter.get_total_flops() - attention / 2

    cfg = load_config(CONFIGS / "tiny_qwen3_cpu.yaml", ["model.recompute_granularity=none"])
    speed = trainer_speed(
        cfg, shape_from_hf({**hf, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}), mean_seq_tokens=L
    )
    forward_per_token = speed.flops_per_token / 4  # old logprobs, forward, backward (2): 4 forwards' worth
    assert forward_per_token * L == pytest.approx(counted_causal, rel=0.01)


def test_plan_prints_the_step_time_the_simulator_trains_at(capsys):
    import argparse

    from megatron_dapo.sim.cli import build_world

    assert (
        main(
            [
                str(CONFIGS / "qwen3_8b.yaml"),
                "--nodes",
                "4",
                "--gpus-per-node",
                "8",
                "rollout.n_resp_per_prompt=16",
                "--response-len",
                "6000",
                "--mfu",
                "0.4",
            ]
        )
        == 0
    )
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("trainer step (estimate)"))
    cfg = _cluster("qwen3_8b.yaml", 4, "rollout.n_resp_per_prompt=16")
    plan = make_plan(cfg, response_tokens=6000, mfu=0.4)
    tokens = 512 * 16 * (256 + 6000)
    assert plan.step.tokens(cfg) == tokens and f"= {tokens / 1e6:.2f} M tokens" in line
    assert f"-> {plan.step.speed.step_s(tokens):.0f} s on 16 GPUs at 40% of 989 TFLOP/s" in line

    # the simulator's trainer, on sequences of the same mean length, takes the same time per token
    args = argparse.Namespace(
        lengths="dapo",
        seed=0,
        cost_model=None,
        step_time=None,
        prompt_len=256,
        gpu_tflops=989.0,
        mfu=0.4,
        token_unit=0,
        gpu_mem_gib=80.0,
        max_running=1024,
        sync_s=5.0,
        keep_prob=0.5,
        steps=1,
        warmup_steps=0,
        engine_admission="sglang",
        length_mean=None,
        cap_share=None,
        trainer_gpu=None,
        link_gb_s=None,
        engine_speed=None,
        engine_kv=None,
        slowdown=[],
        random_slowdowns=None,
    )
    _, sim_speed = build_world(cfg, args)
    default = make_plan(cfg, mfu=0.4)  # the default response length: the simulator's DAPO-like mean
    assert sim_speed == default.step.speed
    assert sim_speed.step_s(1e6) == pytest.approx(default.step.speed.step_s(1e6))


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--mfu", "0", "--mfu=0.0 must be in (0, 1]"),
        ("--mfu", "1.5", "--mfu=1.5 must be in (0, 1]"),
        ("--gpu-tflops", "-1", "--gpu-tflops=-1.0 must be > 0"),
        ("--response-len", "-100", "--response-len=-100.0 must be >= 0"),
        ("--prompt-len", "nan", "--prompt-len=nan must be >= 0"),
    ],
)
def test_plan_refuses_step_time_options_that_make_no_sense(capsys, flag, value, message):
    assert main([str(CONFIGS / "qwen3_8b.yaml"), "--nodes", "4", "--gpus-per-node", "8", flag, value]) == 2
    assert f"plan error: {message}" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- refit per step

LAYER_8B = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 4096 + 2 * 128 + 3 * 4096 * 12288
EMBED_8B = 151936 * 4096


def test_refit_of_qwen3_30b_a3b_by_sync_source():
    # tp=2, ep=8, pp=1, bf16; trainer on nodes 0-1, engines on nodes 2-3: 400G InfiniBand, 50 GB/s.
    plan = make_plan(_cluster("qwen3_30b_a3b.yaml", 4))
    dense = 48 * (2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 2048 + 2 * 128 + 2048 * 128) + 2 * 151936 * 2048 + 2048
    expert = 48 * 128 * 3 * 2048 * 768
    model = 2 * (dense + expert)
    assert model == 2 * 30_532_122_624
    # rank0 path: rank 0 rebuilds the dense tensors + EP rank 0's 16 experts, EP ranks 1-7 hop theirs in
    share0, share_ep = 2 * (dense + expert // 8), 2 * expert // 8
    r = plan.refit
    assert r.link_gbps == 400 and "inter-node" in plan.refit_link
    assert r.rank0_bytes == model + (model - share0) == 111_798_546_432
    # per_stage: 8 sources (EP ranks), each its 16 experts plus some of the dense tensors spread over them:
    # the busiest at most one embedding (the largest dense tensor) above the mean
    assert len(r.source_bytes) == 8 and sum(r.source_bytes) == model
    assert all(b >= share_ep for b in r.source_bytes)
    assert model / 8 <= r.per_stage_busiest_bytes <= model / 8 + 2 * 151936 * 2048 < share0
    assert r.rank0_s == pytest.approx(111_798_546_432 * 8 / 400e9)  # 2.24 s
    assert r.per_stage_s == pytest.approx(model * 8 / 400e9)  # 1.22 s: the model once on the wire


def test_refit_of_qwen3_8b_by_sync_source():
    # pp=1, ep=1: rank 0 is the only source, both paths move the model once.
    r = make_plan(_cluster("qwen3_8b.yaml", 4)).refit
    model = 2 * (36 * LAYER_8B + 2 * EMBED_8B + 4096)
    assert r.source_bytes == [model] and model == 16_381_470_720
    assert r.rank0_bytes == r.per_stage_busiest_bytes == model
    assert r.rank0_s == r.per_stage_s == pytest.approx(model * 8 / 400e9)  # 0.33 s

    # pp=2: stage 0 holds 18 layers + the embedding, stage 1 18 layers + final norm + LM head.
    r = make_plan(_cluster("qwen3_8b.yaml", 4, "parallel.pp=2", "parallel.tp=2")).refit
    stage0, stage1 = 2 * (18 * LAYER_8B + EMBED_8B), 2 * (18 * LAYER_8B + 4096 + EMBED_8B)
    assert r.source_bytes == [stage0, stage1]
    assert r.rank0_bytes == 2 * model - stage0 == model + stage1
    assert r.per_stage_busiest_bytes == stage1


def test_refit_link_is_nvlink_inside_one_node_and_can_be_set(capsys):
    one_node = _cluster("qwen3_8b.yaml", 1, "trainer.world_size=4", "rollout.num_servers=2", "rollout.server_tp=2")
    plan = make_plan(one_node)
    assert plan.refit.link_gbps == 3600 and "intra-node: NVLink" in plan.refit_link
    assert plan.refit.rank0_s == pytest.approx(2 * (36 * LAYER_8B + 2 * EMBED_8B + 4096) * 8 / 3600e9)

    args = [str(CONFIGS / "qwen3_30b_a3b.yaml"), "--nodes", "4", "--gpus-per-node", "8", "--link-gbps", "800"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "inter-node, --link-gbps 800" in out
    assert f"-> {111_798_546_432 * 8 / 800e9:.2f} s" in out  # rank0
    assert f"-> {2 * 30_532_122_624 * 8 / 800e9:.2f} s <- rollout.sync.sources" in out  # auto -> per_stage
    assert main([*args[:-1], "0"]) == 2
    assert "--link-gbps=0.0 must be > 0" in capsys.readouterr().err


def test_plan_prints_the_routing_replay_bytes_per_step():
    from megatron_dapo.planner.plan import format_plan

    plan = make_plan(_cluster("qwen3_30b_a3b.yaml", 4), gpu_mem_gib=80)
    tokens = plan.step.tokens(plan.cfg)
    # Qwen3-30B-A3B: 48 MoE layers x top-8 ids of 128 experts, one byte each
    line = next(x for x in format_plan(plan).splitlines() if x.startswith("routing replay"))
    assert "48 MoE layers x top 8 x 1 B (uint8)" in line
    assert f"= {tokens * 48 * 8 / 2**20:.1f} MiB per step" in line
    off = make_plan(_cluster("qwen3_30b_a3b.yaml", 4, "algo.routing_replay=none"), gpu_mem_gib=80)
    assert "routing replay" not in format_plan(off)


def test_spread_by_bytes_keeps_candidates_and_stays_within_one_item_of_the_mean():
    from megatron_dapo.planner.spread import spread_by_bytes

    sizes = {f"t{i}": s for i, s in enumerate([70, 5, 40, 40, 12, 33, 8, 8, 61, 2])}
    base = {0: 100, 1: 0, 2: 30}  # what each rank carries already (its experts)
    candidates = {k: [0, 1, 2] for k in sizes} | {"t0": [1, 2]}
    chosen = spread_by_bytes(sizes, candidates, base)
    assert chosen == spread_by_bytes(dict(sizes), candidates, dict(base))  # the same on every rank
    assert all(chosen[k] in candidates[k] for k in sizes)
    load = dict(base)
    for k, r in chosen.items():
        load[r] += sizes[k]
    assert sum(load.values()) == sum(sizes.values()) + sum(base.values())
    assert max(load.values()) <= sum(load.values()) / 3 + max(sizes.values())
    with pytest.raises(ValueError, match="no candidate rank for 'x'"):
        spread_by_bytes({"x": 1}, {"x": []}, {})

"""`plan` / `simulate` with trainer.placement=colocated and optimizer.cpu_offload: per-GPU memory by phase,
offload traffic and CPU optimizer time against hand computations from the HF config fields (as
tests/planner/test_plan.py does for the split placement)."""

from __future__ import annotations

import math

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.planner.colocation import CPU_ADAM_PARAMS_S, PCIE_GB_S, optimizer_steps_per_step
from megatron_dapo.planner.plan import fit_errors, format_plan, make_plan
from tests.planner.test_plan import CONFIGS, GiB

MiB = 2**20

# Qwen3-30B-A3B at TP=2, EP=8, ETP=1 (1 node x 8 GPUs, DP=4, expert DP=1), one GPU's parameters:
#   per layer, dense: q,k,v,o / tp + 2 norms + q/k-norm + router; experts: 128 / 8 experts of 3*2048*768
LAYER_DENSE_30B = (2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048) // 2 + 2 * 2048 + 2 * 128 + 2048 * 128
LAYER_EXPERT_30B = 16 * 3 * 2048 * 768
DENSE_30B = 48 * LAYER_DENSE_30B + 2 * math.ceil(151936 / 2) * 2048 + 2048  # + embedding, LM head, final norm
EXPERT_30B = 48 * LAYER_EXPERT_30B
# the server's share at TP 4 (SGLang: 1 of 4 KV heads per GPU, router replicated), bf16
SERVER_30B = 2 * (
    48 * (2 * 2048 * 4096 // 4 + 2 * 2048 * 1 * 128 + 2 * 2048 + 2 * 128 + 2048 * 128 + 128 * 3 * 2048 * 768 // 4)
    + 2 * math.ceil(151936 / 4) * 2048
    + 2048
)


def test_qwen3_30b_a3b_colocated_on_one_node_with_cpu_adam():
    plan = make_plan(load_config(CONFIGS / "qwen3_30b_a3b_colocated.yaml", []))
    co, st = plan.colocated, plan.stages[0]
    n = DENSE_30B + EXPERT_30B
    assert (st.dense_params, st.expert_params) == (DENSE_30B, EXPERT_30B)
    adam = 12 * DENSE_30B / 4 + 12 * EXPERT_30B / 1  # distributed optimizer: / (dp * cp), experts / expert dp
    assert st.optimizer == 0 and st.optimizer_cpu == int(adam * 16 / 12)  # all on the CPU, + fp32 grads
    assert st.optimizer_cpu / GiB == pytest.approx(56.9, abs=0.05)
    assert co.rollout_weights == SERVER_30B and co.rollout == int(0.8 * 80 * GiB)  # weights + KV = the budget
    assert co.training == st.total == 2 * n + 4 * n + st.activations + st.logits
    assert co.update == 2 * n + SERVER_30B + 512 * MiB
    assert co.host == 2 * n + int(adam * 16 / 12)
    assert co.offload_bytes == co.reload_bytes == 2 * n  # bf16 params; no optimizer on the GPU; grads freed
    assert co.transfer_s == pytest.approx(2 * 2 * n / (PCIE_GB_S * 1e9))
    params_on_cpu = int(adam * 16 / 12) // 16
    assert co.cpu_optimizer_params == params_on_cpu
    assert co.cpu_optimizer_s == pytest.approx(8 * params_on_cpu / 25e9 + params_on_cpu / CPU_ADAM_PARAMS_S)
    assert CPU_ADAM_PARAMS_S == pytest.approx(614e9 / 8 / 28)  # host memory bandwidth bound, not the cores
    assert optimizer_steps_per_step(plan.cfg) == 512 // 32
    assert co.peak <= plan.usable_bytes and fit_errors(plan) == []
    text = format_plan(plan)
    assert "colocated GPU by phase" in text and "DOES NOT FIT" not in text and "PCIe at 25 GB/s" in text
    assert [s for s in plan.layout.servers] == [[(0, g) for g in range(4)], [(0, g) for g in range(4, 8)]]


def test_without_cpu_adam_the_30b_colocated_training_phase_does_not_fit():
    plan = make_plan(load_config(CONFIGS / "qwen3_30b_a3b_colocated.yaml", ["optimizer.cpu_offload=false"]))
    (err,) = fit_errors(plan)
    assert "largest term: optimizer" in err and "optimizer.cpu_offload=true" in err


# Qwen3-8B at TP=4 (1 node x 8 GPUs, DP=2), one GPU's parameters; the server's share at TP 2 (4 KV heads each)
N_8B = 36 * ((2 * 4096 * 4096 + 2 * 4096 * 1024) // 4 + 2 * 4096 + 2 * 128 + 3 * 4096 * 12288 // 4)
N_8B += 2 * math.ceil(151936 / 4) * 4096 + 4096
SERVER_8B = 2 * (
    36 * (2 * 4096 * 4096 // 2 + 2 * 4096 * 4 * 128 + 2 * 4096 + 2 * 128 + 3 * 4096 * 12288 // 2)
    + 2 * math.ceil(151936 / 2) * 4096
    + 4096
)


def test_qwen3_8b_colocated_on_one_node():
    plan = make_plan(load_config(CONFIGS / "qwen3_8b_colocated.yaml", []))
    co, st = plan.colocated, plan.stages[0]
    assert st.dense_params == N_8B and st.optimizer == 12 * N_8B // 2 and st.optimizer_cpu == 0
    assert co.rollout_weights == SERVER_8B
    assert co.update == 2 * N_8B + SERVER_8B + 512 * MiB
    assert co.offload_bytes == co.reload_bytes == 2 * N_8B + 12 * N_8B // 2  # params + Adam's GPU state
    assert co.host == co.offload_bytes and co.cpu_optimizer_params == 0
    assert fit_errors(plan) == []
    with_cpu_adam = make_plan(load_config(CONFIGS / "qwen3_8b_colocated.yaml", ["optimizer.cpu_offload=true"]))
    assert with_cpu_adam.colocated.offload_bytes == 2 * N_8B and fit_errors(with_cpu_adam) == []


def test_the_weight_update_phase_is_checked():
    plan = make_plan(load_config(CONFIGS / "qwen3_8b_colocated.yaml", ["rollout.sync.bucket_mb=65536"]))
    errors = fit_errors(plan)
    assert any("during the weight update" in e and "rollout.sync.bucket_mb" in e for e in errors), errors


def test_cli_plans_the_issues_one_node_command(capsys):
    from megatron_dapo.apps.plan import main

    overrides = ["trainer.placement=colocated", "optimizer.cpu_offload=true", "algo.staleness=0"]
    overrides += ["rollout.sync.pause_mode=abort", "rollout.num_servers=2"]
    argv = [str(CONFIGS / "qwen3_30b_a3b.yaml"), "--nodes", "1", "--gpus-per-node", "8", *overrides]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out and "CPU optimizer" in out and "colocated step, trainer side" in out


def test_simulate_colocated_is_synchronous_with_the_cycle_on_the_trainer():
    from megatron_dapo.sim.cli import modes_of, trainer_overhead_s

    cfg = load_config(CONFIGS / "qwen3_30b_a3b_colocated.yaml", [])
    assert modes_of(cfg, None) == ["sync"]
    with pytest.raises(ValueError, match="colocated runs synchronously"):
        modes_of(cfg, "sync,async")
    co = make_plan(cfg).colocated
    assert trainer_overhead_s(cfg, 80.0) == pytest.approx(co.transfer_s + 16 * co.cpu_optimizer_s)
    split = load_config(CONFIGS / "qwen3_8b.yaml", [])
    assert modes_of(split, None) == ["sync", "async", "advanced"] and trainer_overhead_s(split, 80.0) == 0.0

"""The end-to-end refit cost (planner.refit_cost): bytes and tensors of bf16 vs fp8_block from the Qwen3 shapes
counted by hand, the terms it adds to the wire, and what `plan` prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.apps.plan import main
from megatron_dapo.config import load_config
from megatron_dapo.planner import refit_cost as rc
from megatron_dapo.planner.plan import make_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "qwen3"


def _plan(name: str, *overrides: str):
    return make_plan(load_config(CONFIGS / name, ["trainer.nnodes=4", "trainer.gpus_per_node=8", *overrides]))


def test_qwen3_8b_bytes_and_tensors_by_hand():
    plan = _plan("qwen3_8b.yaml")
    bf16, fp8 = (rc.tensor_counts(plan.shape, f, "bf16") for f in ("bf16", "fp8_block"))
    # per layer: q, o 4096x4096; k, v 1024x4096; gate, up 12288x4096; down 4096x12288
    linear = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 12288 * 4096
    scales = 2 * 32 * 32 + 2 * 8 * 32 + 3 * 96 * 32  # one per 128 x 128 block
    other = 2 * 4096 + 2 * 128  # norms, q/k norms
    embed = 151936 * 4096
    assert bf16.nbytes == 2 * (36 * (linear + other) + 2 * embed + 4096) == 16_381_470_720
    assert fp8.nbytes == 36 * (linear + 4 * scales + 2 * other) + 2 * (2 * embed + 4096)
    assert fp8.quantized_params == 36 * linear and bf16.quantized_params == 0
    # tensors: 7 linears + 4 norms per layer, embedding, final norm, lm_head; fp8 adds a scale per linear
    assert bf16.tensors == 36 * 11 + 3 == 399 and fp8.tensors == 399 + 36 * 7
    assert 0.57 < fp8.nbytes / bf16.nbytes < 0.58  # the embedding and lm_head stay bf16


def test_qwen3_30b_a3b_expert_tensors_and_the_published_range():
    plan = _plan("qwen3_30b_a3b.yaml")
    bf16, fp8 = (rc.refit_cost(plan.cfg, plan.shape, plan.refit, f) for f in ("bf16", "fp8_block"))
    assert bf16.counts.expert_tensors == 48 * 128 * 3 == 18_432 and fp8.counts.expert_tensors == 2 * 18_432
    assert bf16.counts.nbytes == 2 * 30_532_122_624
    # every term is there, the wire (per_stage here) halves with the bytes, the buckets too
    assert bf16.wire_s == pytest.approx(plan.refit.per_stage_s)
    assert fp8.wire_s == pytest.approx(bf16.wire_s * fp8.counts.nbytes / bf16.counts.nbytes)
    assert bf16.buckets == -(-bf16.counts.nbytes // (512 * 2**20)) and fp8.buckets < bf16.buckets
    assert bf16.calls_s == pytest.approx((bf16.buckets + 4) * rc.BUCKET_CALL_S)
    lo, hi = bf16.load_s
    assert hi - lo == pytest.approx(bf16.counts.tensors * (rc.LOAD_PER_TENSOR_S[1] - rc.LOAD_PER_TENSOR_S[0]))
    # the total spans the published figures the issue quotes (4.4 s with checkpoint-engine ... ~55-60 s)
    assert bf16.total_s[0] < 4.4 and bf16.total_s[1] > 55
    assert fp8.quantize_s > 0 and bf16.quantize_s == 0


def test_tp_gathers_are_counted():
    tp1 = _plan("qwen3_8b.yaml", "parallel.tp=1", "parallel.pp=1")
    tp4 = _plan("qwen3_8b.yaml", "parallel.tp=4")
    c1, c4 = (rc.refit_cost(p.cfg, p.shape, p.refit, "bf16") for p in (tp1, tp4))
    assert c1.gather_calls == 0 and c1.gather_bytes == 0
    assert c4.gather_calls == 36 * 4 + 2  # qkv, proj, fc1, fc2 per layer; embedding and output layer
    linear = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 12288 * 4096
    assert c4.gather_bytes == 2 * ((36 * linear + 2 * 151936 * 4096) * 3 // 4)


def test_plan_prints_both_formats_and_its_assumptions(capsys):
    assert main([str(CONFIGS / "qwen3_30b_a3b.yaml"), "--nodes", "4", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "refit cost per sync, end to end" in out and "fp8_block" in out
    assert "18,867 (18,432 expert)" in out and "37,491 (36,864 expert)" in out
    assert "assumptions:" in out and "verl #6974" in out

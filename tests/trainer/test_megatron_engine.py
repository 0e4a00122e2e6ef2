"""The Megatron actor under torchrun on gloo, against Hugging Face models of the same weights
(numbers asserted in tests/workers/actor_checks.py)."""

from __future__ import annotations

import pytest

LOGPROB_CHECKS = [
    "logprobs_tp2",
    "logprobs_pp2",
    "moe_ep2",
    "moe_replay_pp2",
    "moe_replay_sp",
    "moe_replay_vpp",
    "variants_moe",
]
UPDATE_CHECKS = ["train_dp2", "shards", "warmup", "sum_norm", "variants"]


@pytest.mark.slow
@pytest.mark.torchrun_checks(2, [f"actor_checks:{c}" for c in LOGPROB_CHECKS], timeout=300)
def test_actor_logprobs_match_hf_at_tp2_pp2_and_moe_ep2(torchrun_checks):
    """Packed and unpacked logprobs equal HF's (dense TP=2, PP=2; Qwen3-MoE EP=2, whose DP=2 update
    is also checked against one process); routing replay's update equals HF forced to the same routing
    under EP=2, PP=2, TP=2 + sequence parallel + EP=2, and PP=2 x VPP=2, with full recompute; so do GSPO
    (TP=2 + SP + EP=2, fused LM head) and CISPO + IcePop (EP=2) with replay."""
    torchrun_checks()


@pytest.mark.slow
@pytest.mark.torchrun_checks(2, [f"actor_checks:{c}" for c in UPDATE_CHECKS], timeout=300)
def test_actor_dp2_update_is_exact_skips_nonfinite_and_resumes(torchrun_checks):
    """...in token-mean and (sum_norm) seq-mean-token-sum-norm, whose divisor must not be the padded width;
    a step fed DP shards (shards) equals the whole batch's bit for bit."""
    torchrun_checks()

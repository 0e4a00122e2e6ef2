"""The Megatron actor under torchrun on gloo, against Hugging Face models of the same weights
(numbers asserted in tests/workers/actor_checks.py)."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_torchrun


@pytest.mark.slow
def test_actor_logprobs_match_hf_at_tp2_pp2_and_moe_ep2(tmp_path):
    """Packed and unpacked logprobs equal HF's (dense TP=2, PP=2; Qwen3-MoE EP=2, whose DP=2 update
    is also checked against one process); routing replay's update equals HF forced to the same routing
    under EP=2, PP=2, TP=2 + sequence parallel + EP=2, and PP=2 x VPP=2, with full recompute."""
    checks = ["logprobs_tp2", "logprobs_pp2", "moe_ep2", "moe_replay_pp2", "moe_replay_sp", "moe_replay_vpp"]
    out = run_torchrun("actor_checks.py", 2, ",".join(checks), str(tmp_path), timeout=300)
    for check in checks:
        assert f"CHECK PASSED {check}" in out, out[-4000:]


@pytest.mark.slow
def test_actor_dp2_update_is_exact_skips_nonfinite_and_resumes(tmp_path):
    """...in token-mean and (sum_norm) seq-mean-token-sum-norm, whose divisor must not be the padded width;
    a step fed DP shards (shards) equals the whole batch's bit for bit."""
    checks = ["train_dp2", "shards", "warmup", "sum_norm"]
    out = run_torchrun("actor_checks.py", 2, ",".join(checks), str(tmp_path), timeout=300)
    for check in checks:
        assert f"CHECK PASSED {check}" in out, out[-4000:]

"""The Megatron actor under torchrun on gloo, against Hugging Face models of the same weights
(numbers asserted in tests/workers/actor_checks.py)."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_torchrun


@pytest.mark.slow
def test_actor_logprobs_match_hf_at_tp2_and_pp2_packed_and_unpacked(tmp_path):
    out = run_torchrun("actor_checks.py", 2, "logprobs_tp2,logprobs_pp2", str(tmp_path), timeout=240)
    assert "CHECK PASSED logprobs_tp2" in out and "CHECK PASSED logprobs_pp2" in out, out[-4000:]


@pytest.mark.slow
def test_actor_dp2_update_is_exact_skips_nonfinite_and_resumes(tmp_path):
    out = run_torchrun("actor_checks.py", 2, "train_dp2,warmup", str(tmp_path), timeout=240)
    assert "CHECK PASSED train_dp2" in out and "CHECK PASSED warmup" in out, out[-4000:]

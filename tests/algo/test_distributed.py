"""Multi-process checks of the DAPO core over real gloo groups (worker: tests/workers/algo_dist.py):
TP=2 vocab-parallel logprobs / entropy / grads equal the unsharded result, and 2 DP ranks x 3
uneven micro-batches give the one-big-batch gradient (torch and Triton-interpreted backends)."""

import pytest

from tests.dist_utils import run_torchrun


@pytest.mark.slow
def test_tp2_logprobs_and_dp2_token_mean_exactness():
    out = run_torchrun("algo_dist.py", 2, timeout=240, env={"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"})
    assert out.count("ALGO DIST OK") == 2, out[-4000:]
    assert out.count("TP=2 triton") == 2 and out.count("DP=2 x 3 micro-batches triton") == 6, out[-4000:]

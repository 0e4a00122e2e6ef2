"""FP8 rollout end to end on the tiny MoE CPU config (EP=2 trainer, embedded server, routing replay on): every
sync sends the FP8 block layout and the servers then run FP8-rounded expert weights, with the default rollout
correction (token_tis) on. SGLang's own MoE FP8 loaders are judged in tests/bridge/test_fp8.py."""

from __future__ import annotations

import glob

import pytest
import torch


@pytest.mark.slow
def test_tiny_moe_trains_with_fp8_block_rollout_and_the_servers_run_the_rounded_weights(tmp_path):
    """Staleness 0, so every sample of step s >= 1 comes from the weights synced after step s - 1:
    - each sync carries exactly the FP8 layout of the model (bytes of `bridge.fp8.quantize_stream` over the HF
      checkpoint: experts, attention and dense MLP as float8 + float32 block scales, the rest fp32);
    - after each sync the servers' logprobs differ from the trainer's by FP8 rounding (k3 at lag 0 > 1e-5 on every
      step), where the same run with bf16 rollout equals the trainer to fp32 rounding (< 1e-9; its sync verify
      checks the servers' logprobs after every sync);
    - the token-TIS weights are on (their mean moves off 1), and every logged scalar of every step is finite."""
    from safetensors.torch import load_file

    from benchmarks.fp8_moe_rollout import all_finite, train
    from benchmarks.routing_replay import prepare
    from megatron_dapo.bridge import fp8

    model, train_file = prepare(tmp_path)
    fp8_rows, _ = train(model, train_file, tmp_path / "fp8", "fp8_block", seed=0, steps=3)
    bf16_rows, _ = train(model, train_file, tmp_path / "bf16", "bf16", seed=0, steps=2)

    hf = {n: t for f in glob.glob(str(model / "*.safetensors")) for n, t in load_file(f).items()}
    assert {t.dtype for t in hf.values()} == {torch.float32}  # the tiny config trains and exports in fp32
    fp8_bytes = sum(t.nbytes for _, t in fp8.quantize_stream(hf.items()))
    assert fp8_bytes < 0.5 * sum(t.nbytes for t in hf.values())

    assert len(fp8_rows) == 3 and len(bf16_rows) == 2
    for r in fp8_rows:
        assert r["sync/bytes"] == fp8_bytes, r["step"]
        assert r["actor/mismatch_k3_lag0"] > 1e-5, r["step"]
        assert r["actor/rollout_corr_weight_mean"] != 1.0
    for r in bf16_rows:
        assert r["sync/bytes"] == sum(t.nbytes for t in hf.values())
        assert r["actor/mismatch_k3_lag0"] < 1e-9, r["step"]
        assert "sync/verify_max_abs_diff" in r
    assert all_finite(fp8_rows) and all_finite(bf16_rows)

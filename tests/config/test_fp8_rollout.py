"""rollout.weight_format: bf16 by default; fp8_block needs a rollout correction, no exact sync check, and (for
SGLang servers) a model whose FP8 block linears SGLang can build."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.config import ConfigError, DapoConfig, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "qwen3"
TINY = CONFIGS / "tiny_qwen3_cpu.yaml"
FP8 = ["rollout.weight_format=fp8_block", "rollout.sync.verify=false"]


def test_default_is_bf16_and_fp8_block_loads():
    assert DapoConfig().rollout.weight_format == "bf16"
    cfg = load_config(TINY, FP8)
    assert cfg.rollout.weight_format == "fp8_block"
    assert cfg.algo.rollout_correction.mode == "token_tis"  # the correction stays on by default
    # SGLang can build Qwen3-8B's FP8 linears at server TP 2 (the config's)
    assert load_config(CONFIGS / "qwen3_8b.yaml", ["rollout.weight_format=fp8_block"]).rollout.weight_format


def test_unknown_format_is_refused_by_name():
    with pytest.raises(ConfigError, match="rollout.weight_format"):
        load_config(TINY, ["rollout.weight_format=fp8"])


def test_fp8_block_refuses_no_correction_by_name():
    with pytest.raises(ConfigError, match=r"rollout.weight_format=fp8_block with algo.rollout_correction.mode=none"):
        load_config(TINY, [*FP8, "algo.rollout_correction.mode=none"])
    load_config(TINY, [*FP8, "algo.rollout_correction.mode=icepop", "algo.rollout_correction.lower=0.5"])


def test_fp8_block_refuses_the_exact_sync_check():
    with pytest.raises(ConfigError, match=r"rollout.sync.verify=true with rollout.weight_format=fp8_block"):
        load_config(TINY, ["rollout.weight_format=fp8_block", "rollout.sync.verify=true"])


def test_fp8_block_over_the_ipc_transport_is_accepted_under_the_ipc_checks():
    """Colocated placement's transport carries the FP8 block stream (tests/sync/test_sglang_peer.py,
    tests/embedded_server/test_fp8_serving.py, tests/trainer/test_loop_colocated.py); its own checks still apply."""
    cfg = load_config(TINY, [*FP8, "rollout.sync.transport=ipc"])
    assert (cfg.rollout.weight_format, cfg.rollout.sync.transport) == ("fp8_block", "ipc")
    with pytest.raises(ConfigError, match=r"rollout.sync.transport=ipc needs rollout.sync.policy=all_at_once"):
        load_config(TINY, [*FP8, "rollout.sync.transport=ipc", "rollout.sync.policy=greedy"])


def test_sglang_needs_whole_128_blocks_per_merged_part_and_tp_rank():
    # the tiny model (hidden 64, kv 2 x 16): fine for the embedded server, which dequantizes partial blocks
    with pytest.raises(ConfigError, match=r"multiple of 128.*k / v \(num_key_value_heads \* head_dim\) per server"):
        load_config(TINY, [*FP8, "rollout.engine=sglang"])
    # Qwen3-30B-A3B: moe intermediate 768 = 6 blocks; at server TP 4 (the config's) an expert's rank holds 192,
    # not whole blocks (SGLang's Fp8MoEMethod raises at start); with --ep-size 4 experts are not TP-split
    moe = CONFIGS / "qwen3_30b_a3b.yaml"
    with pytest.raises(ConfigError, match=r"gate / up \(intermediate size\) per server TP rank = 192"):
        load_config(moe, ["rollout.weight_format=fp8_block"])
    cfg = load_config(moe, ["rollout.weight_format=fp8_block", "rollout.extra_args=[--ep-size, '4']"])
    assert cfg.rollout.extra_args == ["--ep-size", "4"]

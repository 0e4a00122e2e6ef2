"""The FSDP2 actor (trainer.backend: fsdp2) at 2 gloo ranks against a one-process Hugging Face
reference: logprobs, exported weights, gradients, the AdamW update, the non-finite skip and a DCP
checkpoint round trip (numbers asserted in tests/workers/fsdp_checks.py)."""

from __future__ import annotations

import pytest

from megatron_dapo.config.load import load_config


@pytest.mark.slow
@pytest.mark.torchrun_checks(2, [f"fsdp_checks:{c}" for c in ("logprobs", "export", "train", "moe")], timeout=300)
def test_fsdp_actor_matches_one_process_hf_reference(torchrun_checks):
    torchrun_checks()


def test_qwen25_3b_fsdp_config_selects_the_fsdp2_backend():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "qwen3" / "qwen2.5_3b_fsdp.yaml")
    assert cfg.trainer.backend == "fsdp2"
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.ep) == (1, 1, 1, 1)

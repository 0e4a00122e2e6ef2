"""The FSDP2 actor (trainer.backend: fsdp2) at 2 gloo ranks against a one-process Hugging Face
reference: logprobs, exported weights, gradients, the AdamW update, the non-finite skip and a DCP
checkpoint round trip (numbers asserted in tests/workers/fsdp_checks.py)."""

from __future__ import annotations

import pytest

from megatron_dapo.config.load import load_config
from tests.dist_utils import run_torchrun


@pytest.mark.slow
def test_fsdp_actor_matches_one_process_hf_reference(tmp_path):
    out = run_torchrun("fsdp_checks.py", 2, str(tmp_path), timeout=300)
    for check in ("logprobs", "export", "train", "moe"):
        assert f"CHECK PASSED {check}" in out, out[-4000:]


def test_qwen25_3b_fsdp_config_selects_the_fsdp2_backend():
    from pathlib import Path

    cfg = load_config(Path(__file__).parent.parent / "configs" / "qwen3" / "qwen2.5_3b_fsdp.yaml")
    assert cfg.trainer.backend == "fsdp2"
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.ep) == (1, 1, 1, 1)

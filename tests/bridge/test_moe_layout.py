"""Megatron's canonical checkpoint layout for all-MoE Qwen3 (stacked decoder layers), both directions,
against a plain megatron-core GPTModel built by the worker (tests/workers/moe_layout.py)."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_dapo.bridge.cli import main as convert_main
from megatron_dapo.models import QwenArch
from megatron_dapo.models.provider import moe_layer_freq
from megatron_dapo.models.tiny import save_tiny_hf_model, tiny_hf_config
from tests.dist_utils import run_torchrun


def test_all_moe_is_stacked_and_mixed_keeps_the_per_layer_list():
    # Qwen3-30B-A3B's pattern (decoder_sparse_step 1, no mlp_only_layers): megatron-core's default 1.
    all_moe = QwenArch.from_hf(tiny_hf_config("qwen3_moe", mlp_only_layers=[]))
    assert moe_layer_freq(all_moe) == 1
    # Mixed models need the list (megatron-core then stores each layer under its own keys).
    mixed = QwenArch.from_hf(tiny_hf_config("qwen3_moe", mlp_only_layers=[0]))
    assert moe_layer_freq(mixed) == [0, 1, 1, 1]
    sparse = QwenArch.from_hf(tiny_hf_config("qwen3_moe", mlp_only_layers=[], decoder_sparse_step=2))
    assert moe_layer_freq(sparse) == [0, 1, 0, 1]


@pytest.mark.slow
def test_all_moe_checkpoints_interchange_with_plain_megatron_core(tmp_path, capsys):
    """hf-to-megatron output loads into a plain GPTModel (default moe_layer_freq) and gives HF's logits;
    a plain model's own checkpoint converts to HF with its logits; per-layer checkpoints of before
    (converted and actor resume) still load."""
    hf = save_tiny_hf_model("qwen3_moe", tmp_path / "hf", seed=5, mlp_only_layers=[])
    ckpt, work, back = tmp_path / "converted", tmp_path / "work", tmp_path / "hf_back"
    work.mkdir()
    # Saved at EP=2: the two ranks' experts join into one stacked tensor per name.
    assert convert_main(["hf-to-megatron", "--hf", str(hf), "--out", str(ckpt), "--ep", "2"]) == 0, (
        capsys.readouterr().err
    )

    out = run_torchrun("moe_layout.py", 1, str(hf), str(ckpt), str(work), timeout=300)
    errs = dict(re.findall(r"RESULT (converted|old_per_layer) rel=(\S+)", out))
    assert len(errs) == 2 and max(map(float, errs.values())) < 1e-5, out[-4000:]
    for check in ("old_per_layer", "plain_save", "actor_resume"):
        assert f"CHECK PASSED {check}" in out, out[-4000:]

    # A checkpoint Megatron-LM style (iter_0000010 + tracker, no hf_config/ copy) -> HF.
    plain_ckpt = work / "plain_ckpt"
    assert (
        convert_main(["megatron-to-hf", "--ckpt", str(plain_ckpt), "--hf-config", str(hf), "--out", str(back)]) == 0
    ), capsys.readouterr().err
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(back, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    saved = torch.load(work / "plain_logits.pt")
    with torch.no_grad():
        got = model.eval()(input_ids=saved["ids"]).logits.double()
    want = saved["logits"].double()
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < 1e-5, rel
    # ... and the plain model's weights are not the HF model's: the comparison is not vacuous.
    original = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager").eval()
    with torch.no_grad():
        assert (original(input_ids=saved["ids"]).logits.double() - want).abs().max() > 1e-2

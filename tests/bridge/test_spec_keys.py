"""Issue 24 item 3: one checkpoint for the local and Transformer Engine layer specs. The TE spec is built
from megatron-core 0.16.1's own spec code with only TE's CUDA modules stood in for (tests/te_stub.py), in
tests/workers/spec_keys.py."""

from __future__ import annotations

import pytest

from megatron_dapo.bridge.spec_keys import other_spec_key
from tests.dist_utils import run_torchrun


def test_only_a_moe_layers_pre_mlp_norm_has_two_names():
    assert (
        other_spec_key("decoder.layers.mlp.linear_fc1.layer_norm_weight") == "decoder.layers.pre_mlp_layernorm.weight"
    )
    assert (
        other_spec_key("decoder.layers.3.pre_mlp_layernorm.weight")
        == "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"
    )
    for same in (
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.mlp.linear_fc1.weight",
        "decoder.layers.mlp.experts.experts.linear_fc1.weight",
        "decoder.layers.mlp.linear_fc1._extra_state",
        "decoder.final_layernorm.weight",
    ):
        assert other_spec_key(same) is None, same


@pytest.mark.slow
def test_local_and_te_spec_checkpoints_load_into_each_other(tmp_path):
    out = run_torchrun("spec_keys.py", 1, str(tmp_path), timeout=600)
    for family in ("dense", "moe_stacked", "moe_mixed"):
        for check in ("keys", "local>te", "te>local"):
            assert f"CHECK PASSED {family} {check}" in out, out[-4000:]

"""algo.fused_lm_head: the Megatron actor's fused LM head + logprob path gives the unfused path's step
(numbers asserted in tests/workers/fused_head_checks.py), and the configurations it does not cover are
refused naming the key."""

from __future__ import annotations

import pytest

from megatron_dapo.config import ConfigError, derived, load_config
from tests.dist_utils import run_torchrun
from tests.test_config import TINY


@pytest.mark.slow
def test_fused_lm_head_step_equals_unfused_at_tp1_tp2_pp2_untied_and_tied(tmp_path):
    checks = ["tp1", "tp2", "pp2", "tp1_tied", "tp2_tied", "pp2_tied", "tp2_sp"]
    out = run_torchrun("fused_head_checks.py", 2, ",".join(checks), str(tmp_path), timeout=420)
    for check in checks:
        assert f"CHECK PASSED {check}" in out, out[-4000:]


def test_fused_lm_head_defaults_on_for_megatron_off_for_fsdp2():
    assert derived.fused_lm_head(load_config(TINY)) is True
    assert derived.fused_lm_head(load_config(TINY, ["algo.fused_lm_head=false"])) is False
    fsdp = ["trainer.backend=fsdp2", "parallel.tp=1", "trainer.gpus_per_node=1"]
    assert derived.fused_lm_head(load_config(TINY, fsdp)) is False


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["trainer.backend=fsdp2", "parallel.tp=1", "trainer.gpus_per_node=1"],
            "algo.fused_lm_head=true applies to the Megatron actor only, not trainer.backend=fsdp2",
        ),
    ],
)
def test_fused_lm_head_refusals_name_the_key(overrides, expected):
    load_config(TINY, ["algo.fused_lm_head=true"])  # the plain tiny config takes it
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["algo.fused_lm_head=true", *overrides])
    assert expected in str(err.value), str(err.value)
    load_config(TINY, overrides)  # refused because of the key alone

"""algo.fused_lm_head: the Megatron actor's fused LM head + logprob path gives the unfused path's step
(numbers asserted in tests/workers/fused_head_checks.py), and the configurations it does not cover are
refused naming the key."""

from __future__ import annotations

import pytest

from megatron_dapo.config import ConfigError, derived, load_config
from tests.config.test_config import TINY

FUSED_HEAD_CHECKS = ["tp1", "tp2", "pp2", "tp1_tied", "tp2_tied", "pp2_tied", "tp2_sp"]


@pytest.mark.slow
@pytest.mark.torchrun_checks(2, [f"fused_head_checks:{c}" for c in FUSED_HEAD_CHECKS], timeout=420)
def test_fused_lm_head_step_equals_unfused_at_tp1_tp2_pp2_untied_and_tied(torchrun_checks):
    torchrun_checks()


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

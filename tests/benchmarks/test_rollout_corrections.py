"""benchmarks/rollout_corrections.py: every variant's overrides pass the project's config loader (with the
validation) on the demo's config at the sweep's staleness, and set what the variant's name says."""

import pytest

from benchmarks.rollout_corrections import ALL_VARIANTS, EXTRA_VARIANTS, VARIANTS, run_overrides
from megatron_dapo.apps.demo import DEFAULT_CONFIG
from megatron_dapo.config import ConfigError, load_config

# (policy loss, correction mode, correction lower, upper, geo_reject (lower, upper) or None, bypass, bf16 engine)
EXPECTED = {
    "token_tis": ("dapo", "token_tis", None, 2.0, None, False, True),
    "token_mis": ("dapo", "token_mis", None, 2.0, None, False, True),
    "geo_reject": ("dapo", "token_tis", None, 2.0, (0.999, 1.001), False, True),
    "icepop": ("dapo", "icepop", 0.5, 5.0, None, False, True),
    "gspo": ("gspo", "token_tis", None, 2.0, None, False, True),
    "cispo": ("cispo", "token_tis", None, 2.0, None, False, True),
    "seq_tis": ("dapo", "seq_tis", None, 2.0, None, False, True),
    "seq_mis": ("dapo", "seq_mis", 0.5, 2.0, None, False, True),
    "geo_wide": ("dapo", "token_tis", None, 2.0, (0.99, 1.01), False, True),
    "bypass_tis": ("dapo", "token_tis", None, 2.0, None, True, True),
    "fp32": ("dapo", "token_tis", None, 2.0, None, False, False),
}


def test_every_variant_is_checked_and_the_issue_six_come_first():
    assert set(EXPECTED) == set(ALL_VARIANTS)
    assert list(VARIANTS) == ["token_tis", "token_mis", "geo_reject", "icepop", "gspo", "cispo"]
    assert not set(EXTRA_VARIANTS) & set(VARIANTS)


@pytest.mark.parametrize("name", list(ALL_VARIANTS))
def test_variant_overrides_validate_and_set_what_the_name_says(name):
    cfg = load_config(DEFAULT_CONFIG, run_overrides(name, seed=2, steps=30, staleness=3))
    loss, mode, lower, upper, geo, bypass, bf16 = EXPECTED[name]
    rc = cfg.algo.rollout_correction
    assert (cfg.algo.policy_loss, rc.mode, rc.lower, rc.upper, rc.bypass) == (loss, mode, lower, upper, bypass)
    assert ((rc.geo_reject.lower, rc.geo_reject.upper) if rc.geo_reject.enable else None) == geo
    assert (cfg.rollout.extra_args == ["--dtype", "bfloat16"]) is bf16
    assert cfg.rollout.sync.verify is not bf16  # the bf16 engine's logprobs cannot equal the trainer's
    assert (cfg.algo.staleness, cfg.trainer.seed, cfg.data.seed, cfg.trainer.val_every) == (3, 2, 2, 15)


def test_bypass_without_its_correction_is_refused_at_the_sweeps_staleness():
    """bypass_tis is sound only because of its token TIS: the same run with the correction off is refused."""
    overrides = [*run_overrides("bypass_tis", seed=0, steps=30, staleness=3), "algo.rollout_correction.mode=none"]
    with pytest.raises(ConfigError, match="bypass=true with algo.staleness=3"):
        load_config(DEFAULT_CONFIG, overrides)

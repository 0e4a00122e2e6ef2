"""benchmarks/rollout_corrections.py: every variant's overrides pass the project's config loader (with the
validation) on the demo's config at the sweep's staleness, and set what the variant's name says."""

import json

import pytest

from benchmarks.rollout_corrections import ALL_VARIANTS, EXTRA_VARIANTS, VAL, VARIANTS, run_overrides, table
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


def _write_run(path, k3_by_step, val):
    path.mkdir(parents=True)
    rows = [{"step": s, "actor/pg_loss": 0.1, "actor/mismatch_k3": k3} for s, k3 in enumerate(k3_by_step)]
    rows += [{"step": s, VAL: v} for s, v in val.items()]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "bench.json").write_text(json.dumps({"rc": 0, "wall_s": 100.0}))


def test_table_averages_each_third_of_the_steps_then_the_seeds(tmp_path):
    _write_run(tmp_path / "gspo" / "seed0", [1, 1, 2, 2, 3, 3], {0: 0.0, 3: 0.2, 6: 0.4})
    _write_run(tmp_path / "gspo" / "seed1", [3, 3, 4, 4, 5, 5], {0: 0.0, 3: 0.2, 6: 0.2})
    text = table(tmp_path)
    assert "| gspo | 2 | 6 | 0.000±0.000 | 0.200±0.000 | 0.300±0.141 | 3.00e+00±1.41e+00 |" in text
    windows = next(line for line in text.splitlines()[4:] if line.startswith("| gspo"))
    assert windows.split(" | ")[1:4] == ["2±1.41", "3±1.41", "4±1.41"]  # k3 over steps 0-1, 2-3, 4-5

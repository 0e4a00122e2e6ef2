"""One DapoStep over the Megatron and the FSDP2 engine: the same step from the same weights (numbers
asserted in tests/workers/dapo_step_checks.py)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
@pytest.mark.torchrun_checks(2, ["dapo_step_checks:same_step"], timeout=300)
def test_dapo_step_gives_the_same_step_over_the_megatron_and_fsdp2_engines(torchrun_checks):
    torchrun_checks()

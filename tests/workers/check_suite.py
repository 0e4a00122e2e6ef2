"""The checks of several worker modules in one launch (tests/shared_launch.py): each rank imports torch,
megatron-core and transformers once for all of them.

Usage: check_suite.py MODULE:CHECK[,MODULE:CHECK...] TMPDIR
  MODULE: a worker in tests/workers/ whose CHECKS table maps a check's name to fn(hf_dir, tmpdir);
  each check runs as that worker would run it alone (tests.workers.actor_checks.run_checks).
"""

from __future__ import annotations

import importlib
import sys

from tests.workers.actor_checks import run_checks


def suite(names: list[str]) -> dict:
    """MODULE:CHECK -> its function, importing only the modules named (some patch what they check)."""
    checks = {}
    for module in dict.fromkeys(n.partition(":")[0] for n in names):
        for name, fn in importlib.import_module(f"tests.workers.{module}").CHECKS.items():
            checks[f"{module}:{name}"] = fn
    return checks


if __name__ == "__main__":  # dist_checkpointing.save spawns processes that import this file: keep the guard
    run_checks(sys.argv[1:], suite(sys.argv[1].split(",")))

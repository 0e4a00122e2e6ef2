"""verl 0.9.1's own algorithm code as a judge for the tests (installed, never copied here).

`ensure_installed()` pip-installs verl==0.9.1 without dependencies, plus omegaconf (which
`verl.trainer.ppo.core_algos` imports at module level; its config classes are OmegaConf-based), into a
cache directory reused when present. `import_verl()` then makes `verl.trainer.ppo.core_algos` and
`verl.trainer.ppo.rollout_corr_helper` importable unmodified in this process: the GPU-only or heavy
packages on their import paths (STUBBED: tensordict, ray, ...) that this environment lacks are replaced by
empty modules while verl imports; none of them is on the paths the tests call (pure torch functions on
CPU tensors).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from tests import peer_packages
from tests.peer_packages import StubFinder, StubModule

VERL = "verl==0.9.1"
PACKAGES = (VERL, "omegaconf==2.3.0", "antlr4-python3-runtime==4.9.3")
CACHE = Path(os.environ.get("MEGATRON_DAPO_VERL_CACHE", Path.home() / ".cache" / "megatron-dapo" / "verl-0.9.1"))
# Imported at module level on the way to core_algos / rollout_corr_helper, never called by the tests.
STUBBED = (
    "tensordict",
    "ray",
    "codetiming",
    "hydra",
    "pyarrow",
    "datasets",
    "peft",
    "wandb",
    "torchdata",
    "liger_kernel",
    "flash_attn",
    "vllm",
    "sglang",
    "pynvml",
    "torch_npu",
    "mindspeed",
    "megatron",
    "transformer_engine",
    "accelerate",
    "nvtx",
    "pylatexenc",
    "orjson",
)


def ensure_installed(cache: Path = CACHE) -> Path:
    """The cache directory with verl installed; raises (never skips) when PyPI cannot provide it."""
    return peer_packages.ensure_installed(cache, PACKAGES, "the verl-judged tests")


def import_verl(cache: Path = CACHE):
    """verl's `core_algos` and `rollout_corr_helper` modules, imported unmodified. Only the STUBBED packages
    this environment lacks are stubbed, and only while verl imports: the stubs leave sys.modules and the
    finder leaves sys.meta_path afterwards, so later tests in this process import the real packages."""
    ensure_installed(cache)
    if str(cache) not in sys.path:
        sys.path.append(str(cache))  # after the environment's own packages: verl adds, never shadows
    missing = {name for name in STUBBED if importlib.util.find_spec(name) is None}
    finder = StubFinder(missing.__contains__)
    before = set(sys.modules)
    sys.meta_path.insert(0, finder)
    try:
        core_algos = importlib.import_module("verl.trainer.ppo.core_algos")
        rollout_corr = importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
    finally:
        sys.meta_path.remove(finder)
        for name in set(sys.modules) - before:
            if isinstance(sys.modules[name], StubModule):
                del sys.modules[name]
    return core_algos, rollout_corr

"""optimizer.cpu_offload's plumbing into megatron-core 0.16.1's own CPU offload (HybridDeviceOptimizer).
The optimizer itself needs CUDA (its copies run on CUDA streams): on a CPU machine the engine refuses
by name before megatron-core fails; the GPU check runs it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_dapo.config import load_config
from megatron_dapo.trainer.megatron_engine import build_optimizer, optimizer_config_kwargs
from tests.config.test_placement import TINY


def test_cpu_offload_sets_megatron_cores_own_fields():
    from megatron.core.optimizer import OptimizerConfig

    names = {f.name for f in dataclasses.fields(OptimizerConfig)}
    plain = optimizer_config_kwargs(load_config(TINY, []))
    assert set(plain) <= names and not any("offload" in k for k in plain)
    kw = optimizer_config_kwargs(load_config(TINY, ["optimizer.cpu_offload=true", "optimizer.offload_fraction=0.25"]))
    assert set(kw) <= names  # every field megatron-core 0.16.1's OptimizerConfig has
    assert kw["optimizer_cpu_offload"] is True and kw["optimizer_offload_fraction"] == 0.25
    assert kw["use_precision_aware_optimizer"] and kw["use_distributed_optimizer"]  # its required code path
    assert {k: v for k, v in kw.items() if k in plain} == plain


def test_megatron_core_builds_the_hybrid_optimizer_only_with_cuda():
    from megatron.core.optimizer import HybridDeviceOptimizer

    if torch.cuda.is_available():
        pytest.skip("the CUDA path is the GPU check's")
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA"):  # megatron-core's own __init__
        HybridDeviceOptimizer([torch.nn.Parameter(torch.zeros(4))], cpu_optimizer_cls=torch.optim.AdamW)
    with pytest.raises(ValueError, match="optimizer.cpu_offload=true needs CUDA"):
        build_optimizer([], load_config(TINY, ["optimizer.cpu_offload=true"]))


def test_the_fsdp2_engine_refuses_cpu_offload_by_name():
    from types import SimpleNamespace

    from megatron_dapo.trainer.fsdp_engine import check_config

    cfg = load_config(TINY, ["trainer.backend=fsdp2", "parallel.tp=1"])
    cfg.optimizer.cpu_offload = True  # past validation, which refuses it too (tests/config/test_placement.py)
    with pytest.raises(ValueError, match="optimizer.cpu_offload=true needs trainer.backend=megatron"):
        check_config(cfg, SimpleNamespace(is_moe=False))  # a dense model's QwenArch, as check_config reads it

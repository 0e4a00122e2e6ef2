"""Engine offload / reload over both engines (numbers asserted in tests/workers/offload_checks.py), and the
part names."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.errors import EngineOffloadedError
from megatron_dapo.trainer.offload import DeviceOffload, parts_of


def test_parts_of_orders_and_refuses_unknown_names():
    assert parts_of(None) == ("params", "grads", "optimizer")
    assert parts_of({"optimizer", "grads"}) == ("grads", "optimizer")
    assert parts_of("params") == ("params",)
    with pytest.raises(ValueError, match="'weights'"):
        parts_of(["weights"])


def test_a_storage_shared_by_two_parts_moves_with_the_first_and_comes_back_bitwise():
    w = torch.randn(6, dtype=torch.float64)
    master = w[2:]  # an fp32 model's master weights are views of its parameters
    moment = torch.randn(4)
    grad = torch.randn(6)
    off = DeviceOffload(
        torch.device("cpu"), {"params": lambda: [w], "grads": lambda: [grad], "optimizer": lambda: [master, moment]}
    )
    want_w, want_m = w.clone(), moment.clone()
    assert off.offload(["optimizer"]) == {"optimizer": moment.nbytes}
    assert w.untyped_storage().nbytes() == 48 and moment.untyped_storage().nbytes() == 0
    with pytest.raises(EngineOffloadedError, match="optimizer_step needs the engine's optimizer"):
        off.require("optimizer_step", ("params", "optimizer"))
    assert off.offload() == {"params": 48, "grads": 24}
    assert off.reload("grads") == {"grads": 24}
    assert torch.equal(grad, torch.zeros(6))  # gradients are freed, not kept
    off.reload()
    assert torch.equal(w, want_w) and torch.equal(moment, want_m) and torch.equal(master, want_w[2:])
    off.require("optimizer_step", ("params", "grads", "optimizer"))


@pytest.mark.slow
@pytest.mark.torchrun_checks(2, ["offload_checks:offload_megatron"], timeout=300)
def test_megatron_engine_offload_reload_frees_storage_and_training_does_not_notice(torchrun_checks):
    torchrun_checks()


@pytest.mark.slow
@pytest.mark.torchrun_checks(2, ["offload_checks:offload_fsdp2"], timeout=300)
def test_fsdp2_engine_offload_reload_frees_storage_and_training_does_not_notice(torchrun_checks):
    torchrun_checks()

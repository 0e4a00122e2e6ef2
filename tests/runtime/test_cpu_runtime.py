"""The CPU runtime for megatron-core: device mode unit checks, and real parallel training steps on gloo
checked against a single-process reference (see tests/workers/runtime_parallel.py for the numbers)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

TWO_RANK_CHECKS = ["tp_logits", "tp2", "pp2", "dp2_distopt", "ep2", "ckpt_tp2_to_tp1"]


def _run_python(code: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_cpu_mode_maps_cuda_requests_to_cpu():
    # A subprocess: the mode stays on for the life of the process that enables it.
    out = _run_python(
        """
        import torch
        from megatron_dapo.runtime.cpu import cpu_mode_active, enable_cpu_mode

        assert not cpu_mode_active()
        assert enable_cpu_mode() is True and enable_cpu_mode() is True  # idempotent
        x = torch.empty(3, device="cuda")
        y = torch.zeros(2, device=torch.cuda.current_device())
        z = torch.ones(2).cuda().pin_memory().to("cuda:0")
        assert x.device.type == y.device.type == z.device.type == "cpu"
        assert z.type() == "torch.cuda.FloatTensor", z.type()
        assert z.type("torch.cuda.DoubleTensor").dtype == torch.float64

        class AllocInBackward(torch.autograd.Function):  # like megatron's MoE all-to-all
            @staticmethod
            def forward(ctx, a):
                return a * 2

            @staticmethod
            def backward(ctx, g):
                out = g.new_empty(g.shape, device=torch.cuda.current_device())
                out.copy_(g * 2)
                return out

        a = torch.ones(4, requires_grad=True)
        AllocInBackward.apply(a).sum().backward()
        assert torch.equal(a.grad, torch.full((4,), 2.0))
        (g,) = torch.autograd.grad(AllocInBackward.apply(a).sum(), a)
        assert torch.equal(g, torch.full((4,), 2.0))

        # The CUDA RNG stand-ins fork the generator CPU kernels draw from.
        state = torch.cuda.get_rng_state()
        r1 = torch.rand(3)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(3), r1)
        print("OK")
        """
    )
    assert "OK" in out


@pytest.mark.slow
@pytest.mark.torchrun_checks(2, [f"runtime_parallel:{c}" for c in TWO_RANK_CHECKS], timeout=240)
def test_two_rank_training_steps_match_single_process(torchrun_checks):
    """TP=2, PP=2 (1F1B), DP=2 + distributed optimizer, MoE EP=2, and a TP=2 -> TP=1 checkpoint."""
    torchrun_checks()


@pytest.mark.slow
@pytest.mark.torchrun_checks(4, ["runtime_parallel:ep2pp2"], timeout=240)
def test_ep2_x_pp2_training_steps_match_single_process(torchrun_checks):
    torchrun_checks()

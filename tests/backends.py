"""The kernel backends one test suite runs against (tests/algo/test_backends.py, tests/kernels/test_fused_linear.py).

  "torch"            the pure torch reference on CPU (always);
  "torch-cuda"       the torch path on a GPU, where a suite asks for it (marked gpu);
  "triton-cuda"      the Triton kernels on a GPU (marked gpu; skipped without CUDA);
  "triton-interpret" the Triton kernels on CPU under TRITON_INTERPRET=1, the only backend when
                     MEGATRON_DAPO_TEST_BACKENDS=triton-interpret: tests/kernels/test_kernels_interpret.py runs a
                     suite that way in a fresh subprocess, because triton reads the variable when a kernel
                     is decorated, i.e. before this process could set it.
A parameter is (backend, torch.device).
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("MEGATRON_DAPO_TEST_BACKENDS") == "triton-interpret"


def backend_params(*, torch_cuda: bool = False, cuda: bool = True) -> list:
    """pytest params of (backend, device): cuda=False leaves out every CUDA case (e.g. a gloo worker)."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    if INTERPRETED:
        return [pytest.param(("triton", cpu), id="triton-interpret")]
    params = [pytest.param(("torch", cpu), id="torch")]
    if cuda and torch_cuda:
        params.append(pytest.param(("torch", gpu), id="torch-cuda", marks=pytest.mark.gpu))
    if cuda:
        params.append(pytest.param(("triton", gpu), id="triton-cuda", marks=pytest.mark.gpu))
    return params

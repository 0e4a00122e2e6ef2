"""Triton kernels natively on CUDA at Qwen3 sizes (skipped without a GPU): the fused logprob
kernel against the torch reference on the same device, and its memory discipline.
The small-size parity tests of every kernel are tests/test_algo.py's "triton-cuda" cases."""

import pytest
import torch

from megatron_dapo.algo.logprobs import vocab_parallel_logprobs as torch_logprobs
from megatron_dapo.kernels import dispatch


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_logprobs_qwen3_vocab_on_cuda(dtype, tol):
    t, v = 512, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(t, v, generator=g, device="cuda") * 3).to(dtype)
    target = torch.randint(0, v, (t,), generator=g, device="cuda")
    results = []
    for fn in (
        lambda x: dispatch.vocab_parallel_logprobs(x, target, None, 0.9, True, backend="triton"),
        lambda x: torch_logprobs(x, target, None, 0.9, True),
    ):
        x = logits.clone().requires_grad_()
        lp, ent = fn(x)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp, ent, x.grad.float()))
    for a, b, what in zip(*results, ("logprobs", "entropy", "grad")):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"{dtype} {what}: {m}")


@pytest.mark.gpu
def test_fused_logprobs_allocates_no_fp32_copy():
    t, v = 2048, 151936
    logits = torch.randn(t, v, device="cuda", dtype=torch.bfloat16).requires_grad_()
    target = torch.randint(0, v, (t,), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lp = dispatch.vocab_parallel_logprobs(logits, target, backend="triton")
    lp.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    bf16_copy = logits.numel() * logits.element_size()
    # the bf16 gradient itself plus per-token vectors; a fp32 [T, V] temporary would add 2x more
    assert extra < 1.25 * bf16_copy, f"peak extra {extra / 2**20:.0f} MiB vs bf16 grad {bf16_copy / 2**20:.0f} MiB"

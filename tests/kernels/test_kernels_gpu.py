"""Triton kernels natively on CUDA at Qwen3 sizes (skipped without a GPU): the fused logprob
kernel and the fused LM head's Triton row kernels against the torch reference on the same device, and
their memory discipline. The small-size parity tests of every kernel (against float64) are the
"triton-cuda" cases of tests/algo/test_backends.py and tests/kernels/test_fused_linear.py."""

import pytest
import torch

from megatron_dapo.algo.logprobs import vocab_parallel_logprobs as torch_logprobs
from megatron_dapo.kernels import backend as kernel_backend
from megatron_dapo.kernels import fused_linear, fused_linear_logprobs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_logprobs_qwen3_vocab_on_cuda(dtype, tol):
    t, v = 512, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(t, v, generator=g, device="cuda") * 3).to(dtype)
    target = torch.randint(0, v, (t,), generator=g, device="cuda")
    results = []
    for fn in (
        lambda x: kernel_backend.vocab_parallel_logprobs(x, target, None, 0.9, True, backend="triton"),
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
    lp = kernel_backend.vocab_parallel_logprobs(logits, target, backend="triton")
    lp.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    bf16_copy = logits.numel() * logits.element_size()
    # the bf16 gradient itself plus per-token vectors; a fp32 [T, V] temporary would add 2x more
    assert extra < 1.25 * bf16_copy, f"peak extra {extra / 2**20:.0f} MiB vs bf16 grad {bf16_copy / 2**20:.0f} MiB"


def _lm_head_case(tokens, hidden=4096, vocab=151936):
    """Qwen3-8B's LM head in bf16: hidden [T, H], weight [V, H], targets, per-token loss weights."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    w = (torch.randn(vocab, hidden, generator=g, device="cuda") * 2 * hidden**-0.5).bfloat16()
    target = torch.randint(0, vocab, (tokens,), generator=g, device="cuda")
    a, b = torch.randn(tokens, generator=g, device="cuda"), torch.randn(tokens, generator=g, device="cuda")
    return h, w, target, a, b


def _fused_lm_head_step(backend, h, w, target, a, b):
    x, wt = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = fused_linear_logprobs(x, wt, target, temperature=0.9, backend=backend)
    ((lp * a).sum() + (ent * b).sum()).backward()
    return lp.detach(), ent.detach(), x.grad, wt.grad


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1024, 4096])
def test_fused_lm_head_triton_matches_torch_qwen3_size_on_cuda(tokens):
    """fused_linear_logprobs at Qwen3 size (H=4096, V=151936, bf16): the Triton row kernels against the
    torch row ops on the same device (the same cuBLAS logits, so only the fp32 reductions differ); dH
    and dW are bf16, so they may differ by bf16 rounding of the stored values."""
    case = _lm_head_case(tokens)
    got, want = (_fused_lm_head_step(backend, *case) for backend in ("triton", "torch"))
    for name, x, y in zip(("logprobs", "entropy", "dH", "dW"), got, want):
        tol = 1e-4 if x.dtype == torch.float32 else 1e-2
        scale = y.float().abs().max().item()
        torch.testing.assert_close(
            x.float(), y.float(), atol=tol * scale, rtol=tol, msg=lambda m, name=name: f"T={tokens} {name}: {m}"
        )


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fused_lm_head_memory_stays_in_its_workspace(backend):
    """Peak extra memory of a fused forward + backward (T=4096, H=4096, V=151936, bf16), beyond the
    inputs and the bf16 dH / dW it returns, is bounded by what the op allocates by design, not by T x V:
    its workspace (the token chunk's fp32 logits block(s) and hidden rows), three fp32 vocab blocks of
    WEIGHT_BLOCK_MIB (the upcast weight block, the dW accumulator of the second pass, a matmul result),
    and 32 MiB for per-token vectors and allocator rounding: 144 MiB by default. A [T, V] bf16 logits
    tensor alone would be 1187 MiB. (On CPU, torch.profiler's allocator events give 103 MiB for the
    torch backend at T=256, H=4096, and the Triton backend uses one logits block where torch uses two.)"""
    case = _lm_head_case(4096)
    _fused_lm_head_step(backend, *_lm_head_case(64))  # warm-up: kernels compiled, cuBLAS workspace made
    h, w = case[0], case[1]
    outputs = h.numel() * h.element_size() + w.numel() * w.element_size()  # dH + dW
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _fused_lm_head_step(backend, *case)
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base - 2 * outputs) / 2**20  # the step's clones are inputs
    bound = fused_linear.WORKSPACE_MIB + 3 * fused_linear.WEIGHT_BLOCK_MIB + 32
    assert extra <= bound, f"{backend}: peak extra {extra:.0f} MiB > {bound:.0f} MiB"

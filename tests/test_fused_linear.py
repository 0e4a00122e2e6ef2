"""fused_linear_logprobs (megatron_dapo/kernels/fused_linear.py) against float64 autograd of the naive
LM head (full logits, log_softmax, entropy): values and the gradients w.r.t. hidden and weight through
both outputs, a padded vocabulary, temperature, chunk sizes that do not divide T; TP=2 over gloo; and
structurally, that nothing of size T x V is saved for backward."""

import pytest
import torch

from megatron_dapo.kernels import fused_linear_logprobs
from tests.dist_utils import run_torchrun
from tests.workers.fused_linear_tp import TOL, make_case, naive_reference

T, H, ROWS, VOCAB = 37, 16, 53, 50  # 3 padding rows


def case(seed=0, scale=1.0):
    g, hidden, weight, a, b = make_case(T, H, ROWS, seed)
    target = torch.randint(0, VOCAB, (T,), generator=g)
    target[:3] = torch.tensor([-100, VOCAB, ROWS - 1])  # ignored, padding ids: logprob 0, no gradient
    return hidden * scale, weight, target, a, b


def reference(hidden, weight, target, a, b, temp, use_lp=True, use_ent=True):
    rh, rw = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = naive_reference(rh, rw, target, temp, VOCAB)
    ((lp * a).sum() * use_lp + (ent * b).sum() * use_ent).backward()
    return lp.detach(), ent.detach(), rh.grad, rw.grad


def fused(hidden, weight, target, a, b, temp, chunk, use_lp=True, use_ent=True, with_entropy=True):
    x, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    lp, ent = fused_linear_logprobs(
        x, w, target, temperature=temp, vocab_size=VOCAB, chunk_tokens=chunk, with_entropy=with_entropy
    )
    loss = (lp * a.float()).sum() if use_lp else 0.0
    if use_ent:
        loss = loss + (ent * b.float()).sum()
    loss.backward()
    return lp, ent, x.grad, w.grad


def assert_matches(got, want):
    for name, g, w in zip(("logprobs", "entropy", "dH", "dW"), got, want):
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double(), w, **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("chunk", [8, 1, 37, 1024])
@pytest.mark.parametrize("temp", [0.7, 1.0])
def test_matches_float64_reference(chunk, temp):
    hidden, weight, target, a, b = case()
    got = fused(hidden, weight, target, a, b, temp, chunk)
    assert_matches(got, reference(hidden, weight, target, a, b, temp))
    assert torch.equal(got[0][:3], torch.zeros(3)) and not got[3][VOCAB:].any()  # ignored ids; padding rows


def test_large_logits_stay_exact():
    hidden, weight, target, a, b = case(seed=3, scale=40.0)  # logits ~ +-100: the max shift matters
    assert_matches(fused(hidden, weight, target, a, b, 0.7, 8), reference(hidden, weight, target, a, b, 0.7))


@pytest.mark.parametrize("use_lp,use_ent", [(True, False), (False, True)])
def test_one_output_only(use_lp, use_ent):
    """An unused output gets no gradient (None in backward) and the other one's gradient is still right."""
    hidden, weight, target, a, b = case(seed=1)
    got = fused(hidden, weight, target, a, b, 0.7, 8, use_lp=use_lp, use_ent=use_ent)
    assert_matches(got, reference(hidden, weight, target, a, b, 0.7, use_lp=use_lp, use_ent=use_ent))


def test_without_entropy():
    hidden, weight, target, a, b = case(seed=2)
    lp, ent, dh, dw = fused(hidden, weight, target, a, b, 0.7, 8, use_ent=False, with_entropy=False)
    assert ent is None
    rlp, _, rdh, rdw = reference(hidden, weight, target, a, b, 0.7, use_ent=False)
    assert_matches((lp, dh, dw), (rlp, rdh, rdw))


def test_half_inputs_keep_their_dtype():
    hidden, weight, target, a, b = case(seed=4)
    x, w = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    lp, ent = fused_linear_logprobs(x, w, target, temperature=0.7, vocab_size=VOCAB, chunk_tokens=8)
    ((lp * a.float()).sum() + (ent * b.float()).sum()).backward()
    assert lp.dtype == ent.dtype == torch.float32 and x.grad.dtype == w.grad.dtype == torch.bfloat16
    rlp, rent, rdh, _ = reference(x.detach().double(), w.detach().double(), target, a, b, 0.7)
    torch.testing.assert_close(lp.double(), rlp, atol=1e-4, rtol=1e-4)  # fp32 math on the bf16 values
    torch.testing.assert_close(x.grad.double(), rdh, atol=2e-2, rtol=2e-2)  # bf16 rounding of dH


def test_saves_nothing_of_size_t_by_v():
    """Every tensor the autograd graph saves (hooks see save_for_backward too) is smaller than T x V,
    and the biggest are hidden and weight themselves."""
    hidden, weight, target, _, _ = case()
    x, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = fused_linear_logprobs(x, w, target, temperature=0.7, vocab_size=VOCAB, chunk_tokens=8)
    assert (T, H) in saved and (ROWS, H) in saved, saved  # the hooks did see the Function's saves
    assert all(torch.Size(s).numel() < T * VOCAB for s in saved), saved
    assert sorted(saved, key=lambda s: torch.Size(s).numel())[-2:] == [(T, H), (ROWS, H)], saved
    (lp.sum() + ent.sum()).backward()  # the saved set is enough for backward


def test_rejects_bad_inputs():
    hidden, weight, target, _, _ = case()
    with pytest.raises(ValueError):
        fused_linear_logprobs(hidden.float(), weight.float()[:, :4], target)
    with pytest.raises(ValueError):
        fused_linear_logprobs(hidden.float(), weight.float(), target, vocab_size=ROWS + 1)


@pytest.mark.slow
def test_tp2_matches_unsharded_reference():
    out = run_torchrun("fused_linear_tp.py", 2, timeout=180, env={"OMP_NUM_THREADS": "1"})
    assert out.count("FUSED LINEAR TP OK") == 2, out[-4000:]


def test_workspace_sizes_the_chunk():
    """chunk_tokens left unset: the chunk comes from workspace_mib (here a few tokens), same results."""
    from megatron_dapo.kernels.fused_linear import chunk_tokens_for

    assert chunk_tokens_for(151936, 64) == 55 and chunk_tokens_for(10, 1e-4) == 1
    hidden, weight, target, a, b = case(seed=5)
    x, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    lp, ent = fused_linear_logprobs(
        x, w, target, temperature=0.7, vocab_size=VOCAB, workspace_mib=4 * VOCAB * 8 / 2**20
    )
    ((lp * a.float()).sum() + (ent * b.float()).sum()).backward()
    assert_matches((lp, ent, x.grad, w.grad), reference(hidden, weight, target, a, b, 0.7))


def test_half_weight_upcast_block_by_block(monkeypatch):
    """A bf16 weight is read as fp32 in vocab blocks (7 rows here) and, without main_grad, its dW is
    summed per block over every token chunk (a second pass): the same values as the float64 reference
    of the bf16 inputs, within bf16 rounding of the stored dW."""
    from megatron_dapo.kernels import fused_linear

    monkeypatch.setattr(fused_linear, "WEIGHT_BLOCK_MIB", 7 * H * 4 / 2**20)
    hidden, weight, target, a, b = case(seed=6)
    x, w = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    lp, ent = fused_linear_logprobs(x, w, target, temperature=0.7, vocab_size=VOCAB, chunk_tokens=8)
    ((lp * a.float()).sum() + (ent * b.float()).sum()).backward()
    rlp, rent, rdh, rdw = reference(x.detach().double(), w.detach().double(), target, a, b, 0.7)
    torch.testing.assert_close(lp.double(), rlp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent.double(), rent, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.grad.double(), rdw, atol=1e-2, rtol=1e-2)  # bf16 rounding of dW only
    torch.testing.assert_close(x.grad.double(), rdh, atol=2e-2, rtol=2e-2)
    assert not w.grad[VOCAB:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_accumulation_fusion_adds_into_main_grad(dtype):
    """With megatron-core's main_grad (fp32) and gradient_accumulation_fusion, dW lands in main_grad on
    top of what it held (float64 reference; fp32 math on the weight's values) and the weight's grad is
    megatron-core's dummy with grad_added_to_main_grad set, so DDP's hook does not add it again."""
    hidden, weight, target, a, b = case(seed=7)
    x, w = hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
    before = torch.randn(ROWS, H, dtype=torch.float32)
    w.main_grad, w.grad_added_to_main_grad, w.zero_out_wgrad = before.clone(), False, True
    lp, ent = fused_linear_logprobs(
        x, w, target, temperature=0.7, vocab_size=VOCAB, chunk_tokens=8, gradient_accumulation_fusion=True
    )
    ((lp * a.float()).sum() + (ent * b.float()).sum()).backward()
    _, _, rdh, rdw = reference(x.detach().double(), w.detach().double(), target, a, b, 0.7)
    tol = TOL if dtype == torch.float32 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.main_grad.double(), before.double() + rdw, **tol)
    assert w.grad_added_to_main_grad and w.grad.shape == w.shape and not w.grad.any()  # zero_out_wgrad
    torch.testing.assert_close(x.grad.double(), rdh, **(tol if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    # without gradient_accumulation_fusion the same weight gets a plain dW and main_grad is untouched
    w.grad, held = None, w.main_grad.clone()
    lp, _ = fused_linear_logprobs(x, w, target, temperature=0.7, vocab_size=VOCAB, with_entropy=False)
    lp.sum().backward()
    assert torch.equal(w.main_grad, held) and w.grad.abs().sum() > 0


@pytest.mark.gpu
def test_matches_float64_reference_on_cuda():
    """The same op on CUDA tensors (fp32, padded vocabulary, temperature, several chunks)."""
    hidden, weight, target, a, b = case(seed=8)
    x, w = hidden.float().cuda().requires_grad_(), weight.float().cuda().requires_grad_()
    lp, ent = fused_linear_logprobs(x, w, target.cuda(), temperature=0.7, vocab_size=VOCAB, chunk_tokens=8)
    ((lp * a.float().cuda()).sum() + (ent * b.float().cuda()).sum()).backward()
    got = (lp.cpu(), ent.cpu(), x.grad.cpu(), w.grad.cpu())
    assert_matches(got, reference(hidden, weight, target, a, b, 0.7))

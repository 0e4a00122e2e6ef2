"""fused_linear_logprobs (megatron_dapo/kernels/fused_linear.py) against float64 autograd of the naive
LM head (full logits, log_softmax, entropy): values and the gradients w.r.t. hidden and weight through
both outputs, a padded vocabulary, temperature, chunk sizes that do not divide T; TP=2 over gloo (with
sequence parallel); and structurally, that nothing of size T x V is saved for backward.

One suite for both backends of the per-chunk row work (tests/backends.py): "torch" (CPU), "torch-cuda"
and "triton-cuda" (marked gpu) and, under tests/kernels/test_kernels_interpret.py, only "triton-interpret" (the
Triton kernels on CPU under TRITON_INTERPRET=1, every test here including the TP=2 torchrun run; the
shapes are small, so the whole interpreted file runs in well under a minute)."""

import importlib

import pytest
import torch

from megatron_dapo.kernels import fused_linear, fused_linear_logprobs
from tests.backends import backend_params
from tests.dist_utils import run_torchrun
from tests.workers.fused_linear_tp import TOL, make_case, naive_reference

T, H, ROWS, VOCAB = 37, 16, 53, 50  # 3 padding rows
HALF_TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 rounding of a stored dH / dW


@pytest.fixture(params=backend_params(torch_cuda=True))
def be(request):
    return request.param


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


def leaves(be, hidden, weight, dtype=torch.float32):
    """hidden and weight as leaves of `dtype` on the backend's device."""
    dev = be[1]
    return hidden.to(dev, dtype).requires_grad_(), weight.to(dev, dtype).requires_grad_()


def run_op(be, x, w, target, a, b, temp, use_lp=True, use_ent=True, **kw):
    """The op on the backend's device, (lp * a).sum() + (ent * b).sum() backward; results on the CPU."""
    backend, dev = be
    lp, ent = fused_linear_logprobs(x, w, target.to(dev), temperature=temp, vocab_size=VOCAB, backend=backend, **kw)
    loss = (lp * a.to(dev, torch.float32)).sum() if use_lp else 0.0
    if use_ent:
        loss = loss + (ent * b.to(dev, torch.float32)).sum()
    loss.backward()
    cpu = lambda t: None if t is None else t.detach().cpu()
    return cpu(lp), cpu(ent), cpu(x.grad), cpu(w.grad)


def fused(be, hidden, weight, target, a, b, temp, chunk, dtype=torch.float32, **kw):
    return run_op(be, *leaves(be, hidden, weight, dtype), target, a, b, temp, chunk_tokens=chunk, **kw)


def assert_matches(got, want):
    for name, g, w in zip(("logprobs", "entropy", "dH", "dW"), got, want):
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double(), w, **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("chunk", [8, 1, 37, 1024])
@pytest.mark.parametrize("temp", [0.7, 1.0])
def test_matches_float64_reference(be, chunk, temp):
    hidden, weight, target, a, b = case()
    got = fused(be, hidden, weight, target, a, b, temp, chunk)
    assert_matches(got, reference(hidden, weight, target, a, b, temp))
    assert torch.equal(got[0][:3], torch.zeros(3)) and not got[3][VOCAB:].any()  # ignored ids; padding rows


def test_large_logits_stay_exact(be):
    hidden, weight, target, a, b = case(seed=3, scale=40.0)  # logits ~ +-100: the max shift matters
    assert_matches(fused(be, hidden, weight, target, a, b, 0.7, 8), reference(hidden, weight, target, a, b, 0.7))


@pytest.mark.parametrize("use_lp,use_ent", [(True, False), (False, True)])
def test_one_output_only(be, use_lp, use_ent):
    """An unused output gets no gradient (None in backward) and the other one's gradient is still right."""
    hidden, weight, target, a, b = case(seed=1)
    got = fused(be, hidden, weight, target, a, b, 0.7, 8, use_lp=use_lp, use_ent=use_ent)
    assert_matches(got, reference(hidden, weight, target, a, b, 0.7, use_lp=use_lp, use_ent=use_ent))


def test_without_entropy(be):
    hidden, weight, target, a, b = case(seed=2)
    lp, ent, dh, dw = fused(be, hidden, weight, target, a, b, 0.7, 8, use_ent=False, with_entropy=False)
    assert ent is None
    rlp, _, rdh, rdw = reference(hidden, weight, target, a, b, 0.7, use_ent=False)
    assert_matches((lp, dh, dw), (rlp, rdh, rdw))


def test_half_inputs_keep_their_dtype(be):
    hidden, weight, target, a, b = case(seed=4)
    lp, ent, dh, dw = fused(be, hidden, weight, target, a, b, 0.7, 8, dtype=torch.bfloat16)
    assert lp.dtype == ent.dtype == torch.float32 and dh.dtype == dw.dtype == torch.bfloat16
    bf16 = lambda t: t.bfloat16().double()  # the reference of the bf16 values the op was given
    rlp, rent, rdh, _ = reference(bf16(hidden), bf16(weight), target, a, b, 0.7)
    torch.testing.assert_close(lp.double(), rlp, atol=1e-4, rtol=1e-4)  # fp32 math on the bf16 values
    torch.testing.assert_close(dh.double(), rdh, **HALF_TOL)


def test_saves_nothing_of_size_t_by_v(be):
    """Every tensor the autograd graph saves (hooks see save_for_backward too) is smaller than T x V,
    and the biggest are hidden and weight themselves."""
    backend, dev = be
    hidden, weight, target, _, _ = case()
    x, w = leaves(be, hidden, weight)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = fused_linear_logprobs(
            x, w, target.to(dev), temperature=0.7, vocab_size=VOCAB, chunk_tokens=8, backend=backend
        )
    assert (T, H) in saved and (ROWS, H) in saved, saved  # the hooks did see the Function's saves
    assert all(torch.Size(s).numel() < T * VOCAB for s in saved), saved
    assert sorted(saved, key=lambda s: torch.Size(s).numel())[-2:] == [(T, H), (ROWS, H)], saved
    (lp.sum() + ent.sum()).backward()  # the saved set is enough for backward


def test_runs_the_backends_row_ops(be, monkeypatch):
    """The per-chunk work goes to the chosen backend's row ops, once per token chunk each way (37 tokens
    in chunks of 8: 5), so a Triton case does test the kernels, not a silent fallback to torch."""
    backend, _ = be
    if backend == "torch":
        module, name = fused_linear, "TORCH_ROW_OPS"
    else:
        module, name = importlib.import_module("megatron_dapo.kernels.fused_linear_triton"), "ROW_OPS"
    real, calls = getattr(module, name), []
    counted = lambda fn, tag: lambda *args: calls.append(tag) or fn(*args)
    ops = fused_linear.RowOps(counted(real.partials, "fwd"), counted(real.grad_logits, "bwd"), real.needs_scratch)
    monkeypatch.setattr(module, name, ops)
    hidden, weight, target, a, b = case(seed=9)
    assert_matches(fused(be, hidden, weight, target, a, b, 0.7, 8), reference(hidden, weight, target, a, b, 0.7))
    assert calls == ["fwd"] * 5 + ["bwd"] * 5, calls


def test_rejects_bad_inputs(be):
    backend, dev = be
    hidden, weight, target, _, _ = case()
    x, w, target = hidden.float().to(dev), weight.float().to(dev), target.to(dev)
    with pytest.raises(ValueError, match="hidden"):
        fused_linear_logprobs(x, w[:, :4], target, backend=backend)
    with pytest.raises(ValueError, match="vocab_size"):
        fused_linear_logprobs(x, w, target, vocab_size=ROWS + 1, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        fused_linear_logprobs(x, w, target, backend="cuda")


@pytest.mark.slow
@pytest.mark.parametrize("be", backend_params(cuda=False))
def test_tp2_matches_unsharded_reference(be):
    """TP=2 over gloo on CPU: a padded vocabulary, a shard of padding only, and sequence parallel, all
    with temperature (tests/workers/fused_linear_tp.py), with this backend's row ops."""
    backend, _ = be
    out = run_torchrun("fused_linear_tp.py", 2, backend, timeout=180, env={"OMP_NUM_THREADS": "1"})
    assert out.count(f"FUSED LINEAR TP OK backend={backend}") == 2, out[-4000:]


def test_workspace_sizes_the_chunk(be):
    """chunk_tokens left unset: the chunk comes from workspace_mib (here a few tokens), same results."""
    assert fused_linear.chunk_tokens_for(151936, 64) == 55 and fused_linear.chunk_tokens_for(10, 1e-4) == 1
    hidden, weight, target, a, b = case(seed=5)
    x, w = leaves(be, hidden, weight)
    got = run_op(be, x, w, target, a, b, 0.7, workspace_mib=4 * VOCAB * 8 / 2**20)
    assert_matches(got, reference(hidden, weight, target, a, b, 0.7))


def test_half_weight_upcast_block_by_block(be, monkeypatch):
    """A bf16 weight is read as fp32 in vocab blocks (7 rows here) and, without main_grad, its dW is
    summed per block over every token chunk (a second pass, whose blocks start at columns col_lo > 0):
    the same values as the float64 reference of the bf16 inputs, within bf16 rounding of the stored dW."""
    monkeypatch.setattr(fused_linear, "WEIGHT_BLOCK_MIB", 7 * H * 4 / 2**20)
    hidden, weight, target, a, b = case(seed=6)
    lp, ent, dh, dw = fused(be, hidden, weight, target, a, b, 0.7, 8, dtype=torch.bfloat16)
    bf16 = lambda t: t.bfloat16().double()
    rlp, rent, rdh, rdw = reference(bf16(hidden), bf16(weight), target, a, b, 0.7)
    torch.testing.assert_close(lp.double(), rlp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent.double(), rent, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dw.double(), rdw, atol=1e-2, rtol=1e-2)  # bf16 rounding of dW only
    torch.testing.assert_close(dh.double(), rdh, **HALF_TOL)
    assert not dw[VOCAB:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_accumulation_fusion_adds_into_main_grad(be, dtype):
    """With megatron-core's main_grad (fp32) and gradient_accumulation_fusion, dW lands in main_grad on
    top of what it held (float64 reference; fp32 math on the weight's values) and the weight's grad is
    megatron-core's dummy with grad_added_to_main_grad set, so DDP's hook does not add it again."""
    backend, dev = be
    hidden, weight, target, a, b = case(seed=7)
    x, w = leaves(be, hidden, weight, dtype)
    before = torch.randn(ROWS, H, dtype=torch.float32)
    w.main_grad, w.grad_added_to_main_grad, w.zero_out_wgrad = before.to(dev, copy=True), False, True
    _, _, dh, dummy = run_op(be, x, w, target, a, b, 0.7, chunk_tokens=8, gradient_accumulation_fusion=True)
    _, _, rdh, rdw = reference(x.detach().double().cpu(), w.detach().double().cpu(), target, a, b, 0.7)
    tol = TOL if dtype == torch.float32 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.main_grad.double().cpu(), before.double() + rdw, **tol)
    assert w.grad_added_to_main_grad and dummy.shape == w.shape and not dummy.any()  # zero_out_wgrad
    torch.testing.assert_close(dh.double(), rdh, **(tol if dtype == torch.float32 else HALF_TOL))
    # without gradient_accumulation_fusion the same weight gets a plain dW and main_grad is untouched
    w.grad, held = None, w.main_grad.clone()
    lp, _ = fused_linear_logprobs(
        x, w, target.to(dev), temperature=0.7, vocab_size=VOCAB, with_entropy=False, backend=backend
    )
    lp.sum().backward()
    assert torch.equal(w.main_grad, held) and w.grad.abs().sum() > 0

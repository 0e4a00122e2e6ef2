"""One test suite for both backends of the DAPO hot paths (megatron_dapo.kernels.backend).

Each test runs against the backends of tests/backends.py: "torch" (CPU), "triton-cuda" (marked gpu)
and, under MEGATRON_DAPO_TEST_BACKENDS=triton-interpret (tests/kernels/test_kernels_interpret.py), only
"triton-interpret". Every result is compared with the plain float64 computations of
tests/workers/algo_reference.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.kernels import backend as kernel_backend
from tests.backends import backend_params
from tests.workers.algo_reference import (
    ref_filter,
    ref_group_advantages,
    ref_logprobs_entropy,
    ref_policy_loss,
    ref_policy_loss_grad,
)


@pytest.fixture(params=backend_params())
def be(request):
    return request.param


def close(actual, expected, atol, rtol=0.0, what=""):
    torch.testing.assert_close(
        actual.detach().double().cpu(),
        expected.detach().double().cpu(),
        atol=atol,
        rtol=rtol,
        msg=lambda m: f"{what}: {m}",
    )


# ---------------------------------------------------------------- group advantages and filter
def _groups(seed):
    g = torch.Generator().manual_seed(seed)
    # sizes 1 (single), 2, 5, 8 (one all-equal "tie" group), ids not contiguous and shuffled
    ids = torch.tensor([7] * 1 + [3] * 2 + [11] * 5 + [0] * 8 + [5] * 8)
    rewards = torch.randint(0, 2, (ids.numel(),), generator=g).float()
    rewards[16:24] = 1.0  # group 5: all correct
    rewards[3:8] = torch.tensor([0.5, -1.0, 2.0, 0.25, 0.0])  # group 11: real-valued scores
    perm = torch.randperm(ids.numel(), generator=g)
    return rewards[perm], ids[perm]


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_group_advantages_vs_float64(be, norm_by_std):
    backend, dev = be
    rewards, ids = _groups(0)
    got = kernel_backend.group_advantages(rewards.to(dev), ids.to(dev), norm_by_std, 1e-6, backend=backend)
    close(got, ref_group_advantages(rewards, ids, norm_by_std), 1e-5, what="advantages")
    assert got[ids.to(dev) == 7].abs().max() == 0, "single-sample group must have advantage 0"
    assert got[ids.to(dev) == 5].abs().max() == 0, "all-equal group must have advantage 0"


@pytest.mark.parametrize("threshold", [0.5, 0.0])
def test_dynamic_sampling_filter_vs_reference(be, threshold):
    backend, dev = be
    rewards, ids = _groups(1)
    wrong = threshold - 1.0  # acc 0 for the 0.5 threshold, score -1 for the 0 threshold
    rewards = torch.where(ids == 0, torch.full_like(rewards, wrong), rewards)  # group 0: all wrong
    res = kernel_backend.dynamic_sampling_filter(rewards.to(dev), ids.to(dev), threshold, backend=backend)
    keep, n_groups, n_kept, n_correct, n_wrong = ref_filter(rewards, ids, threshold)
    assert res.keep.cpu().tolist() == keep
    assert (res.num_groups, res.num_kept, res.num_all_correct, res.num_all_wrong) == (
        n_groups,
        n_kept,
        n_correct,
        n_wrong,
    )
    assert res.num_all_correct >= 1 and res.num_all_wrong >= 1


def test_dynamic_sampling_filter_score_metric(be):
    backend, dev = be
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    score = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0, -1.0])  # +-1 score; group 3 is a single sample
    res = kernel_backend.dynamic_sampling_filter(score.to(dev), ids.to(dev), 0.0, backend=backend)
    assert res.keep.cpu().tolist() == [False, False, False, False, True, True, False]
    assert (res.num_groups, res.num_kept, res.num_all_correct, res.num_all_wrong) == (4, 1, 1, 2)


def test_token_advantages(be):
    backend, dev = be
    adv = torch.tensor([0.5, -2.0, 0.0, 3.0])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1], [1, 1, 1]])
    got = kernel_backend.token_advantages(adv.to(dev), mask.to(dev), backend=backend)
    expected = torch.tensor([[adv[i].item() * mask[i, t].item() for t in range(3)] for i in range(4)])
    close(got, expected, 0.0, what="token advantages")


# ---------------------------------------------------------------- DAPO policy loss
def _loss_batch(seed, b=5, s=11):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, s, generator=g) * 3
    old = lp + torch.randn(b, s, generator=g) * 0.4  # ratios spread well past both clip bounds
    adv = torch.randn(b, generator=g)
    adv[3] = 0.0  # a zero-advantage sequence (ties of both branches)
    mask = (torch.rand(b, s, generator=g) > 0.3).float()
    mask[1] = 0.0  # an empty (all-masked) sequence
    lp[1] = 50.0  # garbage at padding must not leak (exp(50 - old) would overflow the ratio)
    w = torch.rand(b, s, generator=g) * 3  # raw IS weights, some above the cap
    return lp, old, adv, mask, w


CASES = [
    dict(mode="token-mean"),
    dict(mode="token-mean", c=3.0, w=True),
    dict(mode="token-mean", n_tok=97, dp=2),
    dict(mode="seq-mean-token-sum", c=1.5),
    dict(mode="seq-mean-token-mean", w=True, cap=None),
    dict(mode="seq-mean-token-mean", n_seq=9, dp=3),
    dict(mode="seq-mean-token-sum-norm", norm=64),
    dict(mode="seq-mean-token-sum-norm", n_seq=7, dp=2, c=3.0),
]


def _call_loss(backend, dev, lp, old, adv, mask, w, case):
    return kernel_backend.dapo_policy_loss(
        lp,
        old.to(dev),
        adv.to(dev),
        mask.to(dev),
        0.2,
        0.28,
        case.get("c"),
        case["mode"],
        case.get("n_tok"),
        w.to(dev) if case.get("w") else None,
        global_num_seqs=case.get("n_seq"),
        dp_world_size=case.get("dp", 1),
        rollout_is_cap=case.get("cap", 2.0),
        token_sum_norm=case.get("norm"),
        backend=backend,
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_dapo_policy_loss_vs_float64(be, case):
    backend, dev = be
    lp, old, adv, mask, w = _loss_batch(2)
    x = lp.clone().to(dev).requires_grad_()
    loss, metrics = _call_loss(backend, dev, x, old, adv, mask, w, case)
    loss.backward()
    kw = dict(
        low=0.2,
        high=0.28,
        c=case.get("c"),
        mode=case["mode"],
        n_tok=case.get("n_tok"),
        n_seq=case.get("n_seq"),
        dp=case.get("dp", 1),
        w=w if case.get("w") else None,
        cap=case.get("cap", 2.0),
        norm=case.get("norm"),
    )
    expected = ref_policy_loss(lp, old, adv, mask, **kw)
    close(loss, torch.tensor(expected), 1e-5, 1e-5, what="loss")
    close(x.grad, ref_policy_loss_grad(lp, old, adv, mask, **kw), 1e-5, 1e-4, what="grad")
    assert torch.isfinite(x.grad).all() and (x.grad[1] == 0).all(), "padding must get no gradient"
    assert metrics["num_tokens"].item() == mask.sum().item()
    assert metrics["num_seqs"].item() == (mask.sum(-1) > 0).sum().item()


def test_loss_metrics_vs_float64(be):
    backend, dev = be
    lp, old, adv, mask, _ = _loss_batch(3)
    adv = adv[:, None] * torch.linspace(-1, 1, lp.shape[1])  # token-level advantages of both signs
    n_tok, dp = 211, 2
    _, m = kernel_backend.dapo_policy_loss(
        lp.to(dev),
        old.to(dev),
        adv.to(dev),
        mask.to(dev),
        0.2,
        0.28,
        1.5,
        global_num_tokens=n_tok,
        dp_world_size=dp,
        backend=backend,
    )
    up = low = dual = 0
    rs, k3, rmax = 0.0, 0.0, 0.0
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[i, t] == 0:
                continue
            a, lr = adv[i, t].item(), lp[i, t].item() - old[i, t].item()
            r = math.exp(lr)
            up += a > 0 and r > 1.28
            low += a < 0 and r < 0.8
            dual += a < 0 and r > 1.5
            rs, k3, rmax = rs + r, k3 + (r - 1 - lr), max(rmax, r)
    scale = dp / n_tok
    assert up > 0 and low > 0 and dual > 0, "the batch must exercise every clip"
    for key, val in (
        ("clipfrac_upper", up * scale),
        ("clipfrac_lower", low * scale),
        ("clipfrac_dual", dual * scale),
        ("ratio_mean", rs * scale),
        ("approx_kl", k3 * scale),
        ("ratio_max", rmax),
    ):
        close(m[key], torch.tensor(val), 1e-6, 1e-5, what=key)


def test_loss_micro_batches_sum_to_one_batch(be):
    """token-mean and seq-mean with global denominators: 2 simulated DP ranks x uneven micro-batches."""
    backend, dev = be
    lp, old, adv, mask, _ = _loss_batch(4, b=9, s=7)
    splits = [[0, 1], [2, 3, 4], [5], [6, 7, 8]]  # rank 0: mb 0,1; rank 1: mb 2,3
    for mode, kw_global in (
        ("token-mean", dict(global_num_tokens=mask.sum().item())),
        ("seq-mean-token-mean", dict(global_num_seqs=(mask.sum(-1) > 0).sum().item())),
    ):
        full_x = lp.clone().to(dev).requires_grad_()
        full, _ = kernel_backend.dapo_policy_loss(
            full_x, old.to(dev), adv.to(dev), mask.to(dev), loss_agg_mode=mode, backend=backend
        )
        full.backward()
        x = lp.clone().to(dev).requires_grad_()
        total = 0.0
        for rank_mbs in (splits[:2], splits[2:]):
            for rows in rank_mbs:
                loss, _ = kernel_backend.dapo_policy_loss(
                    x[rows],
                    old[rows].to(dev),
                    adv[rows].to(dev),
                    mask[rows].to(dev),
                    loss_agg_mode=mode,
                    dp_world_size=2,
                    backend=backend,
                    **kw_global,
                )
                (loss / 2).backward()  # DDP's average over the 2 ranks
                total = total + loss.detach() / 2
        close(total, full, 1e-6, 1e-6, what=f"{mode} loss")
        close(x.grad, full_x.grad, 1e-7, 1e-5, what=f"{mode} grad")


@pytest.mark.parametrize("dual", [None, 3.0], ids=["no-dual", "dual"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["A>0", "A<0"])
def test_loss_extreme_log_ratios(be, sign, dual):
    """Log-ratios of +-200 (exp overflows fp32 past ~88.7) on clipped and unclipped tokens: the
    log-ratio is clamped to [-20, 20], so loss, gradient and metrics are finite and equal the
    float64 reference; tokens beyond the clamp get no gradient; Triton equals the torch path."""
    backend, dev = be
    lp, old, _, mask, _ = _loss_batch(13, b=4, s=9)
    mask[:, :6] = 1.0
    # per row: +200 (A>0: upper clip; A<0: dual clip or unclipped), -200 (A>0: unclipped; A<0: lower
    # clip), +-19.5 (inside the clamp, both branches), and ordinary tokens after them
    lp[:, 0], lp[:, 1] = old[:, 0] + 200.0, old[:, 1] - 200.0
    lp[:, 2], lp[:, 3] = old[:, 2] + 19.5, old[:, 3] - 19.5
    adv = sign * torch.tensor([0.5, 1.0, 2.0, 0.25])
    kw = dict(low=0.2, high=0.28, c=dual)
    outs = []
    for b, d in ((backend, dev), ("torch", torch.device("cpu"))):
        for mode in ("token-mean", "seq-mean-token-sum-norm"):
            x = lp.clone().to(d).requires_grad_()
            loss, metrics = kernel_backend.dapo_policy_loss(
                x, old.to(d), adv.to(d), mask.to(d), 0.2, 0.28, dual, mode, token_sum_norm=16, backend=b
            )
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(x.grad).all(), f"{b} {mode}: non-finite loss or grad"
            assert all(torch.isfinite(v) for v in metrics.values()), f"{b} {mode}: non-finite metric"
            assert (x.grad[:, :2] == 0).all(), "tokens beyond the clamp carry no gradient"
            expected = ref_policy_loss(lp, old, adv, mask, mode=mode, norm=16, **kw)
            close(loss, torch.tensor(expected), 1e-5, 1e-6, what=f"{b} {mode} loss")
            close(
                x.grad,
                ref_policy_loss_grad(lp, old, adv, mask, mode=mode, norm=16, **kw),
                1e-6,
                1e-4,
                what=f"{b} {mode} grad",
            )
            close(metrics["ratio_max"], torch.tensor(math.exp(20.0)), 0.0, 1e-6, what="ratio_max")
            outs.append((loss.detach().cpu(), x.grad.cpu()))
    for (loss_a, grad_a), (loss_b, grad_b) in zip(outs[:2], outs[2:]):
        close(loss_a, loss_b, 0.0, 1e-6, what=f"{backend} vs torch loss")
        close(grad_a, grad_b, 1e-7, 1e-5, what=f"{backend} vs torch grad")


# ---------------------------------------------------------------- vocab-parallel log-probs
def _logits(seed, t=7, v=53, scale=3.0, extreme=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, v, generator=g) * scale
    target = torch.randint(0, v, (t,), generator=g)
    if extreme:
        x[0, :] = 1e4  # all tied at +1e4
        x[1, 5] = 1e4  # one dominant logit, the target elsewhere
        target[1] = 6
        x[2, :] = -1e4
        x[2, target[2]] = 1e4  # target dominant
        x[3, ::2] = -1e4
    return x, target


@pytest.mark.parametrize("temperature,extreme", [(1.0, False), (0.7, False), (1.3, False), (1.0, True)])
def test_logprobs_entropy_vs_float64(be, temperature, extreme):
    backend, dev = be
    x, target = _logits(5, extreme=extreme)
    target[4] = -100  # padding id outside the vocabulary
    xx = x.clone().to(dev).requires_grad_()
    lp, ent = kernel_backend.vocab_parallel_logprobs(xx, target.to(dev), None, temperature, True, backend=backend)
    g = torch.Generator().manual_seed(9)
    glp, gh = torch.randn(x.shape[0], generator=g), torch.randn(x.shape[0], generator=g)
    ((lp * glp.to(dev)).sum() + (ent * gh.to(dev)).sum()).backward()

    x64 = x.double().requires_grad_()
    rlp, rent = ref_logprobs_entropy(x64, target, temperature)
    ((rlp * glp.double()).sum() + (rent * gh.double()).sum()).backward()
    close(lp, rlp, 1e-5, 1e-6, what="logprobs")
    close(ent, rent, 1e-5, 1e-6, what="entropy")
    close(xx.grad, x64.grad, 1e-6, 1e-5, what="grad logits")


def test_logprobs_only_and_batch_dims(be):
    backend, dev = be
    x, target = _logits(6, t=12, v=40)
    x3, t3 = x.view(3, 4, 40), target.view(3, 4)
    xx = x3.clone().to(dev).requires_grad_()
    lp = kernel_backend.vocab_parallel_logprobs(xx, t3.to(dev), backend=backend)
    assert lp.shape == (3, 4) and lp.dtype == torch.float32
    lp.sum().backward()
    x64 = x3.double().requires_grad_()
    rlp, _ = ref_logprobs_entropy(x64, t3)
    rlp.sum().backward()
    close(lp, rlp, 1e-5, 1e-6, what="logprobs")
    close(xx.grad, x64.grad, 1e-6, 1e-5, what="grad")


def test_logprobs_bf16_logits(be):
    backend, dev = be
    x, target = _logits(7, t=9, v=70, scale=4.0)
    xb = x.to(torch.bfloat16)
    xx = xb.clone().to(dev).requires_grad_()
    lp, ent = kernel_backend.vocab_parallel_logprobs(xx, target.to(dev), None, 0.9, True, backend=backend)
    (lp.sum() - 0.5 * ent.sum()).backward()
    assert xx.grad.dtype == torch.bfloat16, "grad must be written in the logits' dtype"
    x64 = xb.double().requires_grad_()  # the same bf16 values, exactly, in float64
    rlp, rent = ref_logprobs_entropy(x64, target, 0.9)
    (rlp.sum() - 0.5 * rent.sum()).backward()
    close(lp, rlp, 2e-2, what="bf16 logprobs")
    close(ent, rent, 2e-2, what="bf16 entropy")
    close(xx.grad, x64.grad, 2e-2, what="bf16 grad")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_backend_matches_torch_reference(be, dtype, tol):
    """Direct parity with the torch path (trivially true for the torch backend itself)."""
    backend, dev = be
    x, target = _logits(8, t=10, v=300, scale=5.0)
    x = x.to(dtype)
    outs = []
    for b, d in ((backend, dev), ("torch", torch.device("cpu"))):
        xx = x.clone().to(d).requires_grad_()
        lp, ent = kernel_backend.vocab_parallel_logprobs(xx, target.to(d), None, 1.1, True, backend=b)
        (lp.sum() + ent.sum()).backward()
        outs.append((lp.cpu(), ent.cpu(), xx.grad.float().cpu()))
    for a, r, what in zip(outs[0], outs[1], ("logprobs", "entropy", "grad")):
        close(a, r, tol, what=f"{dtype} {what}")


def test_tiling_does_not_change_results(be):
    """Many vocab chunks / blocks (online max rescaling across blocks, ragged last block) and many
    sequence blocks in the loss kernel give the float64 answer."""
    backend, dev = be
    x, target = _logits(10, t=6, v=203, scale=6.0)
    x[0, 150:] += 20.0  # the row max arrives late: earlier blocks must be rescaled
    xx = x.clone().to(dev).requires_grad_()
    if backend == "torch":
        from megatron_dapo.algo.logprobs import vocab_parallel_logprobs as fn

        tiling = dict(chunk_elements=2 * 203)  # two rows per chunk
    else:
        from megatron_dapo.kernels.logprobs_triton import vocab_parallel_logprobs as fn

        tiling = dict(block_v=32)
    lp, ent = fn(xx.to(dev), target.to(dev), None, 0.8, True, **tiling)
    (lp.sum() + 0.3 * ent.sum()).backward()
    x64 = x.double().requires_grad_()
    rlp, rent = ref_logprobs_entropy(x64, target, 0.8)
    (rlp.sum() + 0.3 * rent.sum()).backward()
    close(lp, rlp, 1e-5, 1e-6, what="logprobs")
    close(ent, rent, 1e-5, 1e-6, what="entropy")
    close(xx.grad, x64.grad, 1e-6, 1e-5, what="grad")

    lp2, old, adv, mask, w = _loss_batch(11, b=4, s=37)
    if backend == "torch":
        loss, _ = kernel_backend.dapo_policy_loss(
            lp2, old, adv, mask, 0.2, 0.28, 3.0, "seq-mean-token-mean", rollout_is_weights=w, backend="torch"
        )
    else:
        from megatron_dapo.kernels.loss_triton import dapo_policy_loss as loss_fn

        loss, _ = loss_fn(
            lp2.to(dev),
            old.to(dev),
            adv.to(dev),
            mask.to(dev),
            0.2,
            0.28,
            3.0,
            "seq-mean-token-mean",
            rollout_is_weights=w.to(dev),
            block_s=8,
        )
    expected = ref_policy_loss(lp2, old, adv, mask, c=3.0, mode="seq-mean-token-mean", w=w)
    close(loss, torch.tensor(expected), 1e-5, 1e-5, what="loss")


def test_padded_vocab_minus_inf_columns(be):
    """megatron pads the vocabulary; the actor masks those columns to -inf: they must have
    probability 0, gradient 0 and leave logprobs, entropy and grads of the real columns exact."""
    backend, dev = be
    real, padded = 45, 64
    x, target = _logits(12, t=5, v=real)
    full = torch.cat([x, torch.full((5, padded - real), float("-inf"))], dim=1)
    xx = full.clone().to(dev).requires_grad_()
    lp, ent = kernel_backend.vocab_parallel_logprobs(xx, target.to(dev), None, 0.9, True, backend=backend)
    (lp.sum() + 0.7 * ent.sum()).backward()
    x64 = x.double().requires_grad_()
    rlp, rent = ref_logprobs_entropy(x64, target, 0.9)
    (rlp.sum() + 0.7 * rent.sum()).backward()
    close(lp, rlp, 1e-5, 1e-6, what="logprobs")
    close(ent, rent, 1e-5, 1e-6, what="entropy")
    close(xx.grad[:, :real], x64.grad, 1e-6, 1e-5, what="grad")
    assert (xx.grad[:, real:] == 0).all()

"""Torch-reference-only checks: float64 gradcheck of the custom autograd function, memory
discipline of the logprob path, overlong shaping, input validation and backend dispatch."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.algo import (
    dapo_policy_loss,
    dynamic_sampling_filter,
    group_advantages,
    overlong_filter_mask,
    overlong_reward,
    vocab_parallel_logprobs,
)
from megatron_dapo.kernels import backend as kernel_backend
from tests.workers.algo_reference import ref_overlong


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_gradcheck_float64(temperature):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 13, generator=g, dtype=torch.float64) * 2).requires_grad_()
    target = torch.randint(0, 13, (5,), generator=g)
    target[2] = -100

    def both(inp):
        lp, ent = vocab_parallel_logprobs(inp, target, None, temperature, True, chunk_elements=2 * 13)
        return lp, ent

    assert torch.autograd.gradcheck(both, (x,), eps=1e-6, atol=1e-8)
    assert torch.autograd.gradcheck(
        lambda inp: vocab_parallel_logprobs(inp, target, None, temperature), (x,), eps=1e-6, atol=1e-8
    )
    # only the entropy used: the logprob output receives no gradient at all
    assert torch.autograd.gradcheck(lambda inp: both(inp)[1], (x,), eps=1e-6, atol=1e-8)


def test_loss_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    lp = (-torch.rand(3, 6, generator=g, dtype=torch.float64)).requires_grad_()
    old = lp.detach() + torch.randn(3, 6, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 6, dtype=torch.float64)
    mask[0, 4:] = 0
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        fn = lambda x: dapo_policy_loss(x, old, adv, mask, clip_ratio_c=2.0, loss_agg_mode=mode)[0]  # noqa: E731
        assert torch.autograd.gradcheck(fn, (lp,), eps=1e-7, atol=1e-7), mode


def test_logprobs_save_no_fp32_copy_of_the_logits():
    """Only the logits themselves (same storage) and per-token vectors are saved for backward."""
    t, v = 64, 1000
    logits = torch.randn(t, v, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, v, (t,))
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        lp, ent = vocab_parallel_logprobs(logits, target, None, 1.0, True, chunk_elements=8 * v)
    big = [s for s in saved if s.numel() >= t * v]
    assert len(big) == 1 and big[0].untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    assert all(s.numel() <= t for s in saved if s.numel() < t * v)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16


def test_overlong_reward_vs_formula():
    lengths = torch.tensor([0, 10, 12, 13, 15, 16, 20, 25])
    got = overlong_reward(lengths, max_response_len=16, overlong_buffer_len=4, penalty_factor=0.5)
    expected = torch.tensor([ref_overlong(int(n), 16, 4, 0.5) for n in lengths])
    torch.testing.assert_close(got.double(), expected.double(), atol=1e-7, rtol=0)
    assert got[5].item() == -0.5 and got[2].item() == 0.0
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_reward(lengths, 16, 0, 1.0)


def test_overlong_filter_keeps_baseline():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    ids = torch.tensor([0, 0, 0, 0])
    truncated = torch.tensor([False, True, False, False])
    mask = torch.ones(4, 3)
    adv = group_advantages(rewards, ids)  # the truncated sample is part of the baseline
    new_mask = overlong_filter_mask(mask, truncated)
    assert new_mask[1].sum() == 0 and new_mask[[0, 2, 3]].sum() == 9 and mask.sum() == 12
    assert adv[1] < 0  # its advantage exists; it is only masked out of the loss
    with pytest.raises(ValueError, match="truncated"):
        overlong_filter_mask(mask, torch.tensor([True]))


def test_bad_inputs_name_the_field():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        dapo_policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 3), loss_agg_mode="mean")
    with pytest.raises(ValueError, match="old_logprobs"):
        dapo_policy_loss(lp, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        dapo_policy_loss(lp, lp, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="clip_ratio_c"):
        dapo_policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 3), clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="global_num_tokens"):
        dapo_policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 3), global_num_tokens=0)
    with pytest.raises(ValueError, match="seq"):
        dapo_policy_loss(lp[0], lp[0], lp[0], lp[0], loss_agg_mode="seq-mean-token-sum")
    with pytest.raises(ValueError, match="target_ids"):
        vocab_parallel_logprobs(torch.zeros(2, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="group_ids"):
        dynamic_sampling_filter(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_dispatch_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(kernel_backend.ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernel_backend.resolve_backend(cpu) == "torch"
    assert kernel_backend.resolve_backend(torch.device("cuda")) == "triton"
    monkeypatch.setenv(kernel_backend.ENV_VAR, "torch")
    assert kernel_backend.resolve_backend(torch.device("cuda")) == "torch"
    assert kernel_backend.resolve_backend(torch.device("cuda"), "triton") == "triton"  # the argument wins
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernel_backend.resolve_backend(cpu, "triton")
    monkeypatch.setenv(kernel_backend.ENV_VAR, "cuda-please")
    with pytest.raises(ValueError, match=kernel_backend.ENV_VAR):
        kernel_backend.resolve_backend(cpu)
    with pytest.raises(ValueError, match="backend"):
        kernel_backend.resolve_backend(cpu, "numpy")

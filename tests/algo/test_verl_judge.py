"""GSPO, CISPO, the rloo / REINFORCE++ advantages, the rollout corrections and the mismatch metrics
against verl 0.9.1's own code (tests/verl_peer.py: installed with pip --no-deps, imported unmodified,
heavy imports stubbed) on the same inputs. Where the conventions differ (docs/algorithm.md, "verl"),
the test feeds verl the equivalent setting and asserts the difference itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_dapo.algo import (
    cispo_policy_loss,
    gspo_policy_loss,
    mismatch_sums,
    reinforce_plus_plus_advantages,
    rloo_advantages,
    rollout_correction,
)


@pytest.fixture(scope="module")
def verl():
    """verl's core_algos and rollout_corr_helper; installs verl into the cache on first use; fails, never
    skips, when that is impossible."""
    from tests.verl_peer import import_verl

    return import_verl()


def _actor_config(low, high):
    from verl.workers.config import ActorConfig

    return ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=low, clip_ratio_high=high
    )


def _batch(seed, b=6, s=8, spread=0.3):
    """Responses as contiguous prefixes (verl's response_mask), one of a single token, none empty."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, s, generator=g).double() * 3
    old = lp + torch.randn(b, s, generator=g).double() * spread
    adv = torch.randn(b, generator=g).double()
    lengths = torch.randint(1, s + 1, (b,), generator=g)
    lengths[0] = 1
    mask = (torch.arange(s)[None] < lengths[:, None]).double()
    return lp, old, adv, mask


def _close(a, b, what, atol=1e-9, rtol=1e-6):
    torch.testing.assert_close(a.detach().double(), b.detach().double(), atol=atol, rtol=rtol, msg=what)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_verl(verl, seed):
    core, _ = verl
    lp, old, adv, mask = _batch(seed, spread=0.002)
    old = old - torch.linspace(-1e-3, 1e-3, 6).double()[:, None] * torch.sign(adv)[:, None]
    ours_x, verl_x = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    ours, m = gspo_policy_loss(ours_x, old, adv, mask, 3e-4, 4e-4, None, "seq-mean-token-mean")
    ours.backward()
    theirs, _ = core.compute_policy_loss_gspo(
        old, verl_x, adv[:, None].expand_as(lp), mask, "seq-mean-token-mean", config=_actor_config(3e-4, 4e-4)
    )
    theirs.backward()
    assert m["clipfrac_upper"] + m["clipfrac_lower"] > 0, "the inputs must exercise GSPO's clip"
    _close(ours, theirs, "gspo loss")
    _close(ours_x.grad * mask, verl_x.grad * mask, "gspo grad")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_cispo_matches_verl(verl, mode):
    """verl's cispo clips the weight on both sides with the actor's clip_ratio_low / high; ours does so
    when clip_ratio_low is given (its default None is the paper's upper-only clip)."""
    core, _ = verl
    lp, old, adv, mask = _batch(4, spread=0.5)
    ours_x, verl_x = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    ours, m = cispo_policy_loss(ours_x, old, adv, mask, 0.2, 0.28, loss_agg_mode=mode)
    ours.backward()
    theirs, _ = core.compute_policy_loss_cispo(
        old, verl_x, adv[:, None].expand_as(lp), mask, mode, config=_actor_config(0.2, 0.28)
    )
    theirs.backward()
    assert m["clipfrac_upper"] > 0 and m["clipfrac_lower"] > 0
    _close(ours, theirs, "cispo loss")
    _close(ours_x.grad * mask, verl_x.grad * mask, "cispo grad")


def _token_rewards(rewards, mask):
    """verl's token_level_rewards: the outcome reward on each response's last token."""
    out = torch.zeros_like(mask)
    last = mask.sum(-1).long() - 1
    out[torch.arange(len(rewards)), last] = rewards.to(out.dtype)
    return out


def test_rloo_matches_verl(verl):
    core, _ = verl
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 3.0, 7.0, 0.25])
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 0, 1])
    mask = torch.ones(len(rewards), 4)
    theirs, _ = core.compute_rloo_outcome_advantage(_token_rewards(rewards, mask), mask, np.array(ids.tolist()))
    ours = rloo_advantages(rewards, ids)
    grouped = ids != 2
    _close(ours[grouped], theirs[grouped, 0], "rloo", atol=1e-6)
    # the convention difference: a single-sample group (no baseline) gets 0 here, its raw reward in verl
    assert float(ours[5]) == 0.0 and float(theirs[5, 0]) == 3.0


def test_reinforce_plus_plus_matches_verl(verl):
    from verl.trainer.config import AlgoConfig

    core, _ = verl
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 0.0], dtype=torch.float64)
    lengths = torch.tensor([3, 5, 1, 2, 6, 4])
    mask = (torch.arange(6)[None] < lengths[:, None]).double()
    theirs, _ = core.compute_reinforce_plus_plus_outcome_advantage(
        _token_rewards(rewards, mask), mask, config=AlgoConfig(gamma=1.0)
    )
    ours = reinforce_plus_plus_advantages(rewards, lengths)
    _close(ours[:, None].expand_as(mask) * mask, theirs, "reinforce++", atol=1e-6)


CORRECTIONS = [  # (our mode, lower, upper) -> verl's (rollout_is level, threshold)
    (("token_tis", None, 2.0), ("token", 2.0)),
    (("icepop", 0.5, 5.0), ("token", "0.5_5.0")),
    (("token_mis", 0.8, 1.5), ("token", "0.8_1.5")),
    (("seq_tis", None, 2.0), ("sequence", 2.0)),
    (("seq_mis", 0.5, 2.0), ("sequence", "0.5_2.0")),
]


@pytest.mark.parametrize("ours_spec,verl_spec", CORRECTIONS, ids=[c[0][0] for c in CORRECTIONS])
def test_rollout_correction_weights_match_verl(verl, ours_spec, verl_spec):
    _, helper = verl
    _, roll, _, mask = _batch(5, b=8, s=6, spread=0.0)
    g = torch.Generator().manual_seed(9)
    old = roll + torch.randn(roll.shape, generator=g).double() * 0.3
    old[2] = roll[2] + 100.0  # beyond the clamp (verl's SAFETY_BOUND is 20 too)
    ours = rollout_correction(old - roll, mask, *ours_spec)
    theirs, _ = helper.compute_rollout_correction_weights(old - roll, mask, verl_spec[0], verl_spec[1])
    _close(ours.weights, theirs, ours_spec[0], atol=1e-12, rtol=1e-10)
    if ours_spec[0] not in ("token_tis", "seq_tis"):
        assert ours.token_rejected.any()


def test_geometric_rejection_matches_verl(verl):
    """verl's seq_mean_k1 bounds the geometric mean of pi_rollout / pi_old (its k1 is log(roll / old)); ours
    bounds pi_old / pi_rollout: [lower, upper] here is [1 / upper, 1 / lower] there."""
    _, helper = verl
    _, roll, _, mask = _batch(6, b=10, s=6, spread=0.0)
    g = torch.Generator().manual_seed(3)
    old = roll + torch.randn(roll.shape, generator=g).double() * 0.15
    lower, upper = 0.9, 1.05
    ours = rollout_correction(old - roll, mask, "none", None, 2.0, lower, upper)
    theirs, _ = helper.compute_rollout_rejection_mask(old - roll, mask, "seq_mean_k1", f"{1 / upper}_{1 / lower}")
    assert ours.seq_rejected.any() and not ours.seq_rejected.all()
    assert torch.equal(ours.weights > 0, theirs > 0)


def test_mismatch_metrics_match_verl(verl):
    _, helper = verl
    _, roll, _, mask = _batch(8, b=7, s=6, spread=0.0)
    g = torch.Generator().manual_seed(4)
    old = roll + torch.randn(roll.shape, generator=g).double() * 0.2
    sums = mismatch_sums(old, roll, mask, rollout_correction(old - roll, mask, "none"))
    theirs = helper.compute_offpolicy_metrics(old, roll, mask)
    n_tok, n_seq = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    for ours_key, verl_key, n in (
        ("k1", "kl", n_tok),
        ("k3", "k3_kl", n_tok),
        ("chi2_token", "chi2_token", n_tok),
        ("chi2_seq", "chi2_seq", n_seq),
        ("log_ppl_diff", "log_ppl_diff", n_seq),
    ):
        assert abs(sums[ours_key] / n - theirs[verl_key]) < 1e-6 * max(1.0, abs(theirs[verl_key])), (
            ours_key,
            sums[ours_key] / n,
            theirs[verl_key],
        )

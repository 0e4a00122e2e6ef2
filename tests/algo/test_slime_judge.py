"""The policy losses (dapo, gspo, cispo), the rollout corrections and the mismatch metrics against slime's
own training-path loss (tests/slime_peer.py: THUDM/slime imported unmodified in a subprocess, megatron-core
on gloo at world size 1, `slime.backends.megatron_utils.loss.loss_function` run on float32 logits), on the
same logits, tokens, masks, advantages and old / rollout log-probs: the loss of the step and its gradient
with respect to the logits, over two micro-batches.

Written and run against slime commit 624b824a898ab0ec1fcb4d373004c7f3852bf515 (2026-08-21, "[NFC] Add
observability subfolder (#2298)"). slime is not on PyPI, so the module skips, naming why, where no slime
source tree is present (tests/slime_peer.py: $MEGATRON_DAPO_SLIME_SRC, else ~/.cache/megatron-dapo/slime-*).

Settings map one to one (docs/algorithm.md, "slime"): slime's eps_clip / eps_clip_high / eps_clip_c are
clip_ratio_low / clip_ratio_high / clip_ratio_c; its default per-sample mean is seq-mean-token-mean and
calculate_per_token_loss is token-mean; CISPO's canonical eps_clip = 1.0 is clip_ratio_low None. Where the
conventions differ (a sample without loss tokens, the log-ratio clamp, the mismatch metrics' per-sample
means) the tests assert the difference itself.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.algo import (
    cispo_policy_loss,
    dapo_policy_loss,
    gspo_policy_loss,
    mismatch_sums,
    rollout_correction,
)
from tests import slime_peer

pytestmark = pytest.mark.slow  # one subprocess importing megatron-core and slime (~10-20 s)

VOCAB = 11


class Batch:
    """One step's samples in two micro-batches: slime's inputs (float32 logits [1, T, V] per micro-batch,
    per-sample lists) and ours ([B, S] padded, logprobs from float64 copies of the same logits)."""

    def __init__(self, seed, sizes=(4, 3), spread=0.3, roll_spread=0.3, seq_shifts=None, empty=None, extreme=None):
        g = torch.Generator().manual_seed(seed)
        n = sum(sizes)
        self.resp = torch.randint(1, 13, (n,), generator=g).tolist()
        self.resp[0] = 1  # a one-token response
        prompt = torch.randint(1, 4, (n,), generator=g).tolist()
        self.S = max(self.resp)
        self.sizes = sizes
        self.tokens = [torch.randint(0, VOCAB, (p + r,), generator=g) for p, r in zip(prompt, self.resp, strict=True)]
        self.logits = []
        start = 0
        for size in sizes:
            t = sum(len(x) for x in self.tokens[start : start + size])
            self.logits.append(torch.randn(1, t, VOCAB, generator=g) * 2)
            start += size
        lp = self.logprobs([x.double() for x in self.logits]).detach()
        self.mask = (torch.arange(self.S)[None] < torch.tensor(self.resp)[:, None]).double()
        holes = (torch.rand(n, self.S, generator=g) < 0.2).double()
        holes[:, 0] = 0.0  # every response keeps its first token (multi-turn style holes after it)
        self.mask = self.mask * (1 - holes)
        if empty is not None:
            self.mask[empty] = 0.0
        self.adv = torch.randn(n, generator=g).float().double()
        noise = torch.randn(n, self.S, generator=g).double() * spread
        if seq_shifts is not None:  # GSPO: a chosen mean log-ratio per sequence, token noise around it
            m = self.mask
            noise = noise - (noise * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
            noise = noise + torch.tensor(seq_shifts, dtype=torch.float64)[:, None]
        self.old = (lp + noise).float().double() * self.mask
        if extreme is not None:  # (sample, token, log-ratio): pi / pi_old = exp(log-ratio)
            i, t, lr = extreme
            self.old[i, t] = lp[i, t] - lr
        self.roll = (self.old + torch.randn(n, self.S, generator=g).double() * roll_spread).float().double() * self.mask

    def logprobs(self, logits):
        """[B, S] log-probs of the response tokens from per-micro-batch logits (any dtype, differentiable)."""
        rows, i = [], 0
        for lg, size in zip(logits, self.sizes, strict=True):
            lsm = torch.log_softmax(lg[0], -1)
            end = 0
            for _ in range(size):
                toks, r = self.tokens[i], self.resp[i]
                end += len(toks)
                row = lsm[end - r - 1 : end - 1].gather(-1, toks[-r:, None])[:, 0]
                rows.append(torch.nn.functional.pad(row, (0, self.S - r)))
                i += 1
        return torch.stack(rows)

    def slime_case(self, args, bypass=False):
        mbs, i = [], 0
        for lg, size in zip(self.logits, self.sizes, strict=True):
            idx = range(i, i + size)
            mbs.append(
                {
                    "logits": lg,
                    "tokens": [self.tokens[j] for j in idx],
                    "response_lengths": [self.resp[j] for j in idx],
                    "loss_masks": [self.mask[j, : self.resp[j]].float() for j in idx],
                    "advantages": [self.adv[j].float().expand(self.resp[j]).clone() for j in idx],
                    "log_probs": None if bypass else [self.old[j, : self.resp[j]].float() for j in idx],
                    "rollout_log_probs": [self.roll[j, : self.resp[j]].float() for j in idx],
                }
            )
            i += size
        return {"args": args, "micro_batches": mbs}

    def ours(self, loss_fn, **kw):
        """Our loss on the whole step (one call: exact over micro-batches) and its logits gradients."""
        leaves = [x.double().requires_grad_() for x in self.logits]
        lp = self.logprobs(leaves)
        old = kw.pop("old", self.old)
        loss, metrics = loss_fn(lp, old, self.adv, self.mask, **kw)
        loss.backward()
        return loss.detach(), [x.grad for x in leaves], metrics


def _correction(b, mode, lower=None, upper=2.0, geo=(None, None), old=None):
    old = b.old if old is None else old
    return rollout_correction(old - b.roll, b.mask, mode, lower, upper, *geo)


PER_TOKEN = {"calculate_per_token_loss": True}
CASES = {  # name: (Batch kwargs, slime args)
    "dapo_token_mean_dual": ({"seed": 0, "spread": 0.8}, {"eps_clip_c": 3.0, **PER_TOKEN}),
    "dapo_seq_mean": ({"seed": 1}, {}),
    "gspo": (
        {"seed": 2, "spread": 0.01, "seq_shifts": [-2e-3, 1e-4, 2e-3, -6e-4, 6e-4, -1e-4, 1e-3]},
        {"advantage_estimator": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4},
    ),
    "cispo_two_sided": ({"seed": 3, "spread": 0.5}, {"advantage_estimator": "cispo", **PER_TOKEN}),
    "cispo_canonical": (
        {"seed": 4, "spread": 1.2},
        {"advantage_estimator": "cispo", "eps_clip": 1.0, "eps_clip_high": 1.0},
    ),
    "token_tis": ({"seed": 5, "roll_spread": 0.6}, {"use_tis": True, **PER_TOKEN}),
    "icepop": (
        {"seed": 6, "roll_spread": 0.6},
        {
            "use_tis": True,
            "custom_tis_function_path": "slime.backends.megatron_utils.loss.icepop_function",
            "tis_clip_low": 0.5,
            "tis_clip": 2.0,
        },
    ),
    "mis_token_mask": (
        {"seed": 7, "roll_spread": 0.6},
        {
            "use_tis": True,
            "custom_tis_function_path": slime_peer.MIS_FUNCTION,
            "tis_mode": "mask",
            "tis_lower_bound": 0.5,
            "tis_upper_bound": 2.0,
        },
    ),
    "mis_seq_truncate": (
        {"seed": 8, "roll_spread": 0.25},
        {
            "use_tis": True,
            "custom_tis_function_path": slime_peer.MIS_FUNCTION,
            "tis_level": "sequence",
            "tis_upper_bound": 2.0,
            **PER_TOKEN,
        },
    ),
    "mis_seq_mask": (
        {"seed": 9, "roll_spread": 0.4},
        {
            "use_tis": True,
            "custom_tis_function_path": slime_peer.MIS_FUNCTION,
            "tis_level": "sequence",
            "tis_mode": "mask",
            "tis_lower_bound": 0.5,
            "tis_upper_bound": 2.0,
        },
    ),
    "mis_geometric_reject": (
        {"seed": 10, "roll_spread": 0.1},
        {
            "use_tis": True,
            "custom_tis_function_path": slime_peer.MIS_FUNCTION,
            "tis_upper_bound": 2.0,
            "use_rs": True,
            "rs_level": "geometric",
            "rs_lower_bound": 0.97,
            "rs_upper_bound": 1.03,
        },
    ),
    "bypass_tis": ({"seed": 11, "roll_spread": 0.6}, {"use_rollout_logprobs": True, "use_tis": True, **PER_TOKEN}),
    "mismatch_metrics_token": (
        {"seed": 12, "roll_spread": 0.4},
        {"get_mismatch_metrics": True, "custom_tis_function_path": slime_peer.MIS_FUNCTION, **PER_TOKEN},
    ),
    "mismatch_metrics_sample": (
        {"seed": 12, "roll_spread": 0.4},
        {"get_mismatch_metrics": True, "custom_tis_function_path": slime_peer.MIS_FUNCTION},
    ),
    "empty_sample_seq": ({"seed": 13, "empty": 3}, {}),
    "empty_sample_token": ({"seed": 13, "empty": 3}, PER_TOKEN),
    "extreme_log_ratio": ({"seed": 14, "extreme": (2, 0, 100.0)}, PER_TOKEN),
}
BATCHES = {name: Batch(**kw) for name, (kw, _) in CASES.items()}


@pytest.fixture(scope="module")
def slime():
    """Every case's result from slime's code, one subprocess for the module."""
    src = slime_peer.find_source()
    if src is None:
        pytest.skip(slime_peer.skip_reason())
    cases = {
        name: BATCHES[name].slime_case(args, bypass=args.get("use_rollout_logprobs", False))
        for name, (_, args) in CASES.items()
    }
    return slime_peer.run(cases, src)


def _close(ours, theirs, what, atol=2e-6, rtol=2e-5):
    """float64 (ours) against slime's float32."""
    torch.testing.assert_close(ours.double(), theirs.double(), atol=atol, rtol=rtol, msg=what)


def _match(slime, name, ours_loss, ours_grads, scale=1.0):
    res = slime[name]
    _close(ours_loss * scale, res["loss"], f"{name} loss")
    for k, (ours_g, theirs_g) in enumerate(zip(ours_grads, res["grads"], strict=True)):
        _close(ours_g * scale, theirs_g, f"{name} logits grad, micro-batch {k}")


def test_dapo_asymmetric_and_dual_clip_token_mean(slime):
    b = BATCHES["dapo_token_mean_dual"]
    loss, grads, m = b.ours(
        dapo_policy_loss, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, rollout_is_cap=None
    )
    assert m["clipfrac_upper"] > 0 and m["clipfrac_lower"] > 0 and m["clipfrac_dual"] > 0
    _match(slime, "dapo_token_mean_dual", loss, grads)


def test_dapo_per_sample_mean_is_seq_mean_token_mean(slime):
    b = BATCHES["dapo_seq_mean"]
    loss, grads, m = b.ours(dapo_policy_loss, loss_agg_mode="seq-mean-token-mean", rollout_is_cap=None)
    assert m["clipfrac_upper"] + m["clipfrac_lower"] > 0
    _match(slime, "dapo_seq_mean", loss, grads)


def test_gspo_matches_slime(slime):
    b = BATCHES["gspo"]
    loss, grads, m = b.ours(gspo_policy_loss, clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    assert m["clipfrac_upper"] + m["clipfrac_lower"] > 0, "the inputs must exercise GSPO's clip"
    assert m["clipfrac_upper"] + m["clipfrac_lower"] < 1
    _match(slime, "gspo", loss, grads)


def test_cispo_two_sided_matches_slime(slime):
    b = BATCHES["cispo_two_sided"]
    loss, grads, m = b.ours(cispo_policy_loss, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert m["clipfrac_upper"] > 0 and m["clipfrac_lower"] > 0
    _match(slime, "cispo_two_sided", loss, grads)


def test_cispo_canonical_no_lower_bound(slime):
    """slime's canonical CISPO sets eps_clip = 1.0 (weight clamped below at 0, i.e. not at all): our
    clip_ratio_low None."""
    b = BATCHES["cispo_canonical"]
    loss, grads, m = b.ours(
        cispo_policy_loss, clip_ratio_low=None, clip_ratio_high=1.0, loss_agg_mode="seq-mean-token-mean"
    )
    assert m["clipfrac_upper"] > 0
    _match(slime, "cispo_canonical", loss, grads)


def _with_correction(name, corr, **kw):
    b = BATCHES[name]
    assert corr.weights is not None
    return b.ours(dapo_policy_loss, rollout_is_weights=corr.weights, rollout_is_cap=None, **kw)


def test_token_tis_matches_slime_vanilla_tis(slime):
    b = BATCHES["token_tis"]
    corr = _correction(b, "token_tis", upper=2.0)
    assert (corr.weights == 2.0).any(), "some weights must be truncated"
    loss, grads, _ = _with_correction("token_tis", corr)
    _match(slime, "token_tis", loss, grads)


def test_icepop_matches_slime_icepop(slime):
    b = BATCHES["icepop"]
    corr = _correction(b, "icepop", lower=0.5, upper=2.0)
    assert corr.token_rejected.any()
    loss, grads, _ = _with_correction("icepop", corr, loss_agg_mode="seq-mean-token-mean")
    _match(slime, "icepop", loss, grads)


def test_token_mis_matches_slime_mis_mask(slime):
    """mis.py's mask mode keeps the weight and drops rejected tokens from the reducer's numerator with the
    denominators unchanged: our zero weight with the step's normalisers."""
    b = BATCHES["mis_token_mask"]
    corr = _correction(b, "token_mis", lower=0.5, upper=2.0)
    assert corr.token_rejected.any()
    loss, grads, _ = _with_correction("mis_token_mask", corr, loss_agg_mode="seq-mean-token-mean")
    _match(slime, "mis_token_mask", loss, grads)


def test_seq_tis_matches_slime_mis_sequence_truncate(slime):
    b = BATCHES["mis_seq_truncate"]
    corr = _correction(b, "seq_tis", upper=2.0)
    w = corr.weights[b.mask.bool()]
    assert (w == 2.0).any() and (w < 2.0).any()
    loss, grads, _ = _with_correction("mis_seq_truncate", corr)
    _match(slime, "mis_seq_truncate", loss, grads)


def test_seq_mis_matches_slime_mis_sequence_mask(slime):
    b = BATCHES["mis_seq_mask"]
    corr = _correction(b, "seq_mis", lower=0.5, upper=2.0)
    assert corr.seq_rejected.any() and not corr.seq_rejected.all()
    loss, grads, _ = _with_correction("mis_seq_mask", corr, loss_agg_mode="seq-mean-token-mean")
    _match(slime, "mis_seq_mask", loss, grads)


def test_geometric_rejection_matches_slime_mis_geometric_rs(slime):
    """mis.py's geometric-level rejection on top of token TIS: our geo_reject with token_tis."""
    b = BATCHES["mis_geometric_reject"]
    corr = _correction(b, "token_tis", upper=2.0, geo=(0.97, 1.03))
    assert corr.seq_rejected.any() and not corr.seq_rejected.all()
    loss, grads, _ = _with_correction("mis_geometric_reject", corr, loss_agg_mode="seq-mean-token-mean")
    _match(slime, "mis_geometric_reject", loss, grads)


def test_bypass_matches_slime_use_rollout_logprobs(slime):
    """slime's use_rollout_logprobs without recomputed old log-probs: the rollout's are the old policy and
    TIS weighs pi_current / pi_rollout (detached), as our bypass does."""
    b = BATCHES["bypass_tis"]
    current = b.logprobs([x.double() for x in b.logits]).detach()
    corr = _correction(b, "token_tis", upper=2.0, old=current)
    assert (corr.weights == 2.0).any()
    loss, grads, _ = b.ours(dapo_policy_loss, old=b.roll, rollout_is_weights=corr.weights, rollout_is_cap=None)
    _match(slime, "bypass_tis", loss, grads)


def test_mismatch_metrics_match_slime(slime):
    """Per token (calculate_per_token_loss) slime's kl / k3_kl are our k1 / k3 over the step's tokens; its
    per-sample mode averages each sequence's own mean (ours is the token mean): there our metrics of each
    sequence alone, averaged over sequences, are slime's. chi2_seq and log_ppl_diff are per sequence in both."""
    b = BATCHES["mismatch_metrics_token"]
    n = b.mask.shape[0]
    ours = mismatch_sums(b.old, b.roll, b.mask, _correction(b, "none"))
    n_tok = float(b.mask.sum())
    tok = slime["mismatch_metrics_token"]
    slime_tok = sum(tok["num_tokens"])
    assert slime_tok == n_tok  # no empty sample here
    for ours_key, slime_key in (("k1", "mis_kl"), ("k3", "mis_k3_kl")):
        theirs = sum(log[slime_key] for log in tok["logs"]) / slime_tok
        assert math.isclose(ours[ours_key] / n_tok, theirs, rel_tol=1e-5, abs_tol=1e-6), (ours_key, theirs)
    per_seq = [
        mismatch_sums(b.old[i : i + 1], b.roll[i : i + 1], b.mask[i : i + 1], _correction(b, "none")) for i in range(n)
    ]
    sample = slime["mismatch_metrics_sample"]
    pairs = (("k1", "mis_kl", True), ("k3", "mis_k3_kl", True), ("chi2_token", "mis_chi2_token", True))
    pairs += (("chi2_seq", "mis_chi2_seq", False), ("log_ppl_diff", "mis_log_ppl_diff", False))
    for ours_key, slime_key, per_token in pairs:
        theirs = sum(log[slime_key] for log in sample["logs"]) / n
        seq_means = sum(s[ours_key] / (float(b.mask[i].sum()) if per_token else 1.0) for i, s in enumerate(per_seq)) / n
        assert math.isclose(seq_means, theirs, rel_tol=1e-5, abs_tol=1e-6), (ours_key, seq_means, theirs)
        if not per_token:
            assert math.isclose(ours[ours_key] / n, theirs, rel_tol=1e-5, abs_tol=1e-6), ours_key
    whole_chi2 = ours["chi2_token"] / n_tok
    seq_chi2 = sum(log["mis_chi2_token"] for log in sample["logs"]) / n
    assert abs(whole_chi2 - seq_chi2) > 1e-3, "the inputs must show the per-sample convention"


def test_empty_sample_counts_in_slime_denominators(slime):
    """A sample without loss tokens: slime's per-sample mean divides by every sample of the step
    (step_global_batch_size) and its per-token count gives it one token (clamp_min(mask.sum(), 1)); ours
    counts neither. The losses and gradients differ by exactly those ratios."""
    b = BATCHES["empty_sample_seq"]
    n_all, n_seq = b.mask.shape[0], int((b.mask.sum(-1) > 0).sum())
    assert n_seq == n_all - 1
    loss, grads, _ = b.ours(dapo_policy_loss, loss_agg_mode="seq-mean-token-mean", rollout_is_cap=None)
    _match(slime, "empty_sample_seq", loss, grads, scale=n_seq / n_all)
    n_tok = float(b.mask.sum())
    loss, grads, _ = BATCHES["empty_sample_token"].ours(dapo_policy_loss, rollout_is_cap=None)
    assert sum(slime["empty_sample_token"]["num_tokens"]) == n_tok + 1
    _match(slime, "empty_sample_token", loss, grads, scale=n_tok / (n_tok + 1))


def test_extreme_log_ratio_slime_has_no_clamp(slime):
    """A token with log(pi / pi_old) = 100: slime's ratio exp(100) overflows float32 and its gradient is NaN
    (0 * inf through the clipped branch); ours clamps the log-ratio at 20, stays finite, and gives that
    token no gradient. The other tokens agree."""
    b = BATCHES["extreme_log_ratio"]
    res = slime["extreme_log_ratio"]
    assert not all(torch.isfinite(g).all() for g in res["grads"])
    loss, grads, _ = b.ours(dapo_policy_loss, rollout_is_cap=None)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    assert b.sizes[0] > 2, "the extreme token is in the first micro-batch"
    _close(grads[1], res["grads"][1], "the other micro-batch's gradient")

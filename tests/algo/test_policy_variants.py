"""GSPO and CISPO losses, rollout corrections and the rloo / REINFORCE++ advantages against independent
float64 references written from the papers' formulas (loss and gradient, torch.autograd on float64
inputs, per-sequence loops), the global-batch exactness of every policy loss, extreme inputs, and the
kernel dispatcher's word on variants the Triton kernel does not cover."""

from __future__ import annotations

import logging
import math

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
from megatron_dapo.kernels import backend as kernel_backend
from tests.backends import backend_params


@pytest.fixture(params=backend_params())
def be(request):
    """The shared backends (tests/backends.py): the dispatcher runs dapo on the Triton kernel where it can,
    gspo and cispo on torch everywhere."""
    return request.param


def close(actual, expected, atol, rtol=0.0, what=""):
    torch.testing.assert_close(
        actual.detach().double().cpu(), expected.detach().double().cpu(), atol=atol, rtol=rtol, msg=what
    )


def _batch(seed, b=6, s=9, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(b, s, generator=g) * 3).double()
    old = lp + torch.randn(b, s, generator=g).double() * spread
    adv = torch.randn(b, generator=g).double()
    mask = (torch.rand(b, s, generator=g) > 0.25).double()
    mask[1] = 0.0  # an empty sequence
    mask[2] = 0.0
    mask[2, 4] = 1.0  # a one-token sequence
    lp[1] = 40.0  # garbage on padding must not leak
    w = (torch.rand(b, s, generator=g) * 2).double()
    return lp, old, adv, mask, w


# ---------------------------------------------------------------- references from the papers
def ref_gspo(lp, old, adv, mask, low, high, w=None, dual=None):
    """GSPO (arXiv:2507.18071 eq. 5-7): J = 1/G sum_i min(s_i A_i, clip(s_i, 1-low, 1+high) A_i), s_i =
    (pi/pi_old)^(1/|y_i|) differentiated as it is (no stop-gradient construction); loss = -J. Rollout
    weights w must be constant over a sequence (a sequence-level correction): the term is scaled by it."""
    x = lp.clone().requires_grad_()
    terms = []
    for i in range(x.shape[0]):
        idx = [t for t in range(x.shape[1]) if mask[i, t] > 0]
        if not idx:
            continue
        s_i = torch.exp(sum(x[i, t] - old[i, t] for t in idx) / len(idx))
        a = float(adv[i])
        unclipped = -a * s_i
        clipped = -a * torch.clamp(s_i, 1 - low, 1 + high)
        term = torch.maximum(unclipped, clipped)
        if dual is not None and a < 0:
            term = torch.minimum(term, torch.tensor(-a * dual, dtype=torch.float64))
        weight = 1.0 if w is None else sum(float(w[i, t]) for t in idx) / len(idx)
        terms.append(term * weight)
    loss = sum(terms) / len(terms)
    loss.backward()
    return loss.detach(), x.grad


def ref_cispo(lp, old, adv, mask, low, high, w=None):
    """CISPO (arXiv:2506.13585 eq. 4-5): J = 1/sum|o_i| sum_i sum_t sg(clip(r_it, 1-low, 1+high)) A_i
    log pi_it (low None: no lower clip); loss = -J."""
    x = lp.clone().requires_grad_()
    total, n = 0.0, 0
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[i, t] <= 0:
                continue
            r = math.exp(float(lp[i, t] - old[i, t]))
            r = min(r, 1 + high) if low is None else min(max(r, 1 - low), 1 + high)
            weight = r * (1.0 if w is None else float(w[i, t]))
            total = total - weight * float(adv[i]) * x[i, t]
            n += 1
    loss = total / n
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("weights", [False, True], ids=["no-is", "is"])
@pytest.mark.parametrize("dual", [None, 1.0004], ids=["no-dual", "dual"])
def test_gspo_vs_paper(seed, weights, dual):
    lp, old, adv, mask, w = _batch(seed, spread=0.001)  # sequence ratios around GSPO's narrow clip range
    old = old - torch.linspace(-1e-3, 1e-3, old.shape[0]).double()[:, None] * torch.sign(adv)[:, None]
    w = w[:, :1].expand_as(w)  # a sequence-level weight, as seq_tis gives
    low, high = 3e-4, 4e-4
    x = lp.clone().requires_grad_()
    loss, m = gspo_policy_loss(x, old, adv, mask, low, high, dual, rollout_is_weights=w if weights else None)
    loss.backward()
    ref_loss, ref_grad = ref_gspo(lp, old, adv, mask, low, high, w if weights else None, dual)
    close(loss, ref_loss, 1e-12, 1e-10, "gspo loss")
    close(x.grad * mask, ref_grad * mask, 1e-12, 1e-9, "gspo grad")
    assert (x.grad[mask == 0] == 0).all()
    assert m["clipfrac_upper"] + m["clipfrac_lower"] > 0, "the batch must exercise the clip"


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("low", [None, 0.2], ids=["upper-only", "two-sided"])
@pytest.mark.parametrize("weights", [False, True], ids=["no-is", "is"])
def test_cispo_vs_paper(seed, low, weights):
    lp, old, adv, mask, w = _batch(seed, spread=0.5)
    x = lp.clone().requires_grad_()
    loss, m = cispo_policy_loss(x, old, adv, mask, low, 0.28, rollout_is_weights=w if weights else None)
    loss.backward()
    ref_loss, ref_grad = ref_cispo(lp, old, adv, mask, low, 0.28, w if weights else None)
    close(loss, ref_loss, 1e-12, 1e-10, "cispo loss")
    close(x.grad, ref_grad, 1e-12, 1e-9, "cispo grad")
    assert m["clipfrac_upper"] > 0
    assert (m["clipfrac_lower"] > 0) == (low is not None)


def test_gspo_float32_matches_float64():
    lp, old, adv, mask, _ = _batch(3, spread=0.001)
    x32 = lp.float().requires_grad_()
    loss32, _ = gspo_policy_loss(x32, old.float(), adv.float(), mask.float())
    loss32.backward()
    ref_loss, ref_grad = ref_gspo(lp, old, adv, mask, 3e-4, 4e-4)
    close(loss32, ref_loss, 1e-6, 1e-5, "gspo fp32 loss")
    close(x32.grad * mask.float(), ref_grad * mask, 1e-6, 1e-4, "gspo fp32 grad")


# ---------------------------------------------------------------- global-batch exactness
LOSSES = {
    "dapo": (kernel_backend.dapo_policy_loss, dict(clip_ratio_c=3.0), 0.4),
    "gspo": (kernel_backend.gspo_policy_loss, dict(), 0.0005),
    "cispo": (kernel_backend.cispo_policy_loss, dict(), 0.5),
}


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_and_dp_ranks_sum_to_one_batch(be, name, mode):
    """2 simulated DP ranks x uneven micro-batches, with rollout weights: the micro-batch losses (and
    their gradients) averaged over ranks equal the one-batch loss."""
    backend, dev = be
    fn, extra, spread = LOSSES[name]
    lp, old, adv, mask, w = _batch(7, b=9, s=7, spread=spread)
    lp, old, adv, mask, w = (t.float().to(dev) for t in (lp, old, adv, mask, w))
    splits = [[0, 1], [2, 3, 4], [5], [6, 7, 8]]
    full_x = lp.clone().requires_grad_()
    full, _ = fn(full_x, old, adv, mask, loss_agg_mode=mode, rollout_is_weights=w, backend=backend, **extra)
    full.backward()
    n_tok, n_seq = mask.sum().item(), (mask.sum(-1) > 0).sum().item()
    x = lp.clone().requires_grad_()
    total = 0.0
    for rank_mbs in (splits[:2], splits[2:]):
        for rows in rank_mbs:
            loss, _ = fn(
                x[rows],
                old[rows],
                adv[rows],
                mask[rows],
                loss_agg_mode=mode,
                rollout_is_weights=w[rows],
                global_num_tokens=n_tok,
                global_num_seqs=n_seq,
                dp_world_size=2,
                backend=backend,
                **extra,
            )
            (loss / 2).backward()
            total = total + loss.detach() / 2
    close(total, full, 1e-6, 1e-6, f"{name} {mode} loss")
    close(x.grad, full_x.grad, 1e-7, 1e-5, f"{name} {mode} grad")


# ---------------------------------------------------------------- extreme inputs
@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_inputs_stay_finite(be, name, sign):
    backend, dev = be
    fn, extra, _ = LOSSES[name]
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, 0.0, 0.0], [-3.0, -1.0, -2.0], [0.0, 0.0, 0.0]])
    old = lp + torch.tensor([[100.0, -100.0, 100.0], [-100.0, 0.0, 0.0], [-100.0, -100.0, -100.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # one-token, empty
    adv = torch.full((4,), sign)
    w = torch.full((4, 3), math.exp(20.0))  # the largest weight a correction hands out (its clamp)
    lp, old, mask, adv, w = (t.to(dev) for t in (lp, old, mask, adv, w))
    for mode in ("token-mean", "seq-mean-token-mean"):
        for weights in (None, w):
            x = lp.clone().requires_grad_()
            loss, metrics = fn(
                x, old, adv, mask, loss_agg_mode=mode, rollout_is_weights=weights, backend=backend, **extra
            )
            loss.backward()
            assert torch.isfinite(loss), (name, mode)
            assert torch.isfinite(x.grad).all(), (name, mode, x.grad)
            assert all(torch.isfinite(v) for v in metrics.values()), metrics
    # all masked, and no sequences at all
    for rows in (torch.zeros(2, 3, device=dev), torch.zeros(0, 3, device=dev)):
        x = torch.zeros(rows.shape, device=dev).requires_grad_()
        ones = torch.ones(rows.shape[0], device=dev)
        loss, _ = fn(x, x.detach(), ones, rows, loss_agg_mode="seq-mean-token-mean", backend=backend, **extra)
        loss.backward()
        assert float(loss.detach()) == 0.0 and torch.isfinite(x.grad).all()


def test_named_errors():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="cispo_policy_loss: clip_ratio_c"):
        cispo_policy_loss(lp, lp, torch.ones(2), torch.ones(2, 3), clip_ratio_c=3.0)
    with pytest.raises(ValueError, match="gspo_policy_loss: need 0 <= clip_ratio_low"):
        gspo_policy_loss(lp, lp, torch.ones(2), torch.ones(2, 3), clip_ratio_low=1.5)
    with pytest.raises(ValueError, match="gspo_policy_loss: need 0 <= clip_ratio_low"):
        gspo_policy_loss(lp, lp, torch.ones(2), torch.ones(2, 3), clip_ratio_low=None)
    with pytest.raises(ValueError, match="gspo_policy_loss: old_logprobs shape"):
        gspo_policy_loss(lp, torch.zeros(2, 4), torch.ones(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="rollout_correction: mode="):
        rollout_correction(lp, torch.ones(2, 3), mode="tis")
    with pytest.raises(ValueError, match="rollout_correction: need 0 < geo_lower < 1 < geo_upper"):
        rollout_correction(lp, torch.ones(2, 3), geo_lower=1.1, geo_upper=1.2)


# ---------------------------------------------------------------- the kernel dispatcher
def test_dispatcher_names_the_variants_it_runs_on_torch(monkeypatch, caplog):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    assert kernel_backend.policy_loss_backend("dapo", cpu, "triton") == ("triton", None)
    for name in ("gspo", "cispo"):
        chosen, why = kernel_backend.policy_loss_backend(name, cpu, "triton")
        assert chosen == "torch" and f"policy loss {name!r} runs the torch path" in why
        assert kernel_backend.policy_loss_backend(name, cpu, "torch") == ("torch", None)
    monkeypatch.setattr(kernel_backend, "_told", set())
    lp, old, adv, mask, _ = _batch(0, spread=0.0005)
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.kernels.backend"):
        got, _ = kernel_backend.gspo_policy_loss(lp.float(), old.float(), adv.float(), mask.float(), backend="triton")
    assert "policy loss 'gspo' runs the torch path" in caplog.text
    want, _ = gspo_policy_loss(lp.float(), old.float(), adv.float(), mask.float())
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="policy loss 'ppo'"):
        kernel_backend.policy_loss_backend("ppo", cpu)


# ---------------------------------------------------------------- rollout corrections
def ref_correction(lr, mask, mode, lower, upper, geo=None):
    """Per-token weights from the formulas of algo/rollout_correction.py's doc, python floats and loops."""
    b, s = lr.shape
    out = [[0.0] * s for _ in range(b)]
    low = 0.0 if lower is None else lower
    for i in range(b):
        idx = [t for t in range(s) if mask[i, t] > 0]
        seq = math.exp(max(-20.0, min(20.0, sum(float(lr[i, t]) for t in idx))))
        keep = True
        if geo is not None and idx:
            g = math.exp(max(-20.0, min(20.0, sum(float(lr[i, t]) for t in idx) / len(idx))))
            keep = geo[0] <= g <= geo[1]
        for t in idx:
            rho = math.exp(max(-20.0, min(20.0, float(lr[i, t]))))
            if mode == "none":
                v = 1.0
            elif mode == "token_tis":
                v = min(rho, upper)
            elif mode in ("token_mis", "icepop"):
                v = rho if low <= rho <= upper else 0.0
            elif mode == "seq_tis":
                v = min(seq, upper)
            else:
                v = seq if low <= seq <= upper else 0.0
            out[i][t] = v if keep else 0.0
    return torch.tensor(out, dtype=torch.float64)


CORRECTIONS = [
    ("token_tis", None, 2.0, None),
    ("token_mis", None, 2.0, None),
    ("icepop", 0.5, 5.0, None),
    ("seq_tis", None, 2.0, None),
    ("seq_mis", 0.3, 3.0, None),
    ("none", None, 2.0, (0.8, 1.25)),
    ("token_tis", None, 2.0, (0.8, 1.25)),
]


@pytest.mark.parametrize("mode,lower,upper,geo", CORRECTIONS)
def test_rollout_correction_vs_formula(mode, lower, upper, geo):
    g = torch.Generator().manual_seed(5)
    lr = torch.randn(8, 6, generator=g).double() * 0.6
    lr[3] = 100.0  # far beyond the clamp: finite, and rejected by every mask
    lr[4] = -100.0
    mask = (torch.rand(8, 6, generator=g) > 0.2).double()
    mask[5] = 0.0
    got = rollout_correction(lr, mask, mode, lower, upper, *(geo or (None, None)))
    want = ref_correction(lr, mask, mode, lower, upper, geo)
    if got.weights is None:
        assert mode == "none" and geo is None
        return
    close(got.weights, want, 1e-12, 1e-10, mode)
    assert torch.isfinite(got.weights).all()
    assert torch.equal(got.token_rejected, (want == 0) & (mask > 0))
    assert torch.equal(got.seq_rejected, ((want == 0) & (mask > 0)).any(-1))
    if mode in ("token_mis", "icepop", "seq_mis") or geo is not None:  # the rejecting ones
        assert got.token_rejected.any(), "the batch must exercise the rejection"


def test_mismatch_sums_vs_formula():
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(4, 5, generator=g).double() * 2
    roll = old + torch.randn(4, 5, generator=g).double() * 0.3
    mask = (torch.rand(4, 5, generator=g) > 0.3).double()
    mask[2] = 0.0
    corr = rollout_correction(old - roll, mask, "token_mis", None, 1.2)
    got = mismatch_sums(old, roll, mask, corr)
    k1 = k3 = chi2 = chi2s = ppl = 0.0
    rejected_tokens = rejected_seqs = 0
    for i in range(4):
        idx = [t for t in range(5) if mask[i, t] > 0]
        if not idx:
            continue
        for t in idx:
            d = float(old[i, t] - roll[i, t])
            k1 += -d
            k3 += math.exp(d) - 1 - d
            chi2 += math.exp(2 * d) - 1
            rejected_tokens += math.exp(d) > 1.2
        chi2s += math.exp(2 * sum(float(old[i, t] - roll[i, t]) for t in idx)) - 1
        ppl += sum(float(roll[i, t] - old[i, t]) for t in idx) / len(idx)
        rejected_seqs += any(math.exp(float(old[i, t] - roll[i, t])) > 1.2 for t in idx)
    want = dict(
        k1=k1,
        k3=k3,
        chi2_token=chi2,
        chi2_seq=chi2s,
        log_ppl_diff=ppl,
        token_rejected_frac=rejected_tokens,
        seq_rejected_frac=rejected_seqs,
    )
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-9, abs_tol=1e-12), (key, got[key], value)


# ---------------------------------------------------------------- advantages
def test_rloo_vs_formula():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 3.0, 7.0])
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 0])
    got = rloo_advantages(rewards, ids)
    for i in range(len(rewards)):
        others = [float(rewards[j]) for j in range(len(rewards)) if ids[j] == ids[i] and j != i]
        want = float(rewards[i]) - sum(others) / len(others) if others else 0.0
        assert math.isclose(float(got[i]), want, rel_tol=1e-6, abs_tol=1e-6), (i, float(got[i]), want)


def test_reinforce_plus_plus_vs_formula():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0], dtype=torch.float64)
    counts = torch.tensor([3, 5, 0, 2, 7])
    got = reinforce_plus_plus_advantages(rewards, counts)
    tokens = [float(r) for r, c in zip(rewards, counts) for _ in range(int(c))]
    mu = sum(tokens) / len(tokens)
    var = sum((v - mu) ** 2 for v in tokens) / (len(tokens) - 1)
    want = [0.0 if c == 0 else (float(r) - mu) / math.sqrt(var + 1e-8) for r, c in zip(rewards, counts)]
    close(got, torch.tensor(want, dtype=torch.float64), 1e-12, 1e-10, "reinforce++")
    assert torch.equal(reinforce_plus_plus_advantages(rewards, torch.tensor([1, 0, 0, 0, 0])), torch.zeros(5).double())
    with pytest.raises(ValueError, match="reinforce_plus_plus_advantages: rewards holds non-finite"):
        reinforce_plus_plus_advantages(torch.tensor([math.nan, 1.0]), torch.tensor([1, 1]))


def test_mismatch_per_weight_version_lag():
    """k3 and the rejected fraction over the tokens of each lag (a partial rollout mixes lags in one
    response), and the trainer's ratio of the reduced sums."""
    from megatron_dapo.algo.rollout_correction import lag_sums
    from megatron_dapo.trainer.dapo_step import per_lag_metrics

    g = torch.Generator().manual_seed(6)
    old = -torch.rand(3, 5, generator=g).double()
    roll = old + torch.randn(3, 5, generator=g).double() * 0.4
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]).double()
    lags = torch.tensor([[0, 0, 1, 1, -1], [2, 2, 2, 2, 2], [1, 1, -1, -1, -1]])
    corr = rollout_correction(old - roll, mask, "token_mis", None, 1.1)
    got = lag_sums(old, roll, mask, corr, lags)
    assert sorted(got) == [0, 1, 2]
    for k, (n, k3, rejected) in got.items():
        sel = [(i, t) for i in range(3) for t in range(5) if mask[i, t] > 0 and lags[i, t] == k]
        d = [float(old[i, t] - roll[i, t]) for i, t in sel]
        assert n == len(sel)
        assert math.isclose(k3, sum(math.exp(x) - 1 - x for x in d), rel_tol=1e-12)
        assert rejected == sum(math.exp(x) > 1.1 for x in d)
    reduced = {"actor/pg_loss": 1.0}
    for k, (n, k3, rejected) in got.items():
        reduced |= {f"actor/_lag{k}/tokens": n, f"actor/_lag{k}/k3": k3, f"actor/_lag{k}/rejected": rejected}
    out = per_lag_metrics(reduced)
    assert out["actor/pg_loss"] == 1.0 and not any(key.startswith("actor/_lag") for key in out)
    for k, (n, k3, rejected) in got.items():
        assert out[f"actor/mismatch_k3_lag{k}"] == k3 / n
        assert out[f"actor/mismatch_token_rejected_frac_lag{k}"] == rejected / n


def test_trainer_takes_the_variant_and_its_clip_range():
    """DapoStep's loss options and loss function per algo.policy_loss (a hook is imported by name)."""
    from pathlib import Path

    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.dapo_step import correction_options, dapo_loss_options, policy_loss_fn

    tiny = Path(__file__).resolve().parents[2] / "configs" / "qwen3" / "tiny_qwen3_cpu.yaml"
    cfg = load_config(tiny, ["algo.policy_loss=gspo", "algo.loss_agg_mode=seq-mean-token-mean"])
    opts = dapo_loss_options(cfg)
    assert (opts["clip_ratio_low"], opts["clip_ratio_high"], opts["clip_ratio_c"]) == (3e-4, 4e-4, 10.0)
    assert policy_loss_fn(cfg).args == ("gspo",) and opts["rollout_is_cap"] is None
    cfg = load_config(tiny, ["algo.policy_loss=cispo", "algo.cispo.clip_ratio_high=2.0"])
    opts = dapo_loss_options(cfg)
    assert (opts["clip_ratio_low"], opts["clip_ratio_high"], opts["clip_ratio_c"]) == (None, 2.0, None)
    cfg = load_config(tiny, ["algo.policy_loss=tests.algo.test_policy_variants:_my_loss"])
    assert policy_loss_fn(cfg) is _my_loss
    cfg = load_config(tiny, ["algo.rollout_correction.mode=seq_mis", "algo.rollout_correction.geo_reject.enable=true"])
    assert correction_options(cfg) == dict(mode="seq_mis", lower=None, upper=2.0, geo_lower=0.999, geo_upper=1.001)


def _my_loss(*args, **kwargs):
    return cispo_policy_loss(*args, **kwargs)

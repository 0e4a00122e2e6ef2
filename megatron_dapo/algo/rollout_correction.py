"""Rollout correction: weights and rejections from the trainer's old-policy logprobs over the rollout's.

Samples come from a rollout engine whose policy pi_roll differs from the trainer's pi_old (stale weights,
partial rollouts mixing versions, bf16 / MoE routing mismatches). Per loss token, with
lr_t = clamp(old_t - roll_t, -20, 20) and rho_t = exp(lr_t) = pi_old / pi_roll:

    token_tis   w_t = min(rho_t, upper)                                   (truncated IS; Ionides 2008)
    token_mis   w_t = rho_t * 1[lower <= rho_t <= upper]                  (masked IS; lower None = 0)
    icepop      w_t = rho_t * 1[lower <= rho_t <= upper]                  (IcePop, Ring-1T arXiv:2510.18855:
                M(k) = k inside [alpha, beta], 0 outside; the same masked weight, named for the two-sided use)
    seq_tis     w_t = min(rho_i, upper),  rho_i = exp(clamp(sum_t lr_t, -20, 20))   (every token of i)
    seq_mis     w_t = rho_i * 1[lower <= rho_i <= upper]
    none        w_t = 1
    geometric rejection (on top of any mode): g_i = exp(sum_t lr_t / n_i); a response with g_i outside
                [geo_lower, geo_upper] gets w_t = 0 on every token.

A rejected token keeps its place in the loss normalisers (they are fixed for the whole step before
the first micro-batch, which keeps micro-batch losses summing to the one-batch loss); its weight is 0.
Weights are data (detached). A response never straddles micro-batches (trainer/packing.py) and the
loss sees whole sequences under context parallelism (trainer/cp_split.py gathers them), so the
per-sequence sums here are complete.

Mismatch metrics (`mismatch_sums`) are sums over the micro-batch; the trainer divides them by the
step's global token or sequence counts, so they add up over micro-batches and DP ranks:
    k1     = mean_t (roll_t - old_t)                    KL(pi_roll || pi_old), k1 estimator
    k3     = mean_t (rho_t - 1 - lr_t)                  KL(pi_roll || pi_old), k3 (Schulman 2020)
    chi2_token = mean_t rho_t^2 - 1;   chi2_seq = mean_i rho_i^2 - 1
    log_ppl_diff = mean_i (mean_t roll_t - mean_t old_t)  (log PPL_old - log PPL_roll)
    token_rejected_frac, seq_rejected_frac: loss tokens / sequences with weight 0 (any token, for seqs)
Per weight-version lag k (`lag_sums`): k3 and the rejected-token fraction over the tokens generated k
versions behind the trainer (partial rollouts mix lags inside one response).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dapo.algo.loss import LOG_RATIO_BOUND

CORRECTION_MODES = ("none", "token_tis", "token_mis", "icepop", "seq_tis", "seq_mis")
MISMATCH_TOKEN_METRICS = ("k1", "k3", "chi2_token", "token_rejected_frac")
MISMATCH_SEQ_METRICS = ("chi2_seq", "log_ppl_diff", "seq_rejected_frac")


@dataclass(frozen=True)
class Correction:
    """Per-token weights [B, S] (detached, 0 on padding and on rejected tokens; None = no weighting) and
    which loss tokens [B, S] / sequences [B] were rejected (weight 0)."""

    weights: torch.Tensor | None
    token_rejected: torch.Tensor
    seq_rejected: torch.Tensor


def _check(log_ratio, loss_mask, mode, lower, upper, geo_lower, geo_upper) -> None:
    name = "rollout_correction"
    if mode not in CORRECTION_MODES:
        raise ValueError(f"{name}: mode={mode!r}, expected one of {CORRECTION_MODES}")
    if log_ratio.dim() != 2 or loss_mask.shape != log_ratio.shape:
        raise ValueError(
            f"{name}: log_ratio {tuple(log_ratio.shape)} and loss_mask {tuple(loss_mask.shape)} must be one [B, S]"
        )
    if mode != "none" and not (upper is not None and upper > 0):
        raise ValueError(f"{name}: mode={mode} needs upper > 0, got {upper}")
    if lower is not None and not (0 <= lower < (upper or float("inf"))):
        raise ValueError(f"{name}: need 0 <= lower < upper, got lower={lower}, upper={upper}")
    if (geo_lower is None) != (geo_upper is None):
        raise ValueError(f"{name}: geometric rejection needs both geo_lower and geo_upper")
    if geo_lower is not None and not 0 < geo_lower < 1 < geo_upper:
        raise ValueError(f"{name}: need 0 < geo_lower < 1 < geo_upper, got {geo_lower}, {geo_upper}")


def rollout_correction(
    log_ratio: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str = "token_tis",
    lower: float | None = None,
    upper: float | None = 2.0,
    geo_lower: float | None = None,
    geo_upper: float | None = None,
) -> Correction:
    """The correction of one micro-batch (module doc). log_ratio = old - rollout logprobs, [B, S]."""
    _check(log_ratio, loss_mask, mode, lower, upper, geo_lower, geo_upper)
    mask = loss_mask.bool()
    dtype = torch.promote_types(log_ratio.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=log_ratio.device)
    lr = torch.where(mask, log_ratio.detach().to(dtype), zero)
    low = 0.0 if lower is None else lower
    if mode == "none":
        weights = None
    elif mode in ("token_tis", "token_mis", "icepop"):
        rho = torch.exp(lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        if mode == "token_tis":
            weights = rho.clamp(max=upper)
        else:
            weights = torch.where((rho >= low) & (rho <= upper), rho, zero)
    else:  # seq_tis / seq_mis
        rho = torch.exp(lr.sum(-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        rho = rho.clamp(max=upper) if mode == "seq_tis" else torch.where((rho >= low) & (rho <= upper), rho, zero)
        weights = rho[:, None].expand_as(lr)
    if geo_lower is not None:
        n = mask.sum(-1).clamp(min=1).to(dtype)
        geo = torch.exp((lr.sum(-1) / n).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        keep = (geo >= geo_lower) & (geo <= geo_upper)
        weights = (torch.ones_like(lr) if weights is None else weights) * keep[:, None].to(dtype)
    if weights is None:
        token_rejected = torch.zeros_like(mask)
    else:
        weights = torch.where(mask, weights, zero)
        token_rejected = mask & (weights == 0)
    return Correction(weights, token_rejected, token_rejected.any(-1))


def lag_sums(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    correction: Correction,
    lags: torch.Tensor,
) -> dict[int, tuple[float, float, float]]:
    """Per weight-version lag k (lags [B, S]: versions between the token's generating weights and the
    trainer's): (loss tokens, sum of k3, rejected tokens) over the tokens of lag k."""
    mask = loss_mask.bool()
    lr = (old_logprobs.detach().double() - rollout_logprobs.detach().double()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    k3 = torch.exp(lr) - 1 - lr
    out = {}
    for k in sorted(set(lags[mask].tolist())):
        sel = mask & (lags == k)
        out[int(k)] = (float(sel.sum()), float(k3[sel].sum()), float((correction.token_rejected & sel).sum()))
    return out


def mismatch_sums(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, correction: Correction
) -> dict[str, float]:
    """Sums over the micro-batch of the mismatch metrics (module doc): MISMATCH_TOKEN_METRICS are to be
    divided by the step's loss-token count, MISMATCH_SEQ_METRICS by its sequence count (sequences with
    at least one loss token; the others contribute nothing)."""
    mask = loss_mask.bool()
    dtype = torch.float64
    zero = torch.zeros((), dtype=dtype, device=old_logprobs.device)
    old = torch.where(mask, old_logprobs.detach().to(dtype), zero)
    roll = torch.where(mask, rollout_logprobs.detach().to(dtype), zero)
    lr = (old - roll).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    rho = torch.where(mask, torch.exp(lr), zero)
    n = mask.sum(-1).to(dtype)
    has = n > 0
    seq_lr = lr.sum(-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    per_seq_ppl = (roll.sum(-1) - old.sum(-1)) / n.clamp(min=1)
    return {
        "k1": float((roll - old).sum()),
        "k3": float(torch.where(mask, rho - 1 - lr, zero).sum()),
        "chi2_token": float(torch.where(mask, rho * rho - 1, zero).sum()),
        "token_rejected_frac": float(correction.token_rejected.sum()),
        "chi2_seq": float(torch.where(has, torch.exp(2 * seq_lr) - 1, zero).sum()),
        "log_ppl_diff": float(torch.where(has, per_seq_ppl, zero).sum()),
        "seq_rejected_frac": float((correction.seq_rejected & has).sum()),
    }

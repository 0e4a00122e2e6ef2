"""DAPO policy-gradient loss: asymmetric (clip-higher) PPO clip, optional dual clip, truncated
rollout importance weights, and loss aggregation that is exact over the global batch.

Per token (A = advantage, r = exp(clamp(logprob - old_logprob, -20, 20))):

    L_t = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
    L_t = min(L_t, -A clip_ratio_c)        if clip_ratio_c is set and A < 0   (dual clip)
    L_t = min(w_t, rollout_is_cap) * L_t   if rollout_is_weights is given      (weight detached)

Clipping counts as *active* only when strictly beyond the bound (upper: A > 0 and
r > 1 + high; lower: A < 0 and r < 1 - low; dual: A < 0 and -A r > -A c, i.e. r > c); an active
branch carries no gradient, a tie carries the unclipped gradient -A r.

The log-ratio is clamped to [-LOG_RATIO_BOUND, LOG_RATIO_BOUND] = [-20, 20] before exp, as verl's
`compute_policy_loss` does: without it a token with log-ratio above ~88.7 overflows exp in fp32,
and its zero-weight branch still yields 0 * inf = NaN in backward. A token beyond the bound gets no
gradient (the clamp is flat there), whichever branch is active; metrics use the clamped value too.

GSPO (Zheng et al. 2025, arXiv:2507.18071 "Group Sequence Policy Optimization", eq. 5-7 and 10)
-------------------------------------------------------------------------------------------------
    log s_i  = clamp(sum_t m_t (logprob_t - old_t) / n_i, -20, 20)        (geometric-mean sequence ratio)
    s_i,t    = sg[s_i] * pi_t / sg[pi_t]      value s_i, gradient s_i * grad log pi_t
    L_it     = max(-A_i s_i,t, -A_i clip(s_i,t, 1 - clip_ratio_low, 1 + clip_ratio_high)) (dual clip as DAPO)
Aggregated by loss_agg_mode (the paper's objective is seq-mean-token-mean: the mean over a sequence's
tokens of a value constant in t is the sequence term, and its gradient is the paper's eq. 10). A
sequence whose mean log-ratio is beyond the bound gets no gradient. Defaults 3e-4 / 4e-4 (paper, sec. 5.1).

CISPO (MiniMax 2025, arXiv:2506.13585 "MiniMax-M1", eq. 4-5)
------------------------------------------------------------
    w_t = sg[clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high)]   (clip_ratio_low None: no lower bound)
    L_t = -A w_t logprob_t
No token is dropped from the gradient (the weight is clipped, not the update). The loss value depends
on the logprobs themselves; its gradient -A w_t grad log pi_t is what matters.

Global normalisation (micro-batch losses that sum to the one-big-batch loss)
------------------------------------------------------------------------------
A training step sees M micro-batches on each of D data-parallel ranks. DDP averages gradients
over the D ranks and the M micro-batch backwards add up, so a micro-batch loss must be its share
of the whole step's loss times D:

    token-mean:   loss_mb = sum_{t in mb} L_t / N_tok * D
                  N_tok = global_num_tokens = loss tokens over all M micro-batches and D ranks
    seq-mean-*:   loss_mb = sum_{i in mb} l_i / N_seq * D
                  N_seq = global_num_seqs = sequences with >= 1 loss token over all M x D
                  l_i = sum_t L_it                          (seq-mean-token-sum)
                  l_i = sum_t L_it / n_i                    (seq-mean-token-mean, n_i = loss tokens of i)
                  l_i = sum_t L_it / token_sum_norm         (seq-mean-token-sum-norm, Dr.GRPO;
                        token_sum_norm defaults to the padded length S and should be a constant
                        such as max_response_length)
    D = dp_world_size.

Then sum over micro-batches, averaged over DP ranks, equals the loss of the whole step as one
batch, and so do the gradients. With global_num_tokens / global_num_seqs None the micro-batch is
the whole batch (local denominators, D ignored). Sequences without loss tokens contribute nothing
and are not counted.

Metrics (detached) use the same rule, so each additive metric summed over micro-batches and
averaged over DP ranks is its global value: clipfrac_upper / clipfrac_lower / clipfrac_dual
(fraction of loss tokens where that clip is active), approx_kl (k3 = r - 1 - log r, Schulman's
low-variance unbiased estimator of KL(pi_old || pi)), ratio_mean; these are normalised by
global_num_tokens (times D) when it is given, else by the local token count. ratio_max is the
local max over loss tokens (combine with MAX; 0 when there are none). num_tokens / num_seqs are
local counts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Columns of the per-sequence partial sums shared by the torch and Triton paths.
ROW_LOSS, ROW_TOKENS, ROW_UPPER, ROW_LOWER, ROW_DUAL, ROW_RATIO, ROW_KL, ROW_RATIO_MAX = range(8)
NUM_ROW_STATS = 8
# |logprob - old_logprob| is clamped to this before exp (verl core_algos.compute_policy_loss).
LOG_RATIO_BOUND = 20.0

# A backend's per-sequence partials: (logprobs, old_logprobs, advantages, loss_mask, clip_ratio_low,
# clip_ratio_high, clip_ratio_c, rollout_is_weights, rollout_is_cap) on [B, S] rows -> [B, NUM_ROW_STATS].
RowStats = Callable[..., torch.Tensor]


def check_loss_shapes(
    logprobs, old_logprobs, advantages, loss_mask, rollout_is_weights, loss_agg_mode, name="dapo_policy_loss"
) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"{name}: loss_agg_mode={loss_agg_mode!r}, expected one of {LOSS_AGG_MODES}")
    for field, t in (("old_logprobs", old_logprobs), ("loss_mask", loss_mask)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name}: {field} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if rollout_is_weights is not None and rollout_is_weights.shape != logprobs.shape:
        raise ValueError(
            f"{name}: rollout_is_weights shape {tuple(rollout_is_weights.shape)} != logprobs shape "
            f"{tuple(logprobs.shape)}"
        )
    if advantages.shape != logprobs.shape and advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"{name}: advantages shape {tuple(advantages.shape)} must be logprobs shape "
            f"{tuple(logprobs.shape)} or per sequence {tuple(logprobs.shape[:1])}"
        )
    if logprobs.dim() not in (1, 2) or (logprobs.dim() == 1 and loss_agg_mode != "token-mean"):
        raise ValueError(
            f"{name}: logprobs must be [batch, seq] (or [tokens] for token-mean), "
            f"got shape {tuple(logprobs.shape)} with {loss_agg_mode}"
        )


def check_loss_settings(
    clip_ratio_low,
    clip_ratio_high,
    clip_ratio_c,
    global_num_tokens,
    global_num_seqs,
    dp_world_size,
    rollout_is_cap,
    name="dapo_policy_loss",
) -> None:
    # only CISPO takes no lower bound (None): its weight is clipped above only, as in the paper
    no_low = clip_ratio_low is None and name == "cispo_policy_loss"
    if not (no_low or (clip_ratio_low is not None and 0 <= clip_ratio_low < 1)) or not clip_ratio_high >= 0:
        raise ValueError(
            f"{name}: need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got {clip_ratio_low}, {clip_ratio_high}"
        )
    if clip_ratio_c is not None and not clip_ratio_c > 1:
        raise ValueError(f"{name}: clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")
    for field, v in (("global_num_tokens", global_num_tokens), ("global_num_seqs", global_num_seqs)):
        if v is not None and not float(v) > 0:
            raise ValueError(f"{name}: {field} must be > 0, got {v}")
    if int(dp_world_size) < 1:
        raise ValueError(f"{name}: dp_world_size must be >= 1, got {dp_world_size}")
    if rollout_is_cap is not None and not rollout_is_cap > 0:
        raise ValueError(f"{name}: rollout_is_cap must be > 0, got {rollout_is_cap}")


def as_rows(logprobs, old_logprobs, advantages, loss_mask, rollout_is_weights):
    """[B, S] views (a 1-D token-mean input is one row); advantages broadcast to tokens."""
    if logprobs.dim() == 1:
        logprobs, old_logprobs, loss_mask = logprobs[None], old_logprobs[None], loss_mask[None]
        advantages = advantages[None]
        rollout_is_weights = None if rollout_is_weights is None else rollout_is_weights[None]
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    return logprobs, old_logprobs, advantages, loss_mask, rollout_is_weights


def _compute_dtype(logprobs):
    return torch.promote_types(logprobs.dtype, torch.float32)


def _token_log_ratio(logprobs, old_logprobs, mask, cdtype):
    """log(pi / pi_old) per token, 0 on padding (any value may sit there), clamped to +-LOG_RATIO_BOUND
    so exp() stays finite on loss tokens (a token beyond the bound gets no gradient)."""
    log_ratio = torch.where(mask, logprobs.to(cdtype) - old_logprobs.to(cdtype), torch.zeros((), dtype=cdtype))
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _clipped_rows(
    ratio, kl_log_ratio, adv, mask, clip_ratio_low, clip_ratio_high, clip_ratio_c, rollout_is_weights, rollout_is_cap
):
    """The PPO clip (asymmetric, optional dual) of per-token `ratio` (carrying the gradient) and the
    per-sequence partials [B, NUM_ROW_STATS]: shared by DAPO (token ratio) and GSPO (sequence ratio)."""
    cdtype = ratio.dtype
    upper = mask & (adv > 0) & (ratio > 1 + clip_ratio_high)
    lower = mask & (adv < 0) & (ratio < 1 - clip_ratio_low)
    pg = -adv * torch.where(upper | lower, ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high).detach(), ratio)
    if clip_ratio_c is not None:
        dual_bound = -adv * clip_ratio_c
        dual = mask & (adv < 0) & (pg > dual_bound)
        pg = torch.where(dual, dual_bound, pg)
    else:
        dual = torch.zeros_like(mask)
    return _rows(pg, ratio, kl_log_ratio, mask, upper, lower, dual, rollout_is_weights, rollout_is_cap, cdtype)


def _rows(pg, ratio, kl_log_ratio, mask, upper, lower, dual, rollout_is_weights, rollout_is_cap, cdtype):
    """Per-sequence partials [B, NUM_ROW_STATS] of per-token losses `pg` (ROW_LOSS carries the gradient)."""
    if rollout_is_weights is not None:
        w = rollout_is_weights.detach().to(cdtype)
        pg = pg * (w if rollout_is_cap is None else w.clamp(max=rollout_is_cap))
    zero = torch.zeros((), dtype=cdtype, device=pg.device)
    pg = torch.where(mask, pg, zero)
    with torch.no_grad():
        r = ratio.detach()
        k3 = torch.where(mask, torch.exp(kl_log_ratio) - 1 - kl_log_ratio, zero)
        stats = [
            mask.sum(-1).to(cdtype),
            upper.sum(-1).to(cdtype),
            lower.sum(-1).to(cdtype),
            dual.sum(-1).to(cdtype),
            torch.where(mask, r, zero).sum(-1),
            k3.sum(-1),
            torch.where(mask, r, zero).amax(-1),
        ]
    return torch.stack([pg.sum(-1), *stats], dim=-1)


def row_stats_torch(
    logprobs,
    old_logprobs,
    advantages,
    loss_mask,
    clip_ratio_low,
    clip_ratio_high,
    clip_ratio_c,
    rollout_is_weights,
    rollout_is_cap,
) -> torch.Tensor:
    """DAPO's per-sequence partial sums [B, NUM_ROW_STATS]; column ROW_LOSS carries the gradient."""
    cdtype = _compute_dtype(logprobs)
    mask = loss_mask.bool()
    log_ratio = _token_log_ratio(logprobs, old_logprobs, mask, cdtype)
    return _clipped_rows(
        torch.exp(log_ratio),
        log_ratio.detach(),
        advantages.to(cdtype),
        mask,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        rollout_is_weights,
        rollout_is_cap,
    )


def row_stats_gspo(
    logprobs,
    old_logprobs,
    advantages,
    loss_mask,
    clip_ratio_low,
    clip_ratio_high,
    clip_ratio_c,
    rollout_is_weights,
    rollout_is_cap,
) -> torch.Tensor:
    """GSPO's per-sequence partials (module doc, "GSPO"): the clip acts on the sequence ratio s_i, each
    token carrying s_i,t = sg[s_i] * pi_t / sg[pi_t] (value s_i, gradient s_i * grad log pi_t)."""
    cdtype = _compute_dtype(logprobs)
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=cdtype, device=logprobs.device)
    lp = torch.where(mask, logprobs.to(cdtype), zero)
    token_log_ratio = torch.where(mask, lp - old_logprobs.to(cdtype), zero)
    n = mask.sum(-1).to(cdtype)
    seq_log_ratio = (token_log_ratio.sum(-1) / n.clamp(min=1)).detach()
    # Beyond the bound the sequence ratio is flat (no gradient), as DAPO's clamped token ratio is.
    inside = seq_log_ratio.abs() <= LOG_RATIO_BOUND
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    log_s = seq_log_ratio[:, None] + torch.where(inside[:, None] & mask, lp - lp.detach(), zero)
    kl_log_ratio = token_log_ratio.detach().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return _clipped_rows(
        torch.exp(log_s),
        kl_log_ratio,
        advantages.to(cdtype),
        mask,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        rollout_is_weights,
        rollout_is_cap,
    )


def row_stats_cispo(
    logprobs,
    old_logprobs,
    advantages,
    loss_mask,
    clip_ratio_low,
    clip_ratio_high,
    clip_ratio_c,
    rollout_is_weights,
    rollout_is_cap,
) -> torch.Tensor:
    """CISPO's per-sequence partials (module doc, "CISPO"): REINFORCE on log pi weighted by the clipped,
    detached token ratio. clip_ratio_low None = no lower bound (the paper's setting); no dual clip."""
    if clip_ratio_c is not None:
        raise ValueError("cispo_policy_loss: clip_ratio_c (dual clip) does not apply to CISPO; pass None")
    cdtype = _compute_dtype(logprobs)
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=cdtype, device=logprobs.device)
    log_ratio = _token_log_ratio(logprobs, old_logprobs, mask, cdtype).detach()
    ratio = torch.exp(log_ratio)
    upper = mask & (ratio > 1 + clip_ratio_high)
    if clip_ratio_low is None:
        lower = torch.zeros_like(mask)
        weight = ratio.clamp(max=1 + clip_ratio_high)
    else:
        lower = mask & (ratio < 1 - clip_ratio_low)
        weight = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    adv = advantages.to(cdtype)
    pg = -adv * weight * torch.where(mask, logprobs.to(cdtype), zero)
    return _rows(
        pg, ratio, log_ratio, mask, upper, lower, torch.zeros_like(mask), rollout_is_weights, rollout_is_cap, cdtype
    )


def aggregate_rows(
    rows: torch.Tensor,
    loss_agg_mode: str,
    global_num_tokens=None,
    global_num_seqs=None,
    dp_world_size: int = 1,
    token_sum_norm=None,
    seq_len: int = 1,
):
    """Loss and metrics from per-sequence partials, with the global normalisation of the module doc."""
    n_tok = rows[:, ROW_TOKENS]
    has_tokens = n_tok > 0
    if global_num_tokens is None:
        tok_scale = 1.0 / n_tok.sum().clamp(min=1)
    else:
        tok_scale = float(dp_world_size) / float(global_num_tokens)
    if global_num_seqs is None:
        seq_scale = 1.0 / has_tokens.sum().clamp(min=1).to(rows.dtype)
    else:
        seq_scale = float(dp_world_size) / float(global_num_seqs)
    seq_loss = rows[:, ROW_LOSS]
    if loss_agg_mode == "token-mean":
        loss = seq_loss.sum() * tok_scale
    elif loss_agg_mode == "seq-mean-token-sum":
        loss = seq_loss.sum() * seq_scale
    elif loss_agg_mode == "seq-mean-token-mean":
        loss = (seq_loss / n_tok.clamp(min=1)).sum() * seq_scale
    else:  # seq-mean-token-sum-norm
        norm = float(seq_len if token_sum_norm is None else token_sum_norm)
        loss = seq_loss.sum() / norm * seq_scale
    with torch.no_grad():
        metrics = {
            "clipfrac_upper": rows[:, ROW_UPPER].sum() * tok_scale,
            "clipfrac_lower": rows[:, ROW_LOWER].sum() * tok_scale,
            "clipfrac_dual": rows[:, ROW_DUAL].sum() * tok_scale,
            "approx_kl": rows[:, ROW_KL].sum() * tok_scale,
            "ratio_mean": rows[:, ROW_RATIO].sum() * tok_scale,
            "ratio_max": rows[:, ROW_RATIO_MAX].max() if rows.shape[0] else rows.new_zeros(()),
            "num_tokens": n_tok.sum(),
            "num_seqs": has_tokens.sum().to(rows.dtype),
        }
    return loss, metrics


def dapo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: int | float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    global_num_seqs: int | float | None = None,
    dp_world_size: int = 1,
    rollout_is_cap: float | None = 2.0,
    token_sum_norm: float | None = None,
    row_stats: RowStats = row_stats_torch,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO clipped policy loss of one micro-batch (pure torch reference; formulas in the module doc).

    logprobs, old_logprobs, loss_mask, rollout_is_weights: [B, S] (or [T] for token-mean);
    advantages: [B, S] or per sequence [B]. rollout_is_weights are raw per-token weights
    pi_old / pi_rollout; they are truncated at rollout_is_cap (None = no truncation) and detached.
    row_stats computes the per-sequence partials (the Triton backend passes its fused kernel here,
    so both backends share these checks, the row views and the aggregation).
    Returns (scalar loss, metrics dict of detached scalars).
    """
    return policy_loss(
        "dapo_policy_loss",
        row_stats,
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        loss_agg_mode,
        global_num_tokens,
        rollout_is_weights,
        global_num_seqs,
        dp_world_size,
        rollout_is_cap,
        token_sum_norm,
    )


def policy_loss(
    name,
    row_stats,
    logprobs,
    old_logprobs,
    advantages,
    loss_mask,
    clip_ratio_low,
    clip_ratio_high,
    clip_ratio_c,
    loss_agg_mode,
    global_num_tokens,
    rollout_is_weights,
    global_num_seqs,
    dp_world_size,
    rollout_is_cap,
    token_sum_norm,
):
    """The checks, row views and global aggregation every policy loss shares; `row_stats` is the variant."""
    check_loss_shapes(logprobs, old_logprobs, advantages, loss_mask, rollout_is_weights, loss_agg_mode, name)
    check_loss_settings(
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        global_num_tokens,
        global_num_seqs,
        dp_world_size,
        rollout_is_cap,
        name,
    )
    lp, old, adv, mask, w = as_rows(logprobs, old_logprobs, advantages, loss_mask, rollout_is_weights)
    rows = row_stats(lp, old, adv, mask, clip_ratio_low, clip_ratio_high, clip_ratio_c, w, rollout_is_cap)
    return aggregate_rows(
        rows, loss_agg_mode, global_num_tokens, global_num_seqs, dp_world_size, token_sum_norm, seq_len=lp.shape[-1]
    )


# GSPO's clip range (Zheng et al. 2025, arXiv:2507.18071, sec. 5.1: 3e-4 left, 4e-4 right).
GSPO_CLIP_RATIO_LOW, GSPO_CLIP_RATIO_HIGH = 3e-4, 4e-4


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_ratio_low: float = GSPO_CLIP_RATIO_LOW,
    clip_ratio_high: float = GSPO_CLIP_RATIO_HIGH,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_num_tokens: int | float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    global_num_seqs: int | float | None = None,
    dp_world_size: int = 1,
    rollout_is_cap: float | None = None,
    token_sum_norm: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO clipped loss on the sequence ratio (module doc, "GSPO"); arguments as `dapo_policy_loss`.
    A [T] token-mean input is one sequence. ratio_mean / ratio_max report the sequence ratio; approx_kl
    is the token k3 as for DAPO."""
    return policy_loss(
        "gspo_policy_loss",
        row_stats_gspo,
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        loss_agg_mode,
        global_num_tokens,
        rollout_is_weights,
        global_num_seqs,
        dp_world_size,
        rollout_is_cap,
        token_sum_norm,
    )


def cispo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: int | float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    global_num_seqs: int | float | None = None,
    dp_world_size: int = 1,
    rollout_is_cap: float | None = None,
    token_sum_norm: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO loss (module doc, "CISPO"); arguments as `dapo_policy_loss`, clip_ratio_low None = no lower
    bound on the weight, clip_ratio_c must be None. clipfrac_upper / _lower count clipped weights."""
    return policy_loss(
        "cispo_policy_loss",
        row_stats_cispo,
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        loss_agg_mode,
        global_num_tokens,
        rollout_is_weights,
        global_num_seqs,
        dp_world_size,
        rollout_is_cap,
        token_sum_norm,
    )


POLICY_LOSSES = {"dapo": dapo_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss}

"""Plain float64 references for the DAPO algorithm tests (python floats and loops on purpose:
nothing here calls megatron_dapo, so a shared mistake cannot hide in both sides).

Imported by tests/test_algo*.py and by the torchrun workers in this directory.
"""

from __future__ import annotations

import math

import torch


def ref_group_advantages(rewards, group_ids, norm_by_std=True, eps=1e-6):
    r = [float(v) for v in rewards]
    g = [int(v) for v in group_ids]
    out = []
    for i, gi in enumerate(g):
        members = [r[j] for j in range(len(r)) if g[j] == gi]
        n = len(members)
        if n == 1:
            out.append(0.0)
            continue
        mean = sum(members) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in members) / (n - 1))
        out.append((r[i] - mean) / (std + eps) if norm_by_std else r[i] - mean)
    return torch.tensor(out, dtype=torch.float64)


def ref_filter(metric, group_ids, threshold=0.5):
    m = [float(v) for v in metric]
    g = [int(v) for v in group_ids]
    groups = {}
    for v, gi in zip(m, g):
        groups.setdefault(gi, []).append(v)
    kept = {gi for gi, vs in groups.items() if max(vs) != min(vs)}
    correct = sum(1 for gi, vs in groups.items() if gi not in kept and vs[0] >= threshold)
    wrong = len(groups) - len(kept) - correct
    return [gi in kept for gi in g], len(groups), len(kept), correct, wrong


def ref_token_loss(lp, old, a, low, high, c, w, cap):
    r = math.exp(min(max(lp - old, -20.0), 20.0))  # verl clamps the log-ratio to [-20, 20] before exp
    loss = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
    if c is not None and a < 0:
        loss = min(loss, -a * c)
    if w is not None:
        loss *= w if cap is None else min(w, cap)
    return loss


def ref_policy_loss(
    lp,
    old,
    adv,
    mask,
    *,
    low=0.2,
    high=0.28,
    c=None,
    mode="token-mean",
    n_tok=None,
    n_seq=None,
    dp=1,
    w=None,
    cap=2.0,
    norm=None,
    only=None,
):
    """Loss of a [B, S] micro-batch as python floats; adv is [B] or [B, S].

    only=(i, t): the share of token (i, t) alone (the others count but add 0), for gradients."""
    lp, old, mask = lp.double().tolist(), old.double().tolist(), mask.double().tolist()
    adv = adv.double()
    adv = adv[:, None].expand(len(lp), len(lp[0])).tolist() if adv.dim() == 1 else adv.tolist()
    w = None if w is None else w.double().tolist()
    seq_sums, seq_counts = [], []
    for i in range(len(lp)):
        s, n = 0.0, 0
        for t in range(len(lp[i])):
            if mask[i][t] > 0:
                if only is None or only == (i, t):
                    s += ref_token_loss(
                        lp[i][t], old[i][t], adv[i][t], low, high, c, None if w is None else w[i][t], cap
                    )
                n += 1
        seq_sums.append(s)
        seq_counts.append(n)
    if mode == "token-mean":
        return sum(seq_sums) / n_tok * dp if n_tok is not None else sum(seq_sums) / max(sum(seq_counts), 1)
    valid = [i for i in range(len(lp)) if seq_counts[i] > 0]
    scale = dp / n_seq if n_seq is not None else 1.0 / max(len(valid), 1)
    if mode == "seq-mean-token-sum":
        return sum(seq_sums[i] for i in valid) * scale
    if mode == "seq-mean-token-mean":
        return sum(seq_sums[i] / seq_counts[i] for i in valid) * scale
    if mode == "seq-mean-token-sum-norm":
        return sum(seq_sums[i] for i in valid) / (len(lp[0]) if norm is None else norm) * scale
    raise ValueError(mode)


def ref_policy_loss_grad(lp, *args, h=1e-6, **kwargs):
    """d loss / d logprobs by central differences of ref_policy_loss (float64), token by token: the
    loss is a sum of per-token shares, and a share alone keeps full precision next to huge ones."""
    base = lp.double().clone()
    grad = torch.zeros_like(base)
    for i in range(base.shape[0]):
        for t in range(base.shape[1]):
            up, down = base.clone(), base.clone()
            up[i, t] += h
            down[i, t] -= h
            grad[i, t] = (
                ref_policy_loss(up, *args, only=(i, t), **kwargs) - ref_policy_loss(down, *args, only=(i, t), **kwargs)
            ) / (2 * h)
    return grad


def ref_logprobs_entropy(logits, target, temperature=1.0):
    """Naive float64 formula (full log_softmax), differentiable for gradient references."""
    x = logits.double() / temperature
    logp = torch.log_softmax(x, dim=-1)
    vocab = x.shape[-1]
    safe = target.clamp(0, vocab - 1)
    picked = logp.gather(-1, safe[..., None]).squeeze(-1)
    inside = (target >= 0) & (target < vocab)
    # an id outside the vocabulary (padding) has logprob 0 and no gradient
    lp = torch.where(inside, picked, torch.zeros_like(picked))
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def ref_overlong(length, max_len, buffer, penalty):
    start = max_len - buffer
    if length <= start:
        return 0.0
    if length <= max_len:
        return (start - length) / buffer * penalty
    return -penalty

"""Token sampling with SGLang's semantics (pure functions over a batch of logits).

As in SGLang 0.5.23's `srt/layers/sampler.py`: temperature < 1e-6 means greedy, whose reported
logprob is log_softmax(logits); otherwise the sampled token's logprob is taken from
log_softmax(logits / temperature) BEFORE top-k / top-p filtering, and the token is drawn from the
filtered, renormalised distribution. top_k <= 0 (SGLang's -1) keeps the whole vocabulary.
"""

from __future__ import annotations

import torch

GREEDY_EPS = 1e-6  # SGLang's _SAMPLING_EPS


def effective_temperature(t: float) -> float:
    return 1.0 if t < GREEDY_EPS else t


def filter_top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero out tokens outside each row's top-k and top-p nucleus; rows are not renormalised."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).expand_as(sorted_p)
    k = torch.where(top_k > 0, top_k, probs.shape[-1]).unsqueeze(-1)
    # keep a token if the mass strictly before it is < top_p (so the top token always stays)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    keep = (ranks < k) & (mass_before < top_p.unsqueeze(-1))
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns (tokens [B], logprobs of those tokens [B]), float32 math."""
    logits = logits.float()
    greedy = temperature < GREEDY_EPS
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    logp = torch.log_softmax(logits / temp, dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    if not bool(greedy.all()):
        probs = filter_top_k_top_p(logp.exp(), top_k, top_p)
        drawn = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        tokens = torch.where(greedy, tokens, drawn)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

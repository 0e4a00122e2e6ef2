"""Token sampling with SGLang's semantics (pure functions over a batch of logits).

As in SGLang 0.5.23's `srt/layers/sampler.py`: temperature < 1e-6 means greedy, whose reported
logprob is log_softmax(logits); otherwise the sampled token's logprob is taken from
log_softmax(logits / temperature) BEFORE top-k / top-p filtering, and the token is drawn from the
filtered, renormalised distribution. top_k <= 0 (SGLang's -1) keeps the whole vocabulary.

Seeded rows (`sampling_seed`): as in SGLang 0.5.23 under --enable-deterministic-inference
(`multinomial_with_seed`), the random draw for a token depends only on the request's seed and the
token's position in the sequence, never on the other rows of the batch, their order, or what was
sampled before. So the same prompt with the same seed gives the same tokens alone or batched, after a
retraction, and on a fresh server; and the n copies of one `n > 1` request share the seed, hence the
tokens (SGLang copies the sampling params to each of the n requests). The draw is an inverse-CDF
lookup of one uniform per (seed, position) in the filtered distribution; SGLang adds hashed Gumbel
noise instead. Same distribution, not the same bits: only reproducibility per server kind is claimed.

Penalties and min_p, as SGLang 0.5.23 defines them (`srt/sampling/penaltylib/`, `sampler.py`):
the penalties change the raw logits before temperature, hence also the reported logprobs, and count
only the request's output tokens (not the prompt). Additive ones first (frequency: minus
penalty x count; presence: minus penalty once a token occurred; min_new_tokens: -inf on every stop
token while fewer tokens were generated), then repetition: logits of tokens that occurred are divided
by the penalty when positive and multiplied when negative. min_p drops, after top-k / top-p, every
token whose probability is below min_p times the most likely token's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-6  # SGLang's _SAMPLING_EPS
_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    # SplitMix64's finaliser: neighbouring (seed, position) pairs give unrelated outputs.
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) that is a pure function of (seed, position); 53 random bits."""
    return (_mix64(_mix64(seed & _M64) ^ (position & _M64)) >> 11) * 2.0**-53


def effective_temperature(t: float) -> float:
    return 1.0 if t < GREEDY_EPS else t


@dataclass(frozen=True)
class Penalties:
    """One request's penalties at SGLang's neutral values by default."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    min_new_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()  # masked while fewer than min_new_tokens were generated

    def is_neutral(self) -> bool:
        return self.frequency == 0.0 and self.presence == 0.0 and self.repetition == 1.0 and self.min_new_tokens <= 0


def apply_penalties(logits: torch.Tensor, outputs: list[list[int]], penalties: list[Penalties]) -> torch.Tensor:
    """Penalised copy of `logits` [B, V]; row i has generated `outputs[i]` so far. Touches only the
    tokens a row has generated (and its stop tokens), not the whole vocabulary."""
    if all(p.is_neutral() for p in penalties):
        return logits
    out = logits.float().clone()
    for i, (ids, p) in enumerate(zip(outputs, penalties)):
        if p.is_neutral():
            continue
        if len(ids) < p.min_new_tokens and p.stop_ids:
            out[i, [t for t in p.stop_ids if 0 <= t < out.shape[-1]]] = float("-inf")
        if ids:
            seen, counts = torch.tensor(ids, device=out.device).unique(return_counts=True)
            row = out[i, seen] - p.frequency * counts - p.presence  # additive first, as SGLang
            out[i, seen] = torch.where(row < 0, row * p.repetition, row / p.repetition)
    return out


def filter_top_k_top_p(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None = None
) -> torch.Tensor:
    """Zero out tokens outside each row's top-k and top-p nucleus, then below min_p x the top token's
    probability; rows are not renormalised."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).expand_as(sorted_p)
    k = torch.where(top_k > 0, top_k, probs.shape[-1]).unsqueeze(-1)
    # keep a token if the mass strictly before it is < top_p (so the top token always stays)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    keep = (ranks < k) & (mass_before < top_p.unsqueeze(-1))
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    if min_p is not None:
        sorted_p = torch.where(sorted_p < sorted_p[:, :1] * min_p.unsqueeze(-1), torch.zeros_like(sorted_p), sorted_p)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def logprob_rows(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The distributions reported logprobs come from: log_softmax(logits / T), T = 1 for greedy rows."""
    greedy = temperature < GREEDY_EPS
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    return torch.log_softmax(logits.float() / temp, dim=-1)


def top_logprobs(logp: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """The k most likely tokens per row as (values, token ids), most likely first, as SGLang's topk."""
    vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return vals.tolist(), idx.tolist()


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: torch.Generator | None = None,
    seeds: list[int | None] | None = None,
    positions: list[int] | None = None,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns (tokens [B], logprobs of those tokens [B]), float32 math.

    Rows whose `seeds[i]` is set draw from `seeded_uniform(seeds[i], positions[i])`; the others from
    `generator` (one engine-wide stream, so their tokens depend on the batch).
    """
    logits = logits.float()
    greedy = temperature < GREEDY_EPS
    logp = logprob_rows(logits, temperature)
    tokens = torch.argmax(logits, dim=-1)
    if not bool(greedy.all()):
        probs = filter_top_k_top_p(logp.exp(), top_k, top_p, min_p)
        seeded = [i for i, sd in enumerate(seeds or ()) if sd is not None and not bool(greedy[i])]
        if len(seeded) < len(probs):
            drawn = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            drawn = torch.zeros_like(tokens)
        if seeded:
            if positions is None or len(positions) != len(probs):
                raise ValueError("sample: seeded rows need one position per row")
            rows = torch.tensor(seeded, device=probs.device)
            cdf = probs[rows].double().cumsum(-1)
            u = torch.tensor(
                [seeded_uniform(seeds[i], positions[i]) for i in seeded], dtype=torch.float64, device=probs.device
            )
            # first token whose cumulative mass exceeds u * total: never a zero-probability token
            pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
            drawn[rows] = pick.clamp(max=probs.shape[-1] - 1)
        tokens = torch.where(greedy, tokens, drawn)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

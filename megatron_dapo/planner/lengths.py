"""Response lengths for the simulated engines: a DAPO-like long tail, or lengths measured by a run.

A length model answers "how many tokens does this sample generate in all", from the sample's seed
(seeded rollouts: a continuation after an abort keeps the seed, hence its total length) and the
prompt (lengths of one prompt's samples are correlated: hard prompts make long answers). The default
is lognormal: a prompt factor (sigma 0.5) times a sample factor (sigma 0.75) around a median of
`median` tokens, cut at max_response_length (the cut ones finish with reason "length").
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist


def _rng(*keys) -> random.Random:
    return random.Random("/".join(map(str, keys)))  # str seeds are hashed stably (not PYTHONHASHSEED)


@dataclass
class LognormalLengths:
    median: float  # tokens
    max_len: int
    prompt_sigma: float = 0.5
    sample_sigma: float = 0.75
    seed: int = 0

    _prompt_mu: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # prompt key -> mu

    def total(self, prompt_key: int, sample_key: int) -> int:
        mu = self._prompt_mu.get(prompt_key)
        if mu is None:  # once per prompt: seeding a Random from a string is most of a draw's cost
            mu = math.log(self.median) + self.prompt_sigma * _rng(self.seed, "p", prompt_key).gauss(0, 1)
            self._prompt_mu[prompt_key] = mu
        x = math.exp(mu + self.sample_sigma * _rng(self.seed, "s", sample_key).gauss(0, 1))
        return max(1, min(self.max_len, int(x)))

    def describe(self) -> str:
        return (
            f"lognormal lengths: median {self.median:.0f}, sigma prompt {self.prompt_sigma:.2f} x sample "
            f"{self.sample_sigma:.2f}, cut at {self.max_len}"
        )


@dataclass
class EmpiricalLengths:
    """Lengths drawn (with replacement) from a measured list."""

    lengths: list[int]
    max_len: int
    source: str = ""
    seed: int = 0

    def total(self, prompt_key: int, sample_key: int) -> int:
        return max(1, min(self.max_len, _rng(self.seed, "e", sample_key).choice(self.lengths)))

    def describe(self) -> str:
        mean = sum(self.lengths) / len(self.lengths)
        return f"{len(self.lengths)} measured lengths from {self.source} (mean {mean:.0f}, max {max(self.lengths)})"


def dapo_like(max_len: int, seed: int = 0) -> LognormalLengths:
    """The default: median max_len / 4 (5120 of 20480; mean ~6600, ~6% cut at max_len), as DAPO runs on
    reasoning models show late in training (long, long-tailed responses)."""
    return LognormalLengths(median=max_len / 4, max_len=max_len, seed=seed)


def mean_length(lengths, n: int = 4000) -> float:
    """The mean response length of a length model, over `n` deterministic draws."""
    return sum(lengths.total(i % 97, i) for i in range(n)) / n


def fit_lognormal(mean: float, truncated_frac: float, max_len: int, seed: int = 0) -> LognormalLengths:
    """Median and total sigma (split as the default's) whose cut mean and cut fraction match a run's."""
    best = None
    for sigma in [0.01 * k for k in range(1, 301)]:
        if truncated_frac > 0:  # P(L > max) = frac fixes the median for this sigma
            z = _norm_ppf(1 - min(max(truncated_frac, 1e-6), 0.999))
            median = max_len / math.exp(sigma * z)
        else:
            median = mean / math.exp(sigma * sigma / 2)
        err = abs(_cut_mean(median, sigma, max_len) - mean)
        if best is None or err < best[0]:
            best = (err, median, sigma)
    _, median, sigma = best
    share = 0.5 / 0.9  # the default's split of the variance between prompt and sample
    return LognormalLengths(
        median, max_len, prompt_sigma=sigma * math.sqrt(share), sample_sigma=sigma * math.sqrt(1 - share), seed=seed
    )


def lengths_by_mean(mean: float, cap_share: float, max_len: int, seed: int = 0) -> LognormalLengths:
    """Lognormal lengths with mean `mean` (after the cut) of which `cap_share` reach max_len (long-CoT
    runs pile up at the cap); ValueError naming the flags when no lognormal has both."""
    if not 0 < mean < max_len:
        raise ValueError(f"--length-mean={mean} must be in (0, max_response_length={max_len})")
    if not 0 <= cap_share < 1:
        raise ValueError(f"--cap-share={cap_share} must be in [0, 1)")
    fit = fit_lognormal(mean, cap_share, max_len, seed)
    sigma = math.hypot(fit.prompt_sigma, fit.sample_sigma)
    got = _cut_mean(fit.median, sigma, max_len)
    if abs(got - mean) > 0.02 * mean:
        raise ValueError(
            f"--length-mean={mean} with --cap-share={cap_share} at max_response_length={max_len}: no lognormal "
            f"has both (the nearest has mean {got:.0f})"
        )
    return fit


def _norm_ppf(p: float) -> float:
    return NormalDist().inv_cdf(p)


def _cut_mean(median: float, sigma: float, max_len: int) -> float:
    """E[min(L, max_len)] for L lognormal(ln median, sigma)."""

    mu, nd = math.log(median), NormalDist()
    b = (math.log(max_len) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2) * nd.cdf(b - sigma) + max_len * (1 - nd.cdf(b))


def load_lengths(spec: str, max_len: int, seed: int = 0):
    """`dapo` (the default tail), a run's metrics.jsonl (fitted to its response length mean and
    truncated fraction), or a JSON file with a `lengths` list (e.g. a benchmark's measured lengths)."""
    if spec == "dapo":
        return dapo_like(max_len, seed)
    path = Path(spec)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"--lengths {spec}: {e.strerror or e}") from None
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        rows = [r for r in rows if "response/length_mean" in r]
        if not rows:
            raise ValueError(f"--lengths {spec}: no row with response/length_mean (a run's metrics.jsonl)")
        mean = sum(r["response/length_mean"] for r in rows) / len(rows)
        frac = sum(r.get("response/truncated_frac", 0.0) for r in rows) / len(rows)
        return fit_lognormal(mean, frac, max_len, seed)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--lengths {spec}: not JSON ({e})") from None
    lengths = data.get("lengths") if isinstance(data, dict) else None
    if not lengths or not all(isinstance(x, int) and x > 0 for x in lengths):
        raise ValueError(f"--lengths {spec}: needs a non-empty `lengths` list of positive integers")
    return EmpiricalLengths(list(lengths), max_len, source=spec, seed=seed)

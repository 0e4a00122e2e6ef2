"""The analytic ceiling of a simulated setting: no coordinator can train faster than this.

Rollout. Take any S decode steps of engine e (speed v_e, KV pool C_e, at most m running requests);
step s has n_s running requests holding K_s KV tokens and lasts L(n_s, K_s) / v_e, with

    L(n, K) = a_b + a_k * K + max(o_thr, o_b + o_k * n).

L is affine in K and convex in n, so by Jensen the S steps last at least S * L(n̄, K̄) / v_e, with n̄ and
K̄ the means over the steps, while they decode S * n̄ tokens: the engine decodes at most
v_e * n̄ / L(n̄, K̄) tokens per second (prefills, pauses and idle time only lower it). K̄ = κ * n̄, where κ
is the KV a running request holds per token it decodes: a request with input p decoding L tokens holds
p + l tokens at its l-th step (l = 0 .. L-1), so over all requests

    κ = p + E[L (L - 1)] / (2 E[L])      (the mean over decoded tokens, not over requests)

(a retracted or aborted request continues from p + its tokens: the same sum). K̄ <= C_e gives
n̄ <= C_e / κ, and n̄ <= m; n / L(n, κ n) grows with n, so

    decode_e <= v_e * n* / L(n*, κ n*),   n* = min(m, C_e / κ)

(the engine's decode capacity with its KV pool full). Every trained sample's response was decoded at
least once (filtered groups, regenerated groups and abandoned pieces only add decoding), and a trained
sample carries p prompt tokens per E[L] response tokens; dynamic sampling keeps a share k of the
groups (k = the simulated reward's keep probability when algo.filter_groups is on, else 1):

    rollout = k * (p + E[L]) / E[L] * sum_e decode_e      trained tokens per second.

Trainer. A step trains T = train_batch_size * n_resp_per_prompt * (p + E[L]) tokens in t(T) seconds;
under all_at_once sync it then waits one weight sync σ before the next step (σ_train = σ), and the
engines, paused for it (rollout.sync.pause_generation; σ_pause = σ), decode during at most W - σ_pause
of a step of W seconds. Per-server sync keeps the trainer going (σ_train = 0) and its pauses of single
engines are not counted (σ_pause = 0: the ceiling stays an upper bound, only looser). So

    trainer = T / (t(T) + σ_train),
    ceiling = T / max(σ_pause + T / rollout, t(T) + σ_train)     ( = min(rollout, trainer) without syncs).

Slowdowns are left out (they only slow engines), and so are the coordinator's own limits (concurrency,
staleness): the ceiling is what the engines and the trainer allow. p, E[L] and κ are the length
model's as the simulated client draws them (rounded up to whole token units).

E[L], κ and k are expectations. A finite run realises them with sampling noise, the kept share above
all: which groups the filter keeps (and their lengths, correlated per prompt) moves a run's trained
tokens per decoded token by several per cent at 16 kept groups a step, so a short filtered run can
land above the ceiling; its decoding (`decode`, the engines' part) stays below. With the filter off
(k = 1, PSRL's setting) only the lengths' noise is left, which thousands of samples a step make small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DRAWS = 20_000  # length draws for E[L] and κ
PROMPTS = 2_000  # over this many prompts (the prompt factor of the lengths)


@dataclass(frozen=True)
class LengthMoments:
    prompt: int  # p: prompt tokens, rounded up to token units
    mean: float  # E[L]
    kv_per_token: float  # κ


@dataclass(frozen=True)
class Ceiling:
    decode: float  # tokens/s all engines decode at most (sum_e decode_e)
    rollout: float  # trained tokens/s the engines allow (decode capacity, full KV pools)
    trainer: float  # trained tokens/s the trainer allows (inf: a free trainer)
    value: float  # trained tokens/s no coordinator can beat
    step_tokens: float  # T
    moments: LengthMoments


def length_moments(lengths, prompt_len: int, max_len: int, unit: int) -> LengthMoments:
    """p, E[L] and κ of the responses the simulated client asks for (megatron_dapo.sim.client)."""
    max_units = math.ceil(max_len / unit)
    total = total_sq = 0
    for i in range(DRAWS):
        tokens = min(max_units, math.ceil(lengths.total(i % PROMPTS, i) / unit)) * unit
        total += tokens
        total_sq += tokens * (tokens - 1)
    prompt = math.ceil(prompt_len / unit) * unit
    return LengthMoments(prompt, total / DRAWS, prompt + total_sq / (2 * total))


def engine_decode_capacity(cost, kv_capacity: int, max_running: int, speed: float, kv_per_token: float) -> float:
    """Tokens per second one engine decodes at most: its KV pool full of requests holding κ per token."""
    n = min(max_running, kv_capacity / kv_per_token)
    return speed * n / cost.step_time(n, kv_per_token * n)


def kept_share(cfg, keep_prob: float) -> float:
    return keep_prob if cfg.algo.filter_groups.enable else 1.0


def ceiling(cfg, world) -> Ceiling:
    """The ceiling of `cfg` (a mode's config) in `world` (megatron_dapo.sim.world.World)."""
    engines = cfg.rollout.num_servers
    m = length_moments(world.lengths, world.prompt_len, cfg.data.max_response_length, world.token_unit)
    decode = sum(
        engine_decode_capacity(world.cost, kv, world.max_running, speed, m.kv_per_token)
        for kv, speed in zip(world.engine_kvs(engines), world.engine_speeds(engines))
    )
    rollout = kept_share(cfg, world.keep_prob) * (m.prompt + m.mean) / m.mean * decode
    step_tokens = cfg.algo.train_batch_size * cfg.rollout.n_resp_per_prompt * (m.prompt + m.mean)
    sync = cfg.rollout.sync
    trainer_s = world.train_s(step_tokens) + (world.sync_s if sync.policy == "all_at_once" else 0.0)
    paused_s = world.sync_s if sync.policy == "all_at_once" and sync.pause_generation else 0.0
    trainer = step_tokens / trainer_s if trainer_s > 0 else math.inf
    value = step_tokens / max(paused_s + step_tokens / rollout, trainer_s)
    return Ceiling(decode, rollout, trainer, value, step_tokens, m)

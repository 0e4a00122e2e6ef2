"""Held-out evaluation through the rollout servers: n sampled answers (and optionally a greedy one)
per prompt, judged by the run's reward function; metrics per data source (see val_metrics).

Used by training every `trainer.val_every` steps and by `megatron-dapo eval`. Sampling follows
`trainer.val`, not the training sampling: DAPO evaluates at temperature 1.0, top_p 0.7. With
`rollout.sampling.seeded`, sample j of held-out prompt i always gets the same sampling seed, so
successive evaluations draw from the same random streams and their difference is the model's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from megatron_dapo.config.derived import val_max_new_tokens
from megatron_dapo.coordinator.producer import response_text, sample_seed
from megatron_dapo.coordinator.router import Router
from megatron_dapo.coordinator.val_metrics import PromptOutcome, validation_metrics
from megatron_dapo.rollout.types import SamplingParams


@dataclass(frozen=True)
class ValSettings:
    n: int  # sampled answers per prompt
    sampling: SamplingParams  # of each sampled answer (its n is ignored)
    greedy: bool = False  # also one greedy answer per prompt
    seed: int | None = None  # per-sample sampling seeds; None = the servers' own randomness

    @classmethod
    def from_config(cls, cfg) -> "ValSettings":
        val, sampling_cfg = cfg.trainer.val, cfg.rollout.sampling
        sampling = SamplingParams(
            temperature=val.temperature,
            top_p=val.top_p,
            max_new_tokens=val_max_new_tokens(cfg),
            stop=list(sampling_cfg.stop) or None,
            stop_token_ids=list(sampling_cfg.stop_token_ids) or None,
        )
        return cls(
            n=val.n, sampling=sampling, greedy=val.greedy, seed=cfg.trainer.seed if sampling_cfg.seeded else None
        )


@dataclass
class ValReport:
    metrics: dict[str, float]  # val/<data_source>/acc/<mean@n | best@n | maj@n | greedy>
    outcomes: list[PromptOutcome]  # one per held-out prompt, in dataset order
    samples: list[dict] = field(default_factory=list)  # every judged answer (prompt, kind, response, pred, acc)


def val_seed(seed: int, prompt_index: int, sample: int) -> int:
    """Sampling seed of validation sample `sample` of held-out prompt `prompt_index`. Training draws are
    numbered from 0; validation uses negative draw numbers, so the two never share a random stream."""
    return sample_seed(seed, -1 - prompt_index, sample)


async def _answers(router: Router, prompt: list[int], index: int, settings: ValSettings) -> tuple[list, list]:
    """(sampled, greedy) samples of one prompt."""
    gid = f"val{index}"
    requests = []
    if settings.n:
        if settings.seed is None:
            requests.append(router.generate(prompt, replace(settings.sampling, n=settings.n), group_id=gid))
        else:
            seeded = [
                replace(settings.sampling, n=1, sampling_seed=val_seed(settings.seed, index, j))
                for j in range(settings.n)
            ]
            requests.append(router.generate(prompt, seeded, group_id=gid))
    if settings.greedy:
        requests.append(router.generate(prompt, replace(settings.sampling, temperature=0.0, n=1), group_id=gid))
    done = await asyncio.gather(*requests)
    sampled = list(done[0]) if settings.n else []
    greedy = list(done[-1]) if settings.greedy else []
    return sampled, greedy


async def _evaluate(urls, dataset, rewards, settings: ValSettings, api_key, tokenizer, timeout_s) -> ValReport:
    async with Router(urls, api_key=api_key, client_kwargs={"timeout_s": timeout_s}) as router:

        async def one(i):
            rec = dataset[i]
            sampled, greedy = await _answers(router, list(rec.prompt_ids), i, settings)
            texts = [response_text(s, tokenizer) for s in sampled + greedy]
            extra = dict(rec.extra_info)
            judged = await asyncio.to_thread(
                rewards.score_many, [(t, rec.ground_truth, rec.data_source, extra) for t in texts]
            )
            n = len(sampled)
            outcome = PromptOutcome(
                rec.data_source,
                tuple(r.acc for r in judged[:n]),
                tuple(r.pred for r in judged[:n]),
                judged[n].acc if greedy else None,
            )
            records = [
                {
                    "prompt_index": i,
                    "data_source": rec.data_source,
                    "ground_truth": rec.ground_truth,
                    "kind": "sampled" if j < n else "greedy",
                    "response": t,
                    "pred": r.pred,
                    "acc": r.acc,
                    "score": r.score,
                }
                for j, (t, r) in enumerate(zip(texts, judged))
            ]
            return outcome, records

        done = await asyncio.gather(*(one(i) for i in range(len(dataset))))
    outcomes = [o for o, _ in done]
    return ValReport(validation_metrics(outcomes), outcomes, [r for _, recs in done for r in recs])


def evaluate(
    urls, dataset, rewards, settings: ValSettings, api_key=None, tokenizer=None, timeout_s: float = 3600.0
) -> ValReport:
    """Sample and judge every prompt of `dataset` on the servers at `urls` (`timeout_s` per /generate:
    one request carries all n samples of a prompt)."""
    return asyncio.run(_evaluate(urls, dataset, rewards, settings, api_key, tokenizer, timeout_s))

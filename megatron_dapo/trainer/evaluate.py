"""Held-out accuracy through the rollout servers: greedy pass@1 and sampled mean accuracy."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from megatron_dapo.rollout.router import Router
from megatron_dapo.rollout.types import SamplingParams
from megatron_dapo.trainer.rollout_side import response_text


async def _evaluate(urls, dataset, rewards, sampling: SamplingParams, n_sampled: int, api_key=None, tokenizer=None) -> dict:
    async with Router(urls, api_key=api_key) as router:
        greedy = replace(sampling, temperature=0.0, n=1)
        sampled = replace(sampling, n=n_sampled)

        async def one(i):
            rec = dataset[i]
            outs = [router.generate(list(rec.prompt_ids), greedy, group_id=f"val{i}")]
            if n_sampled:
                outs.append(router.generate(list(rec.prompt_ids), sampled, group_id=f"val{i}"))
            res = await asyncio.gather(*outs)
            samples = [s for r in res for s in r]
            items = [(response_text(s, tokenizer), rec.ground_truth, rec.data_source, dict(rec.extra_info)) for s in samples]
            return await asyncio.to_thread(rewards.score_many, items)

        scored = await asyncio.gather(*(one(i) for i in range(len(dataset))))
    greedy_acc = sum(r[0].acc for r in scored) / len(scored)
    out = {"val/accuracy_greedy": greedy_acc}
    if n_sampled:
        out["val/accuracy_sampled"] = sum(x.acc for r in scored for x in r[1:]) / (len(scored) * n_sampled)
    return out


def evaluate(urls, dataset, rewards, sampling: SamplingParams, n_sampled: int = 4, api_key=None, tokenizer=None) -> dict:
    """{"val/accuracy_greedy", "val/accuracy_sampled"} over every prompt of `dataset`."""
    return asyncio.run(_evaluate(urls, dataset, rewards, sampling, n_sampled, api_key, tokenizer))

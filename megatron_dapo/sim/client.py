"""What the simulator puts where HTTP and the outside world were: the client of a simulated engine,
the prompts, and the reward.

`SimClient` has the methods of `megatron_dapo.rollout.client.SGLangClient` that the router, the
producer and the sync loop call, and answers with real `Sample`s. Token ids carry no meaning: one id
stands for `token_unit` tokens (so that a cluster-scale run of 20k-token responses does not hold
hundreds of millions of ids); the engine counts and times real tokens.
"""

from __future__ import annotations

import asyncio
import math
import random
import uuid
from collections.abc import Sequence

from megatron_dapo.data.dataset import PromptRecord
from megatron_dapo.rewards.registry import RewardResult
from megatron_dapo.rollout.types import Sample, SamplingParams, ServerLoad, WeightVersionSpan
from megatron_dapo.sim.engine import EngineResult, SimEngine


class SimClient:
    def __init__(self, url: str, engine: SimEngine, lengths, max_new_tokens: int, token_unit: int = 1, seed: int = 0):
        self.base_url, self.engine, self.lengths = url.rstrip("/"), engine, lengths
        self.max_units = max_new_tokens  # in ids (units), as the producer's SamplingParams say
        self.unit = token_unit
        self._rng = random.Random(f"client/{seed}/{url}")

    def _target_units(self, prompt_key: int, sp: SamplingParams) -> tuple[int, bool]:
        """(ids this request will generate, whether it stops at max_new_tokens)."""
        before = self.max_units - sp.max_new_tokens  # ids of an aborted request's earlier pieces
        if sp.sampling_seed is not None:  # a continuation keeps its seed, hence its total length
            total = self.lengths.total(prompt_key, sp.sampling_seed)
        else:  # a fresh draw, given that it is longer than what it has generated already
            draws = (self.lengths.total(prompt_key, self._rng.getrandbits(62)) for _ in range(100))
            total = next((t for t in draws if math.ceil(t / self.unit) > before), (before + 1) * self.unit)
        units = min(self.max_units, math.ceil(total / self.unit))
        remaining = max(0, units - before)
        return min(remaining, sp.max_new_tokens), units >= self.max_units or remaining >= sp.max_new_tokens

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> list[Sample]:
        sampling = sampling or SamplingParams()
        rid = rid or uuid.uuid4().hex
        params = [sampling] * sampling.n if isinstance(sampling, SamplingParams) else list(sampling)
        prompt_key = int(input_ids[0]) if len(input_ids) else 0
        futures, cut = [], []
        for i, sp in enumerate(params):
            units, at_max = self._target_units(prompt_key, sp)
            cut.append(at_max)
            futures.append(
                self.engine.submit(
                    f"{rid}-{i}", len(input_ids) * self.unit, units * self.unit, max_new=sp.max_new_tokens * self.unit
                )
            )
        results: list[EngineResult] = await asyncio.gather(*futures)
        return [
            self._sample(f"{rid}-{i}" if len(params) > 1 else rid, input_ids, r, at_max, i)
            for i, (r, at_max) in enumerate(zip(results, cut))
        ]

    def _sample(self, rid: str, input_ids, r: EngineResult, at_max: bool, index: int) -> Sample:
        units = r.generated // self.unit
        spans = [
            WeightVersionSpan(str(v), start // self.unit, end // self.unit)
            for (start, v), (end, _) in zip(r.versions, r.versions[1:] + [(r.generated, None)])
        ]
        spans = [s for s in spans if s.end > s.start]
        versions = {s.version for s in spans}
        version = spans[-1].version if spans else str(self.engine.version)
        return Sample(
            rid=rid,
            prompt_ids=list(input_ids),
            output_ids=[1] * units,
            logprobs=[0.0] * units,
            finish_reason="abort" if r.aborted else "length" if at_max else "stop",
            weight_version=version,
            weight_versions=spans if len(versions) > 1 else [],
            index=index,
            server=self.base_url,
        )

    # ---- control (as SGLangClient) -------------------------------------------------------------
    async def health(self, timeout_s: float = 5.0) -> bool:
        return True

    async def get_loads(self) -> ServerLoad:
        return self.engine.load()

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        self.engine.abort(None if abort_all else rid)

    async def pause_generation(self, mode: str = "abort") -> dict:
        if mode == "abort":
            self.engine.abort(None)
        self.engine.pause()  # in_place and retract: requests keep their tokens (re-prefill is free here)
        return {}

    async def continue_generation(self, torch_empty_cache: bool = True) -> dict:
        self.engine.resume()
        return {}

    async def aclose(self) -> None:
        pass


class SimPrompts:
    """`size` prompts of `prompt_len` tokens; a prompt's first id is its index + 1 (the engines'
    prompt key for correlated lengths)."""

    def __init__(self, size: int, prompt_len: int, token_unit: int = 1):
        self.size, self.units = size, max(1, math.ceil(prompt_len / token_unit))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> PromptRecord:
        return PromptRecord(idx, (idx + 1,) + (0,) * (self.units - 1), ground_truth="", data_source="sim")


class SimReward:
    """Dynamic sampling by a given keep probability: a kept group has one correct sample (a spread),
    a dropped one is all correct or all wrong (half each)."""

    def __init__(self, keep_prob: float, seed: int = 0):
        if not 0 < keep_prob <= 1:
            raise ValueError(f"keep probability must be in (0, 1], got {keep_prob}")
        self.keep_prob, self._rng = keep_prob, random.Random(f"reward/{seed}")
        self.num_scored = 0

    def activity(self) -> tuple[int, float]:
        """(calls scored, seconds spent scoring): simulated scoring takes no time, so the producer's
        reward/calls_per_s reads 0 here."""
        return self.num_scored, 0.0

    def score_many(self, items) -> list[RewardResult]:
        n = len(items)
        self.num_scored += n
        if self._rng.random() < self.keep_prob and n > 1:
            accs = [i == 0 for i in range(n)]
        else:
            accs = [self._rng.random() < 0.5] * n
        return [RewardResult(score=1.0 if a else -1.0, acc=a) for a in accs]

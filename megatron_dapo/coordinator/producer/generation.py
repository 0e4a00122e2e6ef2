"""Generating one group's samples: one request (or batch request) per attempt, or n + extra samples
of which the first n to finish are kept (on the producer's event loop)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TYPE_CHECKING

from megatron_dapo.rollout.types import Sample, SamplingParams

if TYPE_CHECKING:
    from megatron_dapo.coordinator.producer.core import RolloutProducer

log = logging.getLogger("megatron_dapo.coordinator.producer")


class Generation:
    def __init__(self, producer: RolloutProducer):
        self.p = producer

    async def request(self, router, prompt: list[int], draw: int, group_id: str) -> list:
        """One attempt at the whole group, on a server holding at least its V_traj."""
        p = self.p
        v_traj = p.dispatch.v_traj(draw)
        p.dispatch.set_group_id(draw, group_id)
        if p.s.seed is None and not p.s.aborts_groups:
            sampling = SamplingParams(**{**p.s.sampling.__dict__, "n": p.s.n})
            return await router.generate(prompt, sampling, group_id=group_id, min_version=v_traj)
        # one batch request: the server takes the group at once (n requests would straggle in)
        seeded = [p.dispatch.sampling(draw, i) for i in range(p.s.n)]
        return await router.generate(prompt, seeded, group_id=group_id, rid=group_id, min_version=v_traj)

    async def group(
        self, router, prompt: list[int], idx: int, draw: int, resumed: list[Sample] | None = None
    ) -> list[Sample]:
        """The group's n finished samples; `resumed`: its answers saved by a checkpoint, continued."""
        p = self.p
        if p.s.extra_samples:
            return await self.first_n(router, prompt, idx, draw, resumed)
        if resumed is not None and (len(resumed) != p.s.n or any(x is None for x in resumed)):
            resumed = None  # saved with other redundancy settings: generated again
        for attempt in range(p.s.max_resubmits + 1):
            if resumed is not None:
                samples, resumed = resumed, None
                with p._cv:
                    p.flight[draw].group_id = samples[0].group_id
            else:
                # a fresh group id per attempt: rids of an aborted attempt may still be in flight
                samples = await self.request(router, prompt, draw, f"p{idx}-{uuid.uuid4().hex[:8]}")
                samples = sorted(samples, key=lambda s: s.index)
                for i, s in enumerate(samples):
                    s.index = i
            if not any(s.aborted for s in samples):
                return samples
            if p.s.partial_rollout:
                with p._cv:
                    p.flight[draw].samples = list(samples)
                return list(await asyncio.gather(*(p.completion.finish(router, draw, s) for s in samples)))
            p.completion.count(regenerated=sum(len(s.output_ids) for s in samples))
            log.info("group of prompt %d aborted by the server (attempt %d); resubmitting", idx, attempt)
        raise RuntimeError(f"prompt {idx}: generation aborted {p.s.max_resubmits + 1} times")

    async def first_n(
        self, router, prompt: list[int], idx: int, draw: int, resumed: list[Sample | None] | None
    ) -> list[Sample]:
        """Sample-level redundancy: n + extra samples, one request each; the first n to finish are kept."""
        p = self.p
        n_all = p.s.n + p.s.extra_samples
        gid = f"p{idx}-{uuid.uuid4().hex[:8]}"
        v_traj = p.dispatch.v_traj(draw)
        with p._cv:
            f = p.flight[draw]
            f.group_id = gid
            if resumed is None or len(resumed) != n_all:
                resumed = [None] * n_all
            f.samples = list(resumed)
        tasks = [
            asyncio.ensure_future(self._one_of_n(router, prompt, idx, draw, v_traj, gid, i, resumed[i]))
            for i in range(n_all)
        ]
        kept = await self._keep_first(router, gid, tasks)
        kept.sort(key=lambda smp: smp.index)
        for j, smp in enumerate(kept):
            smp.index = j
        return kept

    async def _one_of_n(
        self, router, prompt: list[int], idx: int, draw: int, v_traj: int, gid: str, i: int, prior: Sample | None
    ) -> Sample:
        """Sample `i` of a redundant group, resubmitted (or continued) while it is aborted."""
        p = self.p
        for _ in range(p.s.max_resubmits + 1):
            if prior is not None:
                smp, prior = prior, None
                smp.group_id = gid
            else:
                (smp,) = await router.generate(
                    prompt,
                    [p.dispatch.sampling(draw, i)],
                    group_id=gid,
                    rid=f"{gid}-s{i}-{uuid.uuid4().hex[:4]}",
                    min_version=v_traj,
                )
                smp.index = i
                p.completion.progress(draw, smp)
            if not smp.aborted:
                return smp
            if p.s.partial_rollout:
                return await p.completion.finish(router, draw, smp)
            p.completion.count(regenerated=len(smp.output_ids))
        raise RuntimeError(f"prompt {idx}: sample {i} aborted {p.s.max_resubmits + 1} times")

    async def _keep_first(self, router, gid: str, tasks: list[asyncio.Future]) -> list[Sample]:
        """The first n of `tasks` to finish; the others are cancelled and their requests aborted."""
        p = self.p
        kept: list[Sample] = []
        try:
            for fut in asyncio.as_completed(tasks):
                kept.append(await fut)
                if len(kept) == p.s.n:
                    break
        finally:
            pending = [t for t in tasks if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await router.abort_group(gid)
                p.counters.coordination["samples_aborted_surplus"] += len(pending)
            await asyncio.gather(*pending, return_exceptions=True)
        return kept

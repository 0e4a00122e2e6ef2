"""Generating one group's samples: one request (or batch request) per attempt, or n + extra samples
of which the first n to finish are kept; an aborted sample continued from its tokens (partial rollout)
(on the producer's event loop)."""

from __future__ import annotations

import asyncio
import logging
import uuid

from megatron_dapo.coordinator.groups import token_versions
from megatron_dapo.coordinator.partial import continuation_ids, finish_partial
from megatron_dapo.coordinator.producer.settings import ProducerSettings
from megatron_dapo.coordinator.producer.state import ProducerState
from megatron_dapo.rollout.types import Sample, SamplingParams

log = logging.getLogger("megatron_dapo.coordinator.producer")


class Generation:
    def __init__(self, settings: ProducerSettings, state: ProducerState):
        self.settings, self.state = settings, state

    # ---- one sample ----------------------------------------------------------------------------
    def count(self, resumes: int = 0, regenerated: int = 0) -> None:
        c = self.state.counters  # loop-owned: only the loop writes or reads them
        c.resumes += resumes
        c.regenerated += regenerated

    def progress(self, draw: int, sample: Sample) -> None:
        """A sample's latest answer: what a checkpoint saves of its group."""
        st = self.state
        with st.cv:
            if draw in st.flight:
                st.flight[draw].samples[sample.index] = sample

    async def finish(self, router, draw: int, sample: Sample) -> Sample:
        """Partial rollout of one aborted sample, on its group's server when it can."""
        v_traj = self.state.v_traj(draw)

        async def generate(so_far: Sample, sampling):
            rid = f"{sample.group_id}-{sample.index}-{uuid.uuid4().hex[:6]}"
            # a resumed trajectory: routing charges its generated tokens, priority queues order it by V_traj,
            # and it goes on at its newest tokens' version or later (never back to older weights)
            (piece,) = await router.generate(
                continuation_ids(so_far),
                sampling,
                group_id=sample.group_id,
                rid=rid,
                min_version=v_traj,
                generated=len(so_far.output_ids),
                newest_version=max(token_versions(so_far), default=None),
            )
            return piece

        return await finish_partial(
            generate,
            sample,
            self.settings.sampling_for(draw, sample.index),
            self.settings.max_resubmits,
            on_resume=lambda: self.count(resumes=1),
            on_progress=lambda merged: self.progress(draw, merged),
        )

    # ---- one group -----------------------------------------------------------------------------
    async def request(self, router, prompt: list[int], draw: int, group_id: str) -> list:
        """One attempt at the whole group, on a server holding at least its V_traj."""
        s = self.settings
        v_traj = self.state.v_traj(draw)
        self.state.set_group_id(draw, group_id)
        if s.seed is None and not s.aborts_groups:
            sampling = SamplingParams(**{**s.sampling.__dict__, "n": s.n})
            return await router.generate(prompt, sampling, group_id=group_id, min_version=v_traj)
        # one batch request: the server takes the group at once (n requests would straggle in)
        seeded = [s.sampling_for(draw, i) for i in range(s.n)]
        return await router.generate(prompt, seeded, group_id=group_id, rid=group_id, min_version=v_traj)

    async def group(
        self, router, prompt: list[int], idx: int, draw: int, resumed: list[Sample] | None = None
    ) -> list[Sample]:
        """The group's n finished samples; `resumed`: its answers saved by a checkpoint, continued."""
        s, st = self.settings, self.state
        if s.extra_samples:
            return await self.first_n(router, prompt, idx, draw, resumed)
        if resumed is not None and (len(resumed) != s.n or any(x is None for x in resumed)):
            resumed = None  # saved with other redundancy settings: generated again
        for attempt in range(s.max_resubmits + 1):
            if resumed is not None:
                samples, resumed = resumed, None
                with st.cv:
                    st.flight[draw].group_id = samples[0].group_id
            else:
                # a fresh group id per attempt: rids of an aborted attempt may still be in flight
                samples = await self.request(router, prompt, draw, f"p{idx}-{uuid.uuid4().hex[:8]}")
                samples = sorted(samples, key=lambda smp: smp.index)
                for i, smp in enumerate(samples):
                    smp.index = i
            if not any(smp.aborted for smp in samples):
                return samples
            if s.partial_rollout:
                with st.cv:
                    st.flight[draw].samples = list(samples)
                return list(await asyncio.gather(*(self.finish(router, draw, smp) for smp in samples)))
            self.count(regenerated=sum(len(smp.output_ids) for smp in samples))
            log.info("group of prompt %d aborted by the server (attempt %d); resubmitting", idx, attempt)
        raise RuntimeError(f"prompt {idx}: generation aborted {s.max_resubmits + 1} times")

    async def first_n(
        self, router, prompt: list[int], idx: int, draw: int, resumed: list[Sample | None] | None
    ) -> list[Sample]:
        """Sample-level redundancy: n + extra samples, one request each; the first n to finish are kept."""
        st = self.state
        n_all = self.settings.n + self.settings.extra_samples
        gid = f"p{idx}-{uuid.uuid4().hex[:8]}"
        v_traj = st.v_traj(draw)
        with st.cv:
            f = st.flight[draw]
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
        s = self.settings
        for _ in range(s.max_resubmits + 1):
            if prior is not None:
                smp, prior = prior, None
                smp.group_id = gid
            else:
                (smp,) = await router.generate(
                    prompt,
                    [s.sampling_for(draw, i)],
                    group_id=gid,
                    rid=f"{gid}-s{i}-{uuid.uuid4().hex[:4]}",
                    min_version=v_traj,
                )
                smp.index = i
                self.progress(draw, smp)
            if not smp.aborted:
                return smp
            if s.partial_rollout:
                return await self.finish(router, draw, smp)
            self.count(regenerated=len(smp.output_ids))
        raise RuntimeError(f"prompt {idx}: sample {i} aborted {s.max_resubmits + 1} times")

    async def _keep_first(self, router, gid: str, tasks: list[asyncio.Future]) -> list[Sample]:
        """The first n of `tasks` to finish; the others are cancelled and their requests aborted."""
        kept: list[Sample] = []
        try:
            for fut in asyncio.as_completed(tasks):
                kept.append(await fut)
                if len(kept) == self.settings.n:
                    break
        finally:
            pending = [t for t in tasks if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await router.abort_group(gid)
                self.state.counters.coordination["samples_aborted_surplus"] += len(pending)
            await asyncio.gather(*pending, return_exceptions=True)
        return kept

"""A finished or aborted sample or group (on the producer's event loop): partial-rollout continuation,
judging, occupying or freeing its slot, giving groups up."""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

from megatron_dapo.coordinator.groups import JudgedGroup, judge_group, token_versions
from megatron_dapo.coordinator.partial import continuation_ids, finish_partial
from megatron_dapo.coordinator.producer.settings import response_text
from megatron_dapo.rollout.types import Sample

if TYPE_CHECKING:
    from megatron_dapo.coordinator.producer.core import RolloutProducer


class Completion:
    def __init__(self, producer: RolloutProducer):
        self.p = producer

    # ---- one sample ----------------------------------------------------------------------------
    def count(self, resumes: int = 0, regenerated: int = 0) -> None:
        c = self.p.counters  # loop-owned: only the loop writes or reads them
        c.resumes += resumes
        c.regenerated += regenerated

    def progress(self, draw: int, sample: Sample) -> None:
        """A sample's latest answer: what a checkpoint saves of its group."""
        with self.p._cv:
            if draw in self.p.flight:
                self.p.flight[draw].samples[sample.index] = sample

    async def finish(self, router, draw: int, sample: Sample) -> Sample:
        """Partial rollout of one aborted sample, on its group's server when it can."""
        p = self.p
        v_traj = p.dispatch.v_traj(draw)

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
            p.dispatch.sampling(draw, sample.index),
            p.s.max_resubmits,
            on_resume=lambda: self.count(resumes=1),
            on_progress=lambda merged: self.progress(draw, merged),
        )

    # ---- one group -----------------------------------------------------------------------------
    async def one_group(self, router, idx: int, draw: int, v_traj: int) -> None:
        """A dispatched group's task: generate, judge, then occupy its slot (kept) or free it (dropped)."""
        rec = self.p.dataset[idx]
        resumed = self.p.flight[draw].samples
        try:
            group = await self._judged(router, rec, idx, draw, v_traj, resumed)
        except asyncio.CancelledError:
            self._given_up(draw)
            raise
        except BaseException as e:  # surfaced to the trainer by take_batch
            self._given_up(draw, e)
            return
        if self._settle(draw, group):
            self.p._wake.set()

    async def _judged(self, router, rec, idx: int, draw: int, v_traj: int, resumed) -> JudgedGroup:
        p = self.p
        samples = await p.generation.group(router, list(rec.prompt_ids), idx, draw, resumed)
        extra = dict(rec.extra_info)
        items = [(response_text(s, p.tokenizer), rec.ground_truth, rec.data_source, extra) for s in samples]
        rewards = await asyncio.to_thread(p.rewards.score_many, items)
        group = judge_group(idx, samples, rewards, p.s.max_response_length, p.s.overlong, p.s.filter_metric)
        group.draw, group.v_traj = draw, v_traj
        return group

    def _given_up(self, draw: int, error: BaseException | None = None) -> None:
        """The group's task ended without a judged group: free its slot unless the coordinator did."""
        p = self.p
        with p._cv:
            if p.flight.pop(draw, None) is None:  # already given up (its slot freed)
                return
            p.slots.release(draw)
            if error is not None:
                p.error = error
                p._changed()

    def _settle(self, draw: int, group: JudgedGroup) -> bool:
        """Occupy the group's slot, or (dropped by dynamic sampling) free it for a fresh prompt at once.
        False if the group was given up while it was being judged."""
        p, c = self.p, self.p.counters
        with p._cv:
            if p.flight.pop(draw, None) is None:
                return False
            c.judged += 1
            c.reward_failures += group.reward_failures
            c.reward_failure_types.update(group.reward_failure_types)
            c.groups_reward_failed += group.reward_failures > 0
            if group.kept:
                p.slots.occupy(draw, group)
                self.abandon(p.slots.take_dropped(), "surplus")  # a buffer filled: its surplus goes
            else:
                p.slots.release(draw)
                c.totals["dropped"] += 1
                if group.accs and all(group.accs):
                    c.dropped_correct += 1
                else:
                    c.dropped_wrong += 1
            p._changed()
        return True

    def abandon(self, draws, reason: str) -> None:
        """Under the lock: give up groups whose slots the controller already freed: cancel their tasks
        and abort their requests on the servers. Their prompts count as drawn."""
        p = self.p
        for d in draws:
            f = p.flight.pop(d, None)
            p.counters.coordination[f"groups_aborted_{reason}"] += 1
            p.counters.totals[f"aborted_{reason}"] += 1
            task = p._tasks.pop(d, None)
            if task is not None:
                task.cancel()
            if f is not None and f.group_id is not None and p._router is not None:
                t = asyncio.ensure_future(p._router.abort_group(f.group_id))
                p._aborts.add(t)  # the loop keeps only weak references to tasks
                t.add_done_callback(p._aborts.discard)

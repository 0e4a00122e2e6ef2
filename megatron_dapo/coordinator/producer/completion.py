"""A finished or aborted group (on the producer's event loop): judging, occupying or freeing its slot,
giving groups up."""

from __future__ import annotations

import asyncio

from megatron_dapo.coordinator.groups import JudgedGroup, judge_group
from megatron_dapo.coordinator.producer.generation import Generation
from megatron_dapo.coordinator.producer.settings import ProducerSettings, response_text
from megatron_dapo.coordinator.producer.state import ProducerState, Signals


class Completion:
    def __init__(
        self,
        settings: ProducerSettings,
        state: ProducerState,
        signals: Signals,
        generation: Generation,
        dataset,
        rewards,
        tokenizer=None,
    ):
        self.settings, self.state, self.signals = settings, state, signals
        self.generation = generation
        self.dataset, self.rewards, self.tokenizer = dataset, rewards, tokenizer
        self._aborts: set[asyncio.Task] = set()  # abort calls in flight

    # ---- one group -----------------------------------------------------------------------------
    async def one_group(self, router, idx: int, draw: int, v_traj: int) -> None:
        """A dispatched group's task: generate, judge, then occupy its slot (kept) or free it (dropped)."""
        rec = self.dataset[idx]
        resumed = self.state.flight[draw].samples
        try:
            group = await self._judged(router, rec, idx, draw, v_traj, resumed)
        except asyncio.CancelledError:
            self._given_up(draw)
            raise
        except BaseException as e:  # surfaced to the trainer by take_batch
            self._given_up(draw, e)
            return
        if self._settle(draw, group):
            self.signals.wake()

    async def _judged(self, router, rec, idx: int, draw: int, v_traj: int, resumed) -> JudgedGroup:
        s = self.settings
        samples = await self.generation.group(router, list(rec.prompt_ids), idx, draw, resumed)
        extra = dict(rec.extra_info)
        items = [(response_text(smp, self.tokenizer), rec.ground_truth, rec.data_source, extra) for smp in samples]
        rewards = await asyncio.to_thread(self.rewards.score_many, items)
        group = judge_group(idx, samples, rewards, s.max_response_length, s.overlong, s.filter_metric)
        group.draw, group.v_traj = draw, v_traj
        return group

    def _given_up(self, draw: int, error: BaseException | None = None) -> None:
        """The group's task ended without a judged group: free its slot unless the coordinator did."""
        st = self.state
        with st.cv:
            if st.flight.pop(draw, None) is None:  # already given up (its slot freed)
                return
            st.slots.release(draw)
            if error is not None:
                self.signals.error = error
                self.signals.changed()

    def _settle(self, draw: int, group: JudgedGroup) -> bool:
        """Occupy the group's slot, or (dropped by dynamic sampling) free it for a fresh prompt at once.
        False if the group was given up while it was being judged."""
        st, c = self.state, self.state.counters
        with st.cv:
            if st.flight.pop(draw, None) is None:
                return False
            c.judged += 1
            c.reward_failures += group.reward_failures
            c.reward_failure_types.update(group.reward_failure_types)
            c.groups_reward_failed += group.reward_failures > 0
            if group.kept:
                st.slots.occupy(draw, group)
                self.abandon(st.slots.take_dropped(), "surplus")  # a buffer filled: its surplus goes
            else:
                st.slots.release(draw)
                c.totals["dropped"] += 1
                if group.accs and all(group.accs):
                    c.dropped_correct += 1
                else:
                    c.dropped_wrong += 1
            self.signals.changed()
        return True

    def abandon(self, draws, reason: str) -> None:
        """Under the lock: give up groups whose slots the controller already freed: cancel their tasks
        and abort their requests on the servers. Their prompts count as drawn."""
        st = self.state
        for d in draws:
            f = st.flight.pop(d, None)
            st.counters.coordination[f"groups_aborted_{reason}"] += 1
            st.counters.totals[f"aborted_{reason}"] += 1
            task = st.tasks.pop(d, None)
            if task is not None:
                task.cancel()
            if f is not None and f.group_id is not None and st.router is not None:
                t = asyncio.ensure_future(st.router.abort_group(f.group_id))
                self._aborts.add(t)  # the loop keeps only weak references to tasks
                t.add_done_callback(self._aborts.discard)

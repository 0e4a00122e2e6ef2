"""The trainer's side: taking step t's batch, and the proactive filter acting while the trainer waits."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter

from megatron_dapo.coordinator.producer.completion import Completion
from megatron_dapo.coordinator.producer.handoff import LoopHandoff
from megatron_dapo.coordinator.producer.settings import BatchInfo, DynamicSamplingExhausted, ProducerSettings
from megatron_dapo.coordinator.producer.state import ProducerState, Signals
from megatron_dapo.coordinator.retry import ProactiveRetry
from megatron_dapo.coordinator.staleness import OCCUPIED

log = logging.getLogger("megatron_dapo.coordinator.producer")

WAIT_S = 1.0  # the longest a waiting take_batch goes without looking again


class Batches:
    """`take_batch` waits on the calling thread; every look at the buffers runs on the loop."""

    def __init__(
        self,
        settings: ProducerSettings,
        state: ProducerState,
        signals: Signals,
        handoff: LoopHandoff,
        completion: Completion,
        rewards,
        retry: ProactiveRetry | None = None,
    ):
        self.settings, self.state, self.signals, self.handoff = settings, state, signals, handoff
        self.completion = completion  # gives up the groups the proactive filter aborts
        self.rewards = rewards  # its activity: the reward throughput per batch
        self.retry = retry  # the proactive filter; None: off
        self.waiting_for: int | None = None  # the buffer the trainer waits on (loop-owned)

    # ---- called from the trainer's (the coordinator service's) thread --------------------------
    def take_batch(self, step: int, timeout_s: float) -> BatchInfo:
        """Block until step `step`'s buffer is full, then hand over its B groups (in draw order)."""
        self.handoff.call(lambda: self._begin_wait(step))
        try:
            return self._wait(step, timeout_s)
        finally:
            self.handoff.call(self._end_wait)

    def _begin_wait(self, step: int) -> None:
        self._check_step(step)
        self.waiting_for = step  # the proactive filter acts only while the trainer waits
        self.signals.poke()

    def _end_wait(self) -> None:
        self.waiting_for = None

    def _wait(self, step: int, timeout_s: float) -> BatchInfo:
        st, signals = self.state, self.signals
        t0, waited = time.monotonic(), st.clock()
        deadline = t0 + timeout_s + WAIT_S  # for the loop's answer: as long as a look may take today
        while True:
            with st.cv:
                seen = signals.changes
            info = self.handoff.call(lambda: self._take(step, waited), deadline)
            if info is not None:
                return info
            if time.monotonic() - t0 > timeout_s:
                with st.cv:
                    raise TimeoutError(
                        f"no full batch for step {step} after {timeout_s}s "
                        f"({st.slots.count(OCCUPIED, step)}/{self.settings.train_batch_size} groups "
                        f"kept, {st.in_flight} in flight)"
                    )
            with st.cv:
                st.cv.wait_for(lambda seen=seen: signals.changes != seen, WAIT_S)

    def _take(self, step: int, waiting_since: float) -> BatchInfo | None:
        info = self.take_ready(step, waiting_since)
        if info is not None:
            self.signals.poke()  # freed slots: dispatch into them
        return info

    def try_take_batch(self, step: int, waiting_since: float | None = None) -> BatchInfo | None:
        return self.handoff.call(lambda: self._try_take(step, waiting_since))

    def _try_take(self, step: int, waiting_since: float | None) -> BatchInfo | None:
        info = self.take_ready(step, self.state.clock() if waiting_since is None else waiting_since)
        began = info is None and self.waiting_for != step
        self.waiting_for = None if info is not None else step  # the caller waits until it has it
        if info is not None or began:  # the proactive filter acts only while the trainer waits
            self.signals.poke()
        return info

    # ---- on the loop (or in place when none runs), under the lock ------------------------------
    def _check_step(self, step: int) -> None:
        nxt = self.state.slots.next_buffer
        if step != nxt:
            raise ValueError(f"take_batch({step}): the next buffer is step {nxt}'s")

    def take_ready(self, step: int, waiting_since: float) -> BatchInfo | None:
        """Consume step `step`'s buffer if it is full; None if not yet."""
        st = self.state
        self._check_step(step)
        error = self.signals.error
        if error is not None:
            raise RuntimeError(f"rollout failed: {error!r}") from error
        if not st.slots.ready():
            if self.signals.exhausted:
                raise self._exhausted(step)
            return None
        # Draw order, not finishing order: the order of a batch (hence its mini-batches) does not
        # depend on timing.
        groups = sorted(st.slots.consume(), key=lambda g: g.draw)
        return self._batch_info(step, groups, waiting_since)

    def _batch_info(self, step: int, groups: list, waiting_since: float) -> BatchInfo:
        st, c, s = self.state, self.state.counters, self.settings
        later = st.slots.count(OCCUPIED)
        # Judged groups beyond this batch (already in later buffers) count towards the next one.
        judged = c.judged - later
        info = BatchInfo(
            groups,
            s.train_batch_size,
            c.dropped_correct,
            c.dropped_wrong,
            gen_batches=max(1, math.ceil(judged / s.gen_batch_groups)),
            reward_failures=c.reward_failures,
            reward_failure_types=Counter(c.reward_failure_types),
            reward_calls_per_s=self._reward_calls_per_s(),
            staleness=Counter(step - g.min_version for g in groups),
            wait_s=st.clock() - waiting_since,
            reserved_slots=st.in_flight,
            occupied_slots=later,
            partial_resumes=c.resumes,
            tokens_regenerated=c.regenerated,
            coordination=self._router_counts(c.coordination),
        )
        c.reset(judged=later)
        return info

    def _exhausted(self, step: int) -> DynamicSamplingExhausted:
        s, c = self.settings, self.state.counters
        return DynamicSamplingExhausted(
            f"dynamic sampling: {c.judged} groups judged in "
            f"{math.ceil(c.judged / s.gen_batch_groups)} generation batches "
            f"(algo.filter_groups.max_num_gen_batches={s.max_num_gen_batches}, "
            f"{s.gen_batch_groups} prompts each), only {self.state.slots.count(OCCUPIED, step)} kept; dropped "
            f"{c.dropped_correct} all-correct and {c.dropped_wrong} all-wrong groups; "
            f"train_batch_size needs {s.train_batch_size}. {self._exhausted_advice()}"
        )

    def _exhausted_advice(self) -> str:
        """What to change; when the reward itself failed in most groups, that comes first (its failed
        calls score as wrong, so they make all-wrong groups)."""
        c = self.state.counters
        advice = "Raise max_num_gen_batches or n_resp_per_prompt, or use an easier / warmer start."
        if 2 * c.groups_reward_failed <= c.judged:
            return advice
        by_type = ", ".join(f"{t} {n}" for t, n in c.reward_failure_types.most_common())
        return (
            f"The reward function failed in {c.groups_reward_failed} of the {c.judged} groups "
            f"({c.reward_failures} calls: {by_type}; messages in the coordinator's log): fix the reward "
            f"(reward.name, reward.timeout_s) first."
        )

    def _reward_calls_per_s(self) -> float:
        """Reward calls scored per second of scoring since the last batch (0 with no scoring)."""
        rewards, c = self.rewards, self.state.counters
        if rewards is None:
            return 0.0
        calls, busy_s = rewards.activity()
        calls_then, busy_then = c.rewards_taken
        c.rewards_taken = (calls, busy_s)
        return (calls - calls_then) / (busy_s - busy_then) if busy_s > busy_then else 0.0

    def _router_counts(self, counts: Counter) -> Counter:
        """`counts` plus the router's admission control since the last batch: times a request was
        refused (kept waiting), and requests waiting at the router now."""
        router, c = self.state.router, self.state.counters
        if router is not None:
            refusals = router.refusals
            counts["routing_refusals"] += max(0, refusals - c.refusals_taken)
            counts["router_queue"] += len(router.dispatcher)
            c.refusals_taken = refusals
        return counts

    def maybe_retry(self) -> None:
        """Under the lock: the proactive filter, while the trainer waits on the next buffer."""
        st = self.state
        if self.retry is None:
            return
        out = self.retry.apply(st.slots, trainer_waiting=self.waiting_for == st.slots.next_buffer)
        if out is None:
            return
        log.info(
            "proactive retry on buffer %d: %d in flight aborted, %d completed groups moved down",
            out.buffer,
            len(out.aborted),
            len(out.moved),
        )
        st.counters.coordination["retries"] += 1
        st.counters.coordination["groups_moved_down"] += len(out.moved)
        self.completion.abandon(out.aborted, "retry")
        self.completion.abandon(st.slots.take_dropped(), "surplus")
        self.signals.changed()

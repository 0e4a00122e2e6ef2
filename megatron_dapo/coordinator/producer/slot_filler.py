"""Filling the staleness slots: a fresh prompt for every slot that can be reserved now, within the
dynamic-sampling limit, and its group's task started (on the producer's event loop)."""

from __future__ import annotations

import asyncio

from megatron_dapo.coordinator.producer.completion import Completion
from megatron_dapo.coordinator.producer.settings import InFlight, ProducerSettings
from megatron_dapo.coordinator.producer.state import ProducerState, Signals


class SlotFiller:
    """Picks prompts for every reservable slot and starts their groups' tasks."""

    def __init__(self, settings: ProducerSettings, state: ProducerState, signals: Signals, completion: Completion):
        self.settings, self.state, self.signals = settings, state, signals
        self.completion = completion  # runs each started group

    def _limit(self) -> int:
        """Groups judged towards one batch before dynamic sampling gives up (0: no limit)."""
        return self.settings.max_num_gen_batches * self.settings.gen_batch_groups

    def _limit_reached(self) -> bool:
        limit = self._limit()
        return limit > 0 and self.state.counters.judged >= limit and not self.state.slots.ready()

    def _room(self) -> int | None:
        """Groups that may still start towards the next batch: the limit less those judged or in flight (each
        in flight will be judged), so it is never overshot by the groups dispatched while the last ones were
        being judged; None: no limit."""
        limit = self._limit()
        return None if limit <= 0 else limit - self.state.counters.judged - self.state.in_flight

    def dispatchable(self) -> list[tuple[int, int, int]]:
        """Under the lock: draw a prompt for every slot that can be reserved now (dataset index, draw, V_traj)."""
        st = self.state
        if self._limit_reached():
            self.signals.exhausted = True
            self.signals.changed()
        if self.signals.exhausted:
            return []
        picks = [(st.flight[d].idx, d, st.flight[d].v_traj) for d in st.redispatch]
        st.redispatch = []
        # Oldest version first: a group of V_traj v may run on any server holding >= v, so with
        # per-server sync the lagging servers keep taking work while buffers up to v + s have room,
        # instead of every new group waiting for (and piling onto) the servers that synced first.
        room = self._room()
        for v in range(self.oldest_version(), st.version + 1):
            for _ in range(st.slots.reservable(v)):
                if room is not None and room <= 0:
                    return picks
                room = None if room is None else room - 1
                idx, draw = st.sampler.next_draw()
                st.slots.reserve(draw, v)
                st.flight[draw] = InFlight(idx, v)
                picks.append((idx, draw, v))
        return picks

    def oldest_version(self) -> int:
        """The oldest weight version a healthy server holds (= the producer's version unless servers
        sync one by one, which only the registry's per-server versions show)."""
        st = self.state
        registry = getattr(st.router, "registry", None)
        if registry is None:
            return st.version
        return min([st.version, *(registry.version(s.url) for s in st.router.healthy())])

    def submit(self, router, picks, tasks: set[asyncio.Task]) -> None:
        """Start a task per picked group; `tasks` holds them until they end."""
        running = self.state.tasks
        for idx, draw, v_traj in picks:
            t = asyncio.create_task(self.completion.one_group(router, idx, draw, v_traj))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            running[draw] = t
            t.add_done_callback(lambda _t, d=draw: running.pop(d, None) if running.get(d) is _t else None)

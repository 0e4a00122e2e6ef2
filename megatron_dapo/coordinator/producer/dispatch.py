"""What to dispatch next, and submitting groups (on the producer's event loop)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING

from megatron_dapo.coordinator.producer.settings import InFlight, sample_seed
from megatron_dapo.rollout.types import SamplingParams

if TYPE_CHECKING:
    from megatron_dapo.coordinator.producer.core import RolloutProducer


class Dispatch:
    """Picks prompts for every reservable slot and starts their groups' tasks."""

    def __init__(self, producer: RolloutProducer):
        self.p = producer
        self.redispatch: list[int] = []  # draws restored in flight from a checkpoint

    def _limit(self) -> int:
        """Groups judged towards one batch before dynamic sampling gives up (0: no limit)."""
        return self.p.s.max_num_gen_batches * self.p.gen_batch_size

    def _limit_reached(self) -> bool:
        limit = self._limit()
        return limit > 0 and self.p.counters.judged >= limit and not self.p.slots.ready()

    def _room(self) -> int | None:
        """Groups that may still start towards the next batch: the limit less those judged or in flight (each
        in flight will be judged), so it is never overshot by the groups dispatched while the last ones were
        being judged; None: no limit."""
        limit = self._limit()
        return None if limit <= 0 else limit - self.p.counters.judged - self.p.in_flight

    def dispatchable(self) -> list[tuple[int, int, int]]:
        """Under the lock: draw a prompt for every slot that can be reserved now (dataset index, draw, V_traj)."""
        p = self.p
        if self._limit_reached():
            p.exhausted = True
            p._changed()
        if p.exhausted:
            return []
        picks = [(p.flight[d].idx, d, p.flight[d].v_traj) for d in self.redispatch]
        self.redispatch = []
        # Oldest version first: a group of V_traj v may run on any server holding >= v, so with
        # per-server sync the lagging servers keep taking work while buffers up to v + s have room,
        # instead of every new group waiting for (and piling onto) the servers that synced first.
        room = self._room()
        for v in range(self.oldest_version(), p.version + 1):
            for _ in range(p.slots.reservable(v)):
                if room is not None and room <= 0:
                    return picks
                room = None if room is None else room - 1
                idx, draw = p.sampler.next_draw()
                p.slots.reserve(draw, v)
                p.flight[draw] = InFlight(idx, v)
                picks.append((idx, draw, v))
        return picks

    def oldest_version(self) -> int:
        """The oldest weight version a healthy server holds (= the producer's version unless servers
        sync one by one, which only the registry's per-server versions show)."""
        p = self.p
        registry = getattr(p._router, "registry", None)
        if registry is None:
            return p.version
        return min([p.version, *(registry.version(s.url) for s in p._router.healthy())])

    def submit(self, router, picks, tasks: set[asyncio.Task]) -> None:
        """Start a task per picked group; `tasks` holds them until they end."""
        p = self.p
        for idx, draw, v_traj in picks:
            t = asyncio.create_task(p.completion.one_group(router, idx, draw, v_traj))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            p._tasks[draw] = t
            t.add_done_callback(lambda _t, d=draw: p._tasks.pop(d, None) if p._tasks.get(d) is _t else None)

    def v_traj(self, draw: int) -> int:
        return self.p.flight[draw].v_traj  # written only on the loop: read there without the lock

    def sampling(self, draw: int, index: int) -> SamplingParams:
        """Sample `index`'s own parameters (its seed when seeded)."""
        s = self.p.s
        seed = None if s.seed is None else sample_seed(s.seed, draw, index)
        return replace(s.sampling, n=1, sampling_seed=seed)

    def set_group_id(self, draw: int, group_id: str) -> None:
        with self.p._cv:
            if draw in self.p.flight:
                self.p.flight[draw].group_id = group_id

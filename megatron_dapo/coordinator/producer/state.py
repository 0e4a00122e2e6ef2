"""What the producer's parts share: `ProducerState` (slots, flight, counters, version, the condition
variable, ...) and `Signals` (what they tell each other, the trainer's waiting side and the loop).

Threads. Both belong to the producer's event loop: other threads (the coordinator service's) reach them
through `handoff`, which runs their calls on the loop (in place when no loop runs). Writes to what other
threads may still read directly (`slots`, `flight`, `sampler`, `totals`, the `consumed` / `buffer` /
`in_flight` views) happen under `cv`, so such a reader holding `cv` sees a consistent snapshot; `cv`
also wakes a waiting `take_batch`. Everything else (version, error, stop, the counters since the last
batch, tasks, router) is read and written on the loop only.
"""

from __future__ import annotations

import asyncio
import threading
import time

from megatron_dapo.coordinator.groups import JudgedGroup
from megatron_dapo.coordinator.producer.settings import InFlight, ProducerCounters, ProducerSettings
from megatron_dapo.coordinator.staleness import RESERVED, StalenessController


class ProducerState:
    """The producer's data. A checkpoint restore replaces `slots` and `flight` whole: parts read them
    here at each use, never keep their own reference."""

    def __init__(self, settings: ProducerSettings, sampler, version: int = 0, clock=time.monotonic):
        self.cv = threading.Condition()
        self.sampler = sampler
        self.version = version  # the newest weights a server holds
        self.clock = clock
        self.slots = StalenessController(
            settings.train_batch_size, settings.staleness, clock=clock, extra=settings.extra_prompts
        )
        self.flight: dict[int, InFlight] = {}  # draw -> its group in flight
        self.counters = ProducerCounters()
        self.tasks: dict[int, asyncio.Task] = {}  # draw -> its group's task
        self.redispatch: list[int] = []  # draws restored in flight from a checkpoint, to dispatch again
        self.router = None  # built by the running loop

    # ---- views of the staleness buffers (read under cv off the loop) ---------------------------
    @property
    def consumed(self) -> int:
        """Groups handed to the trainer, ever (after resume: restored)."""
        return self.slots.next_buffer * self.slots.slots

    @property
    def in_flight(self) -> int:
        return self.slots.count(RESERVED)

    @property
    def buffer(self) -> list[JudgedGroup]:
        """Completed groups waiting to be trained on, in buffer and slot order."""
        return [g for _, _, g in self.slots.occupied_items()]

    @property
    def totals(self):
        """Groups ever: dropped (dynamic sampling) / aborted_surplus / aborted_retry."""
        return self.counters.totals

    # ---- one group in flight -------------------------------------------------------------------
    def v_traj(self, draw: int) -> int:
        return self.flight[draw].v_traj  # written only on the loop: read there without the lock

    def set_group_id(self, draw: int, group_id: str) -> None:
        with self.cv:
            if draw in self.flight:
                self.flight[draw].group_id = group_id


class Signals:
    """What happened, for whoever waits on it: a change a waiting `take_batch` may answer (`changed`),
    work for the loop's dispatcher (`poke` from any thread, `wake` on the loop), and the flags the trainer
    and the loop read (`error`, `exhausted`, `stop`)."""

    def __init__(self, cv: threading.Condition):
        self.cv = cv
        self.changes = 0  # bumped by every changed(): what a waiting take_batch waits for
        self.error: BaseException | None = None
        self.exhausted = False  # dynamic sampling gave up
        self.stop = False
        self._listeners: list = []  # called (under the lock) whenever take_batch may have an answer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    def add_listener(self, fn) -> None:
        self._listeners.append(fn)

    def changed(self) -> None:
        """Under the lock: something take_batch waits for may have happened."""
        self.changes += 1
        self.cv.notify_all()
        for fn in self._listeners:
            fn()

    def fail(self, error: BaseException) -> None:
        """Under the lock: take_batch raises the first error recorded."""
        self.error = self.error or error
        self.changed()

    def request_stop(self) -> None:
        """Under the lock: the loop leaves on its next iteration."""
        self.stop = True
        self.changed()
        self.poke()

    # ---- the loop's dispatcher -----------------------------------------------------------------
    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Called on the loop's thread when it starts."""
        self._loop, self._wake = loop, asyncio.Event()

    def poke(self) -> None:
        """From any thread: wake the loop's dispatcher (on its next iteration)."""
        loop, wake = self._loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # closed meanwhile: nothing left to wake
            pass

    def wake(self) -> None:
        """On the loop: wake its dispatcher now."""
        self._wake.set()

    async def wait(self) -> None:
        """The dispatcher's wait for the next wake."""
        self._wake.clear()
        await self._wake.wait()

"""`RolloutProducer`: the producer's state, its lifecycle and event loop, and the calls other threads make.

Threads. The producer's state belongs to its event loop: other threads (the coordinator service's)
reach it through `handoff`, which runs their calls on the loop (in place when no loop runs). Writes
to what other threads may still read directly (`slots`, `flight`, `sampler`, `totals`, the
`consumed` / `buffer` / `in_flight` views) happen under `_cv`, so such a reader holding `_cv` sees a
consistent snapshot; `_cv` also wakes a waiting `take_batch`. Everything else (version, error, stop,
the counters since the last batch, the buffer the trainer waits on, tasks, router) is read and
written on the loop only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from megatron_dapo.coordinator.groups import JudgedGroup
from megatron_dapo.coordinator.migration import MigrationPolicy
from megatron_dapo.coordinator.producer import state
from megatron_dapo.coordinator.producer.batches import Batches
from megatron_dapo.coordinator.producer.completion import Completion
from megatron_dapo.coordinator.producer.dispatch import Dispatch
from megatron_dapo.coordinator.producer.generation import Generation
from megatron_dapo.coordinator.producer.handoff import LoopHandoff
from megatron_dapo.coordinator.producer.migrate import Migration
from megatron_dapo.coordinator.producer.settings import BatchInfo, InFlight, ProducerCounters, ProducerSettings
from megatron_dapo.coordinator.retry import ProactiveRetry
from megatron_dapo.coordinator.staleness import RESERVED, StalenessController
from megatron_dapo.rollout.types import Sample

log = logging.getLogger("megatron_dapo.coordinator.producer")


class RolloutProducer:
    def __init__(
        self,
        router_factory,
        dataset,
        sampler,
        reward_runner,
        settings: ProducerSettings,
        version: int = 0,
        tokenizer=None,
        clock=time.monotonic,
    ):
        """`router_factory()` builds the router inside the producer's event loop (aiohttp sessions
        belong to the loop that creates them). With `tokenizer`, responses are judged on their
        tokens decoded here (special tokens skipped), whatever text the server returns."""
        self.tokenizer = tokenizer
        self.router_factory = router_factory
        self.dataset, self.sampler, self.rewards = dataset, sampler, reward_runner
        self.s = settings
        self.clock = clock
        self.gen_batch_size = settings.gen_batch_size or settings.train_batch_size
        self._cv = threading.Condition()
        self._changes = 0  # bumped by every _changed(): what a waiting take_batch waits for
        self.handoff = LoopHandoff(self._cv)
        self.version = version
        self.slots = StalenessController(
            settings.train_batch_size, settings.staleness, clock=clock, extra=settings.extra_prompts
        )
        self.retry = ProactiveRetry(settings.retry_threshold, clock) if settings.retry_threshold else None
        self.migration = MigrationPolicy(settings.migration, clock) if settings.migration.enabled else None
        self.counters = ProducerCounters()
        self.flight: dict[int, InFlight] = {}  # draw -> its group in flight
        self.error: BaseException | None = None
        self.exhausted = False
        self._stop = False
        self._tasks: dict[int, asyncio.Task] = {}  # draw -> its group's task
        self._aborts: set[asyncio.Task] = set()  # abort calls in flight
        self._router = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._listeners: list = []  # called (under the lock) whenever take_batch may have an answer
        self.dispatch, self.generation = Dispatch(self), Generation(self)
        self.completion, self.batches, self.migrator = Completion(self), Batches(self), Migration(self)

    # ---- views of the staleness buffers (read under self._cv off the loop) ---------------------
    @property
    def consumed(self) -> int:
        """Groups handed to the trainer, ever (after resume: restored)."""
        return self.slots.next_buffer * self.s.train_batch_size

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

    @property
    def _waiting_for(self) -> int | None:
        return self.batches.waiting_for

    @_waiting_for.setter
    def _waiting_for(self, step: int | None) -> None:
        self.batches.waiting_for = step

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        try:
            self.handoff.call(self._request_stop, deadline)
        except TimeoutError:  # a loop that does not answer: the flag (one write) still stops it when it does
            with self._cv:
                self._request_stop()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))

    def _request_stop(self) -> None:
        self._stop = True
        self._changed()
        self._poke()

    def add_listener(self, fn) -> None:
        """`fn()` is called, under the producer's lock, whenever `try_take_batch` may have a new answer
        (a group judged, an error, exhaustion, stop): how a caller on the producer's own event loop
        (the simulator's trainer) waits without blocking the loop."""
        self._listeners.append(fn)

    def _changed(self) -> None:
        """Under the lock: something take_batch waits for may have happened."""
        self._changes += 1
        self._cv.notify_all()
        for fn in self._listeners:
            fn()

    def _poke(self) -> None:
        """Wake the loop's dispatcher (on its next iteration)."""
        loop, wake = self._loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # closed meanwhile: nothing left to wake
            pass

    def set_version(self, version: int) -> None:
        """A server now holds `version` (after a weight sync): later buffers open for reservations.
        Never backwards: with per-server sync, publishes of two servers may arrive out of order."""
        self.handoff.call(lambda: self._apply_version(version))

    def _apply_version(self, version: int) -> None:
        self.version = max(self.version, version)
        self._poke()

    def fail(self, error: BaseException) -> None:
        """Something outside the producer (a per-server weight sync) failed: take_batch raises it."""
        self.handoff.call(lambda: self._record_error(error))

    def _record_error(self, error: BaseException) -> None:
        self.error = self.error or error
        self._changed()

    # ---- the event loop ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self.run())
        except BaseException as e:  # surfaced to the trainer by take_batch
            log.exception("rollout producer failed")
            with self._cv:
                self.error = e
                self._changed()

    async def run(self) -> None:
        """The producer's loop: dispatch, judge, buffer until `stop()`. `start()` runs it on its own
        thread; a caller owning an event loop (the simulator) may run it as a task there instead."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.handoff.bind(self._loop)
        router = self._router = self.router_factory()
        tasks: set[asyncio.Task] = set()
        async with router:
            if self.migration is not None:
                tasks.add(asyncio.create_task(self.migrator.run(router)))
            while True:
                with self._cv:
                    if self._stop:
                        break
                    self.batches.maybe_retry()
                    picks = self.dispatch.dispatchable()
                self.dispatch.submit(router, picks, tasks)
                self._wake.clear()
                await self._wake.wait()
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- parts reached by name (tests drive them without a running loop) -----------------------
    def _dispatchable(self) -> list[tuple[int, int, int]]:
        return self.dispatch.dispatchable()

    def _maybe_retry(self) -> None:
        self.batches.maybe_retry()

    async def _server_statuses(self, router):
        return await self.migrator.server_statuses(router)

    def _sampling(self, draw: int, index: int):
        return self.dispatch.sampling(draw, index)

    def _progress(self, draw: int, sample: Sample) -> None:
        self.completion.progress(draw, sample)

    # ---- the trainer's side --------------------------------------------------------------------
    def take_batch(self, step: int, timeout_s: float = 3600.0) -> BatchInfo:
        """Block until step `step`'s buffer is full, then hand over its B groups (in draw order)."""
        return self.batches.take_batch(step, timeout_s)

    def try_take_batch(self, step: int, waiting_since: float | None = None) -> BatchInfo | None:
        """`take_batch` without waiting: step `step`'s batch if its buffer is full, else None
        (raises as take_batch does). `waiting_since`: clock() when the caller began waiting (wait_s)."""
        return self.batches.try_take_batch(step, waiting_since)

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Data position, the completed groups not yet trained and the groups in flight, with their
        slots. A resumed producer dispatches the in-flight groups again (same draw, V_traj and slot),
        continuing the samples the servers had answered partially (partial rollout); so no prompt is
        lost or drawn twice. Tokens a server had not yet answered are generated again."""
        return self.handoff.call(lambda: state.state_dict(self))

    def load_state_dict(self, saved: dict) -> None:
        slots, flight = state.restored_slots(self, saved)
        self.handoff.call(lambda: state.install(self, saved, slots, flight))

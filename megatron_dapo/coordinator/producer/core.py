"""`RolloutProducer`: wires the parts over one `ProducerState` and `Signals` (producer.state), runs the
event loop, and takes the calls other threads make (through `handoff`, which runs them on the loop)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from megatron_dapo.coordinator.migration import MigrationPolicy
from megatron_dapo.coordinator.producer import checkpoint
from megatron_dapo.coordinator.producer.batches import Batches
from megatron_dapo.coordinator.producer.completion import Completion
from megatron_dapo.coordinator.producer.generation import Generation
from megatron_dapo.coordinator.producer.handoff import LoopHandoff
from megatron_dapo.coordinator.producer.migrate import Migration
from megatron_dapo.coordinator.producer.settings import BatchInfo, ProducerSettings
from megatron_dapo.coordinator.producer.slot_filler import SlotFiller
from megatron_dapo.coordinator.producer.state import ProducerState, Signals
from megatron_dapo.coordinator.retry import ProactiveRetry

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
        self.router_factory = router_factory
        self.settings = settings
        self.rewards, self.tokenizer = reward_runner, tokenizer  # the service's evaluation scores with them too
        self.state = ProducerState(settings, sampler, version, clock)
        self.signals = Signals(self.state.cv)
        self.handoff = LoopHandoff(self.state.cv)
        shared = (settings, self.state, self.signals)
        self.generation = Generation(settings, self.state)
        self.completion = Completion(*shared, self.generation, dataset, reward_runner, tokenizer)
        self.filler = SlotFiller(*shared, self.completion)
        retry = ProactiveRetry(settings.retry_threshold, clock) if settings.retry_threshold else None
        self.batches = Batches(*shared, self.handoff, self.completion, reward_runner, retry)
        self.migrator = (
            Migration(*shared, MigrationPolicy(settings.migration, clock)) if settings.migration.enabled else None
        )
        self._thread: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        try:
            self.handoff.call(self.signals.request_stop, deadline)
        except TimeoutError:  # a loop that does not answer: the flag (one write) still stops it when it does
            with self.state.cv:
                self.signals.request_stop()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))

    def add_listener(self, fn) -> None:
        """`fn()` is called, under the producer's lock, whenever `try_take_batch` may have a new answer
        (a group judged, an error, exhaustion, stop): how a caller on the producer's own event loop
        (the simulator's trainer) waits without blocking the loop."""
        self.signals.add_listener(fn)

    def set_version(self, version: int) -> None:
        """A server now holds `version` (after a weight sync): later buffers open for reservations.
        Never backwards: with per-server sync, publishes of two servers may arrive out of order."""
        self.handoff.call(lambda: self._apply_version(version))

    def _apply_version(self, version: int) -> None:
        self.state.version = max(self.state.version, version)
        self.signals.poke()

    def fail(self, error: BaseException) -> None:
        """Something outside the producer (a per-server weight sync) failed: take_batch raises it."""
        self.handoff.call(lambda: self.signals.fail(error))

    # ---- the event loop ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self.run())
        except BaseException as e:  # surfaced to the trainer by take_batch
            log.exception("rollout producer failed")
            with self.state.cv:
                self.signals.error = e
                self.signals.changed()

    async def run(self) -> None:
        """The producer's loop: dispatch, judge, buffer until `stop()`. `start()` runs it on its own
        thread; a caller owning an event loop (the simulator) may run it as a task there instead."""
        loop = asyncio.get_running_loop()
        self.signals.bind(loop)
        self.handoff.bind(loop)
        router = self.state.router = self.router_factory()
        tasks: set[asyncio.Task] = set()
        async with router:
            if self.migrator is not None:
                tasks.add(asyncio.create_task(self.migrator.run(router)))
            while True:
                with self.state.cv:
                    if self.signals.stop:
                        break
                    self.batches.maybe_retry()
                    picks = self.filler.dispatchable()
                self.filler.submit(router, picks, tasks)
                await self.signals.wait()
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

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
        return self.handoff.call(lambda: checkpoint.state_dict(self.state))

    def load_state_dict(self, saved: dict) -> None:
        slots, flight = checkpoint.restored_slots(self.settings, self.state.clock, saved)
        self.handoff.call(lambda: checkpoint.install(self.state, saved, slots, flight))

"""A simulated engine that batches as the embedded rollout server does (rollout/embedded/engine.py).

The embedded engine's worker, once idle, prefills everything that waits and decodes that batch until
its last sequence finishes; requests arriving meanwhile wait for the next batch (no continuous
batching). With long-tailed lengths this matters: a group placed on a server while a batch runs there
waits for that batch's slowest sequence. SimEngine (SGLang's continuous batching) admits at every step
boundary; this one admits only into an empty engine, and one event-loop turn later than the request
arrived, so that what arrives at one instant (the n entries of one /generate, which the real server
queues together) starts as one batch. World(batching="static") uses it, to simulate CPU runs of the
embedded servers (benchmarks/sim_validate.py).
"""

from __future__ import annotations

from megatron_dapo.sim.engine import SimEngine


class StaticBatchEngine(SimEngine):
    _admit_pending = False

    def _admit(self) -> None:
        if self.running or not self.waiting or self._admit_pending:
            return  # a batch runs to its end before the next one starts
        self._admit_pending = True
        self.loop.call_soon(self._start_batch)

    def _start_batch(self) -> None:
        """The worker wakes up: everything waiting now (up to max_running) is one batch."""
        self._admit_pending = False
        self.catch_up()
        if not self.running:
            super()._admit()
        self._reschedule()

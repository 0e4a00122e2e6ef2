"""A simulated engine that batches as the embedded rollout server does (rollout/embedded/engine.py).

The embedded engine prefills whatever waits when it is idle and decodes that batch until its last
sequence finishes; requests arriving meanwhile wait for the next batch (no continuous batching).
With long-tailed lengths this matters: a group dispatched while a batch runs waits for that batch's
slowest sequence. SimEngine (SGLang's continuous batching) admits at every step boundary; this one
admits only into an empty engine. World(batching="static") uses it, to simulate CPU runs of the
embedded servers (benchmarks/sim_validate.py).
"""

from __future__ import annotations

from megatron_dapo.sim.engine import SimEngine


class StaticBatchEngine(SimEngine):
    def _admit(self) -> None:
        if not self.running:  # a batch runs to its end before the next one starts
            super()._admit()

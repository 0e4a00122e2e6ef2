"""A simulated engine that batches as the embedded rollout server does (embedded_server/engine.py).

The embedded engine's worker, once idle, takes everything that waits as one batch and decodes it until
its last sequence finishes; requests arriving meanwhile wait for the next batch (no continuous
batching). With long-tailed lengths this matters: a group placed on a server while a batch runs there
waits for that batch's slowest sequence. SimEngine (SGLang's continuous batching) admits at every step
boundary; this one admits only into an empty engine: after a batch ends, everything waiting (up to
max_running); on arrivals at an idle engine, one event-loop turn later, so that the entries of one
/generate (which the real server queues together, `submit_many`) start as one batch.

Requests the coordinator sends at one instant to an idle server reach it over HTTP a few ms apart, and
the real worker starts with whatever has arrived when it wakes: on the CPU runs, such a burst sometimes
starts as one batch and sometimes the first request starts alone and the rest wait for its end (both in
the servers' step traces, docs/history/results-2026-12.md). The simulation has no HTTP latency, so it offers
the two bounds: `split_arrivals=False` (the burst joins) and True (on an arrival at an idle engine only the
first request's entries, ids `rid-i` as SimClient and `abort` spell them, start the batch).
World(batching="static" | "static_split") uses it, to simulate CPU runs of the embedded servers.
"""

from __future__ import annotations

from megatron_dapo.sim.engine import SimEngine


def _call(rid: str) -> str:
    """The /generate call a request entry belongs to (`rid-i` -> `rid`)."""
    return rid.rsplit("-", 1)[0]


class StaticBatchEngine(SimEngine):
    split_arrivals = False
    _admit_pending = False
    _arriving = False  # inside submit: an arrival, not the end of a batch

    def submit(self, rid: str, input_len: int, target: int, max_new: int | None = None):
        self._arriving = True
        try:
            return super().submit(rid, input_len, target, max_new)
        finally:
            self._arriving = False

    def _admit(self) -> None:
        if self.running or not self.waiting or self._admit_pending:
            return  # a batch runs to its end before the next one starts
        self._admit_pending = True
        self.loop.call_soon(self._start_batch, self._arriving and self.split_arrivals)

    def _start_batch(self, first_call_only: bool) -> None:
        """The worker wakes up: everything waiting now (up to max_running) is one batch, or only the
        first request's entries."""
        self._admit_pending = False
        self.catch_up()
        if self.running or not self.waiting:
            return
        later = []
        if first_call_only:
            first = _call(self.waiting[0].rid)
            later = [r for r in self.waiting if _call(r.rid) != first]
            for r in later:
                self.waiting.remove(r)
        super()._admit()
        self.waiting.extend(later)
        self._reschedule()


class SplitArrivalsEngine(StaticBatchEngine):
    split_arrivals = True

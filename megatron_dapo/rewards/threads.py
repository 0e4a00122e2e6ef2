"""Reward calls on a bounded set of threads (`reward.num_workers = 0`).

Python cannot kill a thread: a call still running `timeout_s` after it started is abandoned, and
its thread with it. A fresh thread takes the abandoned one's place, so scoring goes on, but only up
to `max_hung` abandoned threads at a time: the call that would abandon one more raises
`RewardCallsHang`, and so does every call after it (the reward function hangs; the run stops with
that error instead of growing threads without end). An abandoned thread whose call returns at last
exits, freeing its place under the cap. Calls wait for a free thread without their time running:
the limit counts from the moment a thread starts the call.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

NUM_THREADS = 32  # threads serving calls (an I/O-bound reward, e.g. a remote judge, runs this many at once)
MAX_HUNG = 32  # abandoned threads (calls past the time limit) tolerated at once


class RewardCallsHang(RuntimeError):
    """Reward calls ran past `reward.timeout_s` on more threads than the cap allows (Python cannot
    kill a thread); the message says how many."""


@dataclass(eq=False)
class _Call:
    fn: Callable[[], object]
    started: float | None = None  # time.monotonic() when a thread began it
    outcome: tuple | None = None  # ("ok", value) or ("error", type name, message)
    abandoned: bool = False  # past its time limit: the caller gave up on it
    cancelled: bool = False  # not started when its caller failed: never start it


_STOP = None  # in the queue: one thread exits
_numbers = itertools.count()


def outcome_of(fn: Callable[[], object]) -> tuple:
    """("ok", fn()) or ("error", exception type name, message): user code never escapes as a crash."""
    try:
        return ("ok", fn())
    except Exception as e:  # any failure of user code is a scored failure
        return ("error", type(e).__name__, str(e))


class RewardThreads:
    """`num_threads` threads running zero-argument calls for any number of callers at once."""

    def __init__(self, num_threads: int = NUM_THREADS, max_hung: int = MAX_HUNG):
        if num_threads < 1 or max_hung < 0:
            raise ValueError(f"RewardThreads needs num_threads >= 1 and max_hung >= 0, got {num_threads}, {max_hung}")
        self.max_hung = max_hung
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._serving = 0  # threads taking calls from the queue (not abandoned)
        self.hung = 0  # abandoned threads still running their call
        self._failed: RewardCallsHang | None = None
        self._closed = False
        self.thread_name = f"reward-thread-{next(_numbers)}"  # all of this set's threads, hung ones too
        for _ in range(num_threads):
            self._start_thread()

    def _start_thread(self) -> None:
        self._serving += 1
        threading.Thread(target=self._serve, daemon=True, name=self.thread_name).start()

    def _serve(self) -> None:
        while True:
            call = self._queue.get()
            if call is _STOP:
                return
            with self._cv:
                if call.cancelled:
                    continue
                call.started = time.monotonic()
                self._cv.notify_all()  # its caller's clock for it starts now
            outcome = outcome_of(call.fn)
            with self._cv:
                if call.abandoned:  # a fresh thread already took this one's place
                    self.hung -= 1
                    return
                call.outcome = outcome
                self._cv.notify_all()

    def run(self, fns: list[Callable[[], object]], timeout_s: float) -> list[tuple | None]:
        """Each fn's outcome (see `outcome_of`), in order; None for a call abandoned `timeout_s`
        after it started. Raises RewardCallsHang once more than `max_hung` calls hang."""
        calls = [_Call(fn) for fn in fns]
        with self._cv:
            if self._failed is not None:
                raise self._failed
            if self._closed:
                raise RuntimeError("reward calls after the reward runner was closed")
            for call in calls:  # under the lock: before close's stop marks, so they are served
                self._queue.put(call)
        try:
            self._wait(calls, timeout_s)
        except RewardCallsHang:
            with self._cv:
                for call in calls:
                    call.cancelled = call.started is None
            raise
        return [c.outcome for c in calls]

    def _wait(self, calls: list[_Call], timeout_s: float) -> None:
        with self._cv:
            while True:
                if self._failed is not None:
                    raise self._failed
                now = time.monotonic()
                running = [c for c in calls if c.outcome is None and not c.abandoned]
                if not running:
                    return
                late = [c for c in running if c.started is not None and now - c.started >= timeout_s]
                for c in late:
                    self._abandon(c, timeout_s)
                if late:
                    continue
                # wake at the earliest time limit of a started call, or when a thread starts or ends one
                limits = [c.started + timeout_s - now for c in running if c.started is not None]
                self._cv.wait(max(0.0, min(limits)) if limits else None)

    def _abandon(self, call: _Call, timeout_s: float) -> None:
        """Under the lock: give up on `call`; a fresh thread replaces its own, within the cap."""
        if self.hung >= self.max_hung:
            self._failed = RewardCallsHang(
                f"{self.hung + 1} reward calls are still running past reward.timeout_s={timeout_s}s, over the "
                f"cap of {self.max_hung} abandoned threads (Python cannot kill a thread): the reward function "
                f"hangs. Fix it, or set reward.num_workers > 0 (worker processes: a hung call's worker is killed)"
            )
            self._cv.notify_all()
            raise self._failed
        call.abandoned = True
        self.hung += 1
        self._serving -= 1
        self._start_thread()

    def close(self) -> None:
        """The serving threads exit after the calls already queued (hung ones are daemons: they never
        hold up exit; the replacement of a call abandoned from now on takes its stop mark)."""
        with self._cv:
            if not self._closed:
                self._closed = True
                for _ in range(self._serving):
                    self._queue.put(_STOP)

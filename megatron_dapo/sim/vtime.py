"""An asyncio event loop on virtual time: when nothing is ready, the clock jumps to the next timer.

The coordinator's own asyncio code (producer, router, sync loop) runs on it unchanged: `asyncio.sleep`,
`loop.call_at`, `asyncio.wait_for` all read `loop.time()`, which here only moves when every task is
blocked on a timer. Work handed to an executor (`asyncio.to_thread`, the producer's reward scoring) runs
inline and takes no virtual time, so a run is deterministic and never waits on real threads.
"""

from __future__ import annotations

import asyncio
import selectors
import threading


class SimulationStalled(RuntimeError):
    """Every task waits and no timer is set: the simulated system deadlocked."""


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: "VirtualTimeLoop"):
        super().__init__()
        self._loop = loop

    def select(self, timeout=None):
        if timeout is None:
            raise SimulationStalled("simulation stalled: every task waits and no timer is set")
        if timeout > 0:
            self._loop.advance(timeout)
        if not self._loop.woken:  # nothing came through the self-pipe: no system call
            return []
        self._loop.woken = False
        return super().select(0)  # the self-pipe only (call_soon_threadsafe from another thread)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0):
        self._now = float(start)
        self.woken = False  # another thread wrote to the self-pipe since the last select
        super().__init__(_JumpingSelector(self))

    def _write_to_self(self) -> None:
        # call_soon_threadsafe from the loop's own thread (the router's and the producer's wake-ups:
        # here all of them) has queued its callback already; only another thread needs the self-pipe
        if threading.get_ident() != self._thread_id:
            self.woken = True
            super()._write_to_self()

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    def run_in_executor(self, executor, func, *args):
        fut = self.create_future()
        try:
            fut.set_result(func(*args))
        except BaseException as e:  # noqa: BLE001 - delivered to the awaiting task, as an executor would
            fut.set_exception(e)
        return fut


def run_virtual(coro, start: float = 0.0):
    """Run `coro` to completion on a fresh virtual-time loop; returns its result."""
    loop = VirtualTimeLoop(start)
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

"""Hand a call from another thread to the producer's event loop, which owns the producer's state."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.25  # how often a waiting caller checks that the loop still runs
ANSWER_S = 120.0  # the longest a caller waits for a running loop to begin its call, unless told


class LoopHandoff:
    """Runs `fn` on the bound event loop's thread, exactly once, and returns its result (or raises
    its exception) in the calling thread. In place instead when no loop runs (before `start`, after
    the loop ended), when called on the loop's own thread (the simulator's trainer), or when the
    caller holds `lock` (waiting for the loop then could deadlock: the loop takes that lock).
    Either way `fn` runs holding `lock`, so readers on other threads see its writes whole."""

    def __init__(self, lock: threading.Condition):
        self.lock = lock
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread_id: int | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Called on the loop's thread, before the loop touches any state."""
        self.loop, self._thread_id = loop, threading.get_ident()

    def on_loop(self) -> bool:
        return self._thread_id is not None and threading.get_ident() == self._thread_id

    def _in_place(self) -> bool:
        loop = self.loop
        # Condition._is_owned: whether this thread holds the (reentrant) lock
        return loop is None or not loop.is_running() or self.on_loop() or self.lock._is_owned()

    def _locked(self, fn: Callable[[], T]) -> T:
        with self.lock:
            return fn()

    def call(self, fn: Callable[[], T], deadline: float | None = None) -> T:
        """`deadline` (time.monotonic(); default ANSWER_S from now): raise TimeoutError if the loop has
        not begun `fn` by then (a loop that stopped answering, never a lock held by both sides)."""
        if self._in_place():
            return self._locked(fn)
        if deadline is None:
            deadline = time.monotonic() + ANSWER_S
        loop, fut = self.loop, concurrent.futures.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():  # the caller gave up (or ran it in place)
                return
            try:
                fut.set_result(self._locked(fn))
            except BaseException as e:  # handed back to the caller
                fut.set_exception(e)

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop closed meanwhile
            return self._locked(fn)
        while True:
            try:
                return fut.result(timeout=POLL_S)
            except concurrent.futures.TimeoutError:
                pass
            if not loop.is_running() and fut.cancel():  # the loop ended without running it
                return self._locked(fn)
            if time.monotonic() > deadline and fut.cancel():
                raise TimeoutError("the rollout producer's event loop did not answer in time")

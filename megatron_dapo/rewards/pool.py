"""Reward calls in worker processes (`reward.num_workers > 0`).

A reward function is user code: it may hold the GIL for long (a symbolic math check), hang, or
crash the interpreter. In worker processes it does none of that to the coordinator: a call still
running `timeout_s` after its worker began it has its worker killed and replaced (waiting for a free
worker does not count), a worker that dies mid-call (a segfault,
`os._exit`) is replaced, and both calls are reported as reward failures, never a hang. Workers are
spawned (no inherited threads or locks) and exit with the process that started them.

The reward functions are sent to the workers by pickle: module-level functions (the built-ins,
`package.module:function`, a `@register_reward` function) travel by name and are imported there.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import time
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import wait

from megatron_dapo.rewards.threads import outcome_of
from megatron_dapo.runtime.lifetime import exit_with_parent

# A fresh worker's first message: it has imported the reward functions. Its first call's time limit
# starts then, not when the call was sent (starting an interpreter is waiting, not the reward's time);
# the start itself may take up to STARTUP_S.
READY = ("ready",)
STARTUP_S = 120.0


def _worker_main(conn, fns: bytes, parent_pid: int) -> None:
    exit_with_parent(parent_pid)
    default, by_source = pickle.loads(fns)
    try:
        conn.send(READY)
    except OSError:  # the pool closed while this worker started
        return
    while True:
        try:
            response, ground_truth, source, extra = conn.recv()
        except (EOFError, OSError):  # the pool closed
            return
        out = outcome_of(partial(by_source.get(source, default), response, ground_truth, **(extra or {})))
        try:
            conn.send(out)
        except Exception as e:  # an unpicklable result is a scored failure too
            conn.send(("error", type(e).__name__, f"the reward function's result cannot be sent back: {e}"))


@dataclass
class _Worker:
    process: multiprocessing.Process
    conn: object  # the pool's end of the pipe
    started: bool = False  # READY was received


class RewardPool:
    """`num_workers` processes calling `default` (or `by_source[data_source]`) on reward items."""

    def __init__(self, default, by_source: dict | None, num_workers: int):
        try:
            self._fns = pickle.dumps((default, dict(by_source or {})))
        except Exception as e:
            raise ValueError(
                f"reward.num_workers > 0 sends the reward function to worker processes, but it cannot "
                f"be pickled ({type(e).__name__}: {e}); use a module-level function"
            ) from None
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._closed = False
        self.num_workers = num_workers
        self.restarts = 0
        for _ in range(num_workers):
            self._idle.append(self._spawn())

    def _spawn(self) -> _Worker:
        mine, theirs = self._ctx.Pipe()
        p = self._ctx.Process(
            target=_worker_main, args=(theirs, self._fns, os.getpid()), name="reward-worker", daemon=True
        )
        p.start()
        theirs.close()
        return _Worker(p, mine)

    def _checkout(self) -> _Worker | None:
        with self._lock:
            return self._idle.pop() if self._idle and not self._closed else None

    def _checkin(self, w: _Worker) -> None:
        with self._lock:
            if self._closed:
                self._kill(w)
            else:
                self._idle.append(w)

    def _replace(self, w: _Worker) -> None:
        """`w` hangs or died: kill it, a fresh worker takes its place."""
        self._kill(w)
        self.restarts += 1
        if not self._closed:
            self._checkin(self._spawn())

    @staticmethod
    def _kill(w: _Worker) -> None:
        if w.process.is_alive():
            w.process.kill()
        w.process.join(5)
        w.conn.close()

    def score(self, items: list[tuple], timeout_s: float) -> list[tuple | None]:
        """("ok", the function's return value) or ("error", type name, message) per item, in order;
        None for an item whose call ran `timeout_s` past the moment a worker began it (that worker
        was killed). Items wait for a free worker (other callers share them) without their time running."""
        out: list = [None] * len(items)
        todo = list(range(len(items)))
        busy: dict = {}  # conn -> (worker, item index, deadline)
        while todo or busy:
            self._dispatch(items, todo, busy, timeout_s)
            if todo and self._closed:
                for i in todo:
                    out[i] = ("error", "RewardPoolClosed", "the reward worker pool was closed")
                todo.clear()
            for conn in self._ready(busy, waiting=bool(todo)):
                w, i, _ = busy.pop(conn)
                answer = self._receive(w)
                if answer == READY:  # the worker is up: the call starts now
                    w.started = True
                    busy[conn] = (w, i, time.monotonic() + timeout_s)
                else:
                    out[i] = answer
            now = time.monotonic()
            for conn, (w, _, deadline) in list(busy.items()):
                if now >= deadline:  # this call hangs: its answer stays None
                    del busy[conn]
                    self._replace(w)
        return out

    def _dispatch(self, items, todo: list[int], busy: dict, timeout_s: float) -> None:
        """Send waiting items to idle workers; each call's time limit starts as its worker gets it (a
        fresh worker's: once it is up)."""
        while todo:
            w = self._checkout()
            if w is None:
                return
            i = todo.pop(0)
            w.conn.send(items[i])
            busy[w.conn] = (w, i, time.monotonic() + timeout_s + (0.0 if w.started else STARTUP_S))

    @staticmethod
    def _ready(busy: dict, waiting: bool) -> list:
        """The busy workers' pipes with an answer, waiting at most until the earliest time limit (or a
        short while when items wait for workers held by other callers: look for a free one soon)."""
        now = time.monotonic()
        left = min((deadline - now for _, _, deadline in busy.values()), default=0.05)
        if waiting:
            left = min(left, 0.05)
        if not busy:
            time.sleep(max(0.0, left))
            return []
        return wait(list(busy), timeout=max(0.0, left))

    def _receive(self, w: _Worker) -> tuple:
        """A busy worker's message (READY, or its answer: then it is idle again)."""
        try:
            answer = w.conn.recv()
        except (EOFError, OSError):
            w.process.join(5)
            self._replace(w)
            return ("error", "RewardWorkerDied", f"reward worker died (exit code {w.process.exitcode})")
        if answer != READY:
            self._checkin(w)
        return answer

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            w.conn.close()  # the worker sees EOF and returns
            w.process.join(5)
            if w.process.is_alive():
                self._kill(w)

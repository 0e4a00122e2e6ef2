"""Reward calls in worker processes (`reward.num_workers > 0`).

A reward function is user code: it may hold the GIL for long (a symbolic math check), hang, or
crash the interpreter. In worker processes it does none of that to the coordinator: a call still
running at the deadline has its worker killed and replaced, a worker that dies mid-call (a segfault,
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
from multiprocessing.connection import wait

from megatron_dapo.runtime.lifetime import exit_with_parent


def _worker_main(conn, fns: bytes, parent_pid: int) -> None:
    exit_with_parent(parent_pid)
    default, by_source = pickle.loads(fns)
    while True:
        try:
            response, ground_truth, source, extra = conn.recv()
        except EOFError:  # the pool closed
            return
        try:
            out = ("ok", by_source.get(source, default)(response, ground_truth, **(extra or {})))
            conn.send(out)
        except Exception as e:  # any failure of user code (or an unpicklable result) is a scored failure
            conn.send(("error", f"{type(e).__name__}: {e}"))


@dataclass
class _Worker:
    process: multiprocessing.Process
    conn: object  # the pool's end of the pipe


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

    def score(self, items: list[tuple], deadline: float) -> list[tuple[str, object] | None]:
        """("ok", the function's return value) or ("error", message) per item, in order; None for an
        item not answered by `deadline` (time.monotonic()): its worker was killed."""
        out: list = [None] * len(items)
        todo = list(range(len(items)))
        busy: dict = {}  # conn -> (worker, item index)
        while (todo or busy) and time.monotonic() < deadline:
            while todo:
                w = self._checkout()
                if w is None:
                    break
                i = todo.pop(0)
                w.conn.send(items[i])
                busy[w.conn] = (w, i)
            left = deadline - time.monotonic()
            # with items still waiting for a worker (held by other callers), look again soon
            ready = wait(list(busy), timeout=max(0.0, min(left, 0.05) if todo else left)) if busy else []
            if not busy:
                time.sleep(min(0.05, max(0.0, left)))
            for conn in ready:
                w, i = busy.pop(conn)
                try:
                    out[i] = conn.recv()
                except (EOFError, OSError):
                    w.process.join(5)
                    out[i] = ("error", f"reward worker died (exit code {w.process.exitcode})")
                    self._replace(w)
                    continue
                self._checkin(w)
        for w, _ in busy.values():  # past the deadline: these calls hang
            self._replace(w)
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            w.conn.close()  # the worker sees EOF and returns
            w.process.join(5)
            if w.process.is_alive():
                self._kill(w)

"""The colocated step cycle (trainer.placement=colocated, docs/placement.md): the trainer and the rollout
servers take turns on the same GPUs.

    rollout (trainer offloaded) -> servers release weights and KV -> trainer reloads -> train ->
    trainer offloads grads and optimizer state -> servers resume weights -> weight update ->
    trainer offloads params -> servers resume KV -> next rollout

`ColocationCycle` holds the transitions; the loop (trainer/loop.py) calls them in this order around its
own rollout, training and weight update. Rank 0 talks to the servers (it holds the server URLs and the
coordinator); every rank offloads and reloads its own engine, and a barrier after each side's move keeps
the other side from taking memory that is not yet free (no rank reloads before every server released;
no server resumes before every rank offloaded). Each transition is logged with its time and bytes and
reported in the step's metrics (`metrics()`).

Before releasing, rank 0 pauses generation in abort mode: SGLang's release asserts an idle server, and
pause(abort) returns once every request is answered (at staleness 0 none should be running: the step's
batch is complete and the producer cannot reserve a slot before the next version is published; what is
left is the surplus of dynamic sampling, being aborted). The pause also makes a request that arrives
while the server is released wait for the next `continue_generation`, sent after the KV cache is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

WEIGHTS, KV_CACHE = "weights", "kv_cache"  # SGLang's memory tags (sglang.srt.constants)
TRAIN_STATE = ("grads", "optimizer")  # freed after training; the parameters only after the weight update


@dataclass
class Transition:
    """One move of the cycle: `what` moved, in `seconds` (rank 0's, barrier included), `nbytes` device bytes
    of rank 0's engine (servers' moves: 0, they are not measured here)."""

    what: str
    seconds: float
    nbytes: int = 0


class ServerMemory:
    """Rank 0's calls to the servers' memory: pause + release, resume (+ continue). A server that does not
    answer is logged and skipped, as the weight sync's readmission and degrade handle a lost server the
    same way in both placements; the count is in the step's metrics."""

    def __init__(self, urls: Sequence[str], api_key: str | None, timeout_s: float):
        self.urls, self.api_key, self.timeout_s = list(urls), api_key, timeout_s
        self.failures = 0

    def release(self, tags: Sequence[str]) -> None:
        self._every("release", [("pause_generation", ("abort",)), ("release_memory_occupation", (list(tags),))])

    def resume(self, tags: Sequence[str], then_continue: bool = False) -> None:
        calls = [("resume_memory_occupation", (list(tags),))]
        if then_continue:
            calls.append(("continue_generation", ()))
        self._every("resume", calls)

    def _every(self, what: str, calls: list[tuple[str, tuple]]) -> None:
        from megatron_dapo.rollout.client import SGLangClient

        async def one(url):
            async with SGLangClient(url, api_key=self.api_key, timeout_s=self.timeout_s, retries=0) as c:
                for method, args in calls:
                    await getattr(c, method)(*args)

        async def every():
            return await asyncio.gather(*(one(u) for u in self.urls), return_exceptions=True)

        for url, r in zip(self.urls, asyncio.run(every()), strict=True):
            if isinstance(r, BaseException):
                self.failures += 1
                log.warning("colocated %s on %s failed (%r); the weight sync handles a lost server", what, url, r)


class ColocationCycle:
    """The transitions of one trainer rank. `servers`: rank 0's ServerMemory (None on the other ranks);
    `engine`: this rank's training engine (offload / reload, trainer/engine.py), set once it is built;
    `barrier`: every trainer rank's barrier; `clock`: seconds, for the transitions' times."""

    def __init__(
        self,
        servers: ServerMemory | None,
        barrier: Callable[[], None],
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.servers, self.barrier, self.clock = servers, barrier, clock
        self.engine = None
        self.transitions: list[Transition] = []

    # ---- the moves, in cycle order ---------------------------------------------------------------
    def release_servers(self) -> None:
        """Servers release weights and KV cache (rank 0), then every rank may take the GPUs."""
        self._timed("servers release weights and KV cache", lambda: self._servers("release", [WEIGHTS, KV_CACHE]))

    def reload_trainer(self) -> None:
        self._timed("trainer reloads", lambda: sum(self.engine.reload().values()))

    def offload_train_state(self) -> None:
        """After training: gradients and optimizer state off the GPUs, then the servers' weights back
        (the weight update writes them)."""
        self._timed("trainer offloads grads and optimizer state", lambda: self._offload(TRAIN_STATE))
        self._timed("servers resume weights", lambda: self._servers("resume", [WEIGHTS]))

    def offload_params(self) -> None:
        """After the weight update: the parameters off the GPUs, then the servers' KV cache back and their
        generation continued; the caller publishes the new version to the coordinator after this."""
        self._timed("trainer offloads params", lambda: self._offload(["params"]))
        self._timed("servers resume KV cache", lambda: self._servers("resume", [KV_CACHE], then_continue=True))

    def offload_all(self) -> None:
        """A run's first rollout (its weights already pushed): everything off the GPUs, servers whole again."""
        self.offload_train_state()
        self.offload_params()

    # ---- what the step reports -------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """The transitions since the last call, as step metrics (and the servers' failed calls)."""
        moves, self.transitions = self.transitions, []
        total = lambda prefix: sum(t.seconds for t in moves if t.what.startswith(prefix))  # noqa: E731
        nbytes = lambda prefix: float(sum(t.nbytes for t in moves if t.what.startswith(prefix)))  # noqa: E731
        out = {
            "time/colocate_release_s": total("servers release"),
            "time/colocate_resume_s": total("servers resume"),
            "time/offload_s": total("trainer offloads"),
            "time/reload_s": total("trainer reloads"),
            "colocate/offloaded_bytes": nbytes("trainer offloads"),
            "colocate/reloaded_bytes": nbytes("trainer reloads"),
        }
        if self.servers is not None:
            out["colocate/server_call_failures"] = float(self.servers.failures)
        return out

    # ---- internals -------------------------------------------------------------------------------
    def _servers(self, what: str, tags: list[str], then_continue: bool = False) -> int:
        """Rank 0 calls the servers; every rank waits for it (the barrier orders the two sides)."""
        if self.servers is not None:
            if what == "release":
                self.servers.release(tags)
            else:
                self.servers.resume(tags, then_continue)
        self.barrier()
        return 0

    def _offload(self, parts) -> int:
        nbytes = sum(self.engine.offload(parts).values())
        self.barrier()  # no server resumes before every rank's storage is free
        return nbytes

    def _timed(self, what: str, move: Callable[[], int]) -> None:
        t0 = self.clock()
        nbytes = move()
        t = Transition(what, self.clock() - t0, int(nbytes))
        self.transitions.append(t)
        if self.servers is not None:  # rank 0 logs the cycle
            log.info("colocated: %s in %.3f s (%d bytes on rank 0)", t.what, t.seconds, t.nbytes)

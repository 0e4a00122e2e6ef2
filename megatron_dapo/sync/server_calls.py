"""HTTP calls from a blocking trainer thread to the live rollout servers, on an asyncio loop of their own."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence

from megatron_dapo.rollout.client import SGLangClient
from megatron_dapo.sync.errors import WeightSyncError, raise_failed_answers
from megatron_dapo.sync.membership import Membership

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0  # each call of a sync, when neither the caller nor rollout.sync.timeout_s says
GRACE_S = 5.0  # beyond the clients' own timeout: a stalled server's call fails in its client, named
READMIT_HEALTH_S = 2.0  # a lost server's /health, asked at each sync point: it must answer within this


class LoopThread:
    """An asyncio loop on its own thread, so blocking trainer code can drive async HTTP calls."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="weight-sync-http", daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float | None = None):
        return self.submit(coro).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


class ServerCalls:
    """One client per server of `members.urls`; each call goes to the live ones (`members.live`), at once.
    Nothing is started until `start` (only the ranks that talk to servers start it)."""

    def __init__(self, members: Membership, api_key: str | None, timeout_s: float):
        self.members, self.api_key, self.timeout_s = members, api_key, timeout_s
        self._loop: LoopThread | None = None
        self._clients: dict[str, SGLangClient] = {}

    @property
    def started(self) -> bool:
        return self._loop is not None

    def start(self) -> None:
        if self._loop is None:
            self._loop = LoopThread()
            self._clients = {
                u: SGLangClient(u, api_key=self.api_key, timeout_s=self.timeout_s) for u in self.members.urls
            }

    @property
    def clients(self) -> list[SGLangClient]:
        """The live servers' clients, in `live` order."""
        return [self._clients[u] for u in self.members.live]

    def submit(self, coro):
        """A future of the loop thread (`concurrent.futures.Future`)."""
        return self._loop.submit(coro)

    def run(self, coro, timeout: float | None = None):
        return self._loop.run(coro, self.timeout_s + GRACE_S if timeout is None else timeout)

    def ask_all(self, method: str, *args, return_exceptions: bool = False, **kwargs) -> list:
        """`method` on every live server's client at once; their answers (or errors, with return_exceptions)."""

        async def go():
            return await asyncio.gather(
                *(getattr(c, method)(*args, **kwargs) for c in self.clients), return_exceptions=return_exceptions
            )

        return self.run(go())

    def raise_failed(self, what: str, answers: list) -> None:
        """Raise naming each live server whose answer to `what` is an error (errors.raise_failed_answers)."""
        raise_failed_answers(what, self.members.live, answers)

    def ask_all_and_raise_failed(self, method: str, *args, quiet: bool = False) -> None:
        """`method` on every live server, even when some fail; then raise naming each server that failed
        (or only log, with `quiet`, when an earlier error is already on its way)."""
        try:
            self.raise_failed(method, self.ask_all(method, *args, return_exceptions=True))
        except WeightSyncError as e:
            if not quiet:
                raise
            log.warning("%s (after an earlier error)", e)

    def model_infos(self, urls: Sequence[str]) -> dict[str, object]:
        """Each of `urls`' /model_info answer, or what asking it raised (a TimeoutError after READMIT_HEALTH_S)."""

        async def ask():
            return await asyncio.gather(
                *(asyncio.wait_for(self._clients[u].get_model_info(), READMIT_HEALTH_S) for u in urls),
                return_exceptions=True,
            )

        return dict(zip(urls, self.run(ask(), READMIT_HEALTH_S + GRACE_S)))

    def answering(self, urls: Sequence[str]) -> list[str]:
        """Those of `urls` whose /health answers 200 within READMIT_HEALTH_S (a stalled one costs that)."""

        async def ask():
            return await asyncio.gather(*(self._clients[u].health(READMIT_HEALTH_S) for u in urls))

        return [u for u, ok in zip(urls, self.run(ask(), READMIT_HEALTH_S + GRACE_S)) if ok]

    def close(self) -> None:
        if self._loop is None:
            return

        async def close_clients():
            await asyncio.gather(*(c.aclose() for c in self._clients.values()))

        self._loop.run(close_clients())
        self._loop.close()
        self._loop = None


def readmit_answering(members: Membership, calls: ServerCalls) -> list[str]:
    """Live servers restarted unnoticed (another weight version than they loaded, or refusing connections) are
    marked lost; then the lost ones answering /health again go back into `live`. Returns those back."""
    for url, (why, cause) in members.restarted(calls.model_infos(members.with_loaded_version())).items():
        members.mark_lost(url, why, cause)
    return members.readmit(calls.answering(list(members.lost))) if members.lost else []

"""What a weight sync raises, and how a server's failed call is told apart: gone (or stalled) vs refused."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_dapo.rollout.client import SGLangConnectionError, SGLangError


class WeightSyncError(RuntimeError):
    pass


class ServersLost(WeightSyncError):
    """Servers failed a sync call (unreachable, connection lost, no answer within the timeout). The transport
    has left them out and re-formed its group for the rest, so the sync may be tried again with a fresh
    export; `urls` are the servers lost, `reasons` why each was."""

    def __init__(self, message: str, reasons: dict[str, str]):
        super().__init__(message)
        self.reasons = dict(reasons)

    @property
    def urls(self) -> list[str]:
        return list(self.reasons)

    def __reduce__(self):  # the coordinator pickles errors: the constructor's arguments
        return type(self), (str(self), self.reasons), self.__dict__


def is_lost(e: BaseException) -> bool:
    """An answer saying the server is gone or stalled (not that our request was wrong)."""
    return isinstance(e, (SGLangConnectionError, TimeoutError))


def failure_reason(e: BaseException) -> str:
    """A failure in one line: a server's own message where it answered one."""
    if isinstance(e, SGLangError):
        return e.server_message if e.status is not None else str(e)
    return repr(e)


def raise_failed_answers(what: str, urls: Sequence[str], answers: Sequence) -> None:
    """Raise naming each server of `urls` whose answer to `what` is an error, the first as the cause: a
    ServersLost when some of them are gone or stalled, else a WeightSyncError."""
    failed = {url: e for url, e in zip(urls, answers) if isinstance(e, BaseException)}
    if not failed:
        return
    reasons = {url: f"{what}: {failure_reason(e)}" for url, e in failed.items()}
    message = f"{what} failed on " + "; ".join(f"{url}: {failure_reason(e)}" for url, e in failed.items())
    gone = {url: reasons[url] for url, e in failed.items() if is_lost(e)}
    raise (ServersLost(message, gone) if gone else WeightSyncError(message)) from next(iter(failed.values()))

"""The SGLang weight-update session around one sync, on every live server: pause (if configured), begin,
[the transport's updates], end, continue -- end and continue also after a failure.

The protocol, the pause modes and the flush rule: docs/rollout-and-weight-sync.md ("The session protocol
and pause modes"); SGLang 0.5.23 refuses updates outside a session (400).
"""

from __future__ import annotations

import logging

from megatron_dapo.rollout.client import SGLangError
from megatron_dapo.sync.server_calls import ServerCalls

log = logging.getLogger(__name__)

PAUSE_MODES = ("in_place", "retract", "abort")


def flushes_cache(pause_generation: bool, pause_mode: str) -> bool:
    """Whether the last update of a sync may ask SGLang to flush its cache: not after an in_place pause,
    where requests still run and the flush would fail the update."""
    return not (pause_generation and pause_mode == "in_place")


class UpdateSession:
    """The session of each sync on the live servers of `calls`. Between `open` and `close` it holds what the
    sync has done to the servers so far, so that `close` undoes it whatever failed."""

    def __init__(self, calls: ServerCalls, pause_generation: bool, pause_mode: str):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be in_place, retract or abort, got {pause_mode!r}")
        self.calls, self.pause_generation, self.pause_mode = calls, pause_generation, pause_mode
        self.paused = False
        self.opened = False

    @property
    def flush_cache(self) -> bool:
        """Whether the sync's last update asks for a cache flush (`flushes_cache`)."""
        return flushes_cache(self.pause_generation, self.pause_mode)

    def open(self) -> None:
        """Pause (if configured), then begin a weight-update session on every live server."""
        if self.pause_generation:
            self.paused = True  # continue even the servers that paused when another failed to
            answers = self.calls.ask_all("pause_generation", self.pause_mode, return_exceptions=True)
            self.calls.raise_failed("pause_generation", answers)
        self._begin()
        self.opened = True

    def close(self, failed: bool) -> None:
        """End every session, then continue, also after a failure. The first failure is the one raised:
        after a failed update (or a failed end) the cleanup's own errors are only logged, so they never
        hide the cause."""
        paused, opened, self.paused, self.opened = self.paused, self.opened, False, False
        end_error = None
        if opened:
            try:
                self.calls.ask_all_and_raise_failed("end_weight_update", quiet=failed)
            except Exception as e:
                end_error = e
        if paused:
            self.calls.ask_all_and_raise_failed("continue_generation", quiet=failed or end_error is not None)
        if end_error is not None:
            raise end_error

    def _begin(self) -> None:
        """A session left open by a trainer that died mid-sync (SGLang then refuses a new one) is closed
        first: the transport is the servers' only writer."""
        calls = self.calls
        answers = calls.ask_all("begin_weight_update", return_exceptions=True)
        for i, (url, c, e) in enumerate(zip(calls.members.live, calls.clients, answers)):
            if isinstance(e, SGLangError) and "already open" in str(e):
                log.warning("%s: closing a weight-update session left open by an earlier sync", url)
                calls.run(c.end_weight_update())
                answers[i] = calls.run(c.begin_weight_update())
        calls.raise_failed("begin_weight_update", answers)

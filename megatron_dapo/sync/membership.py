"""Which rollout servers a weight transport serves: live, lost (and why), restarted, re-admitted.

State only: the transport asks the servers (their model info, their /health) and hands the answers here.
A lost server keeps its place: re-admitted, it goes back where it was in `urls`, so every server's rank in
a re-formed update group is what it was. Whether the group must be re-formed is `needs_new_group`: the
live servers are no longer those it was formed with. See docs/operations.md for the fault handling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from megatron_dapo.rollout.client import SGLangConnectionError
from megatron_dapo.sync.errors import ServersLost, WeightSyncError

log = logging.getLogger(__name__)


class Membership:
    def __init__(
        self,
        urls: Sequence[str],
        tp_sizes: Sequence[int] | None = None,
        min_live: int = 1,  # fewer live servers than this after a loss: the sync fails (rollout.min_healthy_servers)
        on_lost: Callable[[str, str], None] | None = None,  # each server left out (the registry's mark_down)
    ):
        self.urls = [u.rstrip("/") for u in urls]
        self.tp_sizes = list(tp_sizes or [1] * len(self.urls))
        if len(self.tp_sizes) != len(self.urls):
            raise ValueError(f"server_tp_sizes has {len(self.tp_sizes)} entries for {len(self.urls)} servers")
        self.min_live, self.on_lost = min_live, on_lost
        self.live = list(self.urls)  # the servers in the group; a lost one is left out (`mark_lost`)
        self.lost: dict[str, str] = {}  # url -> why it was left out
        self.lost_causes: dict[str, BaseException] = {}  # url -> the failed call that found it gone (sync points)
        self.loaded: dict[str, str] = {}  # url -> the weight version its last sync loaded
        self.formed_with: list[str] = []  # the servers the update group was last formed with

    # ---- the update group's shape ----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Trainer rank 0 (or the source) plus every live server's TP ranks."""
        return 1 + sum(self._live_tp_sizes())

    def rank_offsets(self) -> list[int]:
        """Each live server's first rank in the update group: 1 + the TP ranks of the live servers before it."""
        tps = self._live_tp_sizes()
        return [1 + sum(tps[:i]) for i in range(len(tps))]

    def _live_tp_sizes(self) -> list[int]:
        return [tp for u, tp in zip(self.urls, self.tp_sizes) if u in self.live]

    @property
    def needs_new_group(self) -> bool:
        return self.live != self.formed_with

    def group_formed(self) -> None:
        self.formed_with = list(self.live)

    def group_left(self) -> None:
        self.formed_with = []

    # ---- transitions -------------------------------------------------------------------------------
    def mark_lost(self, url: str, why: str, cause: BaseException | None = None) -> None:
        self.live.remove(url)
        self.lost[url] = why
        if cause is not None:  # the failed call itself, for an error raised later about this loss
            self.lost_causes[url] = cause
        self.loaded.pop(url, None)
        log.error("weight sync: %s left out (%s); %d server(s) go on", url, why, len(self.live))
        if self.on_lost is not None:
            self.on_lost(url, why)

    def leave_out(self, lost: ServersLost) -> None:
        """Leave the lost servers out of every later sync (and tell `on_lost`); below `min_live` live
        servers, raise naming every server lost."""
        for url, why in lost.reasons.items():
            if url in self.live:
                self.mark_lost(url, why)
        if len(self.live) < self.min_live:
            raise WeightSyncError(
                f"{len(self.live)} live rollout server(s) left, fewer than rollout.min_healthy_servers="
                f"{self.min_live}; lost: {self.describe_lost()}"
            ) from lost

    def synced(self, version: str) -> None:
        """Every live server loaded `version`."""
        self.loaded = {u: version for u in self.live}

    def with_loaded_version(self) -> list[str]:
        """The live servers whose loaded version is known: those a restart can be told on."""
        return [u for u in self.live if u in self.loaded]

    def restarted(self, model_infos: Mapping[str, object]) -> dict[str, tuple[str, BaseException | None]]:
        """Of `model_infos` (url -> its /model_info answer, or the exception asking raised), the live servers
        restarted since their last sync (relaunched unnoticed: they report another weight version than the one
        they loaded, and hold no update group), and those refusing the connection (dead, or still relaunching:
        they cannot take part either). url -> (why, the failed call or None). One that did not answer in time is
        left to the sync (and its timeout)."""
        out = {}
        for url, info in model_infos.items():
            if isinstance(info, SGLangConnectionError):
                out[url] = (f"unreachable: {info}", info)
                continue
            held = info.get("weight_version") if isinstance(info, dict) else None  # None: cannot tell
            if held is not None and str(held) != self.loaded[url]:
                out[url] = (f"restarted: holds weight version {held}, not {self.loaded[url]}", None)
        return out

    def readmit(self, answering: Sequence[str]) -> list[str]:
        """The lost servers of `answering` go back into `live`, in their original places. Returns them."""
        back = [u for u in answering if u in self.lost]
        for url in back:
            log.warning("weight sync: %s answers again (was lost: %s); re-admitting it", url, self.lost.pop(url))
            self.lost_causes.pop(url, None)
        self.live = [u for u in self.urls if u in self.live or u in back]
        return back

    def adopt(self, live: Sequence[str], lost: Mapping[str, str]) -> None:
        """Another rank's decision (trainer rank 0's, with several sources)."""
        self.live, self.lost = list(live), dict(lost)

    def describe_lost(self) -> str:
        return "; ".join(f"{u}: {w}" for u, w in self.lost.items())

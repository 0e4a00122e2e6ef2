"""The weight-sync bridge: stream a trainer's HF-named weights into running rollout servers.

Every trainer rank calls `sync(named_tensors, version)` with its iterator of `(hf_name, tensor)`
(`megatron_dapo.bridge.export_hf_weights(model)` on each rank, which yields `None` for tensors on
ranks other than 0): the iterator is drained on every rank so that the export's gathers progress,
and only trainer rank 0 talks to servers. On rank 0 the tensors are grouped into buckets of about
`bucket_mb`; for each bucket, `/update_weights_from_distributed` is posted to every server at once,
then rank 0 broadcasts the bucket's tensors (one broadcast each, or with `flatten_bucket` one flat
uint8 buffer in SGLang's `flattened_bucket` layout) over the weight-update group, then the answers
are awaited; meanwhile the next bucket is produced and staged. The last bucket carries
`weight_version`, so a server reports the new version only once all of it is loaded.

One sync, as SGLang 0.5.23 requires it (`scheduler_components/weight_updater.py`, `scheduler.py`):

    pause_generation(mode)      if sync.pause_generation
    begin_weight_update         on every server; SGLang refuses updates outside a session (400)
    update_weights_from_distributed x buckets   (flush_cache on the last one, per mode below)
    end_weight_update           on every server, also when a bucket failed
    continue_generation         if paused, also when a bucket failed

SGLang flushes the radix cache after an update only when no request is running (nor queued, unless
paused); otherwise `flush_cache=True` FAILS the update ("Weights were updated, but the cache was not
flushed ..."). What each pause mode leaves behind decides what the bridge asks for:
- in_place: the running batch stays in the scheduler with its KV cache (the point of the mode: those
  requests go on after continue, their `weight_versions` record the switch). A flush would fail, so
  no update sets `flush_cache`; the radix cache keeps prefixes computed with the old weights, which a
  new request sharing a prefix may reuse, just as the paused requests reuse their own KV. Use
  `retract` where every token after a sync must be computed with the new weights.
- retract: the running requests go back to the waiting queue without their KV (re-prefilled with the
  new weights after continue); the scheduler counts as idle, so the last update flushes the cache.
- abort: SGLang aborts every request and waits until none is in flight; idle, the last update flushes.
- no pause (`pause_generation: false`): the server holds new requests and lets the running ones
  finish before it loads (its model-update lock), so the scheduler is idle and the last update flushes.
The embedded server applies the same gate and flush rule, so CPU tests catch a wrong combination.

From several sources (`sources=[0, r1, ...]`, `rollout.sync.sources: per_stage`): each listed trainer rank
(the first rank of a pipeline stage, or an expert-parallel rank holding experts: `bridge.export_sources`)
broadcasts only the tensors it rebuilt itself (`export_hf_weights(..., dst_rank=EACH_SOURCE)`), over its
own weight-update group `<group_name>_src<rank>`, which every server holds beside the others; nothing goes
through rank 0. Rank 0 stays the controller: it pauses, opens every server's session, and, after the last
source, ends the sessions and continues. The sources stream in turn (rank order, the order of the export's
stream), handing a token over a gloo group of the sources: SGLang's scheduler serves one call at a time, so
two sources broadcasting at once could each hold a different server in its broadcast and deadlock. A
source waits for its turn only once the export has rebuilt its first tensor: a source that is also a TP
peer of an earlier one takes part in that one's gathers first. A failed source hands on a "failed" token;
the later ones skip their updates but still drain their export (their TP peers wait on its gathers). Every
rank then exchanges the outcome and raises the same WeightSyncError naming the failed source rank; or, when
each failure lost servers (below), the same ServersLost: every source leaves them out, rank 0 ends the
others' sessions, and the sources re-form their groups in turn (`_reform_in_turn`). The
last source's last bucket carries the version (and the cache flush): it is set once, after all sources.
Re-admission (`readmit`) is then collective too: rank 0 decides which lost servers are back, every rank
adopts its decision, and the sources re-form their groups with them in turn.

A dead or stalled server (connection refused or lost, no answer within `timeout_s`, i.e.
rollout.sync.timeout_s): the sync raises `ServersLost` naming the call and server, after leaving it out
(`live`, `lost`, `on_lost`: the coordinator's registry), ending / continuing the others and re-forming the
group for them; the caller syncs again with a fresh export. Below `min_live` servers a WeightSyncError
names every lost server. A failure is what is raised: the cleanup's errors after it are only logged.
See docs/operations.md.

    bridge = WeightSyncBridge(urls, cfg.rollout.sync)        # on every trainer rank
    bridge.connect()                                          # collective over rank 0 + servers
    stats = bridge.sync(export_hf_weights(model), version=step)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo.config.schema import SyncConfig
from megatron_dapo.rollout import weight_group as wgroup
from megatron_dapo.rollout.client import SGLangClient, SGLangConnectionError, SGLangError
from megatron_dapo.rollout.protocol import FLATTENED_BUCKET
from megatron_dapo.rollout.weight_buckets import Bucket, iter_buckets
from megatron_dapo.runtime.net import LOOPBACK, free_port

log = logging.getLogger(__name__)


DEFAULT_TIMEOUT_S = 600.0  # each call of a sync, when neither the caller nor rollout.sync.timeout_s says
GRACE_S = 5.0  # beyond the clients' own timeout: a stalled server's call fails in its client, named
READMIT_HEALTH_S = 2.0  # a lost server's /health, asked at each sync point: it must answer within this


class WeightSyncError(RuntimeError):
    pass


class ServersLost(WeightSyncError):
    """Servers failed a sync call (unreachable, connection lost, no answer within the timeout). The bridge
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


def _outcome(answer: concurrent.futures.Future, timeout_s: float):
    """A server's answer, or the exception it raised, or a TimeoutError if it has none yet."""
    if not answer.done():
        return TimeoutError(f"no answer in {timeout_s}s")
    return answer.exception() or answer.result()


def _is_lost(e: BaseException) -> bool:
    """An answer saying the server is gone or stalled (not that our request was wrong)."""
    return isinstance(e, (SGLangConnectionError, TimeoutError))


def _lost_by_sources(outcomes, failures: list[str]) -> "ServersLost | None":
    """The sources' outcomes `(rank, why, lost reasons, counts)` as one ServersLost naming every server lost
    and the source that lost it, when each failure lost servers; None when none failed or one failed
    otherwise (a WeightSyncError for all: nothing is left out)."""
    failed = [(why, gone) for _, why, gone, _ in outcomes if why is not None]
    if not failed or any(gone is None for _, gone in failed):
        return None
    reasons = {url: reason for _, gone in failed for url, reason in gone.items()}
    return ServersLost("weight sync lost servers; " + "; ".join(failures), reasons)


def flushes_cache(pause_generation: bool, pause_mode: str) -> bool:
    """Whether the last update of a sync may ask SGLang to flush its cache (see the module docstring):
    not after an in_place pause, where requests still run and the flush would fail the update."""
    return not (pause_generation and pause_mode == "in_place")


@dataclass
class SyncStats:
    version: str
    num_tensors: int
    nbytes: int
    num_buckets: int
    seconds: float
    max_logprob_diff: float | None = None
    source_bytes: dict[int, int] | None = None  # bytes each source rank broadcast (several sources)

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9

    def as_metrics(self, prefix: str = "sync/") -> dict[str, float]:
        m = {
            f"{prefix}seconds": self.seconds,
            f"{prefix}gbps": self.gbps,
            f"{prefix}bytes": float(self.nbytes),
            f"{prefix}buckets": float(self.num_buckets),
        }
        if self.source_bytes:
            m[f"{prefix}sources"] = float(len(self.source_bytes))
            m[f"{prefix}source_bytes_max"] = float(max(self.source_bytes.values()))
        if self.max_logprob_diff is not None:
            m[f"{prefix}max_logprob_diff"] = self.max_logprob_diff
        return m


class _LoopThread:
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


@dataclass
class _InFlight:
    """One bucket on its way: the servers' pending HTTP answers and the running broadcasts."""

    answers: list[concurrent.futures.Future]  # of the HTTP loop thread: one per live server, its answer
    works: list
    payload: list[torch.Tensor]  # kept alive until the broadcasts complete
    names: list[str]


@dataclass
class _Session:
    """What a sync has done to the servers so far, so that it is undone whatever fails."""

    paused: bool = False
    open: bool = False


def _reason(e: BaseException) -> str:
    if isinstance(e, SGLangError):
        return e.server_message if e.status is not None else str(e)
    return repr(e)


def _is_sender() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class WeightSyncBridge:
    def __init__(
        self,
        server_urls: Sequence[str],
        sync_cfg=None,  # megatron_dapo.config.schema.SyncConfig (bucket_mb, pause_generation, flatten_bucket, ...)
        api_key: str | None = None,
        server_tp_sizes: Sequence[int] | None = None,
        pause_mode: str | None = None,  # default: sync_cfg.pause_mode
        group_name: str = "megatron_dapo_weight_sync",
        backend: str | None = None,
        master_address: str = LOOPBACK,
        master_port: int | None = None,
        timeout_s: float | None = None,  # each HTTP call and collective; default sync_cfg.timeout_s, else 600 s
        sources: Sequence[int] | None = None,  # trainer ranks that broadcast; default [0] (all through rank 0)
        min_live: int = 1,  # fewer live servers than this after a loss: the sync fails (rollout.min_healthy_servers)
        on_lost=None,  # (url, reason) -> None, for each server left out (the coordinator's registry.mark_down)
    ):
        self.sources = list(sources or [0])
        if self.sources[0] != 0 or self.sources != sorted(set(self.sources)):
            raise ValueError(f"sources must be ascending distinct trainer ranks starting at 0, got {self.sources}")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if len(self.sources) > 1:
            group_name = f"{group_name}_src{self.rank}"
        self.cfg = sync_cfg or SyncConfig()
        self.urls = [u.rstrip("/") for u in server_urls]
        self.tp_sizes = list(server_tp_sizes or [1] * len(self.urls))
        if len(self.tp_sizes) != len(self.urls):
            raise ValueError(f"server_tp_sizes has {len(self.tp_sizes)} entries for {len(self.urls)} servers")
        pause_mode = pause_mode or self.cfg.pause_mode
        if pause_mode not in ("in_place", "retract", "abort"):
            raise ValueError(f"pause_mode must be in_place, retract or abort, got {pause_mode!r}")
        self.pause_mode = pause_mode
        self.group_name = group_name
        self.backend = backend or wgroup.default_backend()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        )
        self.master_address, self.master_port = master_address, master_port
        self.timeout_s = timeout_s or self.cfg.timeout_s or DEFAULT_TIMEOUT_S
        self.api_key = api_key
        self.live = list(self.urls)  # the servers in the group; a lost one is left out (`_leave_out`)
        self.lost: dict[str, str] = {}  # url -> why it was left out
        self.lost_causes: dict[str, BaseException] = {}  # url -> the failed call that found it gone (sync points)
        self._loaded: dict[str, str] = {}  # url -> the weight version its last sync loaded
        self._members: list[str] = []  # the servers the update group was last formed with
        self.min_live, self.on_lost = min_live, on_lost
        self.sender = self.rank in self.sources
        self.pg = None
        self._turns = None  # the sources' gloo group, over which they hand on the token
        self._staging: list[torch.Tensor | None] = [None, None]
        self._loop: _LoopThread | None = None
        self._clients: dict[str, SGLangClient] = {}

    @property
    def clients(self) -> list[SGLangClient]:
        """The live servers' clients, in `live` order."""
        return [self._clients[u] for u in self.live]

    @property
    def _live_tp(self) -> list[int]:
        return [tp for u, tp in zip(self.urls, self.tp_sizes) if u in self.live]

    @property
    def world_size(self) -> int:
        return 1 + sum(self._live_tp)

    # ---- group ---------------------------------------------------------------------------------
    def connect(self) -> None:
        """Form the weight-update group: rank 0 here, server i at rank_offset 1 + sum(tp of servers < i).
        With several sources: collective over every trainer rank; the sources form theirs in turn."""
        if len(self.sources) == 1:
            if self.sender:
                self._connect_group()
            return
        self._turns = dist.new_group(self.sources, backend="gloo")  # every rank, in the same order
        if not self.sender:
            return
        for source in self.sources:  # one at a time: a server joins one group at a time
            if source == self.rank:
                self._connect_group()
            dist.barrier(group=self._turns)

    def _connect_group(self) -> None:
        if self._loop is None:
            self._loop = _LoopThread()
            self._clients = {u: SGLangClient(u, api_key=self.api_key, timeout_s=self.timeout_s) for u in self.urls}
        port = self.master_port or free_port(self.master_address)
        offsets = [1 + sum(self._live_tp[:i]) for i in range(len(self.live))]

        async def ask_all():
            return await asyncio.gather(
                *(
                    c.init_weights_update_group(
                        self.master_address, port, off, self.world_size, self.group_name, self.backend
                    )
                    for c, off in zip(self.clients, offsets)
                )
            )

        answers = self._loop.submit(ask_all())
        try:
            self.pg = wgroup.init_weight_update_group(
                self.master_address, port, 0, self.world_size, self.group_name, self.backend, self.timeout_s
            )
        except Exception as e:
            raise WeightSyncError(
                f"weight-update group at {self.master_address}:{port} did not form: {e}; "
                f"servers: {self._drain(answers)}"
            ) from e
        answers.result(self.timeout_s + GRACE_S)
        self._members = list(self.live)
        log.info(
            "weight-update group %s formed: %d servers, world size %d", self.group_name, len(self.live), self.world_size
        )

    def _leave_group(self) -> None:
        """Both sides leave the group (servers first, so the group name may be reused)."""
        if self._loop is None:  # never connected
            return
        self._each("destroy_weights_update_group", self.group_name, quiet=True)  # a dead server cannot answer
        if self.pg is not None:  # else torn down already (`_abort_group`)
            wgroup.destroy_weight_update_group(self.pg)
            self.pg = None
        self._members = []

    def _leave_out(self, lost: ServersLost) -> None:
        """Leave the lost servers out of every later sync (and tell `on_lost`); below `min_live` live
        servers, raise naming every server lost."""
        for url, why in lost.reasons.items():
            if url in self.live:
                self._mark_lost(url, why)
        if len(self.live) < self.min_live:
            raise WeightSyncError(
                f"{len(self.live)} live rollout server(s) left, fewer than rollout.min_healthy_servers="
                f"{self.min_live}; lost: " + "; ".join(f"{u}: {w}" for u, w in self.lost.items())
            ) from lost

    def readmit(self) -> list[str]:
        """Lost servers that answer /health again (restarted, relaunched, or no longer stalled) rejoin: the
        group is re-formed with them (in their original places), so the next sync gives them the current
        weights; the caller verifies them and routes to them again. Returns those re-admitted (on rank 0).
        With several sources: collective over every trainer rank (`_readmit_from_sources`)."""
        if len(self.sources) > 1:
            return self._readmit_from_sources()
        if not self.sender or self._loop is None:
            return []
        back = self._back()
        if not back and self.live == self._members:
            return []
        if not self.live:  # every server out: the sync names them
            self._leave_group()
            return []
        try:
            self._reform()  # its leave step also destroys a group a stalled server may still hold
        except WeightSyncError as e:  # a server back only briefly: the others go on without it
            self._leave_out(ServersLost(f"re-admission failed: {e}", {u: f"re-admission: {e}" for u in back}))
            self._reform() if self.live else self._leave_group()
            return []
        return back

    def _back(self) -> list[str]:
        """Rank 0: live servers restarted unnoticed are marked lost; the lost ones answering /health again go
        back into `live` (in their original places). Returns those back."""
        for url, (why, cause) in self._restarted().items():
            self._mark_lost(url, why, cause)
        back = self._answering(list(self.lost)) if self.lost else []
        for url in back:
            log.warning("weight sync: %s answers again (was lost: %s); re-admitting it", url, self.lost.pop(url))
            self.lost_causes.pop(url, None)
        self.live = [u for u in self.urls if u in self.live or u in back]
        return back

    def _readmit_from_sources(self) -> list[str]:
        """`readmit` with several sources, on every trainer rank: rank 0 decides which servers are back (and
        which it lost since, in the logprob check), every rank adopts its `live` / `lost`, and where the live
        servers are no longer those the groups were formed with, the sources re-form their groups in turn. A
        source whose re-formation fails leaves the returning servers out again, on every rank."""
        decision: list = [None]
        if self.rank == 0:
            back = self._back() if self._loop is not None else []
            # a restarted server back in its place needs its group re-formed too (it holds none)
            decision = [(back, list(self.live), dict(self.lost), bool(back) or self.live != self._members)]
        dist.broadcast_object_list(decision, src=0)
        back, self.live, self.lost, changed = decision[0]
        if not changed:
            return back
        errors = self._gather(self._reform_in_turn(catch=True) if self.sender else None)
        if not errors:
            return back
        why = "re-admission failed; " + "; ".join(errors)
        self._leave_out(ServersLost(why, {u: why for u in back if u in self.live}))
        if self._gather(self._reform_in_turn(catch=True) if self.sender else None):
            raise WeightSyncError(f"{why}; re-forming the groups without them failed too")
        return []

    @staticmethod
    def _gather(error: str | None) -> list[str]:
        """Every trainer rank's error (None: none), the failures named by rank, on every rank."""
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        return [f"source rank {rank}: {e}" for rank, e in enumerate(errors) if e is not None]

    def _restarted(self) -> dict[str, tuple[str, BaseException | None]]:
        """Live servers restarted since the last sync (relaunched between two syncs, unnoticed): they report
        another weight version than the one they loaded, and hold no update group. A server that refuses
        the connection (dead, or still relaunching) cannot take part either: left out now, before the sync
        broadcasts to a group it is no longer in. One that does not answer in time is left to the sync (and
        its timeout)."""
        urls = [u for u in self.live if u in self._loaded]

        async def ask():
            return await asyncio.gather(
                *(asyncio.wait_for(self._clients[u].get_model_info(), READMIT_HEALTH_S) for u in urls),
                return_exceptions=True,
            )

        out = {}
        for url, info in zip(urls, self._loop.run(ask(), READMIT_HEALTH_S + GRACE_S)):
            if isinstance(info, SGLangConnectionError):
                out[url] = (f"unreachable: {info}", info)
                continue
            held = info.get("weight_version") if isinstance(info, dict) else None  # None: cannot tell
            if held is not None and str(held) != self._loaded[url]:
                out[url] = (f"restarted: holds weight version {held}, not {self._loaded[url]}", None)
        return out

    def _answering(self, urls: list[str]) -> list[str]:
        """Those of `urls` whose /health answers 200 within READMIT_HEALTH_S (a stalled one costs that)."""

        async def ask():
            return await asyncio.gather(*(self._clients[u].health(READMIT_HEALTH_S) for u in urls))

        return [u for u, ok in zip(urls, self._loop.run(ask(), READMIT_HEALTH_S + GRACE_S)) if ok]

    def _mark_lost(self, url: str, why: str, cause: BaseException | None = None) -> None:
        self.live.remove(url)
        self.lost[url] = why
        if cause is not None:  # the failed call itself, for an error raised later about this loss
            self.lost_causes[url] = cause
        self._loaded.pop(url, None)
        log.error("weight sync: %s left out (%s); %d server(s) go on", url, why, len(self.live))
        if self.on_lost is not None:
            self.on_lost(url, why)

    def _reform(self) -> None:
        """A new group for the live servers (its world size changed): the old one had the lost ones in it."""
        self._leave_group()
        self._connect_group()

    @staticmethod
    def _drain(fut) -> str:
        try:
            return str(fut.result(5))
        except Exception as e:
            return repr(e)

    def close(self) -> None:
        """Leave the group on both sides (servers first, so a later bridge may reuse the group name)."""
        self._leave_group()
        self._staging = [None, None]
        if self._loop is not None:

            async def close_clients():
                await asyncio.gather(*(c.aclose() for c in self._clients.values()))

            self._loop.run(close_clients())
            self._loop.close()
            self._loop = None

    # ---- sync ----------------------------------------------------------------------------------
    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor | None]], version) -> SyncStats | None:
        """Push one full set of weights to every server; returns stats on rank 0, None elsewhere."""
        if len(self.sources) > 1:
            return self._sync_from_sources(named_tensors, str(version))
        if not self.sender:
            for _ in named_tensors:  # take part in the export's collectives
                pass
            return None
        if self.pg is None:
            raise WeightSyncError("sync() before connect()")
        if not self.live:
            raise WeightSyncError(
                "no live server to sync; lost: " + "; ".join(f"{u}: {w}" for u, w in self.lost.items())
            )
        version = str(version)
        t0 = time.perf_counter()
        session = _Session()
        failed = True  # until the last bucket is answered: then errors at the end are raised, not logged
        lost: ServersLost | None = None
        items = iter(named_tensors)
        try:
            self._open(session)
            present = ((n, t) for n, t in items if t is not None)
            counts = self._stream(present, version, flushes_cache(self.cfg.pause_generation, self.pause_mode))
            failed = False
        except ServersLost as e:
            lost = e
            for _ in items:  # the other trainer ranks' export gathers go on to the end
                pass
            self._leave_out(e)  # before the cleanup: end / continue only the servers that go on
            raise
        finally:
            self._close(session, failed)
            if lost is not None:  # a group of the servers that go on (none: only leave the old one)
                self._reform() if self.live else self._leave_group()
        self._loaded = {u: version for u in self.live}
        return self._stats(version, *counts, time.perf_counter() - t0)

    def _sync_from_sources(self, named_tensors, version: str) -> SyncStats | None:
        """`sync` with several sources; collective over every trainer rank (see the module docstring)."""
        if self.sender and self.pg is None:
            raise WeightSyncError("sync() before connect()")
        t0 = time.perf_counter()
        items = iter(named_tensors)
        session = _Session()
        error: BaseException | None = None
        counts = (0, 0, 0)
        if self.rank == 0:
            try:
                self._open(session)
            except Exception as e:  # the sources skip their updates; the outcome is exchanged below
                error = e
        if self.sender:
            error, counts = self._take_turn(items, version, error)
        for _ in items:  # take part in the export's collectives
            pass
        outcomes = [None] * dist.get_world_size()
        why = None if error is None else str(error) if isinstance(error, WeightSyncError) else _reason(error)
        gone = error.reasons if isinstance(error, ServersLost) else None
        dist.all_gather_object(outcomes, (self.rank, why, gone, counts))
        failures = [f"source rank {rank}: {why}" for rank, why, _, _ in outcomes if why is not None]
        lost = _lost_by_sources(outcomes, failures)
        try:
            if lost is not None:  # every rank leaves the same servers out, before the sessions end
                self._leave_out(lost)
        finally:
            if self.rank == 0:
                self._close(session, failed=bool(failures))
            if lost is not None and self.sender:
                self._reform_in_turn()
        if lost is not None:
            raise lost from error
        if failures:
            raise WeightSyncError("weight sync failed; " + "; ".join(failures)) from error
        if self.rank != 0:
            return None
        self._loaded = {u: version for u in self.live}
        totals = [sum(c[i] for *_, c in outcomes) for i in range(3)]
        stats = self._stats(version, *totals, time.perf_counter() - t0)
        stats.source_bytes = {rank: c[1] for rank, _, _, c in outcomes if rank in self.sources}
        return stats

    def _reform_in_turn(self, catch: bool = False) -> str | None:
        """After a loss (or a re-admission) with several sources: each source, in turn, leaves its group and
        forms one of the live servers (none: only leaves), as `connect` formed them; a server joins one
        group at a time. With `catch`, this source's failure is returned (after its turn) instead of raised,
        so the later sources still take theirs."""
        error = None
        for source in self.sources:
            if source == self.rank:
                try:
                    self._reform() if self.live else self._leave_group()
                except Exception as e:  # any: the other sources wait for this one's turn to end
                    if not catch:
                        raise
                    error = str(e) if isinstance(e, WeightSyncError) else _reason(e)
            dist.barrier(group=self._turns)
        return error

    def _take_turn(self, items, version: str, error: BaseException | None):
        """This source's part: rebuild its first tensor, wait for its turn, stream its run of tensors, hand
        on the turn. Returns (its error or None, (tensors, bytes, buckets))."""
        counts = (0, 0, 0)
        first = next(((n, t) for n, t in items if t is not None), None)  # earlier sources' items are None here
        turn = self._wait_turn()
        run = self._own_run(first, items)
        last = self.rank == self.sources[-1]
        if turn and error is None:
            try:
                if first is None:
                    raise WeightSyncError("the export yielded no tensor on this source (export with EACH_SOURCE)")
                flush = last and flushes_cache(self.cfg.pause_generation, self.pause_mode)
                counts = self._stream(run, version if last else None, flush)
            except Exception as e:
                error = e
        for _ in run:  # the rest of this source's run: its TP peers wait on the gathers
            pass
        self._pass_turn(turn and error is None)
        return error, counts

    @staticmethod
    def _own_run(first, items):
        """This source's tensors: `first` and those right after it (the export yields each source's as one run)."""
        if first is None:
            return
        yield first
        for name, tensor in items:
            if tensor is None:
                return
            yield name, tensor

    def _wait_turn(self) -> bool:
        """Block until the previous source hands on the turn; whether all before succeeded (rank 0: True)."""
        i = self.sources.index(self.rank)
        if i == 0:
            return True
        token = torch.zeros(1, dtype=torch.int64)
        dist.recv(token, src=self.sources[i - 1], group=self._turns)
        return bool(token.item())

    def _pass_turn(self, ok: bool) -> None:
        i = self.sources.index(self.rank)
        if i + 1 < len(self.sources):
            dist.send(torch.tensor([int(ok)], dtype=torch.int64), dst=self.sources[i + 1], group=self._turns)

    def _open(self, session: "_Session") -> None:
        """Pause (if configured), then open a weight-update session on every server."""
        if self.cfg.pause_generation:
            session.paused = True  # continue even the servers that paused when another failed to
            self._check("pause_generation", self._all("pause_generation", self.pause_mode, return_exceptions=True))
        self._begin_sessions()
        session.open = True

    def _close(self, session: "_Session", failed: bool) -> None:
        """End every session, then continue, also after a failure. The first failure is the one raised:
        after a failed update (or a failed end) the cleanup's own errors are only logged, so they never
        hide the cause."""
        end_error = None
        if session.open:
            try:
                self._each("end_weight_update", quiet=failed)
            except Exception as e:
                end_error = e
        if session.paused:
            self._each("continue_generation", quiet=failed or end_error is not None)
        if end_error is not None:
            raise end_error

    def _stream(self, present, version: str | None, flush: bool) -> tuple[int, int, int]:
        """Broadcast `(name, tensor)` pairs bucket by bucket; the last bucket carries `version` and `flush`.
        Returns (tensors, bytes, buckets)."""
        bucket_bytes = int(self.cfg.bucket_mb * 1024 * 1024)
        n_tensors = n_bytes = n_buckets = 0
        inflight: _InFlight | None = None
        try:
            # Pipelined: while bucket i is on the wire, bucket i+1 is produced (the export's gathers)
            # and staged (device copy, flattening); its update is posted only once bucket i is answered,
            # so every server sees the updates in order.
            for i, bucket in enumerate(iter_buckets(present, bucket_bytes, aligned=self.cfg.flatten_bucket)):
                payload = self._stage(bucket, slot=i % 2)
                if inflight is not None:
                    self._finish(inflight)
                # the last bucket carries the version: a server reports it only once all of it is loaded
                last = bucket.last and version is not None
                inflight = self._start(bucket, payload, version if last else None, flush and bucket.last)
                n_tensors += len(bucket.tensors)
                n_bytes += bucket.nbytes
                n_buckets += 1
            if inflight is None:
                raise WeightSyncError("sync(): the weight iterator yielded no tensors")
            self._finish(inflight)
            inflight = None
        finally:
            if inflight is not None and not all(f.done() for f in inflight.answers):  # failed mid-bucket
                self._abandon(inflight)
        return n_tensors, n_bytes, n_buckets

    def _stats(self, version: str, n_tensors: int, n_bytes: int, n_buckets: int, seconds: float) -> SyncStats:
        stats = SyncStats(version, n_tensors, n_bytes, n_buckets, seconds)
        log.info(
            "synced %d tensors (%.1f MB, %d buckets) to %d servers in %.2fs (%.2f GB/s), version %s",
            n_tensors,
            n_bytes / 1e6,
            n_buckets,
            len(self.live),
            stats.seconds,
            stats.gbps,
            version,
        )
        return stats

    def _all(self, method: str, *args, return_exceptions: bool = False, **kwargs) -> list:
        """`method` on every server's client at once; their answers (or errors, with return_exceptions)."""

        async def go():
            return await asyncio.gather(
                *(getattr(c, method)(*args, **kwargs) for c in self.clients), return_exceptions=return_exceptions
            )

        return self._loop.run(go(), self.timeout_s + GRACE_S)

    def _check(self, what: str, answers: list) -> None:
        """Raise naming each live server whose answer to `what` is an error, the first as the cause: a
        ServersLost when some of them are gone or stalled, else a WeightSyncError."""
        failed = {url: e for url, e in zip(self.live, answers) if isinstance(e, BaseException)}
        if not failed:
            return
        reasons = {url: f"{what}: {_reason(e)}" for url, e in failed.items()}
        message = f"{what} failed on " + "; ".join(f"{url}: {_reason(e)}" for url, e in failed.items())
        gone = {url: reasons[url] for url, e in failed.items() if _is_lost(e)}
        raise (ServersLost(message, gone) if gone else WeightSyncError(message)) from next(iter(failed.values()))

    def _begin_sessions(self) -> None:
        """Open a weight-update session on every server. A session left open by a trainer that died
        mid-sync (SGLang then refuses a new one) is closed first: this bridge is the servers' only writer."""
        answers = self._all("begin_weight_update", return_exceptions=True)
        for i, (url, c, e) in enumerate(zip(self.live, self.clients, answers)):
            if isinstance(e, SGLangError) and "already open" in str(e):
                log.warning("%s: closing a weight-update session left open by an earlier sync", url)
                self._loop.run(c.end_weight_update(), self.timeout_s + GRACE_S)
                answers[i] = self._loop.run(c.begin_weight_update(), self.timeout_s + GRACE_S)
        self._check("begin_weight_update", answers)

    def _each(self, method: str, *args, quiet: bool = False) -> None:
        """`method` on every live server, even when some fail; then raise naming each server that failed
        (or only log, with `quiet`, when an earlier error is already on its way)."""
        try:
            self._check(method, self._all(method, *args, return_exceptions=True))
        except WeightSyncError as e:
            if not quiet:
                raise
            log.warning("%s (after an earlier error)", e)

    def _stage(self, bucket: Bucket, slot: int) -> list[torch.Tensor]:
        """What goes on the wire for `bucket`: its tensors on the broadcast device, or one flat buffer."""
        if not self.cfg.flatten_bucket:
            return [t.to(self.device).contiguous() for _, t in bucket.tensors]
        if any(t.device != self.device for _, t in bucket.tensors):
            bucket.tensors = [(n, t.to(self.device)) for n, t in bucket.tensors]
        return [bucket.flatten(self._staging_for(bucket.nbytes, slot))]

    def _start(
        self, bucket: Bucket, payload: list[torch.Tensor], version: str | None, flush_cache: bool
    ) -> "_InFlight":
        answers = [
            self._loop.submit(
                c.update_weights_from_distributed(
                    bucket.names,
                    bucket.dtypes,
                    bucket.shapes,
                    group_name=self.group_name,
                    flush_cache=flush_cache,
                    weight_version=version,
                    load_format=FLATTENED_BUCKET if self.cfg.flatten_bucket else None,
                )
            )
            for c in self.clients
        ]
        works = [wgroup.broadcast(t, self.pg, async_op=True) for t in payload]
        return _InFlight(answers, works, payload, list(bucket.names))

    def _finish(self, inflight: "_InFlight") -> None:
        # A server answers only once it has received (and loaded) the whole bucket, so waiting for the
        # answers waits for the broadcasts without polling them; and a server that refused the update,
        # and so never joins the broadcast, surfaces here instead of leaving us blocked in it.
        what = (
            f"update_weights_from_distributed of tensor {inflight.names[0]!r}"
            if len(inflight.names) == 1
            else f"update_weights_from_distributed of the bucket from tensor {inflight.names[0]!r} to "
            f"{inflight.names[-1]!r} ({len(inflight.names)} tensors)"
        )
        bound = self.timeout_s + GRACE_S
        done, waiting = concurrent.futures.wait(inflight.answers, bound, concurrent.futures.FIRST_EXCEPTION)
        if any(f.exception() is not None and _is_lost(f.exception()) for f in done):
            # A server is gone mid-broadcast. The others wait in a receive that cannot complete (until their
            # own group timeout): tearing down our end of the group ends it now, so they answer and go on.
            inflight.works.clear()  # they hold the group's connections open
            self._abort_group()
        concurrent.futures.wait(waiting, bound)
        self._check(what, [_outcome(f, self.timeout_s) for f in inflight.answers])
        for w in inflight.works:
            w.wait()

    def _abort_group(self) -> None:
        """Our end of the group, torn down now: its connections close only once nothing refers to it (the
        caller dropped the broadcasts' works), and their closing ends the other servers' receives."""
        pg, self.pg = self.pg, None
        if pg is not None:
            wgroup.destroy_weight_update_group(pg)
            del pg
            gc.collect()

    @staticmethod
    def _abandon(inflight: "_InFlight") -> None:
        concurrent.futures.wait(inflight.answers, 5)
        for f in inflight.answers:
            if f.done() and f.exception() is not None:
                log.warning("weight update abandoned after an error: %s", f.exception())

    def _staging_for(self, nbytes: int, slot: int) -> torch.Tensor:
        """Reused flat buffers on the broadcast device (two, so bucket i+1 is flattened while bucket i is
        on the wire): no fresh allocation, and no page faults, per bucket."""
        buf = self._staging[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, int(self.cfg.bucket_mb * 1024 * 1024)), dtype=torch.uint8, device=self.device)
            self._staging[slot] = buf
        return buf

    # ---- verification --------------------------------------------------------------------------
    def server_logprobs(self, probe_ids: Sequence[int]) -> list[list[float]]:
        """Each server's logprobs of probe token t given tokens < t (t >= 1), rank 0 only."""
        return self._all("prompt_logprobs", list(probe_ids))

    def verify(self, probe_ids: Sequence[int], trainer_logprobs, tolerance: float | None = None) -> float:
        """Max |server - trainer| logprob over the probe, worst server; raises past the tolerance. A server
        lost meanwhile is left out (the group re-formed for the rest), then ServersLost is raised: the
        others' weights are verified, so the caller may go on."""
        tol = self.cfg.verify_tolerance if tolerance is None else tolerance
        ref = torch.as_tensor(trainer_logprobs, dtype=torch.float64).reshape(-1)
        worst = 0.0
        asked = list(self.live)
        answers = self._all("prompt_logprobs", list(probe_ids), return_exceptions=True)
        lost = None
        try:
            self._check("prompt_logprobs of the verify probe", answers)
        except ServersLost as e:
            lost = e
        for url, lps in zip(asked, answers):
            if lost is not None and url in lost.reasons:
                continue
            got = torch.tensor(lps, dtype=torch.float64)
            if got.shape != ref.shape:
                raise WeightSyncError(f"{url}: {got.numel()} probe logprobs, trainer has {ref.numel()}")
            worst = max(worst, float((got - ref).abs().max()))
        if worst > tol:
            raise WeightSyncError(f"after sync, server logprobs differ from the trainer's by {worst:.3g} > {tol:g}")
        if lost is not None:
            self._leave_out(lost)
            if len(self.sources) == 1:  # several sources re-form their groups together, at the next `readmit`
                self._reform() if self.live else self._leave_group()
            raise lost
        return worst

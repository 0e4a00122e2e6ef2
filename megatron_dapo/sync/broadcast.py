"""The broadcast transport: stream a trainer's HF-named weights into running rollout servers over a
torch.distributed (NCCL, or gloo on CPU) weight-update group, now.

Every trainer rank calls `sync(named_tensors, version)`: the iterator is drained on every rank so that the
export's gathers progress. It composes the servers' `Membership` (live, lost, re-admitted), their
`UpdateSession` (pause, begin ... end, continue), an `UpdateGroup` per source (the group and its buckets) and
a `Topology` (trainer rank 0 alone, or every export source in turn). A dead or stalled server (connection
refused or lost, no answer within `timeout_s`, i.e. rollout.sync.timeout_s): the sync raises `ServersLost`
naming the call and server, after leaving it out (`on_lost`: the coordinator's registry), ending /
continuing the others and re-forming the group for them; the caller syncs again with a fresh export. Below
`min_live` servers a WeightSyncError names every lost server. A failure is what is raised: the cleanup's
errors after it are only logged. Protocol, pause modes, sources and faults: docs/rollout-and-weight-sync.md
and docs/operations.md.

    transport = BroadcastTransport(urls, cfg.rollout.sync)    # on every trainer rank
    transport.connect()                                       # collective over the sources + servers
    stats = transport.sync(export_hf_weights(model), version=step)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_dapo.config.schema import SyncConfig
from megatron_dapo.rollout import weight_group as wgroup
from megatron_dapo.runtime.net import LOOPBACK
from megatron_dapo.sync.errors import ServersLost, WeightSyncError
from megatron_dapo.sync.membership import Membership
from megatron_dapo.sync.probe_check import probe_max_diff
from megatron_dapo.sync.server_calls import DEFAULT_TIMEOUT_S, ServerCalls, readmit_answering
from megatron_dapo.sync.session import UpdateSession
from megatron_dapo.sync.topology import Outcome, SingleSource, Topology, TurnTaking
from megatron_dapo.sync.transport import SyncStats
from megatron_dapo.sync.update_group import StreamCounts, UpdateGroup

log = logging.getLogger(__name__)


class BroadcastTransport:
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
        sources = list(sources or [0])
        if sources[0] != 0 or sources != sorted(set(sources)):
            raise ValueError(f"sources must be ascending distinct trainer ranks starting at 0, got {sources}")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.topology: Topology = TurnTaking(sources, self.rank) if len(sources) > 1 else SingleSource(self.rank)
        self.cfg = cfg = sync_cfg or SyncConfig()
        self.members = Membership(server_urls, server_tp_sizes, min_live, on_lost)
        self.calls = ServerCalls(self.members, api_key, timeout_s or cfg.timeout_s or DEFAULT_TIMEOUT_S)
        self.session = UpdateSession(self.calls, cfg.pause_generation, pause_mode or cfg.pause_mode)
        self.group = UpdateGroup(
            self.members,
            self.calls,
            self.topology.group_name(group_name),
            backend or wgroup.default_backend(),
            master_address,
            master_port,
            cfg.bucket_mb,
            cfg.flatten_bucket,
        )

    # ---- what callers read ---------------------------------------------------------------------
    @property
    def sources(self) -> list[int]:
        return self.topology.sources

    @property
    def live(self) -> list[str]:
        return self.members.live

    @property
    def lost(self) -> dict[str, str]:
        return self.members.lost

    @property
    def lost_causes(self) -> dict[str, BaseException]:
        return self.members.lost_causes

    @property
    def world_size(self) -> int:
        return self.members.world_size

    @property
    def master_address(self) -> str:
        return self.group.master_address

    # ---- the group -----------------------------------------------------------------------------
    def connect(self) -> None:
        """Form the weight-update group(s): collective over the sources (each forms its own, in turn)."""
        self.topology.connect(self.group.form)

    def close(self) -> None:
        """Leave the group on both sides (servers first, so a later transport may reuse the group name)."""
        self.group.close()
        self.calls.close()

    # ---- sync ----------------------------------------------------------------------------------
    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor | None]], version) -> SyncStats | None:
        """Push one full set of weights to every live server; returns stats on rank 0, None elsewhere."""
        version = str(version)
        topology = self.topology
        if topology.is_source and self.group.pg is None:
            raise WeightSyncError("sync() before connect()")
        t0 = time.perf_counter()
        items = iter(named_tensors)
        error, counts = None, StreamCounts()
        if self.rank == 0:  # the controller pauses and opens the servers' sessions
            try:
                if not self.members.live:
                    raise WeightSyncError(f"no live server to sync; lost: {self.members.describe_lost()}")
                self.session.open()
            except Exception as e:  # the sources skip their updates; the outcome is agreed below
                error = e
        if topology.is_source:
            error, counts = self._stream_own_tensors(items, version, error)
        for _ in items:  # take part in the export's collectives to the end
            pass
        outcome = topology.agree(error, counts)
        try:
            if outcome.lost is not None:  # every rank leaves the same servers out, before the sessions end
                self.members.leave_out(outcome.lost)
        finally:
            if self.rank == 0:
                self.session.close(failed=outcome.failed)
            if outcome.lost is not None:  # groups of the servers that go on
                topology.regroup(self.group.reform)
        if outcome.failure is not None:
            raise outcome.failure
        if self.rank != 0:
            return None
        self.members.synced(version)
        return self._stats(version, outcome, time.perf_counter() - t0)

    def _stream_own_tensors(self, items, version: str, error: BaseException | None):
        """This source's part: its tensors, once its turn comes (and nothing failed before); the last source's
        last bucket carries the version and the cache flush. Returns (its error or None, what it streamed)."""
        topology = self.topology
        run = topology.own_tensors(items)
        turn = topology.wait_turn()
        counts = StreamCounts()
        if turn and error is None:
            last = topology.is_last_source
            try:
                counts = self.group.stream(run, version if last else None, last and self.session.flush_cache)
                if not counts.buckets:
                    raise WeightSyncError(topology.NOTHING_TO_SEND)
            except Exception as e:
                error = e
        for _ in run:  # the rest of this source's tensors: its TP peers wait on the gathers
            pass
        topology.pass_turn(turn and error is None)
        return error, counts

    def _stats(self, version: str, outcome: Outcome, seconds: float) -> SyncStats:
        total = sum(outcome.counts.values(), StreamCounts())
        stats = SyncStats(version, total.tensors, total.nbytes, total.buckets, seconds)
        stats.source_bytes = self.topology.source_bytes(outcome)
        log.info(
            "synced %d tensors (%.1f MB, %d buckets) to %d servers in %.2fs (%.2f GB/s), version %s",
            stats.num_tensors,
            stats.nbytes / 1e6,
            stats.num_buckets,
            len(self.members.live),
            stats.seconds,
            stats.gbps,
            version,
        )
        return stats

    # ---- re-admission --------------------------------------------------------------------------
    def readmit(self) -> list[str]:
        """Lost servers that answer /health again (restarted, relaunched, or no longer stalled) rejoin: the
        groups are re-formed with them (in their original places), so the next sync gives them the current
        weights; the caller verifies them and routes to them again. Returns those re-admitted. Trainer rank 0
        decides; with several sources every rank adopts its decision (collective over every trainer rank) and
        the sources re-form their groups in turn. A failed re-formation leaves the returning servers out again."""
        decision = self.topology.decide(self._decide_readmission)
        if decision is None:
            return []
        back, live, lost, changed = decision
        self.members.adopt(live, lost)
        if not changed:
            return back
        errors = self.topology.regroup(self.group.reform, catch=True)
        if not errors:
            return back
        why = "re-admission failed; " + "; ".join(errors)
        self.members.leave_out(ServersLost(why, {u: why for u in back if u in self.members.live}))
        if self.topology.regroup(self.group.reform, catch=True):
            raise WeightSyncError(f"{why}; re-forming the groups without them failed too")
        return []

    def _decide_readmission(self) -> tuple[list[str], list[str], dict[str, str], bool]:
        """Rank 0: (servers back, live, lost, whether the groups must be re-formed)."""
        back = readmit_answering(self.members, self.calls) if self.calls.started else []
        # a restarted server back in its place needs its group re-formed too (it holds none)
        changed = self.calls.started and (bool(back) or self.members.needs_new_group)
        return back, list(self.members.live), dict(self.members.lost), changed

    # ---- verification --------------------------------------------------------------------------
    def server_logprobs(self, probe_ids: Sequence[int]) -> list[list[float]]:
        """Each live server's logprobs of probe token t given tokens < t (t >= 1), rank 0 only."""
        return self.calls.ask_all("prompt_logprobs", list(probe_ids))

    def verify(self, probe_ids: Sequence[int], trainer_logprobs, tolerance: float | None = None) -> float:
        """Max |server - trainer| logprob over the probe, worst server, rank 0 only; raises past the tolerance
        (default rollout.sync.verify_tolerance). A server lost meanwhile is left out (its group re-formed for
        the rest; with several sources at the next `readmit`), then ServersLost is raised: the others' weights
        are verified, so the caller may go on."""
        tol = self.cfg.verify_tolerance if tolerance is None else tolerance
        worst, lost = probe_max_diff(self.calls, probe_ids, trainer_logprobs, tol)
        if lost is not None:
            self.members.leave_out(lost)
            self.topology.regroup_after_verify_loss(self.group.reform)
            raise lost
        return worst

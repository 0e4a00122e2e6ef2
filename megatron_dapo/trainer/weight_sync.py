"""How the trainer's new weights reach the rollout servers: one interface, two policies, each composing a
weight transport (megatron_dapo.sync.transport.WeightTransport).

`WeightSync.start(v)` puts every server on the trainer's weights at version v (servers may hold
anything before: another run's weights, a resumed run's older ones); `after_step(v)` hands over the
weights of version v after an optimizer step and returns the step's sync metrics. Every trainer rank
calls both (exporting weights is collective); rank 0 talks to the coordinator and controls the servers
(with per_stage sources each pipeline-stage / expert source also broadcasts its own tensors).

- `AllAtOnceSync` (`rollout.sync.policy: all_at_once`): a `BroadcastTransport` broadcasts the weights to
  every server inline, then the coordinator dispatches at version v; with `rollout.sync.sources` per_stage
  from every export source (pipeline stage / expert rank) in turn, else all through rank 0. With
  `rollout.sync.transport: ipc` an `IpcTransport` hands servers on rank 0's host handles instead.
- `PerServerStoreSync` (`greedy`, `status_based`): a `PerServerStoreTransport` puts the weights into a
  host-memory store on rank 0; a syncer thread moves each server to them when its policy says
  (megatron_dapo.sync.per_server), and the coordinator learns each server's version as it is published.

With `rollout.sync.verify`, a fixed probe sequence's logprobs are computed by the trainer after every
sync; the servers' logprobs of it must equal them (all at once: checked here; per server: by the syncer).
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from megatron_dapo.bridge import EACH_SOURCE
from megatron_dapo.bridge.fp8 import quantize_stream
from megatron_dapo.config import derived
from megatron_dapo.coordinator.batch import probe_batch
from megatron_dapo.sync.addresses import source_store_addresses
from megatron_dapo.sync.broadcast import BroadcastTransport
from megatron_dapo.sync.errors import ServersLost
from megatron_dapo.sync.ipc import IpcTransport
from megatron_dapo.sync.per_server import PerServerStoreTransport, PerServerSync, WeightStore

log = logging.getLogger(__name__)


class WeightSync:
    """The interface (and what both implementations share: the actor, the byte budget, the probe, the
    transport they compose)."""

    transport = None  # the WeightTransport, set by each implementation

    def __init__(self, cfg, actor, rank: int, coord):
        self.cfg, self.actor, self.rank, self.coord = cfg, actor, rank, coord  # coord: rank 0's client, else None
        self.byte_budget = int(cfg.rollout.sync.bucket_mb * 1024 * 1024)
        # a fixed probe sequence: after each sync the servers' logprobs of it must equal the trainer's
        gen = torch.Generator().manual_seed(0)
        self.probe = torch.randint(3, actor.arch.vocab_size, (24,), generator=gen).tolist()
        # Under torchrun this variable makes every TCP rendezvous a client of torchrun's agent store;
        # the weight-update group's rendezvous (trainer rank 0 hosting, servers joining) would then
        # have no host and hang. The default group is formed already, so it no longer needs it.
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)

    def start(self, version: int) -> None:
        raise NotImplementedError

    def after_step(self, version: int) -> dict[str, float]:
        raise NotImplementedError

    def step_extra(self) -> dict:
        """What metrics.jsonl records of the servers' syncs this step (rank 0)."""
        return {}

    def close(self) -> None:
        self.transport.close()

    def _probe_logprobs(self, version: int) -> torch.Tensor:
        return self.actor.compute_logprobs(probe_batch(self.probe, version))[0]

    def _export(self, dst_rank=0):
        """The export stream, in the servers' weight format: with rollout.weight_format=fp8_block each linear
        weight is block-quantized where it was rebuilt, before any transport (bridge.fp8.quantize_stream)."""
        named = self.actor.export_weights(byte_budget=self.byte_budget, dst_rank=dst_rank)
        return quantize_stream(named) if self.cfg.rollout.weight_format == "fp8_block" else named


class AllAtOnceSync(WeightSync):
    def __init__(self, cfg, actor, rank: int, coord, server_urls, server_tp_sizes=None):
        super().__init__(cfg, actor, rank, coord)
        # per_stage: each export source broadcasts the tensors it rebuilds, none goes through rank 0
        self.per_stage = derived.sync_sources(cfg) == "per_stage"
        sources = actor.export_sources() if self.per_stage else None
        address = cfg.trainer.bind_host  # rank 0's; each other source hosts its group on its own node
        if sources is not None:
            address = source_store_addresses(sources, address, server_urls).get(rank, address)
        common = dict(
            api_key=cfg.rollout.api_key,
            server_tp_sizes=server_tp_sizes,
            timeout_s=derived.sync_timeout_s(cfg),
            min_live=cfg.rollout.min_healthy_servers,
            on_lost=coord.registry.mark_down if rank == 0 else None,  # out of routing too
        )
        if cfg.rollout.sync.transport == "ipc":  # servers on this host: handles, no group (sync/ipc.py)
            self.transport = IpcTransport(server_urls, cfg.rollout.sync, **common)
        else:
            self.transport = BroadcastTransport(
                server_urls, cfg.rollout.sync, sources=sources, master_address=address, **common
            )
        self.transport.connect()

    def _export(self, dst_rank=0):
        return super()._export(EACH_SOURCE if self.per_stage else dst_rank)

    def _sync_until_delivered(self, version: int):
        """The transport's sync; after it lost servers (and left them out, its group re-formed for the rest),
        again with a fresh export: bounded, as each try has fewer servers and the transport stops the run
        below rollout.min_healthy_servers. With several sources every rank raises the loss (each source has
        left the server out and re-formed its group), so every rank exports again."""
        while True:
            stats, lost = None, None
            try:
                stats = self.transport.sync(self._export(), version=version)
            except ServersLost as e:  # raised on rank 0 only (on every rank with several sources)
                lost = e
            if not self._rank0_lost_servers(lost is not None):
                return stats
            if lost is not None:
                log.warning("weight sync of version %d lost %s; again with the other servers", version, lost.urls)

    @staticmethod
    def _rank0_lost_servers(lost: bool) -> bool:
        """Whether rank 0 lost servers, on every trainer rank: then all export again for another try."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return lost
        flag = [lost]
        dist.broadcast_object_list(flag, src=0)
        return bool(flag[0])

    def _sync(self, version: int) -> dict[str, float]:
        self.push(version)
        return self.check(version)

    def push(self, version: int) -> None:
        """The first half of a sync: the weights of `version` to the servers, and the trainer's logprobs of the
        probe (every rank). `check` is the second half; the colocated cycle runs it once the servers have
        their KV cache back (trainer/colocation.py), as the servers' probe needs it."""
        t0 = time.perf_counter()
        # rank 0 decides and talks to the servers; with per_stage sources every rank takes part (each source
        # re-forms its own group), else the others' part of a re-formed group is the same export
        back = self.transport.readmit() if self.rank == 0 or self.per_stage else []
        stats = self._sync_until_delivered(version)
        out = stats.as_metrics() if stats is not None else {}
        out["time/sync_s"] = time.perf_counter() - t0
        ref = self._probe_logprobs(version) if self.cfg.rollout.sync.verify else None
        self._pushed = (version, out, back, ref)

    def check(self, version: int) -> dict[str, float]:
        """The second half: the servers' probe logprobs against the trainer's (rank 0), the servers back in
        routing at `version`; the sync's metrics."""
        pushed_version, out, back, ref = self._pushed
        assert pushed_version == version, f"check({version}) after push({pushed_version})"
        if ref is not None and self.rank == 0:
            out["sync/verify_max_abs_diff"] = self._verify(ref.tolist())
            out["sync/probe_logprob_mean"] = float(ref.double().mean())
        if self.rank == 0:
            self._route_to_synced_servers(back, version)
            self.coord.registry.publish_all(version, out["time/sync_s"])
        return out

    def _route_to_synced_servers(self, back: list[str], version: int) -> None:
        """The re-admitted servers still live after this sync (and its check) hold `version`: route to them.
        So does any other live server routing still holds down: the router saw it restarted, and the sync
        (its retry re-formed the group with it) gave it `version` before the transport noticed."""
        in_service = {s.url for s in self.coord.registry.statuses()}
        for url in self.transport.live:
            if url in back or url not in in_service:
                self.coord.registry.mark_up(url, version)
                log.warning(
                    "rollout server %s re-admitted at weight version %d (%d in service)",
                    url,
                    version,
                    len(self.transport.live),
                )

    def _verify(self, ref: list[float]) -> float:
        """The live servers' probe logprobs against the trainer's; a server lost meanwhile is left out."""
        try:
            return self.transport.verify(self.probe, ref)
        except ServersLost as e:  # the others were verified
            log.warning("weight sync verify lost %s; the run goes on with the other servers", e.urls)
            return self.transport.verify(self.probe, ref)

    def start(self, version: int) -> None:
        self._sync(version)

    def after_step(self, version: int) -> dict[str, float]:
        out = self._sync(version)
        if self.rank == 0:
            self.coord.set_version(version)
        return out


class PerServerStoreSync(WeightSync):
    def __init__(self, cfg, actor, rank: int, coord, server_urls, server_tp_sizes=None):
        super().__init__(cfg, actor, rank, coord)
        store, syncer = WeightStore(), None
        if rank == 0:
            syncer = PerServerSync(
                server_urls,
                cfg.rollout.sync,
                coord.registry,
                store,
                api_key=cfg.rollout.api_key,
                server_tp_sizes=server_tp_sizes,
                master_address=cfg.trainer.bind_host,
                timeout_s=derived.sync_timeout_s(cfg),
                min_live=cfg.rollout.min_healthy_servers,
                probe=self.probe,
                on_publish=lambda url, v: coord.set_version(v),
                on_error=coord.fail,
            )
        self.transport = PerServerStoreTransport(store, syncer)
        self.transport.connect()

    def _store(self, version: int) -> dict[str, float]:
        """The new weights go to the store; each server takes them when its policy says (the first time:
        every server now). A server's failed sync ends the run here, named, at the latest."""
        t0 = time.perf_counter()
        ref = self._probe_logprobs(version).tolist() if self.cfg.rollout.sync.verify else None
        stats = self.transport.sync(self._export(), version, probe_logprobs=ref)
        out = {"time/sync_s": time.perf_counter() - t0}
        if stats is not None:
            out["sync/store_bytes"] = float(stats.nbytes)
        return out

    def start(self, version: int) -> None:
        self._store(version)

    def after_step(self, version: int) -> dict[str, float]:
        return self._store(version)

    def step_extra(self) -> dict:
        return {"server_syncs": self.coord.registry.take_events()}


def build_weight_sync(cfg, actor, rank: int, coord, server_urls, server_tp_sizes=None) -> WeightSync:
    """The implementation `rollout.sync.policy` names (its coordinator client on rank 0, None elsewhere)."""
    cls = AllAtOnceSync if cfg.rollout.sync.policy == "all_at_once" else PerServerStoreSync
    return cls(cfg, actor, rank, coord, server_urls, server_tp_sizes)

"""Refit (weight sync) time per step, by sync source (rollout.sync.sources): pure arithmetic.

The weights travel in the trainer's parameter dtype (model.dtype; SGLang serves them as sent), as full HF
tensors. The export sources (megatron_dapo.bridge.export.export_sources) are the first rank of each
pipeline stage -- on the rank0 path it rebuilds the stage's dense tensors and expert-parallel rank 0's
experts -- and the first rank of each other expert-parallel rank of the stage (its E / ep experts).
TP / expert-TP gathers stay inside a stage (NVLink) and are the same on both paths, so they are left out,
as `Traffic` leaves them out in benchmarks/weight_sync.py.

  rank0      rank 0 receives every other source's share (the export's hops), then broadcasts the whole
             model: model + (model - share of rank 0) bytes through its link ("twice" when many stages).
  per_stage  each source broadcasts only its share (a stage's dense tensors spread over its expert-parallel
             sources, `planner.spread`, as the export does): the busiest source moves max(share) bytes. The
             sources broadcast one after another (SGLang's scheduler serves one update at a time) and
             every server receives the whole model, so the wire time is still model bytes / link:
             per_stage removes the hop into rank 0 and the full copy on rank 0, not the broadcast.
time = bytes * 8 / link Gbit/s over one link, nothing overlapped. For rank0 that is pessimistic where the
hops into rank 0 run on another link (an EP group inside a node: NVLink) or overlap the broadcast on a
full-duplex link (the export stages the next bucket while one is on the wire): then rank0 also comes near
model bytes / link. Not counted: TP gathers, HTTP round trips, pause / continue, the servers' loads
(benchmarks/weight_sync.py measures those on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.config.schema import DapoConfig
from megatron_dapo.config.shapes import ModelShape
from megatron_dapo.planner.memory import dtype_bytes, embedding_params, layer_params, stage_layers
from megatron_dapo.planner.spread import spread_by_bytes

# Gbit/s of one GPU's link, per direction. NVLink 4 (H100 SXM): 900 GB/s both directions = 450 GB/s each.
NVLINK_GBPS = 3600.0
IB_400G_GBPS = 400.0  # one 400 Gbit/s InfiniBand NIC per GPU (NDR)


def source_params(shape: ModelShape, pp: int, vpp: int | None, ep: int) -> tuple[int, list[int]]:
    """(rank 0's own share on the rank0 path, [each export source's share on the per_stage path]), in
    parameters (unsharded), sources in order: per pipeline stage its first rank, then the stage's other
    expert-parallel ranks. Each source rebuilds its E / ep experts; on the rank0 path the first rank also
    rebuilds the stage's dense tensors, on the per_stage path they are spread over the stage's sources (by
    layer, embedding and LM head: a little coarser than the export's per-tensor spread)."""
    shares, dense_items, candidates, first_share = [], {}, {}, 0
    for stage in range(pp):
        items, expert = {}, 0
        for i in stage_layers(shape, pp, vpp, stage):
            lp = layer_params(shape, i)
            items[f"layer {i}"], expert = lp.dense, expert + lp.expert
        if stage == 0:
            items["embedding"] = embedding_params(shape)
        if stage == pp - 1:
            items["final norm and LM head"] = shape.hidden_size + (
                0 if shape.tie_embeddings else embedding_params(shape)
            )
        ranks = ep if expert else 1
        first = len(shares)
        if stage == 0:
            first_share = sum(items.values()) + expert // ranks
        shares += [expert // ranks] * ranks
        dense_items.update(items)
        candidates.update({k: list(range(first, first + ranks)) for k in items})
    chosen = spread_by_bytes(dense_items, candidates, dict(enumerate(shares)))
    for item, source in chosen.items():
        shares[source] += dense_items[item]
    return first_share, shares


@dataclass(frozen=True)
class RefitEstimate:
    """Bytes and seconds of one weight sync, through rank 0 and from every source."""

    model_bytes: int
    source_bytes: list[int]  # per export source, per_stage
    link_gbps: float
    rank0_own_bytes: int  # what rank 0 rebuilds itself on the rank0 path (its stage's dense part, its experts)

    @property
    def rank0_bytes(self) -> int:
        """Through trainer rank 0 on the rank0 path: the hops of the other sources' shares in, the model out."""
        return 2 * self.model_bytes - self.rank0_own_bytes

    @property
    def per_stage_busiest_bytes(self) -> int:
        return max(self.source_bytes)

    @property
    def rank0_s(self) -> float:
        return self.rank0_bytes * 8 / (self.link_gbps * 1e9)

    @property
    def per_stage_s(self) -> float:
        """The sources take turns and every server receives the whole model: model bytes on the wire."""
        return max(self.model_bytes, self.per_stage_busiest_bytes) * 8 / (self.link_gbps * 1e9)


def refit_estimate(cfg: DapoConfig, shape: ModelShape, link_gbps: float) -> RefitEstimate:
    if not link_gbps > 0:
        raise ValueError(f"--link-gbps={link_gbps} must be > 0 (Gbit/s of the trainer -> server link)")
    parallel = cfg.parallel
    ep = parallel.ep if cfg.trainer.backend == "megatron" else 1
    pp = parallel.pp if cfg.trainer.backend == "megatron" else 1
    per_param = dtype_bytes(cfg.model.dtype)
    own, shares = source_params(shape, pp, parallel.vpp, ep)
    shares = [n * per_param for n in shares]
    return RefitEstimate(sum(shares), shares, link_gbps, rank0_own_bytes=own * per_param)


def crosses_nodes(trainer_gpus: list[tuple[int, int]], servers: list[list[tuple[int, int]]]) -> bool:
    """Whether the broadcast leaves a node: trainer ranks and launched servers not all on one node. With no
    server launched by the job (external ones) the servers are taken as remote."""
    if not servers:
        return True
    nodes = {node for node, _ in trainer_gpus} | {node for block in servers for node, _ in block}
    return len(nodes) > 1

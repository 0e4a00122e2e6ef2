"""Refit (weight sync) time per step, by sync source (rollout.sync.sources): pure arithmetic.

The weights travel in the trainer's parameter dtype (model.dtype; SGLang serves them as sent), as full HF
tensors. The export sources (megatron_dapo.bridge.export.export_sources) are the first rank of each
pipeline stage -- it rebuilds the stage's dense tensors and expert-parallel rank 0's experts -- and the
first rank of each other expert-parallel rank of the stage (its E / ep experts). TP / expert-TP gathers
stay inside a stage (NVLink) and are the same on both paths, so they are left out, as `Traffic` leaves
them out in benchmarks/weight_sync.py.

  rank0      rank 0 receives every other source's share (the export's hops), then broadcasts the whole
             model: model + (model - share of rank 0) bytes through its link ("twice" when many stages).
  per_stage  each source broadcasts only its share: the busiest source moves max(share) bytes. The
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

# Gbit/s of one GPU's link, per direction. NVLink 4 (H100 SXM): 900 GB/s both directions = 450 GB/s each.
NVLINK_GBPS = 3600.0
IB_400G_GBPS = 400.0  # one 400 Gbit/s InfiniBand NIC per GPU (NDR)


def source_params(shape: ModelShape, pp: int, vpp: int | None, ep: int) -> list[int]:
    """Parameters each export source rebuilds (unsharded), in source order: per pipeline stage, its first
    rank (dense tensors + expert-parallel rank 0's experts), then the stage's other expert-parallel ranks."""
    shares = []
    for stage in range(pp):
        dense = expert = 0
        for i in stage_layers(shape, pp, vpp, stage):
            lp = layer_params(shape, i)
            dense, expert = dense + lp.dense, expert + lp.expert
        if stage == 0:
            dense += embedding_params(shape)
        if stage == pp - 1:
            dense += shape.hidden_size + (0 if shape.tie_embeddings else embedding_params(shape))
        ranks = ep if expert else 1
        shares.append(dense + expert // ranks)
        shares += [expert // ranks] * (ranks - 1)
    return shares


@dataclass(frozen=True)
class RefitEstimate:
    """Bytes and seconds of one weight sync, through rank 0 and from every source."""

    model_bytes: int
    source_bytes: list[int]  # per export source, per_stage
    link_gbps: float

    @property
    def rank0_bytes(self) -> int:
        """Through trainer rank 0 on the rank0 path: the hops of the other sources' shares in, the model out."""
        return 2 * self.model_bytes - self.source_bytes[0]

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
    p = cfg.parallel
    ep = p.ep if cfg.trainer.backend == "megatron" else 1
    pp = p.pp if cfg.trainer.backend == "megatron" else 1
    per_param = dtype_bytes(cfg.model.dtype)
    shares = [n * per_param for n in source_params(shape, pp, p.vpp, ep)]
    return RefitEstimate(model_bytes=sum(shares), source_bytes=shares, link_gbps=link_gbps)


def crosses_nodes(trainer_gpus: list[tuple[int, int]], servers: list[list[tuple[int, int]]]) -> bool:
    """Whether the broadcast leaves a node: trainer ranks and launched servers not all on one node. With no
    server launched by the job (external ones) the servers are taken as remote."""
    if not servers:
        return True
    nodes = {node for node, _ in trainer_gpus} | {node for block in servers for node, _ in block}
    return len(nodes) > 1

"""megatron-core GPTModel chunks -> full HF tensors, streamed one by one.

Every rank of the job iterates `export_hf_weights` in lock step (it runs collectives). The order is
`mapping.hf_names(arch)` -- the same on every rank and every call. For each megatron parameter:

1. the ranks holding the first replica (data-parallel rank 0; for experts, expert-data-parallel rank 0)
   of its pipeline stage / expert gather their TP (or expert-TP) shards on the group's first rank,
   the *source*, which rebuilds the HF tensors (QKV split, gate / up split, vocab padding trimmed);
   with `dst_rank=EACH_SOURCE` a stage's dense parameters are spread by bytes over the stage's sources
   instead (under EP the other expert-parallel sources hold replicas of them), each gathered by the TP
   group of the source it goes to;
2. the source sends them to `dst_rank` (point to point), or broadcasts them to every rank when
   `dst_rank is None`, or, with `dst_rank=EACH_SOURCE`, keeps them: each tensor is yielded only on the
   rank that rebuilt it, and nothing crosses pipeline stages or expert ranks (the weight sync then
   broadcasts from every source, `export_sources`). In that mode the stream is ordered by source rank
   (then HF order), so that each source's tensors come as one run.

Memory: the source and the destination hold one parameter's full tensors at a time, or up to
`byte_budget` bytes of consecutive tensors from the same source, which travel in one message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Union

import torch
import torch.distributed as dist

from megatron_dapo.bridge.mapping import MappingError, Unit, hf_from_shards, hf_names, hf_shape
from megatron_dapo.bridge.parallel import local_units, model_arch, tp_split_ranks
from megatron_dapo.planner.spread import spread_by_bytes
from megatron_dapo.runtime.layout import ParallelLayout


class _EachSource:
    def __repr__(self) -> str:
        return "EACH_SOURCE"


EACH_SOURCE = _EachSource()  # dst_rank: yield each tensor on the rank that rebuilds it, send nothing


@dataclass
class Traffic:
    """Bytes this rank sent / received in the export beyond its TP gathers (the hops to `dst_rank`)."""

    sent: int = 0
    received: int = 0


@dataclass
class _Plan:
    key: str
    hf_names: tuple[str, ...]
    source: int  # global rank that rebuilds the full tensors
    dtype: torch.dtype


def _plan(units, arch, layout: ParallelLayout, spread: bool = False) -> list[_Plan]:
    """The global export plan, agreed by all ranks: per unit, its source rank and dtype. By default a unit's
    source is the first rank of its first replica (data-parallel rank 0, TP rank 0; for experts expert-data-
    parallel rank 0, expert-TP rank 0). With `spread`, the dense units of each pipeline stage are spread by
    bytes over the sources holding a replica of them (under EP, every expert-parallel source of the stage),
    so that no source broadcasts the stage's whole dense part (`_spread_dense`)."""
    mine = {}
    for unit, param in units:
        rank, _ = layout.tp_split(unit.rule.expert)
        if unit.export and rank == 0 and layout.holds_first_replica(unit.rule.expert):
            mine[unit.key] = (unit.hf_names, str(param.dtype).removeprefix("torch."))
    held = sorted(u.key for u, _ in units if u.export and not u.rule.expert) if spread else []
    world = dist.get_world_size() if dist.is_initialized() else 1
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, (mine, held))
    else:
        gathered = [(mine, held)]
    by_key: dict[str, _Plan] = {}
    for src, (entries, _) in enumerate(gathered):
        for key, (names, dtype) in entries.items():
            if key not in by_key:  # with vpp / several dp replicas the first holder wins; all agree
                by_key[key] = _Plan(key, tuple(names), src, getattr(torch, dtype))
    order = {n: i for i, n in enumerate(hf_names(arch))}
    plans = sorted(by_key.values(), key=lambda p: order.get(p.key, len(order)))
    covered = [n for p in plans for n in p.hf_names]
    expected = hf_names(arch)
    if sorted(covered) != sorted(expected):
        missing = sorted(set(expected) - set(covered))
        extra = sorted(set(covered) - set(expected))
        raise MappingError(
            f"export covers the HF checkpoint incorrectly: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    if spread:
        _spread_dense(plans, arch, {r: set(h) for r, (_, h) in enumerate(gathered)})
    return plans


def _nbytes(p: _Plan, arch) -> int:
    return sum(torch.Size(hf_shape(arch, n)).numel() for n in p.hf_names) * p.dtype.itemsize


def _spread_dense(plans: list[_Plan], arch, held: dict[int, set[str]]) -> None:
    """Re-assign each dense unit to the source (a rank already rebuilding some unit) that holds a replica of
    it and carries the fewest bytes so far, largest unit first: the experts stay where they are, the dense
    part of a stage is spread over its expert-parallel sources. The set of sources does not change."""
    sources = sorted({p.source for p in plans})
    dense = [p for p in plans if p.key in held.get(p.source, ())]
    fixed: dict[int, int] = {}
    for p in plans:
        if p.key not in held.get(p.source, ()):
            fixed[p.source] = fixed.get(p.source, 0) + _nbytes(p, arch)
    candidates = {p.key: [r for r in sources if p.key in held[r]] for p in dense}
    chosen = spread_by_bytes({p.key: _nbytes(p, arch) for p in dense}, candidates, fixed)
    for p in dense:
        p.source = chosen[p.key]


def _gather_full(unit: Unit, param: torch.Tensor, arch, layout: ParallelLayout, dst: int) -> list[torch.Tensor] | None:
    """Gather `param`'s TP shards on global rank `dst` of its TP group -> HF tensors there, None on the others."""
    _, size = layout.tp_split(unit.rule.expert)
    local = param.detach()
    if size == 1:
        return hf_from_shards(unit, arch, [local])
    group = layout.tp_split_group(unit.rule.expert)
    here = layout.rank == dst
    shards = [torch.empty_like(local) for _ in range(size)] if here else None
    dist.gather(local.contiguous(), shards, dst=dst, group=group)
    return hf_from_shards(unit, arch, shards) if here else None


def _buckets(plans: list[_Plan], arch, byte_budget: int | None) -> list[list[_Plan]]:
    buckets: list[list[_Plan]] = []
    size = 0
    for p in plans:
        nbytes = _nbytes(p, arch)
        last = buckets[-1] if buckets else None
        if (
            byte_budget is not None
            and last
            and last[-1].source == p.source
            and last[-1].dtype == p.dtype
            and size + nbytes <= byte_budget
        ):
            last.append(p)
            size += nbytes
        else:
            buckets.append([p])
            size = nbytes
    return buckets


def export_hf_weights(
    model_chunks,
    byte_budget: int | None = None,
    dst_rank: Union[int, None, _EachSource] = 0,
    traffic: Traffic | None = None,
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield `(hf_name, tensor)` for every tensor of the HF checkpoint, in `hf_names(arch)` order.

    Collective: every rank of the default group must call it at the same point (the export plan is
    agreed here, before the first item), then iterate it to the end, with the same arguments.
    The full (unsharded, vocab-trimmed) tensor is yielded on `dst_rank` (default 0: the rank that
    writes files / broadcasts to rollout servers), with `dst_rank=None` on every rank, with
    `dst_rank=EACH_SOURCE` only on the rank that rebuilds it (ordered by source rank, see the module
    docstring); other ranks get `None` in its place. Tensors are in the parameters' dtype, on the CPU
    (or the parameters' device), and must be consumed (copied / written) before the next item is
    requested only if the caller wants to bound memory -- the generator keeps no reference to them.
    `byte_budget`: coalesce consecutive tensors of the same source rank into messages of at most
    this many bytes (None: one message per megatron parameter).
    `traffic`: counts the bytes this rank sends / receives beyond its TP gathers.
    """
    arch = model_arch(model_chunks)
    layout = ParallelLayout.from_megatron()
    units = {u.key: (u, p) for u, p in local_units(model_chunks, arch, layout) if u.export}
    plans = _plan(list(units.values()), arch, layout, spread=dst_rank is EACH_SOURCE)
    if dst_rank is EACH_SOURCE:
        plans = sorted(plans, key=lambda p: p.source)  # stable: HF order within a source
    return _stream(units, plans, arch, layout, byte_budget, dst_rank, traffic or Traffic())


def export_sources(model_chunks) -> list[int]:
    """The distinct ranks that rebuild HF tensors (one per pipeline stage, plus each expert-parallel rank
    holding experts), ascending. Collective over the default group, like `export_hf_weights`."""
    arch = model_arch(model_chunks)
    layout = ParallelLayout.from_megatron()
    units = [(u, p) for u, p in local_units(model_chunks, arch, layout) if u.export]
    return sorted({p.source for p in _plan(units, arch, layout)})  # `spread` moves units, never sources


@torch.no_grad()
def _stream(units, plans, arch, layout: ParallelLayout, byte_budget, dst_rank, traffic: Traffic):
    world = dist.get_world_size() if dist.is_initialized() else 1
    me = layout.rank
    each_source = dst_rank is EACH_SOURCE
    peers = {expert: tp_split_ranks(layout, expert) for expert in (False, True)}
    for bucket in _buckets(plans, arch, byte_budget):
        fulls: list[list[torch.Tensor] | None] = []
        for p in bucket:
            held = units.get(p.key)
            if held is not None and p.source in peers[held[0].rule.expert]:  # the source's TP group gathers
                fulls.append(_gather_full(held[0], held[1], arch, layout, p.source))
            else:
                fulls.append(None)
        source = bucket[0].source
        names = [n for p in bucket for n in p.hf_names]
        if each_source or world == 1 or (dst_rank is not None and source == dst_rank):
            tensors = [t for f in fulls for t in f] if me == source else None
            receives = me == source
        else:
            tensors = _move(bucket, fulls, arch, units, source, dst_rank, me, traffic)
            receives = dst_rank is None or me == dst_rank
        for i, name in enumerate(names):
            yield name, (tensors[i] if (receives and tensors is not None) else None)


def _move(bucket, fulls, arch, units, source: int, dst_rank, me: int, traffic: Traffic):
    """Send one bucket's tensors from `source` to `dst_rank` (None: broadcast to all); the tensors where
    they arrive (and on the source, when broadcasting), None elsewhere."""
    shapes = [hf_shape(arch, n) for p in bucket for n in p.hf_names]
    numels = [torch.Size(s).numel() for s in shapes]
    receivers = [me] if dst_rank is None else [dst_rank]
    if me == source:
        flat = torch.cat([t.reshape(-1) for f in fulls for t in f])
    elif me in receivers:
        device = next(iter(units.values()))[1].device if units else "cpu"
        flat = torch.empty(sum(numels), dtype=bucket[0].dtype, device=device)
    else:
        flat = None
    if dst_rank is None:
        dist.broadcast(flat, src=source)
    elif me == source:
        dist.send(flat, dst=dst_rank)
    elif me == dst_rank:
        dist.recv(flat, src=source)
    if flat is None:
        return None
    nbytes = flat.numel() * flat.element_size()
    if me == source:
        traffic.sent += nbytes
    else:
        traffic.received += nbytes
    if me in receivers or dst_rank is None:
        return [c.view(s) for c, s in zip(flat.split(numels), shapes)]
    return None

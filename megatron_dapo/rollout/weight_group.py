"""The weight-update process group: trainer rank 0 plus every server rank, apart from any default group.

It is formed the way SGLang 0.5.23 forms it on the server side (`srt/utils/common.py:
init_custom_process_group`): a TCPStore at master_address:master_port hosted by rank 0 (what its
`tcp://` rendezvous builds), a `PrefixStore` named after the group, and a process group of the requested backend
built on that store. Doing the same on the trainer makes a trainer and a real SGLang server meet.
The default process group (torchrun's) is neither needed nor touched.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron_dapo.runtime.distributed import tcp_store


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str | None = None,
    timeout_s: float = 300.0,
    connect_timeout_s: float | None = None,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the weight-update group; blocks until all `world_size` ranks have joined.

    `timeout_s` bounds each collective of the group; `connect_timeout_s` (default: the same) bounds reaching
    rank 0's store, so an unreachable address fails in that time.
    """
    backend = backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' requested for the weight-update group, but CUDA is not available")
    timeout = datetime.timedelta(seconds=timeout_s)
    connect_timeout = datetime.timedelta(seconds=connect_timeout_s or timeout_s)
    # What `rendezvous("tcp://...")` builds outside torchelastic: rank 0 hosts the store. Built by hand
    # because under torchrun (TORCHELASTIC_USE_AGENT_STORE) rendezvous would make every rank a client
    # of a store nobody hosts, and so that rank 0's store listens on master_address alone.
    store = tcp_store(master_address, int(master_port), world_size, rank == 0, connect_timeout)
    store = dist.PrefixStore(group_name, store)
    # The private helper is what both SGLang and torch's own new_group use to build a group from a
    # store; the public API would insist on the default group spanning these ranks.
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_weight_update_group(pg: dist.ProcessGroup) -> None:
    try:
        dist.destroy_process_group(pg)
    except Exception:  # a group whose peer died cannot always be torn down cleanly; drop it
        c10d._world.pg_group_ranks.pop(pg, None)


def broadcast(tensor: torch.Tensor, pg: dist.ProcessGroup, async_op: bool = False):
    """Broadcast from group rank 0 (the trainer) over the weight-update group. A float8 tensor travels as its
    bytes (gloo has no float8 type; the bytes are the same under NCCL)."""
    if tensor.is_floating_point() and tensor.element_size() == 1:
        tensor = tensor.view(torch.uint8)
    return dist.broadcast(tensor, group_src=0, group=pg, async_op=async_op)

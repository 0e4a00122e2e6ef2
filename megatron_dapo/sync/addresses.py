"""Where each weight-sync source hosts its update group's store (the TCPStore the servers' workers join).

Trainer rank 0 hosts at `trainer.bind_host`, its own address. With several sources (rollout.sync.sources:
per_stage) every other source hosts its own group, so it must listen on an address of its own node, which
the servers can reach: `MEGATRON_DAPO_NODE_ADDRESS` when the launcher sets it for the rank's node (the Ray
launcher sets each trainer actor's Ray node address; multi-node torchrun: export it on each node), else the
node's address on its route to the first rollout server (what the servers would see it connect from). A
source on another node than rank 0 is refused, by name, where nothing it could listen on is reachable: a
loopback store address, or loopback rollout server URLs (each node's loopback is its own).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from urllib.parse import urlparse

from megatron_dapo.runtime.net import interface_of, is_loopback, is_wildcard, route_address

NODE_ADDRESS_ENV = "MEGATRON_DAPO_NODE_ADDRESS"


def store_address(rank: int, bind_host: str, server_urls: Sequence[str], env: Mapping[str, str] = os.environ) -> str:
    """The address trainer rank `rank` hosts its weight-update group's store at (see the module docstring)."""
    if rank == 0:
        return bind_host
    given = env.get(NODE_ADDRESS_ENV)
    if not given:
        return route_address(server_host(server_urls[0]))
    try:
        own = not is_wildcard(given) and (is_loopback(given) or interface_of(given) is not None)
    except ValueError:
        own = False
    if not own:
        raise ValueError(
            f"{NODE_ADDRESS_ENV}={given!r} on trainer rank {rank} ({socket.gethostname()}) must be one IP address of "
            f"this node's interfaces: its weight-update group's store listens there"
        )
    return given


def server_host(url: str) -> str:
    host = urlparse(url).hostname
    if not host:
        raise ValueError(f"rollout server URL {url!r} names no host")
    return host


def unreachable_sources(placements: Sequence[tuple[int, str, str]], server_urls: Sequence[str]) -> list[str]:
    """Why each source of `placements` -- (rank, node, store address), rank 0's first -- that runs on another
    node than rank 0 could not serve its group; empty when every one can."""
    node0 = placements[0][1]
    loopback_urls = [u for u in server_urls if _is_loopback_host(server_host(u))]
    errors = []
    for rank, node, address in placements:
        if node == node0:
            continue
        if _is_loopback_host(address):
            errors.append(
                f"source rank {rank} on node {node} (rank 0: {node0}) would host its weight-update group at "
                f"loopback {address}, which no server on another node reaches: set {NODE_ADDRESS_ENV} to the "
                f"node's cluster address"
            )
        if loopback_urls:
            errors.append(
                f"source rank {rank} on node {node} (rank 0: {node0}) cannot reach rollout server "
                f"{loopback_urls[0]}: a loopback URL names a server on each node's own loopback; list the servers "
                f"by cluster address (rollout.servers, rollout.host)"
            )
    return errors


def _is_loopback_host(host: str) -> bool:
    try:
        return is_loopback(host)
    except ValueError:  # a name: loopback when every address it resolves to is
        try:
            infos = socket.getaddrinfo(host, None)
        except socket.gaierror:
            return False
        return all(is_loopback(i[4][0].split("%", 1)[0]) for i in infos)


def node_id() -> str:
    """This machine, as distinct from the other nodes of the job: host name and boot id (containers on one
    host share the boot id; two hosts do not)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()


def source_store_addresses(sources: Sequence[int], bind_host: str, server_urls: Sequence[str]) -> dict[int, str]:
    """Collective over the default group: each source's store address, after checking that every source on
    another node than rank 0 can serve its group (ValueError naming each that cannot)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = None
    if rank in sources:
        try:
            mine = (rank, node_id(), store_address(rank, bind_host, server_urls), None)
        except ValueError as e:  # raised on every rank below, not here alone (the others would wait)
            mine = (rank, node_id(), None, str(e))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    placements = [p for p in everyone if p is not None]
    errors = [why for *_, why in placements if why is not None]
    errors = errors or unreachable_sources([p[:3] for p in placements], server_urls)
    if errors:
        raise ValueError("rollout.sync.sources=per_stage: " + "; ".join(errors))
    return {r: address for r, _, address, _ in placements}

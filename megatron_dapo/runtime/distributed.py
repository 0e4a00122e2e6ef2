"""Process-group setup: NCCL on CUDA, gloo on CPU, then megatron-core model parallel state."""

from __future__ import annotations

import datetime
import errno
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo.runtime.cpu import enable_cpu_mode


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> DistInfo:
    """Initialise the default process group from torchrun's environment (or a 1-rank group).

    On a machine without CUDA this also enters CPU mode, so callers may build megatron-core
    models right after.
    """
    backend = backend or default_backend()
    if backend == "gloo":
        enable_cpu_mode()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python script.py`: a group of one on loopback
            from megatron_dapo.runtime.net import LOOPBACK, free_port

            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR=LOOPBACK, MASTER_PORT=str(free_port()))
        _init_default_group(backend, datetime.timedelta(seconds=timeout_s))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)


def _init_default_group(backend: str, timeout: datetime.timedelta) -> None:
    """The default group from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, its store hosted by rank 0
    on MASTER_ADDR alone (torch's env:// rendezvous would listen on every interface).

    Under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) the store is torchrun's own, listening
    where torchrun binds it (every interface; torch offers no option). The same store serves every restart
    of the ranks (torchrun --max-restarts): each attempt's keys go under a prefix of its own, or a
    restarted rank would read a dead rank's gloo address from the attempt before and never connect.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        agent_store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
        )
        store = dist.PrefixStore(
            f"megatron_dapo/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent_store
        )
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
        return
    store = tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timeout)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore at host:port; the master's server listens on `host` alone.

    `dist.TCPStore(host, ..., is_master=True)` binds its server to the wildcard address whatever `host`
    is; a socket bound here and handed over as `master_listen_fd` keeps it on `host`. The store owns
    that descriptor from then on (it closes it), so the Python socket lets go of it.
    """
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout, multi_tenant=True)
    from megatron_dapo.runtime.net import listening_socket

    try:
        sock = listening_socket(host, port)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        # Taken: by a multi-tenant store this process already hosts there (torch hands that one back, as it
        # does for any second master on a port), or by someone else, and then torch's own bind fails too.
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, multi_tenant=True)
    bound_port = sock.getsockname()[1]
    return dist.TCPStore(
        host,
        bound_port,
        world_size,
        is_master=True,
        timeout=timeout,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
    )


def init_model_parallel(
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    seed: int = 1234,
) -> None:
    """megatron-core's parallel state and its model-parallel RNG, after :func:`init_distributed`."""
    from megatron.core import parallel_state, tensor_parallel

    world = dist.get_world_size()
    if world % (tp * pp * cp) != 0:
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()

"""What the embedded server's routes share: one `ServerState` per app, at `app.state.server`.

Routes take it as a parameter annotated `StateDep` (a FastAPI dependency). Generation holds `gate` shared
and an unpaused weight update holds it exclusively (writer first), as SGLang's lock; `update_lock` runs
one weight update at a time. Admin commands run on `admin_pool` and tokenization on `tokenize_pool`,
threads of their own, so that neither long tokenizations nor waits on a peer can delay an admin command.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated

import torch
from fastapi import Depends, Request

from megatron_dapo.bridge.fp8 import DequantizingStream
from megatron_dapo.bridge.hf_loader import HFWeightLoader
from megatron_dapo.embedded_server.engine import Engine
from megatron_dapo.embedded_server.limits import ServerLimits
from megatron_dapo.embedded_server.memory import ModelMemory
from megatron_dapo.embedded_server.weight_receiver import FlatBucketHomes

log = logging.getLogger("megatron_dapo.embedded")


class UpdateGate:
    """Generation holds it shared, an unpaused weight update exclusively (writer first), as SGLang's lock."""

    def __init__(self):
        self.cond = asyncio.Condition()
        self.readers = 0
        self.writer = False

    async def acquire_read(self):
        async with self.cond:
            await self.cond.wait_for(lambda: not self.writer)
            self.readers += 1

    async def release_read(self):
        async with self.cond:
            self.readers -= 1
            self.cond.notify_all()

    async def acquire_write(self):
        async with self.cond:
            await self.cond.wait_for(lambda: not self.writer)
            self.writer = True
            await self.cond.wait_for(lambda: self.readers == 0)

    async def release_write(self):
        async with self.cond:
            self.writer = False
            self.cond.notify_all()


@dataclass(eq=False)
class ServerState:
    engine: Engine
    loader: HFWeightLoader
    limits: ServerLimits
    model_path: str = ""
    served_model_name: str = ""
    api_key: str | None = None
    memory: ModelMemory | None = None  # release / resume of the model's memory (None: a ModelMemory without saver)
    launch_settings: dict = field(default_factory=dict)  # ServerArgs names, for /server_info
    startup_time: float = field(default_factory=time.time)
    groups: dict[str, torch.distributed.ProcessGroup] = field(default_factory=dict)  # weight-update groups
    update_session: str | None = None  # the selector of the open weight-update session
    recv_buffer: torch.Tensor | None = None  # CPU scratch for received bytes that will not be loaded
    homes: FlatBucketHomes = field(init=False)
    # FP8 block weights of an update waiting for their scales (or the reverse), dequantized into the model
    fp8: DequantizingStream = field(default_factory=lambda: DequantizingStream(torch.float32))
    gate: UpdateGate = field(default_factory=UpdateGate)
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    admin_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="embedded-admin")
    )
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="embedded-tokenize")
    )

    resumed: asyncio.Event = field(default_factory=asyncio.Event)  # set while no memory is released

    def __post_init__(self):
        self.homes = FlatBucketHomes(self.loader)
        if self.memory is None:
            self.memory = ModelMemory(self.engine.model)
        self.resumed.set()

    async def wait_resident(self) -> str | None:
        """Wait until no memory is released (a request arriving during a release), at most
        --release-wait-timeout-s; then None, or the 503 message naming what is still released."""
        if self.resumed.is_set():
            return None
        try:
            await asyncio.wait_for(self.resumed.wait(), self.limits.release_wait_s)
        except asyncio.TimeoutError:
            return (
                f"memory released (tags {sorted(self.memory.released)}) and not resumed within "
                f"{self.limits.release_wait_s:g}s (server flag --release-wait-timeout-s); call "
                "/resume_memory_occupation"
            )
        return None

    async def admin(self, request: Request, fn, *args):
        """Apply an admin command on the admin threads, unless its client has already given up on it."""
        if await request.is_disconnected():
            log.warning("%s: the client gave up before it was applied; not applied", request.url.path)
            return None
        return await asyncio.get_running_loop().run_in_executor(self.admin_pool, fn, *args)

    def close(self) -> None:
        self.engine.close()
        for pool in (self.admin_pool, self.tokenize_pool):
            pool.shutdown(wait=False, cancel_futures=True)


async def server_state(request: Request) -> ServerState:
    # async: FastAPI would run a plain function in its thread pool
    return request.app.state.server


StateDep = Annotated[ServerState, Depends(server_state)]

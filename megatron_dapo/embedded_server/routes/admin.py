"""Commands to the engine, as SGLang 0.5.23 answers them: /abort_request, /pause_generation,
/continue_generation, /release_memory_occupation and /resume_memory_occupation.

Abort, pause and continue run on the admin threads (never behind a tokenization or a wait on a peer),
and are not applied when their client has already given up. Releasing memory moves the weights to the
CPU (a CUDA server only, and only with the `weights` tag or no tags); resuming moves them back.
"""

from __future__ import annotations

import asyncio

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from megatron_dapo.embedded_server import schemas as S
from megatron_dapo.embedded_server.state import StateDep

router = APIRouter()


@router.post("/abort_request")
async def abort_request(body: S.AbortIn, request: Request, st: StateDep):
    await st.admin(request, st.engine.abort, body.rid, body.abort_all)
    return Response(status_code=200)


@router.post("/pause_generation")
async def pause_generation(body: S.PauseIn, request: Request, st: StateDep):
    await st.admin(request, st.engine.pause, body.mode)
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(body: S.ContinueIn, request: Request, st: StateDep):
    await st.admin(request, st.engine.resume)
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory(body: S.MemoryIn, st: StateDep):
    eng = st.engine
    if eng.device.type == "cuda" and (body.tags is None or "weights" in body.tags):

        def _off():
            with eng.step_lock:
                eng.model.to("cpu")
                torch.cuda.empty_cache()

        await asyncio.to_thread(_off)
    return None  # SGLang's handler returns None: a JSON `null` body


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory(body: S.MemoryIn, st: StateDep):
    eng = st.engine
    if eng.device.type == "cuda" and (body.tags is None or "weights" in body.tags):

        def _on():
            with eng.step_lock:
                eng.model.to(eng.device)

        await asyncio.to_thread(_on)
    return None  # as SGLang: a JSON `null` body

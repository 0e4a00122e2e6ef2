"""Commands to the engine, as SGLang 0.5.23 answers them: /abort_request, /pause_generation,
/continue_generation, /release_memory_occupation and /resume_memory_occupation.

Abort, pause and continue run on the admin threads (never behind a tokenization or a wait on a peer),
and are not applied when their client has already given up. Releasing and resuming memory: SGLang's
semantics by tag (weights, kv_cache), in embedded_server/memory.py; a request arriving meanwhile waits for
the resume (at most --release-wait-timeout-s, then 503) when --enable-memory-saver really freed it.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from megatron_dapo.embedded_server import schemas as S
from megatron_dapo.embedded_server.memory import NOT_IDLE, WEIGHTS, resolve_tags
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

    saver = st.memory.memory_saver  # without it SGLang frees nothing, and generation goes on as before

    def release():
        with eng.step_lock:  # no step runs meanwhile; SGLang releases only an idle server
            if not eng.is_idle():
                return NOT_IDLE
            if saver:
                eng.hold(True)
                if WEIGHTS in resolve_tags(body.tags):
                    st.homes.forget()  # flattened-bucket homes are the weights' storage too
            st.memory.release(body.tags)
            return None

    async with st.update_lock:  # never in the middle of a weight update
        if saver:
            st.resumed.clear()
        refused = await asyncio.to_thread(release)
        if refused is not None:
            if not (saver and st.memory.released):
                st.resumed.set()
            return JSONResponse({"error": {"message": refused}}, 400)  # SGLang's _create_error_response
    return None  # SGLang's handler returns None: a JSON `null` body


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory(body: S.MemoryIn, st: StateDep):
    eng = st.engine

    def resume():
        with eng.step_lock:
            st.memory.resume(body.tags)
            if not st.memory.released:
                eng.hold(False)

    async with st.update_lock:
        try:
            await asyncio.to_thread(resume)
        except ValueError as e:
            return JSONResponse({"error": {"message": str(e)}}, 400)
        if not st.memory.released:
            st.resumed.set()  # requests that waited go on
    return None  # as SGLang: a JSON `null` body

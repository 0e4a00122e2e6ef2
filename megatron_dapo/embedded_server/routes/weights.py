"""Weight updates, as SGLang 0.5.23 takes them: weight-update sessions (/begin_weight_update ...
/end_weight_update), weight-update groups (/init_weights_update_group, /destroy_weights_update_group),
/update_weights_from_distributed, /update_weights_from_tensor, /update_weight_version and /flush_cache.

Locking, the session rule and the flush rule follow SGLang's (docs/rollout-and-weight-sync.md, "The
session protocol and pause modes").

Calls that wait on a peer (forming, destroying or receiving over a group) run in daemon threads of their
own: they never hold up the admin routes or a SIGTERM. Group formation answers within
--weight-group-timeout-s, and a group that forms after its client was answered is destroyed. An update
whose broadcast cannot be received whole destroys its group: bytes left on the wire would be loaded by the
next update.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
import threading

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from megatron_dapo.bridge import fp8
from megatron_dapo.bridge.hf_loader import WeightLoadError
from megatron_dapo.embedded_server import schemas as S
from megatron_dapo.embedded_server.state import ServerState, StateDep
from megatron_dapo.embedded_server.tensor_payload import load_named_tensors
from megatron_dapo.embedded_server.weight_receiver import announcement_problem, receive
from megatron_dapo.rollout import weight_group as wgroup

log = logging.getLogger("megatron_dapo.embedded")
router = APIRouter()

FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
# SGLang 0.5.23's own messages (srt/managers/scheduler_components/weight_updater.py, http_server.py)
NO_SESSION = "{route} must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION_TO_END = "no weight-update session is open; call begin_weight_update() first"
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)
FLUSH_FAILED_TEXT = "Flush cache failed.\n"
WEIGHTS_RELEASED = (
    "{route}: the weights are released (/release_memory_occupation); call /resume_memory_occupation "
    'with tags ["weights"] first'
)


def in_daemon_thread(fn, *args) -> asyncio.Future:
    """Run blocking `fn` in a thread of its own that neither an executor nor interpreter exit waits for:
    for calls that wait on a peer, which may never answer."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run():
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the awaiting route
            error = e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile (shutdown): nobody waits any more
            pass

    threading.Thread(target=run, name=f"embedded-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return future


# ---- routes --------------------------------------------------------------------------------------


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(st: StateDep):
    # No prefix cache outlives a batch here; nothing to flush, but a busy server refuses as SGLang's
    # does, with SGLang's texts.
    if not st.engine.is_idle():
        return PlainTextResponse(FLUSH_FAILED_TEXT, status_code=400)
    return PlainTextResponse(FLUSH_CACHE_TEXT)


@router.post("/init_weights_update_group")
async def init_group(body: S.InitGroupIn, request: Request, st: StateDep):
    if body.rank_offset >= body.world_size:
        return JSONResponse(
            {"success": False, "message": f"rank_offset: {body.rank_offset} >= world_size {body.world_size}"}, 400
        )
    if body.group_name in st.groups:
        # As SGLang does, a new group replaces one of the same name: its trainer may have died
        # (killed, then resumed) without destroying it. A peer that is gone cannot take part
        # in the teardown, which therefore tolerates failures.
        log.warning("init_weights_update_group: replacing existing group %r", body.group_name)
        await _drop_group(st, body.group_name)
    timeout = st.limits.group_timeout_s
    forming = in_daemon_thread(
        functools.partial(
            wgroup.init_weight_update_group,
            body.master_address,
            body.master_port,
            body.rank_offset,
            body.world_size,
            body.group_name,
            body.backend,
            connect_timeout_s=timeout,
        )
    )

    def destroy_late(done: asyncio.Future):  # formed after its client was answered: never used
        if not done.cancelled() and done.exception() is None:
            log.warning(
                "init_weights_update_group: group %r formed after its request was answered; destroyed", body.group_name
            )
            threading.Thread(target=wgroup.destroy_weight_update_group, args=(done.result(),), daemon=True).start()

    try:
        pg = await asyncio.wait_for(asyncio.shield(forming), timeout)
    except asyncio.TimeoutError:
        forming.add_done_callback(destroy_late)
        return JSONResponse(
            {
                "success": False,
                "message": (
                    f"Failed to init group: {body.group_name!r} at {body.master_address}:{body.master_port} did "
                    f"not form within {timeout:g}s (server flag --weight-group-timeout-s)"
                ),
            },
            400,
        )
    except asyncio.CancelledError:
        forming.add_done_callback(destroy_late)
        raise
    except Exception as e:
        return JSONResponse({"success": False, "message": f"Failed to init group: {e}"}, 400)
    if await request.is_disconnected():
        destroy_late(forming)
        return JSONResponse({"success": False, "message": "the client gave up; group destroyed"}, 400)
    st.groups[body.group_name] = pg
    return {"success": True, "message": "Succeeded to initialize custom process group."}


@router.post("/destroy_weights_update_group")
async def destroy_group(body: S.DestroyGroupIn, st: StateDep):
    if body.group_name not in st.groups:
        return JSONResponse({"success": False, "message": f"group_name: no group {body.group_name!r}"}, 400)
    await _drop_group(st, body.group_name)
    return {"success": True, "message": "Succeeded to destroy custom process group."}


@router.post("/begin_weight_update")
async def begin_weight_update(body: S.BeginUpdateIn, st: StateDep):
    if st.update_session is not None:
        return JSONResponse({"success": False, "message": SESSION_OPEN}, 400)
    st.update_session = body.selector
    return {"success": True, "message": "Success"}


@router.post("/end_weight_update")
async def end_weight_update(body: S.EndUpdateIn, st: StateDep):
    if st.update_session is None:
        return JSONResponse({"success": False, "message": NO_SESSION_TO_END}, 400)
    st.update_session = None
    return {"success": True, "message": "Success"}


@router.post("/update_weights_from_distributed")
async def update_distributed(body: S.UpdateDistributedIn, st: StateDep):
    if (refused := _refused(st, "update_weights_from_distributed")) is not None:
        if body.group_name in st.groups:
            # as below: the sender broadcasts anyway, and the next update must not load its bytes
            log.warning("update outside a weight-update session: group %r destroyed", body.group_name)
            await _drop_group(st, body.group_name)
        return refused
    pg = st.groups.get(body.group_name)
    if pg is None:
        return JSONResponse(
            {
                "success": False,
                "message": f"group_name: no group {body.group_name!r}; call /init_weights_update_group first",
            },
            400,
        )
    unreceivable = announcement_problem(body.names, body.dtypes, body.shapes, _max_update_bytes(st))
    if unreceivable is not None:
        # The sender broadcasts regardless; bytes left on the wire would be loaded by the next update.
        await _drop_group(st, body.group_name, pg)
        return JSONResponse(
            {
                "success": False,
                "message": (
                    f"Failed to update weights: {unreceivable}; its broadcast cannot be received, so group "
                    f"{body.group_name!r} was destroyed: call /init_weights_update_group again"
                ),
            },
            400,
        )
    if body.abort_all_requests:
        await asyncio.to_thread(st.engine.abort, None, True)
    problem = _check_known(st, body.names, body.shapes)
    try:
        flushed = await _exclusive(st, _receive_and_load, st, body, pg, problem)
    except Exception as e:
        # A receive that failed part-way leaves the group out of step with the sender.
        await _drop_group(st, body.group_name, pg)
        return JSONResponse(
            {
                "success": False,
                "message": (
                    f"Failed to update weights: {e}; group {body.group_name!r} was destroyed: "
                    "call /init_weights_update_group again"
                ),
            },
            400,
        )
    if problem is not None:
        return JSONResponse({"success": False, "message": f"Failed to update weights: {problem}"}, 400)
    msg = "Succeeded to update parameter online."
    if body.weight_version is not None:
        msg += f" Weight version updated to {body.weight_version}."
    return _loaded(flushed, msg)


@router.post("/update_weights_from_tensor")
async def update_tensor(body: S.UpdateTensorIn, st: StateDep):
    if (refused := _refused(st, "update_weights_from_tensor")) is not None:
        return refused
    if len(body.serialized_named_tensors) != 1:
        return JSONResponse(
            {
                "success": False,
                "message": "serialized_named_tensors: this server has one TP "
                f"rank, got {len(body.serialized_named_tensors)} entries",
            },
            400,
        )
    if body.abort_all_requests:
        await asyncio.to_thread(st.engine.abort, None, True)

    def decode():  # off the event loop: a large or deeply nested payload takes a while
        raw = base64.b64decode(body.serialized_named_tensors[0], validate=True)
        return load_named_tensors(raw, flattened=body.load_format == "flattened_bucket")

    try:
        named = await asyncio.to_thread(decode)
    except Exception as e:
        return JSONResponse({"success": False, "message": f"serialized_named_tensors: cannot deserialize ({e})"}, 400)
    problem = _check_known(st, [n for n, _ in named], [list(t.shape) for _, t in named])
    if problem is not None:
        return JSONResponse({"success": False, "message": f"Failed to update weights: {problem}"}, 400)
    flushed = await _exclusive(st, _load, st, named, body.weight_version, None, body.flush_cache)
    return _loaded(flushed, "Success")


@router.post("/update_weight_version")
async def update_version(body: S.UpdateVersionIn, request: Request, st: StateDep):
    eng = st.engine

    def run():
        if body.abort_all_requests:
            eng.abort(None, True)
        with eng.step_lock:
            eng.set_weight_version(body.new_version)

    await st.admin(request, run)
    return {
        "success": True,
        "message": f"Weight version updated to {body.new_version}",
        "new_version": body.new_version,
    }


# ---- helpers -------------------------------------------------------------------------------------


async def _exclusive(st: ServerState, fn, *args):
    """Run blocking `fn` in a thread, as a weight update: at once if paused, else after draining."""
    async with st.update_lock:
        if st.engine.is_paused():
            return await in_daemon_thread(fn, *args)
        await st.gate.acquire_write()
        try:
            return await in_daemon_thread(fn, *args)
        finally:
            await st.gate.release_write()


async def _drop_group(st: ServerState, name: str, pg=None) -> None:
    """Destroy the weight-update group `name` (only if it is still `pg`, when given: a failed update must not
    take down the group that replaced its own). In a daemon thread: a dead peer may hang the teardown."""
    if pg is not None and st.groups.get(name) is not pg:
        return
    pg = st.groups.pop(name, None)
    if pg is not None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.shield(in_daemon_thread(wgroup.destroy_weight_update_group, pg)), st.limits.group_timeout_s
            )


def _receive_and_load(st: ServerState, body: S.UpdateDistributedIn, pg, problem: str | None) -> bool | None:
    """Receive the broadcast `body` announces over `pg` and load it, or, when `problem` says it cannot be
    loaded, only take its bytes off the wire. Runs as a weight update (`_exclusive`)."""
    eng = st.engine

    def into(name, dtype, shape):
        # Receive straight into the parameter: nothing is generating now (paused, or drained
        # by the update gate), and it saves a copy of every byte. Not FP8 scales: dequantized away.
        if fp8.scale_base(name) is not None:
            return None
        dst, _ = st.loader.target(name)
        ok = dst.dtype == dtype and dst.is_contiguous() and dst.device == eng.device
        return dst if ok else None

    received = []  # (layout, flat) of a flattened bucket meant for the model

    def flat_buffer(layout):
        if problem is not None:
            return _scratch_buffer(st, layout)
        received.append((layout, st.homes.buffer(layout, eng.device)))
        return received[-1][1]

    named = receive(
        pg,
        body.names,
        body.dtypes,
        body.shapes,
        eng.device,
        flattened=body.load_format == "flattened_bucket",
        into=into if problem is None else None,
        flat_buffer=flat_buffer,
    )
    if problem is None:
        return _load(
            st, named, body.weight_version, home=received[0] if received else None, flush_cache=body.flush_cache
        )
    return None


def _scratch_buffer(st: ServerState, layout) -> torch.Tensor:
    """Receive buffer for a flattened bucket that will not be loaded (a refused update must still take
    its bytes off the wire): kept between such updates on the CPU, fresh on a GPU."""
    if st.engine.device.type != "cpu":
        return torch.empty(layout.nbytes, dtype=torch.uint8, device=st.engine.device)
    if st.recv_buffer is None or st.recv_buffer.numel() < layout.nbytes:
        st.recv_buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    return st.recv_buffer[: layout.nbytes]


def _max_update_bytes(st: ServerState) -> int:
    # No update carries more than every parameter at twice its size (a float64 sender to a float32 server).
    return 2 * sum(p.numel() * p.element_size() for p in st.loader.params.values())


def _load(st: ServerState, named, weight_version, home=None, flush_cache: bool = False) -> bool:
    """Load; returns False when `flush_cache` asked for a flush that SGLang would refuse (busy)."""
    with st.engine.step_lock:
        if home is not None:
            st.homes.adopt(*home, named)
        try:  # FP8 block weights are dequantized as each one's scales arrive (bridge.fp8)
            st.loader.load(st.fp8.feed(named))
            if weight_version is not None:  # the update's last bucket: no weight may wait for its scales
                st.fp8.finish()
        except Exception:
            st.fp8.reset()
            raise
        if weight_version is not None:
            st.engine.set_weight_version(weight_version)
        return not flush_cache or st.engine.is_idle()


def _refused(st: ServerState, route: str) -> JSONResponse | None:
    if st.update_session is None:
        return JSONResponse({"success": False, "message": NO_SESSION.format(route=route)}, 400)
    if st.memory.weights_released and st.memory.memory_saver:
        return JSONResponse({"success": False, "message": WEIGHTS_RELEASED.format(route=route)}, 400)
    return None


def _loaded(flushed: bool, message: str) -> dict | JSONResponse:
    """The answer to an update that loaded: with flush_cache, SGLang fails it unless the cache was
    flushed, i.e. the engine was idle right after the load (`_load` tells)."""
    if not flushed:
        return JSONResponse({"success": False, "message": NOT_FLUSHED}, 400)
    return {"success": True, "message": message}


def _check_known(st: ServerState, names, shapes) -> str | None:
    for name, shape in zip(names, shapes):
        base = fp8.scale_base(name)  # an FP8 block weight's scales: a block per 128 x 128 of the weight
        try:
            dst, _ = st.loader.target(base or name)
        except WeightLoadError as e:
            return str(e)
        want = fp8.scale_shape(dst.shape) if base else list(dst.shape)
        if list(want) != list(shape):
            return f"{name}: shape {list(shape)} != expected {list(want)}"
    return None
